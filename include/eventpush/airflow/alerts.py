"""Alerts through Airflow's own task callbacks: one clear log line an on-call engineer can grep
or route (``ALERT eventpush ...``), and an ``eventpush_alert{alert}`` gauge written through the
batch metrics path (textfile / Pushgateway, see ``eventpush.metrics.publish_batch``) that the
Prometheus rules of docs/OPERATIONS.md page on. A later success sets the gauge back to 0.

- ``audit_missing``: the audit DAG's ``check`` failed and its report has missing records;
- ``push_check``: a push slice's check failed (offsets, rows or counts wrong) or its lag is
  past ``EVENTPUSH_ALERT_LAG_EVENTS`` (see ``push_lag_check``);
- ``rebalance_check``: the rebalance DAG failed (its GX check refused the proposal, or the
  apply went stale).
"""

from __future__ import annotations

import logging
import os

from eventpush.db import connection
from eventpush.errors import first_line
from eventpush.metrics import publish_batch
from eventpush.status import read_status

log = logging.getLogger("eventpush.alerts")

LAG_ALERT_DEFAULT = 100_000


def raise_alert(alert: str, message: str) -> str:
    """Log the alert line and set ``eventpush_alert{alert}`` to 1; returns the line."""

    line = f"ALERT eventpush {alert}: {message}"
    log.error("%s", line)
    publish_batch(f"alert_{alert}", {"eventpush_alert": [({"alert": alert}, 1)]})
    return line


def clear_alert(alert: str) -> None:
    publish_batch(f"alert_{alert}", {"eventpush_alert": [({"alert": alert}, 0)]})


def _where(context) -> str:
    ti = context.get("ti") or context.get("task_instance")
    dag_id = getattr(ti, "dag_id", "?")
    run_id = getattr(ti, "run_id", "?")
    return f"dag {dag_id} run {run_id}"


def audit_failed(context) -> None:
    """on_failure_callback of the audit's ``check``: alerts when records are missing."""
    report = context["ti"].xcom_pull(task_ids="report")
    missing = report.get("missing") if isinstance(report, dict) else None
    if not missing:
        return  # the check failed on something else; Airflow's own failure says what
    worst = sorted(
        (r for r in report.get("runners") or [] if r.get("missing")),
        key=lambda r: -r["missing"],
    )[:5]
    runners = ", ".join(f"{_runner(r)} ({r['missing']})" for r in worst)
    raise_alert(
        "audit_missing",
        f"{missing} records missing in audit report {report.get('report_id')} "
        f"[{report.get('since')} .. {report.get('until')}) bus {report.get('bus') or 'all'}: "
        f"{runners}; {_where(context)}",
    )


def _runner(row: dict) -> str:
    """A report's runner as the alert names it: with its id when the report has one (a
    deleted target's runner and a live one re-created with its names share the name)."""
    rid = row.get("runner_id")
    return row["runner"] if rid is None else f"{row['runner']} #{rid}"


def audit_passed(context) -> None:
    clear_alert("audit_missing")


def push_failed(context) -> None:
    exc = context.get("exception")
    why = first_line(exc) if exc is not None and str(exc).strip() else "check failed"
    raise_alert("push_check", f"{why}; {_where(context)}")


def rebalance_failed(context) -> None:
    exc = context.get("exception")
    why = first_line(exc) if exc is not None and str(exc).strip() else "failed"
    raise_alert("rebalance_check", f"{why}; {_where(context)}")


def rebalance_passed(context) -> None:
    clear_alert("rebalance_check")


def lag_limit() -> int:
    value = os.environ.get("EVENTPUSH_ALERT_LAG_EVENTS", "").strip()
    if not value:
        return LAG_ALERT_DEFAULT
    if not value.isdigit():
        raise ValueError(f"EVENTPUSH_ALERT_LAG_EVENTS must be a whole number, got {value!r}")
    return int(value)


def push_lag_check(url: str, worker: str) -> str | None:
    """Why ``worker``'s lag (events published and not yet committed, over its runners) is
    past ``EVENTPUSH_ALERT_LAG_EVENTS`` (one line), or None."""
    limit = lag_limit()
    with connection(url) as conn:
        runners = [r for r in read_status(conn)["runners"] if r["worker"] == worker]
    total = sum(r["lag"] for r in runners)
    if total <= limit:
        return None
    worst = sorted(runners, key=lambda r: -r["lag"])[:3]
    names = ", ".join(f"{r['runner']} ({r['lag']})" for r in worst)
    return f"worker {worker} lags {total} events (limit {limit}): {names}"
