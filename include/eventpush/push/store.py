"""The push engine's database side: lease, runner claims, assignment, reads and commits.

Plain synchronous psycopg2 functions; the engine calls them through ``asyncio.to_thread`` so
no database call blocks the event loop. A commit writes delivery rows, failure rows, offsets
and runner counters in one transaction, and only on the connection that holds the worker's
lease, so a copy of the worker that lost its lease can never move an offset.

Fencing: a worker pushes a runner only while it holds the runner's claim (a session advisory
lock on the lease connection), taken when the assignment gives it the runner and let go only
after its sends for that runner have stopped; every commit checks, under a share lock on the
runner rows, that each runner it writes for is still assigned to this worker at the
generation the worker started it with. A commit for a runner that moved is refused whole
(:class:`FencedError`) and retried without it.
"""

from __future__ import annotations

import io
import json
import os
import socket
from dataclasses import dataclass, field
from typing import NamedTuple

import psycopg2
import psycopg2.errors
import psycopg2.extras

from eventpush.config import setting
from eventpush.db import Connection, copy_text, transaction
from eventpush.policy import POLICY_FIELDS
from eventpush.sinks.contract import Auth, Target, Tls
from eventpush.sources import broker_name

DEFAULT_BROKER = "eventpush"  # the column default: a bus on eventpush's own PostgreSQL store
LEASE_NAMESPACE = 0x45_50  # first key of the advisory lock; the worker id is the second
RUNNER_NAMESPACE = 0x45_51  # a runner's claim; the runner id is the second key
# The application_name of a push slice's lease session: how a DAG task tells the slice it
# takes over from (it waits for the lease) from a standalone worker (it leaves it alone).
SLICE_APP = "eventpush push slice"


class WorkerBusyError(RuntimeError):
    """Another process holds this worker's lease."""


class UnknownWorkerError(ValueError):
    """No worker of that name is configured."""


class LeaseLostError(RuntimeError):
    """The lease went away (connection lost) and another process has taken it since."""


class FencedError(RuntimeError):
    """A commit refused because some of its runners are no longer this worker's."""

    def __init__(self, runner_ids: frozenset[int]) -> None:
        super().__init__(f"runners {sorted(runner_ids)} are no longer assigned to this worker")
        self.runner_ids = runner_ids


# Tuples, not frozen dataclasses: one is made per record delivered, on the event loop, and a
# frozen dataclass costs several times as much to build.
class DeliveryRow(NamedTuple):
    runner_id: int
    runner: str
    bus: str
    queue_id: int
    offset: int
    message_id: str
    attempts: int
    http_status: int | None  # None: a sink without HTTP statuses (NATS)
    latency_ms: float


class FailureRow(NamedTuple):
    runner_id: int
    runner: str
    bus: str
    queue_id: int
    offset: int
    message_id: str
    attempts: int
    http_status: int | None
    error: str


class VersionRow(NamedTuple):
    """From ``from_offset`` on its queue, a runner's events are judged by these versions."""

    runner_id: int
    queue_id: int
    from_offset: int
    rule_version: int
    target_version: int
    state: str
    pattern: str


@dataclass(frozen=True)
class OffsetRow:
    runner_id: int
    queue_id: int
    committed: int
    pulled: int
    message_id: str | None


def worker_id(conn: Connection, name: str) -> int:
    with transaction(conn) as cur:
        cur.execute("SELECT id FROM event_push_worker WHERE name = %s", (name,))
        row = cur.fetchone()
    if row is None:
        raise UnknownWorkerError(
            f"unknown worker {name!r}: create it with 'eventpush worker create'"
        )
    return row[0]


def take_lease(conn: Connection, worker: str, wid: int, wait_s: float = 0.0) -> None:
    """Hold the worker's advisory lock on ``conn`` (autocommit session lock). With ``wait_s``
    the call waits in PostgreSQL's lock queue that long for the holder to let go (it is
    granted the moment the holder unlocks: no polling); otherwise it fails at once."""
    conn.autocommit = True
    with conn.cursor() as cur:
        if wait_s > 0:
            got = _wait_for_lock(cur, wid, wait_s)
        else:
            cur.execute("SELECT pg_try_advisory_lock(%s, %s)", (LEASE_NAMESPACE, wid))
            got = cur.fetchone()[0]
        if not got:
            cur.execute(
                "SELECT host, pid FROM event_push_worker WHERE id = %s",
                (wid,),
            )
            host, pid = cur.fetchone()
            where = f" (last seen as pid {pid} on {host})" if pid else ""
            raise WorkerBusyError(f"worker {worker!r} is already running elsewhere{where}")
        cur.execute(
            "UPDATE event_push_worker SET host = %s, pid = %s, started_at = now(), "
            "heartbeat_at = now() WHERE id = %s",
            (socket.gethostname(), os.getpid(), wid),
        )
    conn.autocommit = False


