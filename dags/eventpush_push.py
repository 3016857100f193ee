"""
### eventpush_push: the always-on push loop

Runs continuously, one run at a time. Each run:

1. **list_workers**: the enabled push workers that have runners assigned.
2. **push**, mapped over them (`eventpush.airflow.push_slice.PushSliceOperator`): it checks
   once for work (new events or retries due) and, without any, hands the wait to
   `eventpush.airflow.triggers.WorkerWorkTrigger` in the triggerer (no worker slot held). The
   wait ends when work comes, when the run's window ends (`slice_seconds`, 120 s by default,
   after the run started) or after `wait_timeout_s` (300 s by default); without work the task
   skips and the run ends quietly. With work, it runs the push engine of that worker until
   the window ends, under the worker's lease: between bursts the engine waits on publish
   notifications, so an event published during the slice goes out within milliseconds.
   Every push task of a run ends with the window, so an idle worker never holds back the next
   slice of a busy one. A standalone `eventpush worker run` of the same worker and this task
   never push at once (the task skips when the lease is held elsewhere). It returns the
   slice's counts and records the slice (counts and before/after snapshots) as an event on
   the asset `eventpush_push_slices`.

The Great Expectations check of each slice is not on this path: the DAG
`eventpush_push_checks` is scheduled on `eventpush_push_slices` and checks every slice
recorded there (failing loudly, with the `push_check` alert). The wait and the push are one
task and the check is elsewhere because every task Airflow starts between two slices costs
seconds, and those seconds are the hand-over, when nothing of the worker is pushed.

The eventpush database is the Airflow connection `eventpush_db`, or `EVENTPUSH_DATABASE_URL`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task

from eventpush.airflow.push_slice import PUSH_SLICES, PushSliceOperator

SLICE_SECONDS = 120
WAIT_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 5.0
NO_WORKERS_BACKOFF_S = 30.0


@dag(
    dag_id="eventpush_push",
    description="Push events from buses to their targets, one mapped push task per worker",
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
            SLICE_SECONDS,
            type="number",
            minimum=1,
            description="the run's window: each push slice of a run ends this long after its start",
        ),
        "wait_timeout_s": Param(
            WAIT_TIMEOUT_S,
            type="number",
            minimum=1,
            description="how long a worker's push task waits for work before the run ends quietly",
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

    PushSliceOperator.partial(
        task_id="push",
        # Retried: a slice whose Celery worker died resumes from the committed offsets elsewhere.
        retries=2,
        retry_delay=timedelta(seconds=5),
        outlets=[PUSH_SLICES],
        slice_seconds="{{ params.slice_seconds }}",
        wait_timeout="{{ params.wait_timeout_s }}",
        poll_interval=POLL_INTERVAL_S,
    ).expand(worker=list_workers())


eventpush_push()
