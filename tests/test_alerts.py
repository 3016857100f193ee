"""The Airflow callbacks' alerts: the log line, the ``eventpush_alert`` gauge in a textfile, and
the push DAG's lag limit against real PostgreSQL."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from eventpush import catalog
from eventpush.airflow import alerts
from eventpush.publish import publish


def alert_value(directory, alert: str) -> float:
    text = (directory / f"eventpush_alert_{alert}.prom").read_text()
    [value] = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "eventpush_alert" and s.labels == {"alert": alert}
    ]
    return value


class TaskInstance(SimpleNamespace):
    def xcom_pull(self, task_ids: str):
        return self.xcoms[task_ids]


def test_audit_callback_alerts_on_missing_and_a_pass_clears_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    report = {
        "report_id": 12,
        "missing": 5,
        "since": "2026-01-01T00:00:00+00:00",
        "until": "2026-01-01T01:00:00+00:00",
        "bus": None,
        "runners": [
            {"runner": "orders/r/a", "missing": 1},
            {"runner": "orders/r/b", "missing": 4},
            {"runner": "orders/r/c", "missing": 0},
        ],
    }
    ti = TaskInstance(dag_id="eventpush_audit", run_id="manual__1", xcoms={"report": report})
    with caplog.at_level(logging.ERROR, logger="eventpush.alerts"):
        alerts.audit_failed({"ti": ti})
    [line] = [r.getMessage() for r in caplog.records if r.name == "eventpush.alerts"]
    assert line.startswith("ALERT eventpush audit_missing: 5 records missing in audit report 12")
    assert "orders/r/b (4), orders/r/a (1)" in line and "orders/r/c" not in line
    assert "dag eventpush_audit run manual__1" in line
    assert alert_value(tmp_path, "audit_missing") == 1
    alerts.audit_passed({"ti": ti})
    assert alert_value(tmp_path, "audit_missing") == 0


def test_audit_callback_is_quiet_when_nothing_is_missing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    ti = TaskInstance(dag_id="d", run_id="r", xcoms={"report": {"missing": 0, "runners": []}})
    alerts.audit_failed({"ti": ti})
    assert not list(tmp_path.iterdir()) and "ALERT" not in caplog.text


def test_rebalance_callback_names_the_failure(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    ti = TaskInstance(dag_id="eventpush_rebalance", run_id="r1", xcoms={})
    with caplog.at_level(logging.ERROR, logger="eventpush.alerts"):
        alerts.rebalance_failed({"ti": ti, "exception": ValueError("spread 3.0 over 1.5\nmore")})
    assert "ALERT eventpush rebalance_check: spread 3.0 over 1.5; dag eventpush_rebalance" in (
        caplog.text
    )
    assert alert_value(tmp_path, "rebalance_check") == 1


def test_push_lag_limit(conn, db_url, monkeypatch):
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    spec = catalog.TargetSpec(name="t", url="http://127.0.0.1:9/ok")
    catalog.create_target(conn, "orders", "r", spec)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    lines = [json.dumps({"source": "shop", "detail-type": "x", "detail": {}}) for _ in range(5)]
    publish(conn, "orders", lines)
    monkeypatch.setenv("EVENTPUSH_ALERT_LAG_EVENTS", "10")
    assert alerts.push_lag_check(db_url, "w1") is None
    monkeypatch.setenv("EVENTPUSH_ALERT_LAG_EVENTS", "4")
    assert alerts.push_lag_check(db_url, "w1") == (
        "worker w1 lags 5 events (limit 4): orders/r/t (5)"
    )
    monkeypatch.setenv("EVENTPUSH_ALERT_LAG_EVENTS", "lots")
    with pytest.raises(ValueError, match="EVENTPUSH_ALERT_LAG_EVENTS must be a whole number"):
        alerts.push_lag_check(db_url, "w1")