def _wait_for_lock(cur, wid: int, wait_s: float) -> bool:
    cur.execute("SELECT set_config('lock_timeout', %s, false)", (f"{int(wait_s * 1000)}ms",))
    try:
        cur.execute("SELECT pg_advisory_lock(%s, %s)", (LEASE_NAMESPACE, wid))
        return True
    except psycopg2.errors.LockNotAvailable:
        return False
    finally:
        cur.execute("SELECT set_config('lock_timeout', '0', false)")


# pg_locks lists the advisory locks of every database on the server: only this one's count.
_THIS_LEASE = (
    "{p}locktype = 'advisory' AND {p}classid = %s AND {p}objid = %s AND {p}objsubid = 2 "
    "AND {p}database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def lease_holder(conn: Connection, wid: int) -> str | None:
    """The ``application_name`` of the session holding the worker's lease (``SLICE_APP`` for
    a push slice of the DAG), or None when nobody holds it."""
    with transaction(conn) as cur:
        cur.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            f"WHERE {_THIS_LEASE.format(p='l.')} AND l.granted",
            (LEASE_NAMESPACE, wid),
        )
        row = cur.fetchone()
    return row[0] if row else None


def lease_wanted(conn: Connection, wid: int) -> bool:
    """Whether another session waits in the lock queue for the worker's lease (the next push
    slice, ready to take over)."""
    with transaction(conn) as cur:
        cur.execute(
            f"SELECT EXISTS (SELECT 1 FROM pg_locks WHERE {_THIS_LEASE.format(p='')} "
            "AND NOT granted)",
            (LEASE_NAMESPACE, wid),
        )
        return cur.fetchone()[0]


def release_lease(conn: Connection, wid: int) -> None:
    """Let go of the lease and every runner claim held with it."""
    conn.rollback()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("UPDATE event_push_worker SET pid = NULL WHERE id = %s", (wid,))
        cur.execute("SELECT pg_advisory_unlock_all()")


def _claims_held(cur) -> set[int]:
    cur.execute(
        "SELECT objid::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
        "AND classid = %s AND objsubid = 2 AND granted",
        (RUNNER_NAMESPACE,),
    )
    return {row[0] for row in cur.fetchall()}


def _claim(cur, runner_ids: list[int]) -> set[int]:
    """Take the claims not held yet; the ids whose claim this session now holds."""
    held = _claims_held(cur)
    for rid in runner_ids:
        if rid not in held:
            cur.execute("SELECT pg_try_advisory_lock(%s, %s)", (RUNNER_NAMESPACE, rid))
            if cur.fetchone()[0]:
                held.add(rid)
    return held & set(runner_ids)


def _assigned(cur, wid: int, generations: dict[int, int], lock: bool) -> set[int]:
    """The runners still assigned to this worker at the generation given."""
    cur.execute(
        "SELECT id, worker_id, generation FROM event_target_runner WHERE id = ANY(%s)"
        + (" FOR SHARE" if lock else ""),
        (list(generations),),
    )
    return {rid for rid, worker, gen in cur.fetchall() if worker == wid and gen == generations[rid]}


def claim_runners(conn: Connection, wid: int, generations: dict[int, int]) -> set[int]:
    """Claim runners assigned to this worker ({id: generation}); returns those claimed. A
    runner whose previous worker has not let go yet is not claimed (try again later)."""
    with transaction(conn) as cur:
        assigned = _assigned(cur, wid, generations, lock=False)
        return _claim(cur, sorted(assigned))


