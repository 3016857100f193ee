"""What the push DAG runs: the workers it maps over, ``PushSliceOperator`` (wait for work
deferred, then one bounded slice of a worker), and the asset through which each slice hands
its check to the ``eventpush_push_checks`` DAG.

The wait and the slice are one task, not a sensor and a task after it: at a steady stream of
events the worker has work when a run starts, and every task Airflow starts costs seconds of
scheduling and process start, which is the hand-over between two slices.

The check of a slice runs off the push path: the push task records the slice (its report and
the before and after snapshots) as the ``extra`` of an event on ``PUSH_SLICES``, and the
checks DAG, scheduled on that asset, checks every slice whose event triggered its run. So the
next push run starts as soon as a slice ends, and a broken slice still fails a DAG run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from eventpush.airflow.connection import CONN_ID, database_url
from eventpush.airflow.triggers import (
    DEFAULT_POLL_S,
    DEFAULT_TIMEOUT_S,
    WorkerWorkTrigger,
    worker_has_work,
)
from eventpush.db import connection, transaction
from eventpush.metrics import metrics_port
from eventpush.quality.push_slice import snapshot

# Named only: a URI with a scheme would load every provider's URI handlers (about 0.6 s) in
# each task process that parses a DAG file using it.
PUSH_SLICES = Asset(name="eventpush_push_slices", group="eventpush")

PUSH_WORKERS_SQL = """
SELECT w.name FROM event_push_worker w
WHERE w.enabled AND EXISTS (SELECT 1 FROM event_target_runner r WHERE r.worker_id = w.id)
ORDER BY w.name
"""

SLICE_KEYS = ("report", "before", "after")
# Work found at the very end of a run's window still gets a slice worth the task's start-up
# (it is waiting already); the run then ends a little after its window.
MIN_SLICE_S = 5.0


def push_workers(url: str) -> list[str]:
    """The enabled workers that have runners: what the push DAG maps over."""

    with connection(url) as conn, transaction(conn) as cur:
        cur.execute(PUSH_WORKERS_SQL)
        return [name for (name,) in cur.fetchall()]


def push_slice(worker: str, url: str, budget_s: float) -> dict:
    """One slice of ``worker``'s push loop for its whole ``budget_s``, between two snapshots
    for the check: ``{"report": {...}, "before": {...}, "after": {...}}``.

    The engine is not stopped when it runs out of work: it waits on publish notifications, so
    an event published during the slice is pushed within milliseconds rather than in the next
    slice. Raises the engine's ``WorkerBusyError`` when another process holds the lease.
    """
    # Deferred: the push runtime (pyreqwest, uvloop, the engine) loads only when a worker runs.
    from eventpush.push import run_worker

    with connection(url) as conn:
        before = snapshot(conn, worker)
        # With EVENTPUSH_METRICS_PORT set the slice serves /metrics while it runs; slices
        # of other workers on the same host find the port taken and run without (warned).
        report = run_worker(
            worker,
            max_seconds=budget_s,
            url=url,
            metrics_port=metrics_port(None),
            metrics_required=False,
        )
        after = snapshot(conn, worker)
    return {"report": report.as_dict(), "before": before, "after": after}


def slices_to_check(events: Iterable[Any]) -> list[dict]:
    """The slices recorded by ``PUSH_SLICES`` asset events (``triggering_asset_events``), in
    the order they happened, each with the label its check result is saved under
    (``PUSH_RUN_ID/WORKER``, as when the check ran inside the push run).

    Raises ``ValueError`` naming the event when one does not carry a slice: a check that
    cannot see its slice must fail, not pass.
    """
    slices = []
    for event in sorted(events, key=lambda e: e.timestamp):
        where = f"asset event of {event.source_dag_id}/{event.source_run_id} at {event.timestamp}"
        extra = event.extra or {}
        missing = [key for key in SLICE_KEYS if not isinstance(extra.get(key), dict)]
        if missing:
            raise ValueError(f"{where}: no slice to check (missing {', '.join(missing)})")
        worker = extra["before"].get("worker")
        slices.append(
            {
                **{key: extra[key] for key in SLICE_KEYS},
                "label": f"{event.source_run_id}/{worker}",
            }
        )
    return slices


class PushSliceOperator(BaseOperator):
    """Push one slice of ``worker``, waiting for work first without holding a worker slot.

    Every push task of a run ends by the same moment, the run's start plus ``slice_seconds``
    (the run's window), so a worker that waits for work never holds back the next slice of a
    busy one: the run, and with it the hand-over to the next run, ends on time.

    It checks once for work (new events or retries due); without any it defers to
    ``WorkerWorkTrigger`` in the triggerer until work comes, the window ends or
    ``wait_timeout`` passes (then it skips: the run ends quietly and the continuous schedule
    starts the next). With work, it runs the push engine for the rest of the window (at
    least ``MIN_SLICE_S``) under the worker's lease, returns the engine's counts and records
    the slice (counts and snapshots) as the ``extra`` of an event on ``PUSH_SLICES`` (which
    must be among its ``outlets``). It skips when the lease is held elsewhere.
    """

    template_fields = ("worker", "slice_seconds", "wait_timeout")
    ui_color = "#e8f4ff"

    def __init__(
        self,
        *,
        worker: str,
        slice_seconds: float | str,
        wait_timeout: float | str = DEFAULT_TIMEOUT_S,
        poll_interval: float = DEFAULT_POLL_S,
        conn_id: str = CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.worker = worker
        self.slice_seconds = slice_seconds
        self.wait_timeout = wait_timeout
        self.poll_interval = poll_interval
        self.conn_id = conn_id

    def window_left(self, context: Any) -> float:
        """Seconds left until this run's window ends (negative once it has)."""
        started = context["dag_run"].start_date.timestamp()
        return started + float(self.slice_seconds) - time.time()

    def execute(self, context: Any) -> dict:
        if worker_has_work(database_url(self.conn_id), self.worker):
            return self._push(context)
        wait = min(float(self.wait_timeout), self.window_left(context))
        if wait <= 0:
            raise AirflowSkipException(f"no work for worker {self.worker!r} in this run's window")
        self.defer(
            trigger=WorkerWorkTrigger(
                worker=self.worker,
                timeout=wait,
                poll_interval=self.poll_interval,
                conn_id=self.conn_id,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict | None = None) -> dict:
        if not event or event.get("status") != "work":
            waited = (event or {}).get("waited_s", "?")
            raise AirflowSkipException(f"no work for worker {self.worker!r} within {waited}s")
        return self._push(context)

    def _push(self, context: Any) -> dict:
        # Deferred: the push runtime (pyreqwest, uvloop, the engine) loads only when a worker runs.
        from eventpush.push import WorkerBusyError

        budget = max(MIN_SLICE_S, self.window_left(context))
        try:
            result = push_slice(self.worker, database_url(self.conn_id), budget)
        except WorkerBusyError as exc:
            raise AirflowSkipException(
                f"worker {self.worker!r} is pushed elsewhere: {exc}"
            ) from None
        self.log.info("worker %s: %s", self.worker, result["report"])
        context["outlet_events"][PUSH_SLICES].extra = result
        return result["report"]
