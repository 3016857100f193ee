"""The Prometheus alert rules and the Grafana dashboard that docs/OPERATIONS.md ships: they
parse, and every metric they name is one the code defines (worker or batch)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml

from eventpush.metrics import (
    WorkerMetrics,
    audit_results,
    batch_registry,
    rebalance_results,
    replay_results,
)
from eventpush.sparkjobs.audit import AuditResult, RunnerAudit
from eventpush.sparkjobs.replay import ReplayResult

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "eventpush-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "eventpush-dashboard.json"
METRIC = re.compile(r"\beventpush_[a-z0-9_]+")


def defined_names() -> set[str]:
    """Every sample name the code can expose (counters' _total, histograms' _bucket, ...)."""
    worker = WorkerMetrics("w")
    worker.attempted("b/r/t", "delivered", 0.01, retry=True)
    worker.committed([SimpleNamespace(runner="b/r/t")], [SimpleNamespace(runner="b/r/t")])
    worker.commit_seconds.observe(0.01)
    worker.runner_state({"b/r/t": (0, False)})
    worker.lag("b/r/t", 0, 0, 0.0)
    worker.already_held("b/r/t", "stream S", 1)
    registries = [worker.registry]
    audit = AuditResult([RunnerAudit("b/r/t", 1, 1, 0, 0, 0, 0)], 1, None, None)
    proposal = SimpleNamespace(proposal=SimpleNamespace(moves=1, spread=1.0))
    for job, results in (
        ("audit", audit_results(audit)),
        ("replay", replay_results(ReplayResult(replay_id=1, selected=1))),
        ("rebalance", rebalance_results(proposal, applied=True)),
        ("alert_x", {"eventpush_alert": [({"alert": "x"}, 1)]}),
    ):
        registries.append(batch_registry(job, results))
    return {s.name for r in registries for family in r.collect() for s in family.samples}


def test_alert_rules_parse_and_name_only_defined_metrics():
    doc = yaml.safe_load(RULES.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    assert len(rules) >= 5
    defined = defined_names()
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["alert"].startswith("Eventpush") and rule["labels"]["severity"]
        named = set(METRIC.findall(rule["expr"]))
        assert named, f"{rule['alert']} names no eventpush metric"
        assert named <= defined, f"{rule['alert']} names undefined metrics {named - defined}"
    alerts = {rule["alert"] for rule in rules}
    assert {"EventpushAuditMissing", "EventpushAirflowAlert", "EventpushLagGrowing"} <= alerts


def test_grafana_dashboard_parses_and_names_only_defined_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    named = {name for expr in exprs for name in METRIC.findall(expr)}
    defined = defined_names()
    assert named <= defined, named - defined
    # The dashboard shows the figures: deliveries, lag, latency, breaker, loop lag.
    for wanted in (
        "eventpush_deliveries_total",
        "eventpush_lag_seconds",
        "eventpush_attempt_duration_seconds_bucket",
        "eventpush_breaker_open",
        "eventpush_event_loop_lag_seconds",
    ):
        assert wanted in named


def test_operations_doc_points_at_the_shipped_files():
    text = (REPO / "docs" / "OPERATIONS.md").read_text()
    for path in (RULES, DASHBOARD):
        assert str(path.relative_to(REPO)) in text
