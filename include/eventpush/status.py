"""Progress and lag per worker and runner, as the CLI, the plugin and the checks read it.

Per runner and queue: ``lag = max offset - committed``, ``in_flight = pulled - committed``,
``waiting = max offset - pulled``; a runner's figures are the sums over its bus's queues.

One vocabulary with the audit (``sparkjobs.audit``) and the demo: ``delivered`` counts
deliveries to the target, live and by replay (``replayed`` is the part by replay);
``failed`` counts records that stand failed now (open failures and records a replay could
not deliver either; a failure later replayed is delivered, no longer failed);
``open_failures`` those a replay may still take. The engine's own counter of live
deliveries and failures is ``delivered_live`` and ``failed_live``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from eventpush.db import Connection, transaction
from eventpush.sources import sync_heads

HEARTBEAT_STALE_S = 30

RUNNERS_SQL = """
SELECT r.name, w.name, r.state, b.name,
       coalesce(sum(q.next_offset - o."offset"), 0)::bigint AS lag,
       coalesce(sum(greatest(o.pulled - o."offset", 0)), 0)::bigint AS in_flight,
       coalesce(sum(greatest(q.next_offset - greatest(o.pulled, o."offset"), 0)), 0)::bigint,
       r.delivered_total, r.failed_total,
       (SELECT count(*) FROM event_push_failure f
         WHERE f.runner_id = r.id AND f.status = 'failed') AS open_failures,
       r.generation,
       r.replayed_total AS replayed,
       (SELECT count(*) FROM event_push_failure f
         WHERE f.runner_id = r.id AND f.status IN ('failed', 'dead')) AS failed_now
FROM event_target_runner r
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus b ON b.id = ru.bus_id
LEFT JOIN event_push_worker w ON w.id = r.worker_id
LEFT JOIN event_push_offset o ON o.runner_id = r.id
LEFT JOIN (
    -- The heads just asked of a broker, where they are ahead of those recorded: on a
    -- read-only database they cannot be recorded first.
    SELECT q.bus_id, q.queue_id, greatest(q.next_offset, h.head) AS next_offset
    FROM event_bus_queue q
    LEFT JOIN unnest(%(bus_ids)s::int[], %(queue_ids)s::int[], %(heads)s::bigint[])
        AS h(bus_id, queue_id, head) ON h.bus_id = q.bus_id AND h.queue_id = q.queue_id
) q ON q.bus_id = b.id AND q.queue_id = o.queue_id
WHERE r.deleted_at IS NULL
GROUP BY r.id, w.name, b.name
ORDER BY r.name
"""

WORKERS_SQL = """
SELECT w.name, w.enabled, w.capacity, w.host, w.pid, w.heartbeat_at, w.metrics,
       count(r.id) AS runners
FROM event_push_worker w
LEFT JOIN event_target_runner r ON r.worker_id = w.id
GROUP BY w.id
ORDER BY w.name
"""


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


def read_status(conn: Connection) -> dict:
    """``{"workers": [...], "runners": [...]}`` as the CLI's ``status --json`` prints it.
    Buses on a broker have their heads asked first (a broker that does not answer leaves the
    last heads seen, and the lag figures are that old). They are recorded when the database
    takes writes; on a read-only one (a standby, a failover's old primary) status is still
    read, the lag counted to the heads just asked, and nothing written."""
    found = sync_heads(conn)
    asked = [(bus_id, q, head) for bus_id, heads in found.items() for q, head in heads.items()]
    with transaction(conn) as cur:
        cur.execute(WORKERS_SQL)
        worker_rows = cur.fetchall()
        cur.execute(
            RUNNERS_SQL,
            {
                "bus_ids": [a[0] for a in asked],
                "queue_ids": [a[1] for a in asked],
                "heads": [a[2] for a in asked],
            },
        )
        runner_rows = cur.fetchall()
    now = datetime.now(UTC)
    workers = [
        {
            "worker": name,
            "enabled": enabled,
            "capacity": capacity,
            "runners": runners,
            "alive": heartbeat is not None
            and (now - heartbeat).total_seconds() < HEARTBEAT_STALE_S,
            "host": host,
            "pid": pid,
            "heartbeat_at": _iso(heartbeat),
            "metrics": metrics or {},
        }
        for name, enabled, capacity, host, pid, heartbeat, metrics, runners in worker_rows
    ]
    runners = [
        {
            "runner": name,
            "worker": worker,
            "state": state,
            "bus": bus,
            "lag": lag,
            "in_flight": in_flight,
            "waiting": waiting,
            "delivered": delivered_live + replayed,
            "replayed": replayed,
            "failed": failed_now,
            "open_failures": open_failures,
            "delivered_live": delivered_live,
            "failed_live": failed_live,
            "generation": generation,
        }
        for (
            name,
            worker,
            state,
            bus,
            lag,
            in_flight,
            waiting,
            delivered_live,
            failed_live,
            open_failures,
            generation,
            replayed,
            failed_now,
        ) in runner_rows
    ]
    return {"workers": workers, "runners": runners}


HAS_WORK_SQL = """
SELECT EXISTS (
    SELECT 1
    FROM event_target_runner r
    JOIN event_push_worker w ON w.id = r.worker_id
    JOIN event_push_offset o ON o.runner_id = r.id
    JOIN event_target t ON t.id = r.target_id
    JOIN event_rule ru ON ru.id = t.rule_id
    JOIN event_bus_queue q ON q.bus_id = ru.bus_id AND q.queue_id = o.queue_id
    WHERE w.name = %s AND w.enabled AND r.state = 'RUNNING' AND q.next_offset > o."offset"
      AND NOT EXISTS (SELECT 1 FROM event_runtime_control c WHERE c.scope = 'worker'
                      AND c.name = w.name AND c.key = 'paused' AND c.value = 'true'::jsonb)
)
"""


def has_work(conn: Connection, worker: str) -> bool:
    """True when a running runner of ``worker`` has events past its committed offset (new
    events, or ones a previous slice handed back before finishing their retries). On a
    read-only database a broker's new events wait to be recorded: no slice could commit them
    before the database takes writes again."""
    sync_heads(conn, worker=worker)
    with transaction(conn) as cur:
        cur.execute(HAS_WORK_SQL, (worker,))
        return cur.fetchone()[0]
