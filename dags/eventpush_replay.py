"""
### eventpush_replay: re-push records, on demand

Trigger it from the form. **What**: `failed` re-pushes the open failure records (those still
`failed`; the window is when they failed), `missing` the audit's gaps (committed past but
never delivered nor recorded), `all` every event of the window the rule matches, as an
archive replay does, and needs a window (at most `EVENTPUSH_REPLAY_MAX_WINDOW_HOURS`, 168 by
default) unless **everything** is ticked. Narrow it by bus, rule, target, window and message
ids (at most 1,000, each at most 128 characters); cap it with a maximum count (at most
`EVENTPUSH_REPLAY_MAX_COUNT`, 1,000,000 by default, which also applies when empty) and a rate
limit (at least `EVENTPUSH_REPLAY_MIN_RATE`, 1 record per second); a dry run only selects
and checks. Times without an offset are UTC.

1. **check_request**: refuses impossible forms (until before since, unknown bus, a field the
   form does not have, limits exceeded, ...) with a message naming the field.
2. **replay_job**: `spark_jobs/replay.py` through SparkSubmitOperator (connection
   `spark_default`): Spark selects, Great Expectations checks the selection, the executors
   re-push with the engine's delivery code (same signing, retries and `webhook-id`), then GX
   checks that the counts add up. Stopped after `EVENTPUSH_REPLAY_TIMEOUT_MINUTES` (240).
3. **report**: the run's counts from `event_replay_run`.

Safe to run twice: what the first run delivered is not pushed again by a second `failed` or
`missing` replay. The audit's gaps are replayed by `eventpush_replay_gaps`, scheduled on the
audit's asset `eventpush://audit/gaps`; this form stays for manual replays.

#### Through the REST API

The form's fields are the run's `conf`; leave out what you would leave empty. With a token
from `POST /auth/token` (`{"username": ..., "password": ...}`):

```
POST /api/v2/dags/eventpush_replay/dagRuns
Authorization: Bearer TOKEN

{"logical_date": null,
 "conf": {"what": "failed", "target": "crm", "since": "2026-01-01T00:00:00+00:00",
          "max_count": 1000, "rate_limit": 50, "dry_run": true}}
```

A value the form refuses (`"max_count": -5`) is answered 400 at once; a request that cannot
be served (an unknown target) fails `check_request` with the reason. Poll
`GET /api/v2/dags/eventpush_replay/dagRuns/RUN_ID` until `state` is `success` or `failed`;
the counts are `report`'s result:
`GET /api/v2/dags/eventpush_replay/dagRuns/RUN_ID/taskInstances/report/xcomEntries/return_value`
gives `{"replay_id", "status", "selected", "delivered", "failed", "dry_run", "error"}`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import Param, dag, get_current_context, task

from eventpush.airflow.spark_submit import spark_job
from eventpush.sparkjobs.forms import form_params, replay_limits

LIMITS = replay_limits()


@dag(
    dag_id="eventpush_replay",
    description="Re-push failed records, audit gaps or a window's events (Spark)",
    doc_md=__doc__,
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    is_paused_upon_creation=False,
    tags=["eventpush", "replay", "spark"],
    default_args={"owner": "eventpush", "retries": 0},
    render_template_as_native_obj=True,
    params={name: Param(**kw) for name, kw in form_params(LIMITS).items()},
)
def eventpush_replay() -> None:
    @task
    def check_request() -> list[str]:
        """Refuse impossible requests with a clear message; the job's arguments otherwise."""
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.hook import EventpushHook
        from eventpush.sparkjobs.replay import ReplayRequestError, checked_job_args

        context = get_current_context()
        run = context["dag_run"]
        try:
            return checked_job_args(
                EventpushHook().get_uri(), dict(context["params"]), run.run_id, run.conf
            )
        except ReplayRequestError as exc:
            raise AirflowFailException(f"replay request refused: {exc}") from None

    args = check_request()
    job = spark_job(
        "replay", "ti.xcom_pull(task_ids='check_request')", execution_timeout=LIMITS.timeout
    )

    @task
    def report() -> dict[str, Any]:
        """The counts of this run's replay, as recorded by the job."""
        from eventpush.airflow.hook import EventpushHook
        from eventpush.sparkjobs.replay import recorded_run

        result = recorded_run(EventpushHook().get_uri(), get_current_context()["dag_run"].run_id)
        print(f"replay {result['replay_id']}: {result}")
        return result

    args >> job >> report()


eventpush_replay()
