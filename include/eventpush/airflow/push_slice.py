"""What the push DAG runs: the workers it maps over, ``PushSliceSensor`` (a deferrable sensor
whose wait is in the triggerer and which, once its condition holds, runs one slice of the
worker itself), and the asset through which each slice hands its check to the
``eventpush_push_checks`` DAG.

The sensor runs the slice rather than a task after it: every task Airflow starts costs
seconds of scheduling and process start, and at a steady stream of events the condition
holds at the first poke, so the wait costs nothing and the slice starts at once.

Make before break: runs of the push DAG overlap, and a slice starts while the previous slice
of its worker still pushes. It waits for the worker's lease in PostgreSQL's lock queue (an
advisory lock, granted the moment the holder lets go); the previous slice, once its window
is over, stops as soon as it sees a successor waiting. So the worker is handed from one
slice to the next in the time the old one takes to commit and the new one to read its
assignment, not the seconds Airflow takes to start a task.

The check of a slice runs off the push path: the push task records the slice (its report and
the before and after snapshots) as the ``extra`` of an event on ``PUSH_SLICES``, and the
checks DAG, scheduled on that asset, checks every slice whose event triggered its run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from airflow.sdk import Asset
from airflow.sdk.bases.sensor import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import (
    AirflowFailException,
    AirflowSensorTimeout,
    AirflowSkipException,
)

from eventpush.airflow.connection import CONN_ID, database_url
from eventpush.airflow.triggers import (
    DEFAULT_POLL_S,
    ELSEWHERE,
    WorkerWorkTrigger,
    slice_due,
)
from eventpush.db import connection, transaction
from eventpush.metrics import metrics_port
from eventpush.quality.push_slice import snapshot

# Named only: a URI with a scheme would load every provider's URI handlers (about 0.6 s) in
# each task process that parses a DAG file using it.
PUSH_SLICES = Asset(name="eventpush_push_slices", group="eventpush")

PUSH_WORKERS_SQL = """
SELECT w.name FROM event_push_worker w
WHERE w.enabled AND EXISTS (
    SELECT 1 FROM event_target_runner r WHERE r.worker_id = w.id AND r.deleted_at IS NULL
)
ORDER BY w.name
"""

SLICE_KEYS = ("report", "before", "after")
# Work found at the very end of a run's window still gets a slice worth the task's start-up
# (it is waiting already); the run then ends a little after its window.
MIN_SLICE_S = 5.0
# After its window a slice goes on pushing until the next slice waits for the lease, at most
# this long: the successor is late only when the scheduler is (a run started late, a busy
# machine), and until it comes the worker keeps pushing rather than idling.
HAND_OVER_S = 60.0


def seconds_of(name: str, value: object) -> float:
    """A duration field of the form as rendered, in seconds. JSON's NaN and Infinity pass the
    form's minimum and maximum (every comparison with NaN is false): a slice of either length
    would never end, so they are refused in one line before anything is pushed."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise AirflowFailException(f"{name} must be a finite number of seconds, got {value!r}")
    return seconds


def push_workers(url: str) -> list[str]:
    """The enabled workers that have runners: what the push DAG maps over."""

    with connection(url) as conn, transaction(conn) as cur:
        cur.execute(PUSH_WORKERS_SQL)
        return [name for (name,) in cur.fetchall()]


def push_slice(
    worker: str,
    url: str,
    budget_s: float,
    *,
    hand_over_s: float = 0.0,
    until_idle: bool = False,
) -> dict:
    """One slice of ``worker``'s push loop, between two snapshots for the check:
    ``{"report": {...}, "before": {...}, "after": {...}}``.

    The slice waits up to ``budget_s`` for the worker's lease (a previous slice letting go),
    pushes until ``budget_s`` has passed, then goes on for up to ``hand_over_s`` more until
    the next slice waits for the lease. With ``until_idle`` it ends as soon as the worker has
    nothing left to do (one-off runs: the demo). The engine is not stopped when it runs out
    of work: it waits on publish notifications, so an event published during the slice is
    pushed within milliseconds. The "before" snapshot is taken once the lease is held, so it
    does not count what the previous slice still pushed. Raises the engine's
    ``WorkerBusyError`` when the lease stays held elsewhere.
    """
    # Deferred: the push runtime (pycurl, uvloop, the engine) loads only when a worker runs.
    from eventpush.push import HandOver, run_worker
    from eventpush.push.store import SLICE_APP

    with connection(url) as conn:
        taken: dict = {}
        hand_over = HandOver(
            lease_wait_s=budget_s,
            yield_after_s=None if until_idle else budget_s,
            on_lease=lambda: taken.update(before=snapshot(conn, worker)),
            application_name=SLICE_APP,
        )
        # With EVENTPUSH_METRICS_PORT set the slice serves /metrics while it runs; slices
        # of other workers on the same host find the port taken and run without (warned).
        report = run_worker(
            worker,
            max_seconds=budget_s + hand_over_s,
            until_idle=until_idle,
            url=url,
            metrics_port=metrics_port(None),
            metrics_required=False,
            hand_over=hand_over,
        )
        after = snapshot(conn, worker)
    return {"report": report.as_dict(), "before": taken["before"], "after": after}


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