def release_runners(conn: Connection, runner_ids: list[int]) -> None:
    """Let go of runner claims (after this worker's sends for them have stopped)."""
    with transaction(conn) as cur:
        held = _claims_held(cur)
        for rid in runner_ids:
            if rid in held:
                cur.execute("SELECT pg_advisory_unlock(%s, %s)", (RUNNER_NAMESPACE, rid))


ASSIGNMENT_SQL = """
SELECT r.id, r.state, r.generation, coalesce(
    (SELECT jsonb_object_agg(c.key, c.value) FROM event_runtime_control c
      WHERE c.scope = 'runner' AND c.name = r.name), '{}'::jsonb), ru.version, t.version,
    r.deleted_at IS NOT NULL
FROM event_target_runner r
JOIN event_push_worker w ON w.id = r.worker_id
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
WHERE w.id = %s AND w.enabled
ORDER BY r.id
"""


@dataclass(frozen=True)
class Assignment:
    """What the catalog gives one worker: its live runners ({id: (state, generation,
    controls)}), the catalog versions of each one's rule and target ({id: (rule version,
    target version)}), its own controls, and the runners deleted while it held them (it
    finishes their sends and commits what they delivered, then lets go: ``let_go_deleted``)."""

    runners: dict[int, tuple]
    versions: dict[int, tuple[int, int]]
    controls: dict
    deleted: frozenset[int]


def read_assignment(conn: Connection, wid: int, worker: str) -> Assignment:
    with transaction(conn) as cur:
        cur.execute(ASSIGNMENT_SQL, (wid,))
        rows = cur.fetchall()
        live = [row for row in rows if not row[6]]
        cur.execute(
            "SELECT key, value FROM event_runtime_control WHERE scope = 'worker' AND name = %s",
            (worker,),
        )
        controls = dict(cur.fetchall())
    return Assignment(
        runners={rid: (state, gen, ctl) for rid, state, gen, ctl, *_ in live},
        versions={row[0]: (row[4], row[5]) for row in live},
        controls=controls,
        deleted=frozenset(row[0] for row in rows if row[6]),
    )


def let_go_deleted(conn: Connection, wid: int, runner_ids: list[int]) -> None:
    """Deleted runners this worker is done with: their claims let go and their worker
    cleared, so nothing counts them as held here any more."""
    release_runners(conn, runner_ids)
    with transaction(conn) as cur:
        cur.execute(
            "UPDATE event_target_runner SET worker_id = NULL "
            "WHERE id = ANY(%s) AND worker_id = %s AND deleted_at IS NOT NULL",
            (runner_ids, wid),
        )


TARGET_SQL = f"""
SELECT r.id, r.name, b.name, b.id, ru.name, ru.pattern::text, t.name, t.url, t.secret,
       t.transform_kind, t.transform_spec, {", ".join("t." + f for f in POLICY_FIELDS)},
       b.account, b.region,
       t.secret_old, t.secret_old_until, ru.version, t.version, ru.state, b.source_url,
       d.name, d.method, d.rate_limit, t.concurrency_auto, t.headers,
       coalesce(t.client_cert_file, d.client_cert_file),
       coalesce(t.client_key_file, d.client_key_file), coalesce(t.ca_file, d.ca_file),
       c.id, c.name, c.version, c.auth_kind, c.parameters, c.secret, c.headers, c.query
FROM event_target_runner r
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus b ON b.id = ru.bus_id
LEFT JOIN event_api_destination d ON d.id = t.destination_id
LEFT JOIN event_connection c ON c.id = d.connection_id
"""


def load_targets(cur, where: str = "TRUE", params: tuple = ()) -> list[Target]:
    """Targets joined with their runner, rule and bus, secrets unsealed; ``where`` is a
    fixed SQL condition over aliases r, t, ru, b with its values in ``params``. A secret that
    does not open is ``sealed.SecretKeyError`` (one line), never an unsigned send."""
    from eventpush import sealed

    cur.execute(f"{TARGET_SQL} WHERE {where} ORDER BY r.id", params)
    targets = []
    policy_end = 11 + len(POLICY_FIELDS)
    for row in cur.fetchall():
        (*head, secret, transform_kind, transform_spec) = row[:11]
        policy = dict(zip(POLICY_FIELDS, row[11:policy_end], strict=True))
        account, region, old, old_until, rule_version, target_version, state, source = row[
            policy_end : policy_end + 8
        ]
        targets.append(
            Target(
                *head,
                sealed.unseal_or_none(secret),
                transform_kind,
                transform_spec,
                **policy,
                bus_account=account,
                bus_region=region,
                broker=broker_name(source),
                secret_old=sealed.unseal_or_none(old),
                secret_old_until=old_until,
                rule_version=rule_version,
                target_version=target_version,
                rule_state=state,
                **_destination_fields(row[policy_end + 8 :]),
            )
        )
    return targets


