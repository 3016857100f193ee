"""
### eventpush_push: the always-on push loop

Runs continuously, one run at a time. Each run:

1. **list_workers**: the enabled push workers that have runners assigned.
2. For each of them (dynamic task mapping over the task group `worker`):
   - **wait_for_work**: a deferrable sensor. It checks once, then hands the wait to
     `eventpush.airflow.triggers.WorkerWorkTrigger` in the triggerer (no worker slot held) until the
     worker's runners have new events or retries due. After `wait_timeout_s` (a run param,
     300 s by default) without work it skips, the run ends quietly and the next one starts.
   - **push**: the push engine for that worker for one bounded slice (until idle, or the
     `slice_seconds` budget), under the worker's lease: a standalone `eventpush worker run`
     of the same worker and this task never push at once (the task skips when the lease is
     held elsewhere). Returns the slice's counts.
   - **check**: a Great Expectations suite over what the slice wrote: offsets never moved
     backwards, every delivery row belongs to a runner of this worker and matches its rule,
     failure rows carry an error, counts add up. Fails the task loudly otherwise, and also
     when the worker's lag is past `EVENTPUSH_ALERT_LAG_EVENTS` (100000 by default); its
     failure callback raises the `push_check` alert (`eventpush.airflow.alerts`).

The eventpush database is the Airflow connection `eventpush_db`, or `EVENTPUSH_DATABASE_URL`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Param, dag, get_current_context, task, task_group

from eventpush.airflow import alerts
from eventpush.airflow.triggers import WorkerWorkSensor

WAIT_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 5.0
NO_WORKERS_BACKOFF_S = 30.0


@dag(
    dag_id="eventpush_push",
    description="Push events from buses to their targets, one mapped task group per worker",
    doc_md=__doc__,
    schedule="@continuous",
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=False,
    tags=["eventpush", "push"],
    default_args={"owner": "eventpush", "retries": 0},
    params={
        "slice_seconds": Param(
            120, type="number", minimum=1, description="time budget of one push slice"
        ),
        "wait_timeout_s": Param(
            WAIT_TIMEOUT_S,
            type="number",
            minimum=1,
            description="how long a worker's sensor waits for work before the run ends quietly",
        ),
    },
)
def eventpush_push() -> None:
    @task
    def list_workers() -> list[str]:
        """The enabled workers that have runners; waits a little when there are none, so an
        empty deployment does not spin the continuous schedule."""
        import time

        from eventpush.airflow.connection import database_url
        from eventpush.airflow.push_slice import push_workers

        url = database_url()
        deadline = time.monotonic() + NO_WORKERS_BACKOFF_S
        while not (workers := push_workers(url)) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        return workers

    # Retried: a slice whose Celery worker died resumes from the committed offsets elsewhere.
    @task(retries=2, retry_delay=timedelta(seconds=5))
    def push(worker: str) -> dict[str, Any]:
        """One bounded push slice for ``worker``; returns the engine's counts and the before
        and after snapshots the check compares."""
        from airflow.sdk.exceptions import AirflowSkipException

        from eventpush.airflow.connection import database_url
        from eventpush.airflow.push_slice import push_slice
        from eventpush.push import WorkerBusyError

        budget = float(get_current_context()["params"]["slice_seconds"])
        try:
            result = push_slice(worker, database_url(), budget)
        except WorkerBusyError as exc:
            raise AirflowSkipException(f"worker {worker!r} is pushed elsewhere: {exc}") from None
        print(f"worker {worker}: {result['report']}")
        return result

    @task(on_failure_callback=alerts.push_failed)
    def check(result: dict[str, Any]) -> dict[str, Any]:
        """The Great Expectations check of the slice; raises ``CheckFailed`` when it breaks,
        and fails when the worker's lag is past ``EVENTPUSH_ALERT_LAG_EVENTS`` (an alert)."""
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.connection import database_url
        from eventpush.quality.push_slice import check_push_slice

        worker = result["before"]["worker"]
        label = f"{get_current_context()['dag_run'].run_id}/{worker}"
        url = database_url()
        outcome = check_push_slice(url, result["before"], result["after"], result["report"], label)
        lagging = alerts.push_lag_check(url, worker)
        if lagging:
            raise AirflowFailException(lagging)
        return {"report": result["report"], "check": outcome["statistics"]}

    @task_group(group_id="worker")
    def per_worker(worker: str) -> None:
        waited = WorkerWorkSensor(
            task_id="wait_for_work",
            worker=worker,
            wait_timeout="{{ params.wait_timeout_s }}",
            poll_interval=POLL_INTERVAL_S,
        )
        pushed = push(worker)
        waited >> pushed
        check(pushed)

    per_worker.expand(worker=list_workers())


eventpush_push()
