"""
### eventpush_rebalance: who pushes what

Every 10 minutes, and on demand.

1. **check_inputs**: the form holds no field it does not have (a mistyped `dry_run` is
   refused, not ignored) and there are enabled workers when there are runners to place.
2. **rebalance_job**: `spark_jobs/rebalance.py` through SparkSubmitOperator (connection
   `spark_default`): each runner's load (rate x latency) from the delivery log in Spark, a
   sticky assignment balanced relative to worker capacity (even by count without load
   data), a Great Expectations check of the proposal (every enabled runner exactly once,
   only enabled workers, spread and moves within bound), then one transaction that applies
   it with a new generation. A refused proposal fails the job and changes nothing.
3. **report**: the check's outcome and the generation; push workers re-read their runners
   and pick the change up without a restart.

#### Through the REST API

```
POST /api/v2/dags/eventpush_rebalance/dagRuns
Authorization: Bearer TOKEN

{"logical_date": null, "conf": {"window_minutes": 60, "dry_run": true}}
```
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import Param, dag, get_current_context, task

from eventpush.airflow import alerts
from eventpush.airflow.spark_submit import spark_job


@dag(
    dag_id="eventpush_rebalance",
    description="Balance runners over push workers by load and capacity (Spark + GX)",
    doc_md=__doc__,
    schedule=timedelta(minutes=10),
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_runs=1,
    tags=["eventpush", "rebalance", "spark"],
    # Any task failing (inputs refused, the GX check of the proposal, a stale apply) raises
    # the rebalance_check alert; a passing report clears it (eventpush.airflow.alerts).
    default_args={
        "owner": "eventpush",
        "retries": 0,
        "on_failure_callback": alerts.rebalance_failed,
    },
    render_template_as_native_obj=True,
    params={
        "window_minutes": Param(
            15,
            type="integer",
            minimum=1,
            maximum=1440,
            title="Load window (minutes)",
            description="how far back the delivery log is read for each runner's load",
        ),
        "dry_run": Param(
            False, type="boolean", title="Dry run", description="propose and check only"
        ),
    },
)
def eventpush_rebalance() -> None:
    @task
    def check_inputs() -> list[str]:
        """Workers and runners are there to balance; the job's arguments."""
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.hook import EventpushHook
        from eventpush.sparkjobs.forms import FormError, rebalance_args

        context = get_current_context()
        run = context["dag_run"]
        try:
            args = rebalance_args(dict(context["params"]), run.conf, run.run_id)
        except FormError as exc:
            raise AirflowFailException(f"rebalance request refused: {exc}") from None
        found = EventpushHook().placement()
        print(
            f"{found.runners} runners, {found.enabled_workers} of {found.workers} workers enabled"
        )
        if found.runners and not found.enabled_workers:
            raise AirflowFailException("no enabled worker to place runners on")
        return args

    job = spark_job("rebalance", "ti.xcom_pull(task_ids='check_inputs')")

    @task(on_success_callback=alerts.rebalance_passed)
    def report() -> dict[str, Any]:
        """The proposal check's outcome and the assignment's current generation."""
        from eventpush.airflow.hook import EventpushHook

        run_id = get_current_context()["dag_run"].run_id
        row, generation = EventpushHook().rebalance_outcome(run_id)
        if row is None or not row[0]:
            raise RuntimeError(f"no passing rebalance check recorded for {run_id}")
        return {"generation": generation, "check": row[1]}

    check_inputs() >> job >> report()


eventpush_rebalance()
