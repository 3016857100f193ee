"""What the push DAG runs: the workers it maps over, and one bounded slice of a worker."""

from __future__ import annotations

PUSH_WORKERS_SQL = """
SELECT w.name FROM event_push_worker w
WHERE w.enabled AND EXISTS (SELECT 1 FROM event_target_runner r WHERE r.worker_id = w.id)
ORDER BY w.name
"""


def push_workers(url: str) -> list[str]:
    """The enabled workers that have runners: what the push DAG maps over."""
    from eventpush.db import connection, transaction

    with connection(url) as conn, transaction(conn) as cur:
        cur.execute(PUSH_WORKERS_SQL)
        return [name for (name,) in cur.fetchall()]


def push_slice(worker: str, url: str, max_seconds: float) -> dict:
    """One bounded slice of ``worker``'s push loop (until idle or ``max_seconds``), between two
    snapshots for the check: ``{"report": {...}, "before": {...}, "after": {...}}``.

    Raises the engine's ``WorkerBusyError`` when another process holds the worker's lease.
    """
    from eventpush.db import connection
    from eventpush.metrics import metrics_port
    from eventpush.push import run_worker
    from eventpush.quality.push_slice import snapshot

    with connection(url) as conn:
        before = snapshot(conn, worker)
        # With EVENTPUSH_METRICS_PORT set the slice serves /metrics while it runs; slices
        # of other workers on the same host find the port taken and run without (warned).
        report = run_worker(
            worker,
            until_idle=True,
            max_seconds=max_seconds,
            url=url,
            metrics_port=metrics_port(None),
            metrics_required=False,
        )
        after = snapshot(conn, worker)
    return {"report": report.as_dict(), "before": before, "after": after}