def _destination_fields(row: tuple) -> dict:
    """The Target fields of issue 32: destination, method, rate limit, adaptive concurrency,
    headers (the connection's, then the target's own over them), query, TLS files (the
    target's own over the destination's) and the connection's credentials, unsealed."""
    from eventpush import sealed

    destination, method, rate_limit, auto, target_headers, cert, key, ca = row[:8]
    connection_id, connection, version, kind, params, secret, headers, query = row[8:]
    fields: dict = {"concurrency_auto": auto}
    if destination is not None:
        fields.update(destination=destination, method=method, rate_limit=rate_limit)
    merged = dict((k, v) for k, v in (headers or []) + (target_headers or []))
    if merged:
        fields["headers"] = tuple(merged.items())
    if query:
        fields["query"] = tuple((k, v) for k, v in query)
    if cert is not None or ca is not None:
        fields["tls"] = Tls(cert, key, ca)
    if connection_id is not None:
        name = params.get("key_name") or params.get("username") or params.get("client_id")
        fields["auth"] = Auth(
            connection_id,
            connection,
            version,
            kind,
            name,
            sealed.unseal(secret),
            token_url=params.get("token_url"),
            scopes=tuple(params.get("scopes", ())),
            params=tuple((k, v) for k, v in params.get("oauth_params", ())),
        )
    return fields


def read_targets(conn: Connection, runner_ids: list[int]) -> list[Target]:
    with transaction(conn) as cur:
        return load_targets(cur, "r.id = ANY(%s)", (runner_ids,))


def read_versions(conn: Connection, runner_ids: list[int]) -> list[VersionRow]:
    """The recorded versions of runners, oldest first per queue."""
    with transaction(conn) as cur:
        cur.execute(
            "SELECT runner_id, queue_id, from_offset, rule_version, target_version, state, "
            "pattern::text FROM event_runner_version WHERE runner_id = ANY(%s) "
            "ORDER BY runner_id, queue_id, from_offset, rule_version, target_version",
            (runner_ids,),
        )
        return [VersionRow(*row) for row in cur.fetchall()]


def read_offsets(conn: Connection, runner_ids: list[int]) -> dict[int, dict[int, int]]:
    """Committed offsets: {runner_id: {queue_id: offset}}."""
    with transaction(conn) as cur:
        cur.execute(
            'SELECT runner_id, queue_id, "offset" FROM event_push_offset WHERE runner_id = ANY(%s)',
            (runner_ids,),
        )
        out: dict[int, dict[int, int]] = {}
        for rid, qid, offset in cur.fetchall():
            out.setdefault(rid, {})[qid] = offset
    return out


@dataclass
class CommitBatch:
    """What one commit writes. ``xid`` is set by :func:`commit` before anything is written,
    so a commit whose outcome is unknown (reply lost, cancelled) can be looked up instead of
    being retried blindly."""

    deliveries: list[DeliveryRow]
    failures: list[FailureRow]
    offsets: list[OffsetRow]
    generations: dict[int, int]  # every runner written for -> generation it was started at
    brokers: dict[int, str] = field(default_factory=dict)  # runner -> its rows' broker_name
    xid: int | None = None
    versions: list[VersionRow] = field(default_factory=list)  # versions taking effect

    def without(self, runner_ids: frozenset[int]) -> CommitBatch:
        return CommitBatch(
            [d for d in self.deliveries if d.runner_id not in runner_ids],
            [f for f in self.failures if f.runner_id not in runner_ids],
            [o for o in self.offsets if o.runner_id not in runner_ids],
            {r: g for r, g in self.generations.items() if r not in runner_ids},
            {r: b for r, b in self.brokers.items() if r not in runner_ids},
            versions=[v for v in self.versions if v.runner_id not in runner_ids],
        )

    def empty(self) -> bool:
        return not (self.deliveries or self.failures or self.offsets or self.versions)


