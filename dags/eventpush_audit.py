"""
### eventpush_audit: is every event accounted for?

Hourly over its data interval, and on demand for any window (the form's `since` and
`until`; empty means the run's data interval, or the hour before the run when it was
triggered without a logical date; a time without an offset is UTC).

1. **window**: the window and bus to audit, checked (until after since, at most
   `EVENTPUSH_AUDIT_MAX_WINDOW_HOURS` long (168 by default; audit a longer stretch as several
   windows), the bus exists, no field the form does not have).
2. **audit_job**: `spark_jobs/audit.py` through SparkSubmitOperator (connection
   `spark_default`): per runner, the events its rule matches in the window against delivery
   rows, failure rows and committed offsets: expected, delivered, failed, pending, missing,
   duplicates. With the form's `verify_sinks` (off by default), readable destinations
   (JetStream) are read back too: `absent` (delivered in the books, not in the stream: fails
   the run like a missing record) and `expired` (aged out by the stream's own limits). Writes
   an `event_audit_report` row. With the form's `roll_up` (off by default), each runner found
   clean has the window's delivery rows replaced by one summary row (`eventpush.rollups`).
3. **report**: reads that report back.
4. **check**: a Great Expectations suite: no runner has a missing record and the counts add
   up. Any missing record fails the run, and the task's failure callback raises the
   `audit_missing` alert: an `ALERT eventpush audit_missing: ...` log line and
   `eventpush_alert{alert="audit_missing"} 1` (cleared by the next passing check).
5. **publish_gaps**: when records are missing or absent (and only then), emits an event on
   the asset `eventpush://audit/gaps` whose extra holds the report id, the window, the bus,
   the number missing and the runners that miss records (id, name and how many each).
   `eventpush_replay_gaps`, scheduled on that asset, replays them when the Airflow Variable
   `eventpush_replay_gaps` is `true` (off by default), or when this run's form asked for it
   (`replay_missing`).

#### Through the REST API

```
POST /api/v2/dags/eventpush_audit/dagRuns
Authorization: Bearer TOKEN

{"logical_date": null,
 "conf": {"bus": "orders", "since": "2026-01-01T00:00:00+00:00",
          "until": "2026-01-02T00:00:00+00:00", "replay_missing": true}}
```

`report`'s result (`.../taskInstances/report/xcomEntries/return_value`) holds the report id,
the window and the per-runner counts; the dashboard shows the last report.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import Asset, CronDataIntervalTimetable, Param, dag, get_current_context, task

from eventpush.airflow import alerts
from eventpush.airflow.gaps import GAPS_URI
from eventpush.airflow.spark_submit import spark_job

GAPS = Asset(GAPS_URI)


@dag(
    dag_id="eventpush_audit",
    description="Delivery-completeness audit per runner and window (Spark + GX)",
    doc_md=__doc__,
    # Data intervals (not trigger times): each hourly run audits the hour before it.
    schedule=CronDataIntervalTimetable("0 * * * *", timezone="UTC"),
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_runs=1,
    tags=["eventpush", "audit", "spark"],
    default_args={"owner": "eventpush", "retries": 0},
    render_template_as_native_obj=True,
    params={
        "bus": Param(None, type=["null", "string"], title="Bus", description="empty for every bus"),
        "since": Param(
            None,
            type=["null", "string"],
            format="date-time",
            title="Since",
            description="window start (ISO 8601); empty: the run's data interval",
        ),
        "until": Param(
            None,
            type=["null", "string"],
            format="date-time",
            title="Until",
            description="window end (ISO 8601), exclusive; empty: the run's data interval",
        ),
        "verify_sinks": Param(
            False,
            type="boolean",
            title="Verify destinations",
            description="also read JetStream destinations back: records the books call "
            "delivered but the stream does not hold are absent (and fail the audit)",
        ),
        "roll_up": Param(
            False,
            type="boolean",
            title="Roll up clean runners",
            description="replace the window's delivery rows of every runner found clean by "
            "one summary row each (later audits of the window answer the same figures)",
        ),
        "replay_missing": Param(
            False,
            type="boolean",
            title="Replay the gap",
            description="replay the missing records now, even while the gap-replay switch "
            "(Variable eventpush_replay_gaps) is off",
        ),
    },
)
def eventpush_audit() -> None:
    @task
    def window() -> dict[str, Any]:
        """The window and bus to audit, and the job's arguments."""
        from airflow.sdk.exceptions import AirflowFailException

        from eventpush.airflow.hook import EventpushHook
        from eventpush.sparkjobs.forms import FormError, audit_flag, audit_window

        context = get_current_context()
        try:
            since_at, until_at, bus = audit_window(
                dict(context["params"]),
                context["dag_run"].conf,
                # A run triggered with "logical_date": null has no data interval.
                context.get("data_interval_start"),
                context.get("data_interval_end"),
            )
            verify = audit_flag(dict(context["params"]), "verify_sinks")
        except FormError as exc:
            raise AirflowFailException(f"audit request refused: {exc}") from None
        since, until = since_at.isoformat(), until_at.isoformat()
        if bus and not EventpushHook().bus_exists(bus):
            raise AirflowFailException(f"unknown bus {bus!r}")
        args = ["--since", since, "--until", until] + (["--bus", bus] if bus else [])
        args += ["--verify-sinks"] if verify else []
        args += ["--roll-up"] if audit_flag(dict(context["params"]), "roll_up") else []
        return {"since": since, "until": until, "bus": bus, "args": args}

    spec = window()
    job = spark_job("audit", "ti.xcom_pull(task_ids='window')['args']")

    @task
    def report(spec: dict[str, Any]) -> dict[str, Any]:
        """The report the job wrote for this window."""
        from eventpush.airflow.hook import EventpushHook

        found = EventpushHook().audit_report(spec["since"], spec["until"], spec["bus"])
        if found is None:
            raise RuntimeError("the audit job wrote no report for this window")
        print(
            f"audit report {found.report_id}: {found.expected} expected, {found.missing} "
            f"missing, {found.absent} absent"
        )
        return {
            **spec,
            "report_id": found.report_id,
            "missing": found.missing,
            "absent": found.absent,
            "runners": found.runners,
        }

    @task(on_failure_callback=alerts.audit_failed, on_success_callback=alerts.audit_passed)
    def check(report: dict[str, Any]) -> dict[str, Any]:
        """Great Expectations: no missing record, counts add up. Fails the run otherwise."""
        from eventpush.airflow.hook import EventpushHook
        from eventpush.quality.batch import check_audit

        label = f"{get_current_context()['dag_run'].run_id} report {report['report_id']}"
        return check_audit(report["runners"], label, EventpushHook().get_uri()).statistics

    @task(outlets=[GAPS])
    def publish_gaps(report: dict[str, Any]) -> dict[str, Any]:
        """An event on the gaps asset with the counts, when records are missing; skipped (no
        event) otherwise."""
        from airflow.sdk.exceptions import AirflowSkipException

        from eventpush.airflow.gaps import gap_extra

        if not report["missing"] and not report.get("absent"):
            raise AirflowSkipException("nothing missing: no gap event")
        context = get_current_context()
        extra = gap_extra(report, bool(context["params"].get("replay_missing")))
        context["outlet_events"][GAPS].extra = extra
        return extra

    reported = report(spec)
    spec >> job >> reported
    check(reported)
    publish_gaps(reported)


eventpush_audit()
