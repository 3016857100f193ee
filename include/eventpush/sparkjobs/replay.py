"""Replay: re-push failed records, audit gaps, or every matching event of a window.

A request is checked first (``check_request``: impossible values refused with a message that
says which field and why). Operator input is bounded by configuration (``replay_limits``):
``all`` needs a window (or the explicit ``everything``) no longer than
``EVENTPUSH_REPLAY_MAX_WINDOW_HOURS``, no run selects more than
``EVENTPUSH_REPLAY_MAX_COUNT`` records, a rate limit is at least ``EVENTPUSH_REPLAY_MIN_RATE``
records per second, and message ids are few and short (they travel as spark-submit
arguments). Spark selects the records: ``failed`` reads the open failure rows
(status ``failed``, window on when they failed), ``missing`` takes the audit's gaps, ``all``
every event of the window the rule matches (from the start of the bus, as an archive replay
does). ``missing`` also reads readable destinations back (``audit.verify``): a record the
books call delivered that its destination does not hold (``absent``) is re-pushed too; one
the destination still answers as held (a deleted message whose id a stream remembers within
its duplicate window) is not restored and counts as failed (replay it once the window has
passed). The executors then push them with the engine's delivery code (signing, inline
retries, the stable ``webhook-id``), each partition writing its delivery rows (origin
``replay``) and failure-row updates in one transaction.

Safe to run twice: ``failed`` selects only rows still ``failed``, ``missing`` only records
still without a delivery, and before pushing each partition skips any ``failed``/``missing``
record that gained a delivery row meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta

from eventpush.addresses import address_policy
from eventpush.config import redact
from eventpush.db import connect, connection, transaction
from eventpush.metrics import publish_batch, replay_results
from eventpush.partitions import PastRetentionError, clip_window, kept_since_by_bus
from eventpush.push.committing import outcome_rows
from eventpush.push.store import copy_deliveries, load_targets
from eventpush.quality import batch as quality
from eventpush.rules.transforms import compile_transform
from eventpush.sinks import Sinks
from eventpush.sinks.contract import DELIVERED, FINAL, Record, by_answer
from eventpush.sinks.readback import ABSENT
from eventpush.sources import sync_heads
from eventpush.sparkjobs import forms, jdbc
from eventpush.sparkjobs.audit import KEYS, classify, load_scope, readable_runners, verify
from eventpush.sparkjobs.forms import (
    MAX_MESSAGE_ID_LENGTH,
    MAX_MESSAGE_IDS,
    PATTERN_VERSIONS,
    WHATS,
    FormError,
    ReplayLimits,
    ReplayRequest,
    job_args,
    replay_limits,
)

PUSH_CONCURRENCY = 16  # requests in flight per partition
WRITE_INTERVAL_S = 0.2  # how often a partition writes its finished outcomes (as the engine)
# A pushing partition is a Python process, a database connection and an HTTP pool: below this
# many records a second one cost more than it gave (docs/BENCHMARKS.md, replay).
RECORDS_PER_PUSH_PARTITION = 50_000


class ReplayRequestError(ValueError):
    """A replay request that cannot be run; the message names the field."""


@dataclass
class ReplayResult:
    replay_id: int
    selected: int
    delivered: int = 0
    failed: int = 0
    skipped: int = 0
    dry_run: bool = False
    runners: dict = field(default_factory=dict)  # runner name -> selected count
    warnings: list = field(default_factory=list)  # one line each, e.g. events past retention

    def to_json(self) -> dict:
        return asdict(self)


def check_bounds(req: ReplayRequest, limits: ReplayLimits | None = None) -> None:
    """Refuse requests outside what the operator may ask for (no database needed)."""
    limits = limits or replay_limits()
    if req.what not in WHATS:
        raise ReplayRequestError(f"what must be one of {', '.join(WHATS)}, got {req.what!r}")
    if req.pattern_version not in PATTERN_VERSIONS:
        raise ReplayRequestError(
            f"pattern version must be {' or '.join(PATTERN_VERSIONS)}, got {req.pattern_version!r}"
        )
    if req.since and req.until and req.until <= req.since:
        raise ReplayRequestError(
            f"until ({req.until.isoformat()}) must be after since ({req.since.isoformat()})"
        )
    if req.what == "all" and not req.everything:
        if req.since is None:
            raise ReplayRequestError(
                "what=all needs a window: give since (and until), or set everything to "
                "re-push every event ever published"
            )
        span = (req.until or datetime.now(UTC)) - req.since
        if span > limits.max_window:
            raise ReplayRequestError(
                f"the window of what=all spans {_hours(span)} hours, over the limit of "
                f"{_hours(limits.max_window)} (EVENTPUSH_REPLAY_MAX_WINDOW_HOURS)"
            )
    if req.max_count is not None and req.max_count <= 0:
        raise ReplayRequestError(f"max count must be a positive number, got {req.max_count}")
    if req.max_count is not None and req.max_count > limits.max_count:
        raise ReplayRequestError(
            f"max count {req.max_count} is over the limit of {limits.max_count} "
            "(EVENTPUSH_REPLAY_MAX_COUNT)"
        )
    if req.rate_limit is not None and req.rate_limit <= 0:
        raise ReplayRequestError(
            f"rate limit must be a positive number of records per second, got {req.rate_limit}"
        )
    if req.rate_limit is not None and req.rate_limit < limits.min_rate:
        raise ReplayRequestError(
            f"rate limit must be at least {limits.min_rate:g} records per second "
            f"(EVENTPUSH_REPLAY_MIN_RATE), got {req.rate_limit:g}"
        )
    if req.rate_limit and req.max_count:
        needs = timedelta(seconds=req.max_count / req.rate_limit)
        if needs > limits.timeout:
            raise ReplayRequestError(
                f"{req.max_count} records at {req.rate_limit:g} per second take "
                f"{_hours(needs)} hours, longer than the job's timeout of "
                f"{_hours(limits.timeout)} (EVENTPUSH_REPLAY_TIMEOUT_MINUTES)"
            )
    if len(req.message_ids) > MAX_MESSAGE_IDS:
        raise ReplayRequestError(
            f"at most {MAX_MESSAGE_IDS} message ids, got {len(req.message_ids)}"
        )
    if any(not isinstance(m, str) or not m.strip() for m in req.message_ids):
        raise ReplayRequestError("message ids must be non-empty strings")
    for i, message_id in enumerate(req.message_ids, start=1):
        if len(message_id) > MAX_MESSAGE_ID_LENGTH:
            raise ReplayRequestError(
                f"message id {i} is {len(message_id)} characters long, over the limit of "
                f"{MAX_MESSAGE_ID_LENGTH}"
            )


def _hours(span: timedelta) -> str:
    return f"{span.total_seconds() / 3600:.4g}"


def check_request(req: ReplayRequest, cur) -> list[int]:
    """Refuse impossible requests; returns the ids of the runners in scope."""
    check_bounds(req)
    if req.bus is not None:
        cur.execute("SELECT 1 FROM event_bus WHERE name = %s AND deleted_at IS NULL", (req.bus,))
        if cur.fetchone() is None:
            raise ReplayRequestError(f"unknown bus {req.bus!r}")
    if req.rule is not None:
        cur.execute(
            "SELECT 1 FROM event_rule ru JOIN event_bus b ON b.id = ru.bus_id "
            "WHERE ru.name = %s AND (%s::text IS NULL OR b.name = %s) "
            "AND ru.deleted_at IS NULL",
            (req.rule, req.bus, req.bus),
        )
        if cur.fetchone() is None:
            where = f" on bus {req.bus!r}" if req.bus else ""
            raise ReplayRequestError(f"unknown rule {req.rule!r}{where}")

    # Runners of deleted targets are never replayed to (their books stay, for the audit).
    scope = load_scope(cur, bus=req.bus, rule=req.rule, target=req.target, live_only=True)
    if req.target is not None and not scope.runners:
        if load_scope(cur, bus=req.bus, rule=req.rule, target=req.target).runners:
            raise ReplayRequestError(
                f"target {req.target!r} was deleted: nothing is replayed to it (its delivery "
                "and failure rows stay for the audit)"
            )
        raise ReplayRequestError(f"unknown target {req.target!r} for the given bus and rule")
    runner_ids = [r.runner_id for r in scope.runners]
    check_horizon(req, cur, runner_ids, {r.bus_id for r in scope.runners})
    return runner_ids


GONE_FAILURES_SQL = (
    "SELECT count(*), count(*) FILTER (WHERE b.events_kept_since IS NOT NULL "
    "AND b.source_url IS NULL AND NOT EXISTS (SELECT 1 FROM bus_event e WHERE e.bus_id = b.id "
    'AND e.queue_id = f.queue_id AND e."offset" = f."offset")), '
    "min(b.name) FILTER (WHERE b.events_kept_since IS NOT NULL), min(b.events_kept_since) "
    "FROM event_push_failure f JOIN event_target_runner r ON r.id = f.runner_id "
    "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
    "JOIN event_bus b ON b.id = ru.bus_id "
    "WHERE f.status = 'failed' AND f.runner_id = ANY(%(runners)s) "
    "AND (%(since)s::timestamptz IS NULL OR f.ctime >= %(since)s) "
    "AND (%(until)s::timestamptz IS NULL OR f.ctime < %(until)s) "
    "AND (%(ids)s::text[] IS NULL OR f.message_id = ANY(%(ids)s))"
)


def check_horizon(req: ReplayRequest, cur, runner_ids: list[int], bus_ids: set[int]) -> None:
    """Refuse, in one line, a replay of what retention has dropped: a window that begins
    before a bus in scope keeps events, or failures whose events are all gone."""
    kept = kept_since_by_bus(cur, sorted(bus_ids))
    if not kept:
        return
    try:
        clip_window(kept, req.since, req.until, "replay")
    except PastRetentionError as exc:
        raise ReplayRequestError(str(exc)) from None
    for name, start in kept.items():
        if req.since is not None and req.since < start:
            raise ReplayRequestError(
                f"replay refused: the window starts {req.since.isoformat()}, before bus "
                f"{name!r} keeps events (from {start.isoformat()}): give --since "
                f"{start.isoformat()} or later"
            )
    total, gone, bus, start = gone_failures(req, cur, runner_ids)
    if total and gone == total:
        raise ReplayRequestError(
            f"replay refused: the {total} failed records selected are of events gone by "
            f"retention (bus {bus!r} keeps events from {start.isoformat()}): they can no "
            "longer be replayed"
        )


def gone_failures(req: ReplayRequest, cur, runner_ids: list[int]) -> tuple:
    """For a ``failed`` replay: how many open failures it selects, how many of them are of
    events retention dropped, and the first such bus and where it keeps events from."""
    if req.what != "failed":
        return 0, 0, None, None
    cur.execute(
        GONE_FAILURES_SQL,
        {
            "runners": runner_ids,
            "since": req.since,
            "until": req.until,
            "ids": list(req.message_ids) or None,
        },
    )
    return cur.fetchone()


# ``absent``: delivered in the books, not held by its destination (a ``missing`` replay).
SELECTION_COLUMNS = ["runner_id", "bus_id", "queue_id", "offset", "message_id", "ctime", "absent"]
PUSH_COLUMNS = ["runner_id", "bus_id", "queue_id", "offset", "message_id", "absent"]
NOT_RESTORED = (
    "{where} still holds this record's key (a removed message whose id it remembers within "
    "its duplicate window): not restored; replay it again once the window has passed"
)

OPEN_FAILURES_SQL = (
    'SELECT f.runner_id, ru.bus_id, f.queue_id, f."offset", f.message_id, f.ctime, '
    "FALSE AS absent "
    "FROM event_push_failure f JOIN event_target_runner r ON r.id = f.runner_id "
    "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
    "WHERE f.status = 'failed' AND f.runner_id = ANY(%(runners)s)"
)


def select(spark, db_url: str, req: ReplayRequest, runner_ids: list[int], policy=None):
    """The records to replay, one row per (runner, queue, offset), oldest first."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F

    if req.what == "failed":
        # The open failure rows are one indexed query: PostgreSQL filters, orders and limits
        # them in one read (one JDBC partition), where slicing them by runner, joining their
        # buses in Spark and sorting there cost a second or more of a replay's fixed cost.
        db = jdbc.jdbc_database(db_url)
        return jdbc.read_query(spark, db, open_failures_sql(db_url, req, runner_ids))
    with connection(db_url) as conn:
        sync_heads(conn)  # a broker's bus: read up to its heads as they are now
    with connection(db_url) as conn, transaction(conn) as cur:
        scope = load_scope(cur, runner_ids=runner_ids, pattern_version=req.pattern_version)
    readable = req.what == "missing" and bool(readable_runners(scope))
    rows = classify(
        spark,
        db_url,
        scope,
        req.since,
        req.until,
        from_start=req.what == "all",
        delivered_at=readable,
    )
    if readable:
        rows = rows.persist()
        checked = verify(spark, rows, scope, policy)
        absent = checked.where(F.col("state") == ABSENT).select(*KEYS, F.lit(True).alias("absent"))
        rows = rows.join(absent, list(KEYS), "left").where(
            (F.col("state") == "missing") | F.col("absent").isNotNull()
        )
        rows = rows.withColumn("absent", F.coalesce(F.col("absent"), F.lit(False)))
    elif req.what == "missing":
        rows = rows.where(F.col("state") == "missing").withColumn("absent", F.lit(False))
    else:
        rows = rows.withColumn("absent", F.lit(False))
    if req.message_ids:
        rows = rows.where(F.col("message_id").isin(list(req.message_ids)))
    rows = rows.select(*SELECTION_COLUMNS).orderBy("ctime", "runner_id", "queue_id", "offset")
    return rows.limit(effective_max_count(req))


