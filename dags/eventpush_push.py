"""
### eventpush_push: the always-on push loop

Runs every `SLICE_SECONDS` (120 s), and two runs may be active at once: each run starts
while the previous one still pushes, so every worker is handed from one slice to the next
with no gap (make before break). Each run:

1. **list_workers**: the enabled push workers that have runners assigned (a run whose conf
   has a field the form does not have is refused here).
2. **push**, mapped over them: a deferrable sensor,
   `eventpush.airflow.push_slice.PushSliceSensor`. Its condition holds when the worker has
   work (new events or retries due) or when the previous run's slice holds the worker's
   lease (this slice takes over from it). Until then the wait is in the triggerer
   (`eventpush.airflow.triggers.WorkerWorkTrigger`, woken by publish notifications), no
   worker slot held; `timeout`, `soft_fail` (a timeout skips), `mode` and `poke_interval`
   work as for any sensor. Without work in the run's window (`slice_seconds` after the run
   started) it skips and the next run's sensor waits instead.

   When the condition holds, **the sensor runs the slice itself**: the push engine of that
   worker, under the worker's lease, until the run's window ends. A separate task after the
   sensor would be one more task start per slice, seconds of scheduling and process start
   on the push path. Between bursts the engine waits on publish notifications, so an event
   published during the slice goes out within milliseconds.

   The hand-over: the next run's slice starts while this one pushes and waits for the lease
   in PostgreSQL's lock queue (an advisory lock, granted the moment it is let go; no
   polling). After its window this slice stops as soon as it sees that waiter, and at the
   latest `hand_over_s` (60 s) later; it lets go of the lease right after its final commit,
   and the successor pushes at once. A standalone `eventpush worker run` of the same worker
   and this task never push at once (the sensor skips when the lease is held by anything but
   a slice). Each slice returns its counts and records itself (counts and before/after
   snapshots) as an event on the asset `eventpush_push_slices`.

The Great Expectations check of each slice is not on this path: the DAG
`eventpush_push_checks` is scheduled on `eventpush_push_slices` and checks every slice
recorded there (failing loudly, with the `push_check` alert).

One-off runs (the demo, a manual trigger) may set `until_idle`: each slice then ends as soon
as its worker has nothing left to do. The eventpush database is the Airflow connection
`eventpush_db`, or `EVENTPUSH_DATABASE_URL`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task

from eventpush.airflow.push_slice import HAND_OVER_S, PUSH_SLICES, PushSliceSensor

SLICE_SECONDS = 120
POLL_INTERVAL_S = 5.0
PUSH_FORM_FIELDS = ("slice_seconds", "hand_over_s", "until_idle")
# A slice holds its worker's lease for its window and hand-over: a day and an hour at most,
# so a one-off run with a huge number cannot keep a worker from every later slice.
MAX_SLICE_SECONDS = 86_400
MAX_HAND_OVER_S = 3_600


@dag(
    dag_id="eventpush_push",
    description="Push events from buses to their targets, one mapped push sensor per worker",
    doc_md=__doc__,
    # Runs every window and two at once: the next run's slices are ready before this run's
    # end (``@continuous`` allows one run at a time, so it always leaves a gap).
    schedule=timedelta(seconds=SLICE_SECONDS),
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=2,
    is_paused_upon_creation=False,
    tags=["eventpush", "push"],
    default_args={"owner": "eventpush", "retries": 0},
    params={
        "slice_seconds": Param(
            SLICE_SECONDS,
            type="number",
            minimum=1,
            maximum=MAX_SLICE_SECONDS,
            description="the run's window: each slice pushes until this long after the run "
            "started, then hands over to the next run's",
        ),
        "hand_over_s": Param(
            HAND_OVER_S,
            type="number",
            minimum=0,
            maximum=MAX_HAND_OVER_S,
            description="after its window, how long a slice may wait for the next one to "
            "take over (it stops as soon as the next one waits for the lease)",
        ),
        "until_idle": Param(
            False,
            type="boolean",
            description="end each slice as soon as its worker has nothing left to do "
            "(one-off runs)",
        ),
    },
)
def eventpush_push() -> None:
    @task
    def list_workers() -> list[str]:
        """The enabled workers that have runners (none: the run ends, the next one looks)."""
        from airflow.sdk import get_current_context
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.hook import EventpushHook
        from eventpush.airflow.push_slice import push_workers
        from eventpush.sparkjobs.forms import FormError, check_form_keys

        # A mistyped field (say "until_idel") would otherwise be ignored without a word.
        try:
            check_form_keys(get_current_context()["dag_run"].conf, known=PUSH_FORM_FIELDS)
        except FormError as exc:
            raise AirflowFailException(f"push request refused: {exc}") from None
        return push_workers(EventpushHook().get_uri())

    PushSliceSensor.partial(
        task_id="push",
        # Retried: a slice whose Celery worker died resumes from the committed offsets elsewhere.
        retries=2,
        retry_delay=timedelta(seconds=5),
        outlets=[PUSH_SLICES],
        slice_seconds="{{ params.slice_seconds }}",
        hand_over_s="{{ params.hand_over_s }}",
        until_idle="{{ params.until_idle }}",
        timeout=SLICE_SECONDS,
        soft_fail=True,
        poke_interval=POLL_INTERVAL_S,
    ).expand(worker=list_workers())


eventpush_push()