def commit(conn: Connection, wid: int, batch: CommitBatch) -> None:
    """Deliveries, failures, offsets and counters in one transaction, under the lease and
    the claims of every runner written for, fenced by their assignment generation."""
    deliveries, failures, offsets = batch.deliveries, batch.failures, batch.offsets
    brokers = batch.brokers
    batch.xid = None
    with transaction(conn) as cur:
        cur.execute("SELECT txid_current()")
        batch.xid = cur.fetchone()[0]
        # The lease is a session lock on this very connection; after a reconnect it must have
        # been taken again, and this check makes a commit without it impossible.
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
            "AND pid = pg_backend_pid() AND classid = %s AND objid = %s AND granted)",
            (LEASE_NAMESPACE, wid),
        )
        if not cur.fetchone()[0]:
            raise LeaseLostError("commit refused: this connection does not hold the lease")
        if batch.generations:
            # The runner table's ROW EXCLUSIVE lock first, the one the counters' UPDATE below
            # needs: taken later, it would wait for an assignment change (assign, worker
            # enable/disable, rebalance: SHARE ROW EXCLUSIVE on the table, then a row
            # updated) that itself waits for this commit's row locks, a deadlock. Taken
            # first, the one waits for the other. Commits do not block each other with it.
            cur.execute("LOCK TABLE event_target_runner IN ROW EXCLUSIVE MODE")
            # FOR SHARE: a rebalance moving one of these runners waits for this commit.
            assigned = _assigned(cur, wid, batch.generations, lock=True)
            claimed = _claim(cur, sorted(assigned))
            fenced = frozenset(batch.generations) - claimed
            if fenced:
                raise FencedError(fenced)
        if batch.versions:
            # With the offsets they let pass: an offset past a version's start is never
            # committed without the version that judged the events before it.
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO event_runner_version (runner_id, queue_id, from_offset, "
                "rule_version, target_version, state, pattern) VALUES %s "
                "ON CONFLICT DO NOTHING",
                batch.versions,
            )
        if deliveries:
            copy_deliveries(cur, deliveries, brokers)
        if failures:
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, "
                'broker_name, queue_id, "offset", message_id, attempts, http_status, last_error) '
                'VALUES %s ON CONFLICT (runner_id, queue_id, "offset") DO UPDATE SET '
                "attempts = event_push_failure.attempts + EXCLUDED.attempts, "
                "http_status = EXCLUDED.http_status, last_error = EXCLUDED.last_error, "
                "status = 'failed', mtime = now()",
                [
                    (
                        f.runner_id,
                        f.runner,
                        f.bus,
                        brokers.get(f.runner_id, DEFAULT_BROKER),
                        f.queue_id,
                        f.offset,
                        f.message_id,
                        f.attempts,
                        f.http_status,
                        f.error,
                    )
                    for f in failures
                ],
            )
        if offsets:
            psycopg2.extras.execute_values(
                cur,
                'UPDATE event_push_offset o SET "offset" = greatest(o."offset", v.committed), '
                "pulled = greatest(o.pulled, v.pulled), "
                "message_id = coalesce(v.message_id, o.message_id), "
                "mtime = now() "
                "FROM (VALUES %s) AS v(runner_id, queue_id, committed, pulled, message_id) "
                "WHERE o.runner_id = v.runner_id AND o.queue_id = v.queue_id",
                [(o.runner_id, o.queue_id, o.committed, o.pulled, o.message_id) for o in offsets],
                template="(%s, %s, %s::bigint, %s::bigint, %s::text)",
            )
        counts: dict[int, list[int]] = {}
        for d in deliveries:
            counts.setdefault(d.runner_id, [0, 0])[0] += 1
        for f in failures:
            counts.setdefault(f.runner_id, [0, 0])[1] += 1
        if counts:
            psycopg2.extras.execute_values(
                cur,
                "UPDATE event_target_runner r SET delivered_total = r.delivered_total + v.d, "
                "failed_total = r.failed_total + v.f FROM (VALUES %s) AS v(id, d, f) "
                "WHERE r.id = v.id",
                [(rid, d, f) for rid, (d, f) in counts.items()],
            )


