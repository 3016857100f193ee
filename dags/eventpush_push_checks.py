"""
### eventpush_push_checks: the checks of the push slices, off the push path

Scheduled on the asset `eventpush_push_slices`: every push slice of `eventpush_push` records
itself there (its counts and the before and after snapshots of its worker's runners), and each
run of this DAG checks the slices recorded since the previous run, one mapped task each.

1. **slices**: the slices behind the asset events that triggered this run, oldest first.
   An event that carries no slice fails the task (a check must never pass unseen).
2. **check** (mapped per slice): a Great Expectations suite over what the slice wrote:
   offsets never moved backwards, every delivery row belongs to a runner of that worker and
   matches its rule, failure rows carry an error, counts add up. It fails loudly otherwise,
   and also when the worker's lag is past `EVENTPUSH_ALERT_LAG_EVENTS` (100000 by default);
   its failure callback raises the `push_check` alert (`eventpush.airflow.alerts`), and the
   failed task fails this DAG run. Results are saved to `event_check_result` under the label
   `PUSH_RUN_ID/WORKER`.

The eventpush database is the Airflow connection `eventpush_db`, or `EVENTPUSH_DATABASE_URL`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import dag, get_current_context, task

from eventpush.airflow import alerts
from eventpush.airflow.push_slice import PUSH_SLICES


@dag(
    dag_id="eventpush_push_checks",
    description="Great Expectations checks of the push slices, scheduled on their asset",
    doc_md=__doc__,
    schedule=[PUSH_SLICES],
    start_date=datetime(2024, 1, 1),
    catchup=False,
    # one at a time: a run that starts while another checks takes every slice since
    max_active_runs=1,
    is_paused_upon_creation=False,
    tags=["eventpush", "push", "quality"],
    default_args={"owner": "eventpush", "retries": 0},
)
def eventpush_push_checks() -> None:
    @task
    def slices() -> list[dict[str, Any]]:
        """The push slices recorded by the asset events behind this run, oldest first."""
        from eventpush.airflow.push_slice import slices_to_check

        events = get_current_context()["triggering_asset_events"]
        return slices_to_check(events.get(PUSH_SLICES, []))

    @task(on_failure_callback=alerts.push_failed)
    def check(pushed: dict[str, Any]) -> dict[str, Any]:
        """The Great Expectations check of one slice; raises ``CheckFailed`` when it breaks,
        and fails when the worker's lag is past ``EVENTPUSH_ALERT_LAG_EVENTS`` (an alert)."""
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.hook import EventpushHook
        from eventpush.quality.push_slice import check_push_slice

        url = EventpushHook().get_uri()
        before, after, report = pushed["before"], pushed["after"], pushed["report"]
        outcome = check_push_slice(url, before, after, report, pushed["label"])
        lagging = alerts.push_lag_check(url, before["worker"])
        if lagging:
            raise AirflowFailException(lagging)
        return {"label": pushed["label"], "report": report, "check": outcome["statistics"]}

    check.expand(pushed=slices())


eventpush_push_checks()
