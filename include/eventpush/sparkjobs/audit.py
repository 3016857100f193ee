"""The delivery-completeness audit: per runner and window, what was owed and what happened.

For each runner, the *expected* records are the events of its bus at or past the runner's
``start_offset`` (per queue), created in the window, that the version of its rule in force at
the event's offset matches (``event_runner_version``: a changed pattern judges from where it
took effect, a disabled rule matches nothing until enabled again; evaluated on the executors
by the Python rule engine, ``with_matching_runners``). Each expected record is then exactly
one of:

- ``delivered``: it has at least one delivery row (live or replay);
- ``failed``: no delivery row, and a failure row that is ``failed`` or ``dead``;
- ``pending``: neither, and the runner has not yet committed past it;
- ``missing``: neither, yet the runner's committed offset is past it: a lost record.

``duplicates`` counts delivery rows beyond the first for one record. The per-record frame
(``classify``) is also what a replay of audit gaps selects from. Runners of deleted targets
are audited as well (their books stay), marked ``deleted``.

With ``verify_sinks``, the destinations that can be read back (a sink kind with
``read_back``: JetStream) are read, on the executors, one partition per target URL
(``verify``, by :mod:`eventpush.sinks.readback`): each ``delivered`` record whose key the
destination does not hold is ``absent`` (counted with ``missing`` in the exit code, listed by
queue and offset) or ``expired`` (aged out by the destination's own limits), apart. ``sink``
says per runner what was read, that it could not be read, or that its kind cannot be.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import lru_cache

from eventpush import rollups
from eventpush.db import connection, transaction
from eventpush.metrics import audit_results, publish_batch
from eventpush.partitions import clip_window, kept_since_by_bus
from eventpush.rules.patterns import RuleIndex
from eventpush.sources import sync_heads
from eventpush.sparkjobs import jdbc
from eventpush.sparkjobs.forms import PATTERN_VERSIONS

STATES = ("delivered", "failed", "pending", "missing")
NO_END = 2**62  # the newest version's segment runs on for good
KEYS = ("runner_id", "queue_id", "offset")  # one record of one runner


# Absent records listed per runner in a report (the counts are always whole).
ABSENT_LISTED = 1000


@dataclass(frozen=True)
class AuditRunner:
    runner_id: int
    name: str
    bus_id: int
    bus: str
    pattern: str  # its rule's pattern now
    deleted: bool = False
    url: str = ""


@dataclass(frozen=True)
class VersionSegment:
    """Offsets [start, stop) of one runner's queue judged by pattern ``vid`` (None: by no
    pattern, the rule was disabled)."""

    runner_id: int
    queue_id: int
    start: int
    stop: int
    vid: int | None


@dataclass(frozen=True)
class RunnerAudit:
    runner: str
    expected: int
    delivered: int
    failed: int
    missing: int
    pending: int
    duplicates: int
    deleted: bool = False  # the runner of a deleted target (its books, kept)
    # With verify_sinks: records delivered in the books that the destination does not hold
    # (absent) or has aged out (expired); ``sink`` says what was read ("stream ORDERS"),
    # "not readable (http)" or "error: ..."; None when the sinks were not verified.
    absent: int = 0
    expired: int = 0
    sink: str | None = None
    # What the figures are keyed by: a deleted target's runner and a live one re-created
    # with the same names share ``runner`` (the name, for display). None only in reports
    # saved before the id was recorded.
    runner_id: int | None = None


@dataclass(frozen=True)
class AuditResult:
    runners: list[RunnerAudit]
    report_id: int | None
    since: datetime | None
    until: datetime | None

    # runner id -> the absent records, (queue_id, offset, message_id), at most ABSENT_LISTED
    absent_records: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    # One line per bus whose kept events begin inside the window (retention clipped it).
    warnings: list[str] = field(default_factory=list)
    # With roll_up: runner id -> delivery rows its clean window's summary row replaced.
    rolled_up: dict[int, int] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        keys = ("expected", "delivered", "failed", "missing", "pending", "duplicates")
        keys += ("absent", "expired")
        return {k: sum(getattr(r, k) for r in self.runners) for k in keys}

    def unaccounted(self) -> int:
        """What fails the audit: records missing from the books or absent from their
        destination, and runners whose readable destination could not be read."""
        unread = sum(1 for r in self.runners if r.sink is not None and r.sink.startswith("error"))
        return self.totals()["missing"] + self.totals()["absent"] + unread

    def names(self) -> dict[int | None, str]:
        """runner id -> its name, for showing what ``absent_records`` and ``rolled_up`` key."""
        return {r.runner_id: r.runner for r in self.runners}

    def to_json(self) -> dict:
        listed, names = self.absent_records, self.names()
        return {
            "runners": [
                asdict(r)
                | (
                    {
                        "absent_records": [
                            {"queue_id": q, "offset": o, "message_id": m}
                            for q, o, m in listed.get(r.runner_id, [])
                        ]
                    }
                    if r.sink is not None
                    else {}
                )
                for r in self.runners
            ],
            "totals": self.totals(),
            "report_id": self.report_id,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "warnings": self.warnings,
            # A list, not an object keyed by name: two runners may share one.
            "rolled_up": [
                {"runner_id": rid, "runner": names.get(rid), "rows": n}
                for rid, n in self.rolled_up.items()
            ],
        }


@dataclass(frozen=True)
class AuditScope:
    """The runners an audit covers, their offsets and the bus ranges to read."""

    runners: list[AuditRunner]
    offsets: list[tuple[int, int, int, int]]  # runner_id, queue_id, start_offset, committed
    ranges: list[jdbc.QueueRange]
    # The versions' patterns (vid -> (bus id, pattern JSON)) and where each judged.
    patterns: dict[int, tuple[int, str]] = field(default_factory=dict)
    segments: list[VersionSegment] = field(default_factory=list)
    rollups: list[rollups.Rollup] = field(default_factory=list)  # rolled-up clean windows
    # (bus id, queue id) -> where the bus's queue begins: below it, a deleted bus's events in
    # the store this bus took over (event_bus_queue.first_offset); absent: 0.
    firsts: dict[tuple[int, int], int] = field(default_factory=dict)


def load_scope(
    cur,
    bus: str | None = None,
    rule: str | None = None,
    target: str | None = None,
    runner_ids: list[int] | None = None,
    *,
    live_only: bool = False,
    pattern_version: str = "history",
) -> AuditScope:
    """Runners matching the filters (all when none; only those of live targets with
    ``live_only``), with offsets, queue ranges and the pattern versions that judged their
    events (``current``: the rule's pattern now, for every offset)."""
    cur.execute(
        "SELECT r.id, r.name, b.id, b.name, ru.pattern::text, r.deleted_at IS NOT NULL, t.url "
        "FROM event_target_runner r "
        "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
        "JOIN event_bus b ON b.id = ru.bus_id "
        "WHERE (%(bus)s::text IS NULL OR b.name = %(bus)s) "
        "AND (%(rule)s::text IS NULL OR ru.name = %(rule)s) "
        "AND (%(target)s::text IS NULL OR t.name = %(target)s) "
        "AND (%(ids)s::int[] IS NULL OR r.id = ANY(%(ids)s)) "
        "AND (NOT %(live)s OR r.deleted_at IS NULL) ORDER BY r.id",
        {"bus": bus, "rule": rule, "target": target, "ids": runner_ids, "live": live_only},
    )
    runners = [AuditRunner(*row) for row in cur.fetchall()]
    ids = [r.runner_id for r in runners]
    patterns, segments = _versions(cur, runners, pattern_version)
    cur.execute(
        'SELECT runner_id, queue_id, start_offset, "offset" FROM event_push_offset '
        "WHERE runner_id = ANY(%s) ORDER BY runner_id, queue_id",
        (ids,),
    )
    offsets = [tuple(row) for row in cur.fetchall()]
    # Per bus and queue: from the earliest start of any runner to the queue's end.
    cur.execute(
        "SELECT q.bus_id, q.queue_id, min(o.start_offset), q.next_offset, q.first_offset "
        "FROM event_push_offset o JOIN event_target_runner r ON r.id = o.runner_id "
        "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
        "JOIN event_bus_queue q ON q.bus_id = ru.bus_id AND q.queue_id = o.queue_id "
        "WHERE o.runner_id = ANY(%s) GROUP BY q.bus_id, q.queue_id, q.next_offset, "
        "q.first_offset ORDER BY q.bus_id, q.queue_id",
        (ids,),
    )
    found = cur.fetchall()
    ranges = [jdbc.QueueRange(*row[:4]) for row in found]
    firsts = {(bus_id, q): first for bus_id, q, _, _, first in found if first}
    return AuditScope(runners, offsets, ranges, patterns, segments, rollups.load(cur, ids), firsts)


def _versions(
    cur, runners: list[AuditRunner], pattern_version: str
) -> tuple[dict[int, tuple[int, str]], list[VersionSegment]]:
    """Each runner's pattern versions and the offsets each judged, per queue. The first
    version also judges what came before it (an archive replay's view); a runner with no
    recorded version (or ``current``) is judged by its rule's pattern now throughout."""
    if pattern_version not in PATTERN_VERSIONS:
        raise ValueError(
            f"pattern version must be {' or '.join(PATTERN_VERSIONS)}, got {pattern_version!r}"
        )
    rows = []
    if pattern_version == "history":
        cur.execute(
            "SELECT runner_id, queue_id, from_offset, state, pattern::text "
            "FROM event_runner_version WHERE runner_id = ANY(%s) "
            "ORDER BY runner_id, queue_id, from_offset, rule_version, target_version",
            ([r.runner_id for r in runners],),
        )
        rows = cur.fetchall()
    bus_of = {r.runner_id: r.bus_id for r in runners}
    patterns: dict[int, tuple[int, str]] = {}
    vids: dict[tuple[int, str], int] = {}  # (bus id, pattern) -> vid: one index entry each

    def vid_of(runner_id: int, state: str, pattern: str) -> int | None:
        if state != "ENABLED":
            return None
        key = (bus_of[runner_id], pattern)
        if key not in vids:
            vids[key] = len(vids) + 1
            patterns[vids[key]] = key
        return vids[key]

    per_queue: dict[tuple[int, int], list[tuple[int, int | None]]] = {}
    for runner_id, queue_id, start, state, pattern in rows:
        line = per_queue.setdefault((runner_id, queue_id), [])
        if line and line[-1][0] == start:
            line.pop()  # never in force: a newer version took effect at the same offset
        line.append((start, vid_of(runner_id, state, pattern)))
    segments = []
    for (runner_id, queue_id), line in per_queue.items():
        for i, (start, vid) in enumerate(line):
            stop = line[i + 1][0] if i + 1 < len(line) else NO_END
            segments.append(VersionSegment(runner_id, queue_id, 0 if i == 0 else start, stop, vid))
    judged = {s.runner_id for s in segments}
    for r in runners:
        if r.runner_id not in judged:
            segments.append(
                VersionSegment(
                    r.runner_id, -1, 0, NO_END, vid_of(r.runner_id, "ENABLED", r.pattern)
                )
            )
    return patterns, segments


@lru_cache(maxsize=16)
def _indexes(rules: tuple[tuple[int, int, str], ...]) -> dict[int, RuleIndex]:
    """bus id -> the rule index of the rules on that bus: built once per executor process, so
    an event costs what its fields match, not how many rules there are."""
    by_bus: dict[int, list] = {}
    for rid, bus_id, pattern in rules:
        by_bus.setdefault(bus_id, []).append((rid, pattern))
    return {bus_id: RuleIndex(rs) for bus_id, rs in by_bus.items()}


def with_matching_runners(events, rules: list[tuple[int, int, str]]):
    """``events`` plus ``runner_ids``: the ids of the rules (runner_id, bus_id, pattern JSON)
    that match each event of its bus, by the Python rule engine (the push engine's own), in
    Arrow-fed batches on the executors. A Spark SQL form of the patterns measured 2-4 times
    slower on cached events, up to 10 times in the job, and was removed (docs/BENCHMARKS.md,
    "Audit: the rule evaluator")."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    frozen = tuple((int(rid), int(bus_id), str(p)) for rid, bus_id, p in rules)

    @F.udf(T.ArrayType(T.IntegerType()))
    def matching(bus_id: int, text: str) -> list[int]:
        index = _indexes(frozen).get(bus_id)
        return index.matching(json.loads(text)) if index is not None else []

    return events.withColumn("runner_ids", matching(F.col("bus_id"), F.col("body")))


def classify(
    spark,
    db_url: str,
    scope: AuditScope,
    since: datetime | None = None,
    until: datetime | None = None,
    slice_size: int = jdbc.DEFAULT_SLICE,
    from_start: bool = False,
    delivered_at: bool = False,
):
    """One row per expected record: runner_id, bus_id, queue_id, offset, message_id, ctime,
    body, deliveries (count), failure_status, committed, state. With ``from_start`` every
    matching event counts, also those from before a runner began (an archive replay's view);
    with ``delivered_at``, also the time of its last delivery row (for ``verify``)."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F

    db = jdbc.jdbc_database(db_url)
    ranges = scope.ranges
    if from_start:  # from where the bus began: below it, a deleted bus's events
        ranges = [
            jdbc.QueueRange(
                r.bus_id, r.queue_id, scope.firsts.get((r.bus_id, r.queue_id), 0), r.end
            )
            for r in ranges
        ]
    # Deferred: bus_events imports PySpark at load.
    from eventpush.sparkjobs.bus_events import read_events

    events = read_events(spark, db_url, ranges, since, until, slice_size)
    # The index matches each event once against every pattern version (vid) of its bus; a
    # match counts for the runners whose segment of the event's queue and offset that vid
    # judged (queue -1: every queue).
    rules = [(vid, bus_id, pattern) for vid, (bus_id, pattern) in scope.patterns.items()]
    by_vid = with_matching_runners(events, rules).select(
        "bus_id",
        "queue_id",
        "offset",
        "message_id",
        "ctime",
        "body",
        F.explode("runner_ids").alias("vid"),
    )
    segments = spark.createDataFrame(
        [(s.runner_id, s.queue_id, s.start, s.stop, s.vid) for s in scope.segments if s.vid] or [],
        "runner_id INT, seg_queue INT, seg_start BIGINT, seg_stop BIGINT, vid INT",
    )
    matched = by_vid.join(
        F.broadcast(segments),
        (by_vid["vid"] == segments["vid"])
        & ((segments["seg_queue"] == by_vid["queue_id"]) | (segments["seg_queue"] == -1))
        & (by_vid["offset"] >= segments["seg_start"])
        & (by_vid["offset"] < segments["seg_stop"]),
    ).select("bus_id", "queue_id", "offset", "message_id", "ctime", "body", "runner_id")
    offsets = spark.createDataFrame(
        scope.offsets or [], "runner_id INT, queue_id INT, start_offset BIGINT, committed BIGINT"
    )
    expected = matched.join(F.broadcast(offsets), ["runner_id", "queue_id"])
    if not from_start:
        expected = expected.where(F.col("offset") >= F.col("start_offset"))
    ids = [r.runner_id for r in scope.runners]
    columns = 'runner_id, queue_id, "offset"' + (", ctime AS delivered_at" if delivered_at else "")
    when = [F.max("delivered_at").alias("delivered_at")] if delivered_at else []
    deliveries = (
        jdbc.read_by_runner(spark, db, "event_push_delivery", columns, ids)
        .groupBy("runner_id", "queue_id", "offset")
        .agg(F.count(F.lit(1)).alias("deliveries"), *when)
    )
    failures = jdbc.read_by_runner(
        spark,
        db,
        "event_push_failure",
        'runner_id, queue_id, "offset", status AS failure_status',
        ids,
    )
    keys = list(KEYS)
    joined = expected.join(deliveries, keys, "left").join(failures, keys, "left")
    # A record of a rolled-up window (eventpush.rollups) has no delivery rows any more: it
    # was found delivered or failed when the window was audited clean, never missing.
    rolls = spark.createDataFrame(
        [(r.runner_id, r.window_start, r.window_end) for r in scope.rollups] or [],
        "roll_runner INT, roll_start TIMESTAMP, roll_end TIMESTAMP",
    )
    joined = joined.join(
        F.broadcast(rolls),
        (joined["runner_id"] == rolls["roll_runner"])
        & (joined["ctime"] >= rolls["roll_start"])
        & (joined["ctime"] < rolls["roll_end"]),
        "left",
    )
    rolled = F.col("roll_start").isNotNull()
    failed = F.col("failure_status").isin("failed", "dead")
    deliveries_col = F.coalesce(F.col("deliveries"), F.lit(0))
    deliveries_col = F.when(rolled & ~failed, F.greatest(deliveries_col, F.lit(1))).otherwise(
        deliveries_col
    )
    state = (
        F.when(rolled, F.when(failed, "failed").otherwise("delivered"))
        .when(deliveries_col > 0, "delivered")
        .when(failed, "failed")
        .when(F.col("offset") >= F.col("committed"), "pending")
        .otherwise("missing")
    )
    return joined.select(
        "runner_id",
        "bus_id",
        "queue_id",
        "offset",
        "message_id",
        "ctime",
        "body",
        deliveries_col.alias("deliveries"),
        "failure_status",
        "committed",
        state.alias("state"),
        "roll_start",
        *(["delivered_at"] if delivered_at else []),
    )


def readable_runners(scope: AuditScope) -> dict[int, str]:
    """runner id -> target URL, for the runners whose sink kind can read its destination."""
    from eventpush.sinks import readable

    return {r.runner_id: r.url for r in scope.runners if readable(r.url)}


def verify(spark, records, scope: AuditScope, policy=None):
    """The ``delivered`` records of ``classify``'s frame (made ``delivered_at``) checked at
    their destinations, on the executors: one partition per target URL (as many as there are
    cores at most), each reading its URL once through the sink kind's ``read_back``. A frame
    of ``readback.SCHEMA``: a marker row per runner read (``checked`` or ``error``) and a row
    per record its destination does not hold (``absent`` or ``expired``); None when no runner
    of the scope has a readable destination."""
    from pyspark.sql import functions as F

    from eventpush.addresses import address_policy
    from eventpush.sinks import readback

    urls = readable_runners(scope)
    if not urls:
        return None
    policy = policy if policy is not None else address_policy()
    by_runner = spark.createDataFrame(list(urls.items()), "runner_id INT, url STRING")
    delivered = (
        records.where((F.col("state") == "delivered") & F.col("roll_start").isNull())
        .join(F.broadcast(by_runner), "runner_id")
        .select(
            "url",
            "runner_id",
            "queue_id",
            "offset",
            F.col("ctime").cast("double").alias("ctime"),
            F.col("delivered_at").cast("double").alias("delivered_at"),
        )
    )
    parts = max(1, min(len(set(urls.values())), spark.sparkContext.defaultParallelism))
    rows = (
        delivered.repartition(parts, "url")
        .sortWithinPartitions("url")
        .rdd.mapPartitions(readback.check_partition(policy))
    )
    return spark.createDataFrame(rows, readback.SCHEMA)


def summarise(records, scope: AuditScope, checked=False, whole=()) -> list[RunnerAudit]:
    """Per-runner counts from ``classify``'s frame; every runner of the scope appears. With
    ``checked`` (``verify``'s frame, or None when nothing was readable, for an audit that
    verifies sinks), each runner's absent, expired and sink too. ``whole``: the roll-ups
    lying wholly inside the audited window, whose own figures stand for their records."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F

    def count_state(name: str):
        return F.sum(F.when(F.col("state") == name, 1).otherwise(0)).alias(name)

    if whole:
        answered = records.sparkSession.createDataFrame(
            [(r.runner_id, r.window_start) for r in whole], "runner_id INT, roll_start TIMESTAMP"
        )
        records = records.join(F.broadcast(answered), ["runner_id", "roll_start"], "left_anti")
    rows = (
        records.groupBy("runner_id")
        .agg(
            F.count(F.lit(1)).alias("expected"),
            *(count_state(s) for s in STATES),
            F.sum(F.greatest(F.col("deliveries") - 1, F.lit(0))).alias("duplicates"),
        )
        .collect()
    )
    by_id = {row["runner_id"]: row for row in rows}
    sinks = _sink_states(checked, scope) if checked is not False else {}
    out = []
    for r in scope.runners:
        row = by_id.get(r.runner_id)
        counts = {k: int(row[k] or 0) if row else 0 for k in ("expected", *STATES, "duplicates")}
        for w in whole:
            if w.runner_id == r.runner_id:
                for key in ("expected", "delivered", "failed", "duplicates"):
                    counts[key] += getattr(w, key)
        out.append(
            RunnerAudit(
                runner=r.name,
                **counts,
                deleted=r.deleted,
                **sinks.get(r.runner_id, {}),
                runner_id=r.runner_id,
            )
        )
    return out


def _sink_states(checked, scope: AuditScope) -> dict[int, dict]:
    """runner id -> absent, expired and sink, from ``verify``'s frame."""
    from pyspark.sql import functions as F

    from eventpush.sinks import readback, scheme_of

    out: dict[int, dict] = {}
    readable = readable_runners(scope)
    for r in scope.runners:
        if r.runner_id in readable:
            # Read, but with nothing delivered in the window there was nothing to look for.
            out[r.runner_id] = {"sink": "verified: nothing delivered in the window"}
        else:
            out[r.runner_id] = {"sink": f"not readable ({scheme_of(r.url)})"}
    if checked is None:
        return out
    rows = (
        checked.groupBy("runner_id", "state")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.first("where").alias("where"),
            F.first("error").alias("error"),
        )
        .collect()
    )
    for row in rows:
        state, entry = row["state"], out[row["runner_id"]]
        if state == readback.CHECKED:
            entry["sink"] = f"verified: {row['where']}"
        elif state == readback.ERROR:
            entry["sink"] = f"error: {row['error']}"
        else:
            entry[state] = int(row["n"])
    return out


def absent_listing(checked, records) -> dict[int, list[tuple[int, int, str]]]:
    """runner id -> its absent records (queue_id, offset, message_id), the first
    ABSENT_LISTED of each by queue and offset."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from eventpush.sinks import readback

    if checked is None:
        return {}
    order = Window.partitionBy("runner_id").orderBy("queue_id", "offset")
    rows = (
        checked.where(F.col("state") == readback.ABSENT)
        .join(records.select(*KEYS, "message_id"), list(KEYS))
        .withColumn("n", F.row_number().over(order))
        .where(F.col("n") <= ABSENT_LISTED)
        .select("runner_id", "queue_id", "offset", "message_id")
        .collect()
    )
    out: dict[int, list[tuple[int, int, str]]] = {}
    for row in sorted(rows, key=lambda r: (r["runner_id"], r["queue_id"], r["offset"])):
        out.setdefault(int(row["runner_id"]), []).append(
            (int(row["queue_id"]), int(row["offset"]), row["message_id"])
        )
    return out


def write_report(
    cur, bus: str | None, since, until, runners: list[RunnerAudit], verified: bool = False
) -> int:
    totals = AuditResult(runners, None, since, until).totals()
    cur.execute(
        "INSERT INTO event_audit_report (bus, window_start, window_end, expected, delivered, "
        "failed, missing, pending, duplicates, runners, absent, expired) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        (
            bus,
            since,
            until,
            totals["expected"],
            totals["delivered"],
            totals["failed"],
            totals["missing"],
            totals["pending"],
            totals["duplicates"],
            json.dumps([asdict(r) for r in runners]),
            totals["absent"] if verified else None,
            totals["expired"] if verified else None,
        ),
    )
    return cur.fetchone()[0]


def run_audit(
    spark,
    db_url: str,
    bus: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    save: bool = True,
    slice_size: int = jdbc.DEFAULT_SLICE,
    verify_sinks: bool = False,
    roll_up: bool = False,
) -> AuditResult:
    """Audit every runner (of ``bus``, if given) over ``[since, until)``; saves the report.
    With ``verify_sinks``, readable destinations are read back too (``verify``). With
    ``roll_up`` (a closed window: both ends given, its end past), the runners found clean
    have the window's delivery rows replaced by one summary row each (eventpush.rollups)."""
    if roll_up and (since is None or until is None or until > datetime.now(UTC)):
        raise ValueError("--roll-up needs a closed window: give --since and a past --until")
    with connection(db_url) as conn:
        sync_heads(conn)  # a broker's bus: read up to its heads as they are now
    with connection(db_url) as conn, transaction(conn) as cur:
        if bus is not None:
            cur.execute("SELECT 1 FROM event_bus WHERE name = %s", (bus,))
            if cur.fetchone() is None:
                raise ValueError(f"unknown bus {bus!r}")
        scope = load_scope(cur, bus=bus)
        # Retention's horizon: a window wholly past it is refused, one reaching past it is
        # answered from where the kept events begin (what is gone is not expected, never
        # missing) with a warning.
        kept = kept_since_by_bus(cur, sorted({r.bus_id for r in scope.runners}))
        warnings = clip_window(kept, since, until, "audit")
    bus_names = {r.runner_id: r.bus for r in scope.runners}
    whole = [
        w
        for w in rollups.whole_within(scope.rollups, since, until)
        if bus_names[w.runner_id] not in kept or w.window_start >= kept[bus_names[w.runner_id]]
    ]
    records = classify(spark, db_url, scope, since, until, slice_size, delivered_at=verify_sinks)
    listed: dict = {}
    if verify_sinks and scope.runners:
        # Read once: the counts, the check and the listing all use the frame.
        records = records.persist()
        checked = verify(spark, records, scope)
        if checked is not None:
            checked = checked.persist()
        runners = summarise(records, scope, checked, whole)
        listed = absent_listing(checked, records)
        if not roll_up:
            records.unpersist()
        if checked is not None:
            checked.unpersist()
    else:
        records = records.persist() if roll_up else records  # read again by the roll-up
        runners = summarise(records, scope, whole=whole) if scope.runners else []
    report_id = None
    if save:
        with connection(db_url) as conn, transaction(conn) as cur:
            report_id = write_report(cur, bus, since, until, runners, verified=verify_sinks)
    rolled: dict[int, int] = {}
    if roll_up:
        rolled = roll_up_clean(db_url, records, runners, since, until, report_id)
        records.unpersist()
    result = AuditResult(runners, report_id, since, until, listed, warnings, rolled)
    if save:  # a saved audit is a result operators watch: textfile / Pushgateway when set
        publish_batch("audit", audit_results(result))
    return result


def roll_up_clean(
    db_url: str, records, runners: list[RunnerAudit], since, until, report_id
) -> dict[int, int]:
    """The runners found clean (nothing missing, pending or absent, a readable destination
    read) with records in the window: their delivery rows replaced by one summary row each.
    Returns runner id -> delivery rows replaced."""
    from pyspark.sql import functions as F

    # By id: a deleted runner found clean must not roll up a live one of its name.
    clean = {
        r.runner_id: r
        for r in runners
        if r.expected
        and not (r.missing or r.pending or r.absent)
        and not (r.sink or "").startswith("error")
    }
    if not clean:
        return {}
    keys = (
        records.where(F.col("roll_start").isNull() & F.col("runner_id").isin(list(clean)))
        .select("runner_id", "queue_id", "offset")
        .collect()
    )
    offsets: dict[int, dict[int, list[int]]] = {}
    for row in keys:
        offsets.setdefault(row["runner_id"], {}).setdefault(row["queue_id"], []).append(
            row["offset"]
        )
    windows = [
        rollups.RunnerWindow(rid, r.expected, r.delivered, r.failed, r.duplicates, offsets[rid])
        for rid, r in clean.items()
        if rid in offsets
    ]
    with connection(db_url) as conn:
        return rollups.roll_up(conn, since, until, windows, report_id)
