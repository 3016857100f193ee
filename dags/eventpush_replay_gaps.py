"""
### eventpush_replay_gaps: replay what an audit found missing

Scheduled on the asset `eventpush://audit/gaps`, which `eventpush_audit` updates only when a
report has missing records (the event's extra: report id, window, bus, missing, and the
runners missing records: id, name and how many each).

1. **gap_request**: the gap events of this run (those that triggered it; for a manual run, the
   latest one) as one `what=missing` replay request over their window and bus, checked like
   `eventpush_replay`'s form. Skipped, and nothing else runs, unless the Airflow Variable
   `eventpush_replay_gaps` is `true` or the audit run asked for the replay (its form's
   `replay_missing`). Off by default: turn it on with
   `airflow variables set eventpush_replay_gaps true`.
2. **replay_job**: `spark_jobs/replay.py` through SparkSubmitOperator (connection
   `spark_default`), as in `eventpush_replay`: only records still missing are re-pushed.
3. **report**: the run's counts from `event_replay_run`.

For any other replay (failed records, another window, a dry run) use `eventpush_replay`'s form.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import Asset, dag, get_current_context, task

from eventpush.airflow.gaps import GAPS_URI
from eventpush.airflow.spark_submit import spark_job
from eventpush.sparkjobs.forms import replay_limits

GAPS = Asset(GAPS_URI)


@dag(
    dag_id="eventpush_replay_gaps",
    description="Replay the audit's gaps when the operator turned it on (Spark)",
    doc_md=__doc__,
    schedule=[GAPS],
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_runs=1,
    tags=["eventpush", "replay", "audit", "spark"],
    default_args={"owner": "eventpush", "retries": 0},
    render_template_as_native_obj=True,
)
def eventpush_replay_gaps() -> None:
    @task(inlets=[GAPS])
    def gap_request() -> list[str]:
        """The replay job's arguments for this run's gap events; skipped when switched off."""
        from airflow.sdk import Variable
        from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

        from eventpush.airflow.gaps import SWITCH, replay_form, switch_on
        from eventpush.airflow.hook import EventpushHook
        from eventpush.sparkjobs.replay import ReplayRequestError, checked_job_args

        context = get_current_context()
        events = list(context["triggering_asset_events"].get(GAPS, []))
        if not events:  # a manual run: the latest gap the audit reported
            events = list(context["inlet_events"][GAPS][-1:])
        try:
            switch = switch_on(Variable.get(SWITCH, default=None))
            # an asset event made by hand may carry any extra: a bad window is refused here
            form = replay_form((e.extra or {} for e in events), switch)
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None
        if form is None:
            raise AirflowSkipException(
                f"gap replay is off (Variable {SWITCH}) and no audit asked for it"
                if events
                else "no audit gap to replay"
            )
        label = context["dag_run"].run_id
        print(f"replaying {form} for {len(events)} gap event(s)")
        try:
            return checked_job_args(EventpushHook().get_uri(), form, label)
        except ReplayRequestError as exc:
            raise AirflowFailException(f"gap replay refused: {exc}") from None

    job = spark_job(
        "replay", "ti.xcom_pull(task_ids='gap_request')", execution_timeout=replay_limits().timeout
    )

    @task
    def report() -> dict[str, Any]:
        """The counts of this run's replay, as recorded by the job."""
        from eventpush.airflow.hook import EventpushHook
        from eventpush.sparkjobs.replay import recorded_run

        result = recorded_run(EventpushHook().get_uri(), get_current_context()["dag_run"].run_id)
        print(f"replay {result['replay_id']}: {result}")
        return result

    gap_request() >> job >> report()


eventpush_replay_gaps()