DELIVERY_COLUMNS = (
    'runner_id, consumer_group, topic_name, broker_name, queue_id, "offset", message_id, '
    "attempts, http_status, latency_ms"
)


NULL = "\\N"  # NULL in COPY's text format


def copy_deliveries(
    cur,
    deliveries: list[DeliveryRow],
    brokers: dict[int, str],
    replay: bool = False,
    replay_id: int | None = None,
) -> None:
    """Delivery rows through COPY, for the engine's commit and for replay's partitions
    (``replay``: rows of origin ``replay``, carrying ``replay_id`` when there is one).
    ``brokers``: runner -> its rows' broker_name (the default when absent)."""
    buf = io.StringIO()
    prefixes: dict[int, str] = {}  # a runner's first four columns, escaped once
    end = "\n"
    if replay:  # COPY's text format: \N is NULL
        end = f"\treplay\t{NULL if replay_id is None else int(replay_id)}\n"
    for d in deliveries:
        prefix = prefixes.get(d.runner_id)
        if prefix is None:
            broker = copy_text(brokers.get(d.runner_id, DEFAULT_BROKER))
            prefix = f"{d.runner_id}\t{copy_text(d.runner)}\t{copy_text(d.bus)}\t{broker}\t"
            prefixes[d.runner_id] = prefix
        buf.write(
            f"{prefix}{d.queue_id}\t{d.offset}\t{copy_text(d.message_id)}\t"
            f"{d.attempts}\t{copy_text(d.http_status)}\t{d.latency_ms:.3f}{end}"
        )
    buf.seek(0)
    columns = f"{DELIVERY_COLUMNS}, origin, replay_id" if replay else DELIVERY_COLUMNS
    cur.copy_expert(f"COPY event_push_delivery ({columns}) FROM STDIN", buf)


def heartbeat(conn: Connection, wid: int, metrics: dict, runner_stats: list[tuple]) -> None:
    """Worker heartbeat and metrics, and one metric row per runner (lag computed here). Each
    heartbeat also drops its runners' rows older than ``EVENTPUSH_METRIC_RETENTION_HOURS``
    (48 by default): a few rows at a time through the (runner_id, ts) index, so the table
    stays bounded without a job of its own."""

    retention_hours = setting("EVENTPUSH_METRIC_RETENTION_HOURS", 48)
    with transaction(conn) as cur:
        cur.execute(
            "UPDATE event_push_worker SET heartbeat_at = now(), metrics = %s WHERE id = %s",
            (json.dumps(metrics), wid),
        )
        if runner_stats:
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO event_push_metric (worker_id, runner_id, delivered, failed, lag, "
                "in_flight, waiting, p50_ms, p99_ms) "
                "SELECT v.worker_id, v.runner_id, r.delivered_total, r.failed_total, "
                'coalesce(sum(q.next_offset - o."offset"), 0), '
                'coalesce(sum(greatest(o.pulled - o."offset", 0)), 0), '
                "coalesce(sum(greatest(q.next_offset - o.pulled, 0)), 0), v.p50, v.p99 "
                "FROM (VALUES %s) AS v(worker_id, runner_id, p50, p99) "
                "JOIN event_target_runner r ON r.id = v.runner_id "
                "JOIN event_push_offset o ON o.runner_id = r.id "
                "JOIN event_target t ON t.id = r.target_id "
                "JOIN event_rule ru ON ru.id = t.rule_id "
                "JOIN event_bus_queue q ON q.bus_id = ru.bus_id AND q.queue_id = o.queue_id "
                "GROUP BY v.worker_id, v.runner_id, r.delivered_total, r.failed_total, "
                "v.p50, v.p99",
                [(wid, *stats) for stats in runner_stats],
                template="(%s, %s, %s::real, %s::real)",
            )
            cur.execute(
                "DELETE FROM event_push_metric WHERE runner_id = ANY(%s) "
                "AND ts < now() - make_interval(hours => %s)",
                ([stats[0] for stats in runner_stats], retention_hours),
            )


def commit_status(conn: Connection, xid: int) -> str | None:
    """'committed', 'aborted' or 'in progress' for a commit's transaction id (None when
    too old to tell)."""
    with transaction(conn) as cur:
        cur.execute("SELECT txid_status(%s)", (xid,))
        return cur.fetchone()[0]