class PushSliceSensor(BaseSensorOperator):
    """Wait until ``worker`` has something to push, then push one slice of it.

    The condition (``slice_due``): the worker has work (new events or retries due), or a
    previous slice of the DAG holds its lease (this one takes over from it, make before
    break). When it holds, the sensor runs the slice itself (``push_slice``) and returns the
    slice's counts (its XCom); it records the slice (counts and snapshots) as the ``extra``
    of an event on ``PUSH_SLICES`` (which must be among its ``outlets``). When the lease is
    held by something else (a standalone ``eventpush worker run``), it skips.

    A sensor in every way Airflow knows: ``deferrable`` (the default) hands the wait to
    ``WorkerWorkTrigger`` in the triggerer, no worker slot held; otherwise ``mode`` poke or
    reschedule poke every ``poke_interval``. ``timeout`` bounds the wait for work, and so does
    the run's window (``slice_seconds`` after the run started: there is nothing to wait for
    in this run after it, the next run has its own sensor); ``soft_fail`` turns a timeout
    into a skip. The slice pushes until the window ends, then until the next run's slice
    waits for the lease (at most ``hand_over_s`` more); with ``until_idle``, until the worker
    has nothing left to do.
    """

    template_fields = ("worker", "slice_seconds", "hand_over_s", "until_idle")
    ui_color = "#e8f4ff"

    def __init__(
        self,
        *,
        worker: str,
        slice_seconds: float | str,
        hand_over_s: float | str = HAND_OVER_S,
        until_idle: bool | str = False,
        deferrable: bool = True,
        conn_id: str = CONN_ID,
        poke_interval: float = DEFAULT_POLL_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.worker = worker
        self.slice_seconds = slice_seconds
        self.hand_over_s = hand_over_s
        self.until_idle = until_idle
        self.deferrable = deferrable
        self.conn_id = conn_id

    def window_left(self, context: Any) -> float:
        """Seconds left until this run's window ends (negative once it has)."""
        started = context["dag_run"].start_date.timestamp()
        return started + seconds_of("slice_seconds", self.slice_seconds) - time.time()

    def poke(self, context: Any) -> bool | PokeReturnValue:
        from eventpush.airflow.connection import database_url

        due = slice_due(database_url(self.conn_id), self.worker)
        if due == ELSEWHERE:
            raise AirflowSkipException(f"worker {self.worker!r} is pushed by another process")
        if due is None:
            if self.window_left(context) <= 0:
                raise AirflowSkipException(
                    f"no work for worker {self.worker!r} in this run's window"
                )
            return False
        self.log.info("worker %s: %s, pushing a slice", self.worker, due)
        return PokeReturnValue(True, self._push(context))

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        done = self.poke(context)
        if done:
            return done.xcom_value
        self._defer(context)

    def execute_complete(self, context: Any, event: dict | None = None) -> Any:
        if not event or event.get("status") == "timeout":
            waited = (event or {}).get("waited_s", "?")
            raise AirflowSensorTimeout(f"no work for worker {self.worker!r} within {waited}s")
        done = self.poke(context)  # the work may have gone meanwhile (pushed elsewhere)
        if done:
            return done.xcom_value
        self._defer(context)

    def _defer(self, context: Any) -> None:
        wait = min(self.timeout, self.window_left(context))
        if wait <= 0:
            raise AirflowSkipException(f"no work for worker {self.worker!r} in this run's window")
        self.defer(
            trigger=WorkerWorkTrigger(
                worker=self.worker,
                timeout=wait,
                poll_interval=self.poke_interval,
                conn_id=self.conn_id,
            ),
            method_name="execute_complete",
        )

    def _push(self, context: Any) -> dict:
        # Deferred: the push runtime (pycurl, uvloop, the engine) loads only when a worker runs.
        from eventpush.push import WorkerBusyError

        budget = max(MIN_SLICE_S, self.window_left(context))
        until_idle = str(self.until_idle).lower() in ("true", "1")
        try:
            result = push_slice(
                self.worker,
                database_url(self.conn_id),
                budget,
                hand_over_s=seconds_of("hand_over_s", self.hand_over_s),
                until_idle=until_idle,
            )
        except WorkerBusyError as exc:
            raise AirflowSkipException(
                f"worker {self.worker!r} is pushed elsewhere: {exc}"
            ) from None
        self.log.info("worker %s: %s", self.worker, result["report"])
        context["outlet_events"][PUSH_SLICES].extra = result
        return result["report"]
