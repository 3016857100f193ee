"""Batch job results as Prometheus metrics: a node-exporter textfile and a Pushgateway push
(a loopback HTTP server stands in for the gateway and keeps what it was sent)."""

from __future__ import annotations

import http.server
import threading
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from eventpush.metrics import (
    audit_results,
    publish_batch,
    rebalance_results,
    replay_results,
)
from eventpush.sparkjobs.audit import AuditResult, RunnerAudit
from eventpush.sparkjobs.replay import ReplayResult


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


AUDIT = AuditResult(
    [
        RunnerAudit("orders/created/crm", 30, 25, 2, 3, 0, 0, runner_id=1),
        RunnerAudit("orders/big/billing", 15, 15, 0, 0, 0, 1, runner_id=2),
    ],
    report_id=7,
    since=None,
    until=None,
)


@pytest.fixture
def gateway():
    """A Pushgateway stand-in on loopback: records (method, path, body) of every request."""
    received: list[tuple[str, str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _keep(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            received.append((self.command, self.path, self.rfile.read(length).decode()))
            self.send_response(200)
            self.end_headers()

        do_PUT = do_POST = _keep

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def test_audit_results_go_to_a_textfile_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    monkeypatch.delenv("EVENTPUSH_PUSHGATEWAY_URL", raising=False)
    where = publish_batch("audit", audit_results(AUDIT))
    path = tmp_path / "eventpush_audit.prom"
    assert where == [str(path)]
    assert [p.name for p in tmp_path.iterdir()] == ["eventpush_audit.prom"]  # no temp file left
    got = samples(path.read_text())
    crm = (("runner", "orders/created/crm"), ("runner_id", "1"))
    billing = (("runner", "orders/big/billing"), ("runner_id", "2"))
    assert got[("eventpush_audit_missing_records", crm)] == 3
    assert got[("eventpush_audit_missing_records", billing)] == 0
    assert got[("eventpush_audit_failed_records", crm)] == 2
    assert got[("eventpush_audit_expected_records", billing)] == 15
    assert got[("eventpush_batch_last_success_timestamp_seconds", (("job", "audit"),))] > 0
    # A second run replaces the file whole.
    publish_batch("audit", audit_results(AuditResult([], 8, None, None)))
    assert ("eventpush_audit_missing_records", crm) not in samples(path.read_text())


def test_replay_and_rebalance_results_are_pushed_to_the_gateway(gateway, monkeypatch):
    url, received = gateway
    monkeypatch.setenv("EVENTPUSH_PUSHGATEWAY_URL", url)
    monkeypatch.delenv("EVENTPUSH_METRICS_TEXTFILE_DIR", raising=False)
    replay = ReplayResult(replay_id=3, selected=10, delivered=8, failed=2)
    assert publish_batch("replay", replay_results(replay)) == [url]
    rebalance = SimpleNamespace(proposal=SimpleNamespace(moves=4, spread=1.25))
    publish_batch("rebalance", rebalance_results(rebalance, applied=True))
    assert [(m, p) for m, p, _ in received] == [
        ("PUT", "/metrics/job/eventpush_replay"),
        ("PUT", "/metrics/job/eventpush_rebalance"),
    ]
    pushed = samples(received[0][2])
    assert {k[1][0][1]: v for k, v in pushed.items() if k[0] == "eventpush_replay_records"} == {
        "selected": 10,
        "delivered": 8,
        "failed": 2,
        "skipped": 0,
    }
    moved = samples(received[1][2])
    assert moved[("eventpush_rebalance_moves", (("applied", "true"),))] == 4
    assert moved[("eventpush_rebalance_spread", (("applied", "true"),))] == 1.25


def test_an_unreachable_gateway_is_logged_and_the_job_result_stands(monkeypatch, caplog):
    # Port 9 on loopback (discard) has no listener here: the push is refused at once.
    monkeypatch.setenv("EVENTPUSH_PUSHGATEWAY_URL", "http://user:s3cret@127.0.0.1:9")
    monkeypatch.delenv("EVENTPUSH_METRICS_TEXTFILE_DIR", raising=False)
    assert publish_batch("replay", replay_results(ReplayResult(replay_id=1, selected=0))) == []
    assert "push to gateway" in caplog.text and "s3cret" not in caplog.text