def open_failures_sql(db_url: str, req: ReplayRequest, runner_ids: list[int]) -> str:
    """The query of a ``failed`` selection as SQL text for Spark's JDBC reader, its values
    bound by psycopg2 (which binds on the client anyway), so no value is pasted in by hand."""
    sql, params = OPEN_FAILURES_SQL, {"runners": list(runner_ids)}
    if req.since:
        sql, params["since"] = sql + " AND f.ctime >= %(since)s", req.since
    if req.until:
        sql, params["until"] = sql + " AND f.ctime < %(until)s", req.until
    if req.message_ids:
        sql, params["ids"] = sql + " AND f.message_id = ANY(%(ids)s)", list(req.message_ids)
    sql += ' ORDER BY f.ctime, f.runner_id, f.queue_id, f."offset" LIMIT %(limit)s'
    params["limit"] = effective_max_count(req)
    with connection(db_url) as conn, conn.cursor() as cur:
        return cur.mogrify(sql, params).decode()


def effective_max_count(req: ReplayRequest) -> int:
    """The request's maximum count, or the configured cap when it gives none."""
    return req.max_count if req.max_count is not None else replay_limits().max_count


def push_partition(
    db_url: str, replay_id: int, what: str, rate_per_partition: float | None, policy=None
):
    """The function each executor partition runs: push, then record, in one transaction.
    ``policy`` is the driver's address policy: executors enforce it, not their own env."""

    def run(groups):
        rows = [row for group in groups for row in group]  # one group per partition
        if not rows:
            return iter([])
        import uvloop  # as the engine: it roughly halves the loop's own cost per request

        return iter(uvloop.run(_push(db_url, replay_id, what, rate_per_partition, rows, policy)))

    return run


