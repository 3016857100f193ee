"""
### eventpush_retention: books that stay small

Daily (just after midnight UTC), and on demand. It takes no configuration: a run given a
`conf` with any field (say `{"dry_run": true}`) is refused before it drops anything.

1. **maintain**: `eventpush.partitions.maintain`, as `eventpush db maintain` does it: the day
   partitions of every bus's events and of the delivery log made ahead
   (`EVENTPUSH_PARTITIONS_AHEAD_DAYS`, 3 by default), the days behind each bus's retention
   (`bus create|update --retention`, else `EVENTPUSH_RETENTION`, 7d) dropped whole, no row
   deleted; failure rows (the dead-letter store) deleted after their own retention
   (`EVENTPUSH_FAILURE_RETENTION`, 30d, and never before their bus's events). A drop waits
   for its locks in short tries (150 ms, retried up to 5 s, publishers let through between
   them); a table a reader held past that is left to the next run (`postponed`), that bus
   alone.
2. **check**: a Great Expectations suite over the partition layout: every partitioned table
   has its days ahead made and no partition left behind its retention. Fails the run
   otherwise.

#### Through the REST API

```
POST /api/v2/dags/eventpush_retention/dagRuns
Authorization: Bearer TOKEN

{"logical_date": null}
```
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import dag, get_current_context, task


@dag(
    dag_id="eventpush_retention",
    description="Time partitions made ahead, dropped behind retention (GX-checked)",
    doc_md=__doc__,
    schedule="5 0 * * *",
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_runs=1,
    tags=["eventpush", "retention"],
    default_args={"owner": "eventpush", "retries": 1},
)
def eventpush_retention() -> None:
    @task
    def maintain() -> dict[str, Any]:
        """Make partitions ahead, drop those behind retention, prune old failure rows."""
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.hook import EventpushHook
        from eventpush.partitions import maintain
        from eventpush.sparkjobs.forms import FormError, check_form_keys

        # It takes no configuration: a conf asking for, say, a dry run must not drop partitions.
        try:
            check_form_keys(get_current_context()["dag_run"].conf, known=())
        except FormError as exc:
            raise AirflowFailException(f"retention request refused: {exc}") from None
        with EventpushHook().connection() as conn:
            report = maintain(conn, progress=print)  # a missed day told as it is made
        print(
            f"{len(report.created)} partitions made, {len(report.dropped)} dropped, "
            f"{report.failures_deleted} failure rows deleted, "
            f"{len(report.postponed)} tables postponed (a reader held them)"
        )
        return report.to_json()

    @task
    def check(report: dict[str, Any]) -> dict[str, Any]:
        """Great Expectations: days ahead made, nothing left behind retention."""
        from eventpush.airflow.hook import EventpushHook
        from eventpush.partitions import layout
        from eventpush.quality.batch import check_retention

        hook = EventpushHook()
        with hook.connection() as conn:
            rows = layout(conn)
        label = f"{get_current_context()['dag_run'].run_id} retention"
        return {"tables": len(rows), "dropped": len(report["dropped"])} | dict(
            check_retention(rows, label, hook.get_uri()).statistics
        )

    check(maintain())


eventpush_retention()
