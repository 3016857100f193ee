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
passed). The executors then push them (:mod:`eventpush.sparkjobs.replay_push`: the engine's
delivery code, signing, inline retries, the stable ``webhook-id``), each partition writing
its delivery rows (origin ``replay``) and failure-row updates in one transaction; this module
is the request's handling on the driver: check, select, GX checks, the run's record.

Safe to run twice: ``failed`` selects only rows still ``failed``, ``missing`` only records
still without a delivery, and before pushing each partition skips any ``failed``/``missing``
record that gained a delivery row meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta

from eventpush.addresses import address_policy
from eventpush.config import redact
from eventpush.db import connect, connection, transaction
from eventpush.metrics import publish_batch, replay_results
from eventpush.partitions import PastRetentionError, clip_window, kept_since_by_bus
from eventpush.quality import batch as quality
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
    span_hours,
)
from eventpush.sparkjobs.replay_push import (
    ordered_runners,
    push_partition,
    push_partitions,
    spread,
)

log = logging.getLogger(__name__)


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
                f"the window of what=all spans {span_hours(span)} hours, over the limit of "
                f"{span_hours(limits.max_window)} (EVENTPUSH_REPLAY_MAX_WINDOW_HOURS)"
            )
    if req.max_count is not None and req.max_count <= 0:
        raise ReplayRequestError(f"max count must be a positive number, got {req.max_count}")
    if req.max_count is not None and req.max_count > limits.max_count:
        raise ReplayRequestError(
            f"max count {req.max_count} is over the limit of {limits.max_count} "
            "(EVENTPUSH_REPLAY_MAX_COUNT)"
        )
    # NaN passes every comparison below (and then paces nothing); inf is no limit at all.
    if req.rate_limit is not None and not math.isfinite(req.rate_limit):
        raise ReplayRequestError(
            f"rate limit must be a finite number of records per second, got {req.rate_limit}"
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
                f"{span_hours(needs)} hours, longer than the job's timeout of "
                f"{span_hours(limits.timeout)} (EVENTPUSH_REPLAY_TIMEOUT_MINUTES)"
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


# The session lock a pushing replay holds from its selection to its last write: two at once
# (a form submitted twice, the CLI beside the DAG, the gap DAG beside either) both selected
# the same open failures and delivered each of them twice.
REPLAY_LOCK_KEY = 0x6570_7265_706C  # "eprepl"


@contextlib.contextmanager
def one_replay_at_a_time(db_url: str, dry_run: bool) -> Iterator[float]:
    """Held while a replay selects and pushes: another waits for it, then selects what it
    left. Yields the seconds spent waiting. A dry run pushes nothing and waits for nobody.
    The lock is the session's: a driver that dies lets it go with its connection."""
    if dry_run:
        yield 0.0
        return
    conn = connect(db_url, application_name="eventpush-replay-lock")
    try:
        conn.autocommit = True
        started = time.monotonic()
        with conn.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s)", (REPLAY_LOCK_KEY,))
            if not cur.fetchone()[0]:
                log.warning("another replay is pushing: this one waits for it to finish")
                # As long as it takes: a statement or lock timeout in the database URL's
                # options is for the work, not for this wait (the caller's own timeout is).
                cur.execute("SET statement_timeout = 0; SET lock_timeout = 0")
                cur.execute("SELECT pg_advisory_lock(%s)", (REPLAY_LOCK_KEY,))
        yield time.monotonic() - started
    finally:
        conn.close()  # the lock goes with the session


def run_replay(spark, db_url: str, req: ReplayRequest, run_label: str = "cli") -> ReplayResult:
    """Check, select, GX-check the selection, push (unless dry run), GX-check the result;
    one pushing replay at a time (:func:`one_replay_at_a_time`)."""
    policy = address_policy()  # read on the driver: a bad range fails before anything runs
    with one_replay_at_a_time(db_url, req.dry_run) as waited:
        result = _run_replay(spark, db_url, req, run_label, policy)
    if waited >= 1:
        result.warnings.append(f"waited {waited:.0f} s for another replay to finish first")
    publish_batch("replay", replay_results(result))
    return result


def _run_replay(spark, db_url: str, req: ReplayRequest, run_label: str, policy) -> ReplayResult:
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