async def _push(db_url, replay_id, what, rate, rows, policy=None) -> list[tuple[str, int]]:
    # Deferred: bus_events imports PySpark at load.
    from eventpush.sparkjobs.bus_events import source_bodies

    conn = connect(db_url, application_name="eventpush-replay")
    try:
        with transaction(conn) as cur:
            ids = sorted({r["runner_id"] for r in rows})
            targets = {t.runner_id: t for t in load_targets(cur, "r.id = ANY(%s)", (ids,))}
            keys = [(r["runner_id"], r["bus_id"], r["queue_id"], r["offset"]) for r in rows]
            events = event_bodies(cur, [k[1:] for k in keys])
            bodies = {(rid, q, o): events[b, q, o] for rid, b, q, o in keys if (b, q, o) in events}
            already = set()
            if what != "all":
                cur.execute(
                    'SELECT DISTINCT d.runner_id, d.queue_id, d."offset" '
                    "FROM unnest(%s::int[], %s::int[], %s::bigint[]) AS k(runner_id, q, off) "
                    "JOIN event_push_delivery d ON d.runner_id = k.runner_id "
                    'AND d.queue_id = k.q AND d."offset" = k.off',
                    [int_array(k[i] for k in keys) for i in (0, 2, 3)],
                )
                already = {tuple(row) for row in cur.fetchall()}
        bodies.update(source_bodies(conn, keys))  # events of buses kept outside PostgreSQL
        transforms = {
            rid: compile_transform(t.transform_kind, t.transform_spec) for rid, t in targets.items()
        }
        interval = 1.0 / rate if rate else 0.0
        start = time.monotonic()
        pending: list = []  # (target, records, outcome) not yet written
        counts = {"delivered": 0, "failed": 0}

        def record(row) -> Record:
            raw = bodies[(row["runner_id"], row["queue_id"], row["offset"])]
            return Record(row["queue_id"], row["offset"], row["message_id"], json.loads(raw), raw)

        async def send(first: int, batch: list, sinks) -> None:
            """One request of up to ``batch_size`` records, paced by its first record's index."""
            if interval:  # record i goes no earlier than i / rate
                delay = start + first * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            target = targets[batch[0]["runner_id"]]
            records = [record(row) for row in batch]
            outcome = await sinks.deliver(target, records, transforms[target.runner_id])
            if outcome.held and any(batch[i]["absent"] for i in outcome.held):
                not_restored(batch, outcome)
            pending.append((target, records, outcome))

        todo: dict[int, list] = {}
        skipped = 0
        for row in rows:
            key = (row["runner_id"], row["queue_id"], row["offset"])
            # An absent record has its delivery row: the destination lost it, not the books.
            done = key in already and not row["absent"]
            if done or key not in bodies or row["runner_id"] not in targets:
                skipped += 1
            else:
                todo.setdefault(row["runner_id"], []).append(row)
        # As live: a batch target gets batches of its size; an ordered target gets one sender
        # per queue that sends its batches in offset order, each after the one before is final.
        lines: deque[list[tuple[int, list]]] = deque()
        first = 0
        for runner_id, runner_rows in sorted(todo.items()):
            target = targets[runner_id]
            runner_rows.sort(key=lambda r: (r["queue_id"], r["offset"]))
            queues: dict[int, list] = {}
            for row in runner_rows:
                queues.setdefault(row["queue_id"] if target.ordered else -1, []).append(row)
            for queue_rows in queues.values():
                line = []
                for k in range(0, len(queue_rows), target.batch_size):
                    line.append((first, queue_rows[k : k + target.batch_size]))
                    first += len(line[-1][1])
                lines.extend([line] if target.ordered else [[b] for b in line])

        async def sender(sinks) -> None:
            # A fixed set of senders taking lines in order: the concurrency bound without a
            # task (and a semaphore waiter) per request.
            while lines:
                for first, batch in lines.popleft():
                    await send(first, batch, sinks)

        # One transaction for the partition, as before, but written while the pushes go on
        # (as the engine's committer does), not after them: the rows' foreign-key checks and
        # index updates cost about as much as the requests themselves.
        with transaction(conn) as cur:
            done = asyncio.Event()

            async def writer() -> None:
                while True:
                    finished = done.is_set()
                    chunk = pending[:]
                    pending.clear()
                    if chunk:
                        await asyncio.to_thread(_write_outcomes, cur, chunk, replay_id, counts)
                    if finished:
                        return
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(WRITE_INTERVAL_S):
                            await done.wait()

            writing = asyncio.create_task(writer())
            try:
                async with Sinks(policy) as sinks:
                    senders = min(PUSH_CONCURRENCY, len(lines))
                    await asyncio.gather(*(sender(sinks) for _ in range(senders)))
            finally:
                done.set()
                await writing
    finally:
        conn.close()
    return [("delivered", counts["delivered"]), ("failed", counts["failed"]), ("skipped", skipped)]


def not_restored(batch: list, outcome) -> None:
    """Absent records the destination answered as held on their first attempt were not
    written again: each fails with the reason (``NOT_RESTORED``), the rest keep their
    answers."""
    answers = outcome.per_record or [(outcome.kind, outcome.error)] * len(batch)
    why = NOT_RESTORED.format(where=outcome.held_by or "the destination")
    for i in outcome.held:
        if batch[i]["absent"]:
            answers[i] = (FINAL, why)
    outcome.per_record = answers
    if len(set(answers)) == 1:
        outcome.kind, outcome.error = answers[0]


def int_array(values) -> str:
    """Integers as the text of a PostgreSQL array, for a ``%s::int[]`` parameter: psycopg2
    adapts a list element by element, several times slower, and these lists are a
    partition's every record, built while its pushes run."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


def event_bodies(cur, keys: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], str]:
    """Bodies of the events at ``keys`` (bus_id, queue_id, offset), each read once: a queue
    whose wanted offsets lie close together is read as one range of its index (a replay of a
    run of failures, or of a window), the others offset by offset."""
    wanted: dict[tuple[int, int], set[int]] = {}
    for bus_id, queue_id, offset in keys:
        wanted.setdefault((bus_id, queue_id), set()).add(offset)
    ranges, scattered = [], []
    for (bus_id, queue_id), offsets in wanted.items():
        lo, hi = min(offsets), max(offsets)
        if hi - lo + 1 <= 2 * len(offsets):
            ranges.append((bus_id, queue_id, lo, hi + 1))
        else:
            scattered.extend((bus_id, queue_id, offset) for offset in offsets)
    rows = []
    if ranges:
        cur.execute(
            'SELECT e.bus_id, e.queue_id, e."offset", e.body::text '
            "FROM unnest(%s::int[], %s::int[], %s::bigint[], %s::bigint[]) "
            "AS w(bus_id, queue_id, lo, hi) JOIN bus_event e ON e.bus_id = w.bus_id "
            'AND e.queue_id = w.queue_id AND e."offset" >= w.lo AND e."offset" < w.hi',
            [int_array(r[i] for r in ranges) for i in range(4)],
        )
        rows += cur.fetchall()
    if scattered:
        cur.execute(
            'SELECT e.bus_id, e.queue_id, e."offset", e.body::text '
            "FROM unnest(%s::int[], %s::int[], %s::bigint[]) AS k(bus_id, queue_id, off) "
            "JOIN bus_event e ON e.bus_id = k.bus_id AND e.queue_id = k.queue_id "
            'AND e."offset" = k.off',
            [int_array(k[i] for k in scattered) for i in range(3)],
        )
        rows += cur.fetchall()
    return {(b, q, o): body for b, q, o, body in rows}


def _write_outcomes(cur, outcomes: list, replay_id: int, counts: dict) -> None:
    """Delivery rows (origin ``replay``), and failure rows marked ``replayed`` or ``dead``, for
    finished requests, built by the engine's own row builder and written by its COPY writer,
    so live and replay rows cannot drift apart."""
    # Deferred: psycopg2's extras are loaded only by the executors that write rows.
    import psycopg2.extras

    delivered, failed = [], []  # delivery rows; (failure row, the runner's broker_name)
    brokers = {}  # runner -> its delivery rows' broker_name
    for target, sent, answer in outcomes:
        for outcome, records in by_answer(sent, answer):
            rows = outcome_rows(target, records, outcome)
            if outcome.kind == DELIVERED:
                delivered.extend(rows)
                brokers[target.runner_id] = target.broker
            else:
                failed.extend((row, target.broker) for row in rows)
    if delivered:
        # The runners' counters first: a worker's commit holds its runner rows FOR SHARE
        # while it writes failure rows, so taking them before the failure rows below keeps
        # the two in one lock order.
        per_runner = Counter(d.runner_id for d in delivered)
        cur.execute(
            "UPDATE event_target_runner r SET replayed_total = r.replayed_total + k.n "
            "FROM unnest(%s::int[], %s::bigint[]) AS k(id, n) WHERE r.id = k.id",
            (list(per_runner), list(per_runner.values())),
        )
        copy_deliveries(cur, delivered, brokers, replay=True, replay_id=replay_id)
        cur.execute(
            "UPDATE event_push_failure f SET status = 'replayed', replay_id = %s, "
            "mtime = now() FROM unnest(%s::int[], %s::int[], %s::bigint[]) "
            "AS k(runner_id, q, off) WHERE f.runner_id = k.runner_id "
            'AND f.queue_id = k.q AND f."offset" = k.off',
            (
                replay_id,
                int_array(d.runner_id for d in delivered),
                int_array(d.queue_id for d in delivered),
                int_array(d.offset for d in delivered),
            ),
        )
    if failed:
        psycopg2.extras.execute_values(
            cur,
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, "
            'queue_id, "offset", message_id, attempts, http_status, last_error, broker_name, '
            'status, replay_id) VALUES %s ON CONFLICT (runner_id, queue_id, "offset") DO UPDATE '
            "SET status = 'dead', attempts = event_push_failure.attempts + "
            "EXCLUDED.attempts, http_status = EXCLUDED.http_status, "
            "last_error = EXCLUDED.last_error, replay_id = EXCLUDED.replay_id, mtime = now()",
            [(*f, broker, "dead", replay_id) for f, broker in failed],
            page_size=1000,
        )
    counts["delivered"] += len(delivered)
    counts["failed"] += len(failed)


def start_run(db_url: str, req: ReplayRequest) -> int:
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "INSERT INTO event_replay_run (request, what, dry_run) VALUES (%s, %s, %s) "
            "RETURNING id",
            (json.dumps(req.to_json()), req.what, req.dry_run),
        )
        return cur.fetchone()[0]


def finish_run(db_url: str, result: ReplayResult, error: str | None = None) -> None:
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "UPDATE event_replay_run SET status = %s, selected = %s, delivered = %s, "
            "failed = %s, error = %s, finished_at = now() WHERE id = %s",
            (
                "failed" if error else "succeeded",
                result.selected,
                result.delivered,
                result.failed,
                error,
                result.replay_id,
            ),
        )


def run_replay(spark, db_url: str, req: ReplayRequest, run_label: str = "cli") -> ReplayResult:
    """Check, select, GX-check the selection, push (unless dry run), GX-check the result."""
    policy = address_policy()  # read on the driver: a bad range fails before anything runs
    with connection(db_url) as conn, transaction(conn) as cur:
        runner_ids = check_request(req, cur)
        _, gone, bus, start = gone_failures(req, cur, runner_ids)
    replay_id = start_run(db_url, req)
    result = ReplayResult(replay_id=replay_id, selected=0, dry_run=req.dry_run)
    if gone:  # pushed nowhere: skipped, and said
        result.warnings.append(
            f"{gone} failed records are of events gone by retention (bus {bus!r} keeps events "
            f"from {start.isoformat()}): they can no longer be replayed and are skipped"
        )
    try:
        # One read of the selection to the driver (its keys are few columns, and the check
        # and the counts need them all), then one Spark job that pushes it: no cache, no
        # shuffle to spread it, no reduce stage for three counts.
        keys = select(spark, db_url, req, runner_ids, policy).select(*PUSH_COLUMNS).toPandas()
        result.selected = len(keys)
        names = _runner_names(db_url, runner_ids)
        counts = keys["runner_id"].value_counts().to_dict() if len(keys) else {}
        result.runners = {names[int(r)]: int(n) for r, n in counts.items()}
        label = f"{run_label} replay {replay_id}"
        quality.check_replay_selection(keys, runner_ids, effective_max_count(req), label, db_url)
        if not req.dry_run and result.selected:
            sc = spark.sparkContext
            parts = push_partitions(result.selected, sc.defaultParallelism)
            rate = req.rate_limit / parts if req.rate_limit else None
            groups = spread(keys.to_dict("records"), parts, ordered_runners(db_url, runner_ids))
            totals: dict[str, int] = {}
            pushed = sc.parallelize(groups, len(groups)).mapPartitions(
                push_partition(db_url, replay_id, req.what, rate, policy)
            )
            for name, n in pushed.collect():
                totals[name] = totals.get(name, 0) + n
            result.delivered = int(totals.get("delivered", 0))
            result.failed = int(totals.get("failed", 0))
            result.skipped = int(totals.get("skipped", 0))
            quality.check_replay_result(
                result.selected, result.delivered, result.failed, result.skipped, label, db_url
            )
    except Exception as exc:
        error = redact(str(exc).strip(), db_url).splitlines()[0][:500] if str(exc).strip() else ""
        finish_run(db_url, result, error=error or type(exc).__name__)
        raise
    finish_run(db_url, result)

    publish_batch("replay", replay_results(result))
    return result


def recorded_run(db_url: str, label: str) -> dict:
    """The counts of the replay run recorded under ``label`` (an Airflow run id); raises
    unless it succeeded, so a DAG's report task fails with the run's own error."""
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "SELECT id, status, selected, delivered, failed, dry_run, error "
            "FROM event_replay_run WHERE request->>'label' = %s ORDER BY id DESC LIMIT 1",
            (label,),
        )
        row = cur.fetchone()
    if row is None:
        raise RuntimeError(f"the replay job recorded no run for {label}")
    keys = ("replay_id", "status", "selected", "delivered", "failed", "dry_run", "error")
    result = dict(zip(keys, row, strict=True))
    if result["status"] != "succeeded":
        raise RuntimeError(f"replay {result['replay_id']} {result['status']}: {result['error']}")
    return result


def push_partitions(selected: int, parallelism: int) -> int:
    """How many partitions push: one per ``RECORDS_PER_PUSH_PARTITION`` records, at most one
    per executor core."""
    wanted = -(-selected // RECORDS_PER_PUSH_PARTITION)
    return max(1, min(wanted, parallelism))


def ordered_runners(db_url: str, runner_ids: list[int]) -> set[int]:
    """The runners among ``runner_ids`` whose target is ordered."""
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "SELECT r.id FROM event_target_runner r JOIN event_target t ON t.id = r.target_id "
            "WHERE r.id = ANY(%s) AND t.ordered",
            (runner_ids,),
        )
        return {row[0] for row in cur.fetchall()}


def spread(rows: list[dict], parts: int, ordered: set[int]) -> list[list[dict]]:
    """The selected rows in ``parts`` groups, one per pushing partition: an ordered target's
    queue stays in one group (one sender per queue, in offset order), whole queues going to
    the smallest group; an unordered target's records are dealt round, so a runner with few
    queues still keeps every partition busy."""
    if parts <= 1:
        return [rows]
    groups: list[list[dict]] = [[] for _ in range(parts)]
    queues: dict[tuple[int, int], list[dict]] = {}
    dealt = 0
    for row in rows:
        if row["runner_id"] in ordered:
            queues.setdefault((row["runner_id"], row["queue_id"]), []).append(row)
        else:
            groups[dealt % parts].append(row)
            dealt += 1
    for queue in sorted(queues.values(), key=len, reverse=True):
        min(groups, key=len).extend(queue)
    return groups


def _runner_names(db_url: str, runner_ids: list[int]) -> dict[int, str]:
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute("SELECT id, name FROM event_target_runner WHERE id = ANY(%s)", (runner_ids,))
        return dict(cur.fetchall())


def request_from_form(
    params: dict, label: str | None = None, conf: dict | None = None
) -> ReplayRequest:
    """A request from the replay DAG's form (``forms.request_from_form``), a bad field
    refused as a ``ReplayRequestError``."""
    try:
        return forms.request_from_form(params, label, conf)
    except FormError as exc:
        raise ReplayRequestError(str(exc)) from None


def checked_job_args(
    db_url: str, params: dict, label: str | None = None, conf: dict | None = None
) -> list[str]:
    """A replay form, checked against the database, as the replay job's arguments; raises
    ``ReplayRequestError`` naming the field otherwise (the DAGs' first task)."""
    request = request_from_form(params, label, conf)
    with connection(db_url) as conn, transaction(conn) as cur:
        check_request(request, cur)
    return job_args(request)
