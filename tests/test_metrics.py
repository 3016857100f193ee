"""Prometheus metrics of a real worker: scraped over HTTP from ``/metrics`` while it pushes to a
loopback receiver, parsed with prometheus_client's own parser, checked against PostgreSQL."""

from __future__ import annotations

import time
import urllib.request

import pytest
import support
from prometheus_client.parser import text_string_to_metric_families
from support import RunningWorker, events, rows, wait_until

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import controls, engine

rx = support.rx  # the shared receiver fixture (tests/support.py)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_scraped_counters_equal_the_delivery_and_failure_rows(conn, db_url, rx, monkeypatch):
    monkeypatch.setattr(engine, "HEARTBEAT_INTERVAL_S", 0.2)
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    flaky = catalog.TargetSpec(name="ok", url=rx.url + "/flaky?fail=1", backoff_ms=5)
    catalog.create_target(conn, "orders", "r", flaky)
    catalog.create_target(
        conn, "orders", "r", catalog.TargetSpec(name="gone", url=rx.url + "/gone")
    )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    publish(conn, "orders", events(12))
    with RunningWorker("w1", db_url) as worker:
        expected = 24  # every event, once per target

        def all_committed():
            [(done,)] = rows(
                conn,
                "SELECT (SELECT count(*) FROM event_push_delivery)"
                " + (SELECT count(*) FROM event_push_failure)",
            )
            return done == expected

        wait_until(all_committed, what="all outcomes committed")
        # The gauges follow: lag at the next heartbeat (0 once the offsets are committed),
        # in-flight and breaker at the next 0.25 s sample.
        samples = wait_until(
            lambda: (
                (s := scrape(worker.port))
                and value(s, "eventpush_lag_events", runner="orders/r/ok") == 0
                and value(s, "eventpush_lag_events", runner="orders/r/gone") == 0
                and value(s, "eventpush_in_flight_records", runner="orders/r/ok") == 0
                and value(s, "eventpush_breaker_open", runner="orders/r/gone") is not None
                and s
            ),
            what="lag 0 on /metrics",
        )
        delivered = dict(
            rows(conn, "SELECT consumer_group, count(*) FROM event_push_delivery GROUP BY 1")
        )
        failed = dict(
            rows(conn, "SELECT consumer_group, count(*) FROM event_push_failure GROUP BY 1")
        )
        assert delivered == {"orders/r/ok": 12} and failed == {"orders/r/gone": 12}
        counted = {
            (labels["runner"], labels["outcome"]): v
            for (name, lbls), v in samples.items()
            if name == "eventpush_deliveries_total" and (labels := dict(lbls))
        }
        assert counted == {
            **{(runner, "delivered"): n for runner, n in delivered.items()},
            **{(runner, "failed"): n for runner, n in failed.items()},
        }
        # Every request the receiver saw is one observed attempt; the flaky target's second
        # attempts are the retries.
        ok_requests = rx.state.count["/flaky"]
        assert ok_requests == 24
        assert (
            value(
                samples,
                "eventpush_attempt_duration_seconds_count",
                runner="orders/r/ok",
                outcome="retry",
            )
            == 12
        )
        assert (
            value(
                samples,
                "eventpush_attempt_duration_seconds_count",
                runner="orders/r/ok",
                outcome="delivered",
            )
            == 12
        )
        assert (
            value(
                samples,
                "eventpush_attempt_duration_seconds_count",
                runner="orders/r/gone",
                outcome="final",
            )
            == 12
        )
        assert value(samples, "eventpush_retries_total", runner="orders/r/ok") == 12
        assert value(samples, "eventpush_retries_total", runner="orders/r/gone") is None
        assert value(samples, "eventpush_in_flight_records", runner="orders/r/ok") == 0
        assert value(samples, "eventpush_waiting_records", runner="orders/r/ok") == 0
        assert value(samples, "eventpush_lag_seconds", runner="orders/r/ok") == 0
        assert value(samples, "eventpush_breaker_open", runner="orders/r/gone") == 0
        assert value(samples, "eventpush_commit_duration_seconds_count") >= 1
        assert value(samples, "eventpush_event_loop_lag_seconds", worker="w1") >= 0

        # The heartbeat JSON carries the loop lag for the rebalancer (from the first sample on).
        def beat():
            [(metrics,)] = rows(conn, "SELECT metrics FROM event_push_worker WHERE name = 'w1'")
            conn.rollback()
            return metrics if metrics.get("loop_lag_ms") is not None else None

        lag_ms = wait_until(beat, what="loop_lag_ms in the heartbeat")["loop_lag_ms"]
        assert isinstance(lag_ms, int | float) and 0 <= lag_ms < 60_000
    with pytest.raises(OSError):  # the worker stopped: so did its /metrics
        scrape(worker.port)


def test_lag_in_events_and_seconds_while_a_runner_is_paused(conn, db_url, rx, monkeypatch):
    monkeypatch.setattr(engine, "HEARTBEAT_INTERVAL_S", 0.2)
    catalog.create_bus(conn, "orders", 1)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_target(conn, "orders", "r", catalog.TargetSpec(name="t", url=rx.url + "/ok"))
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    controls.set_paused(conn, "runner", "orders/r/t", True)
    publish(conn, "orders", events(5))
    time.sleep(0.3)  # the oldest event is at least this old
    with RunningWorker("w1", db_url) as worker:
        samples = wait_until(
            lambda: (
                (s := scrape(worker.port))
                and value(s, "eventpush_lag_events", runner="orders/r/t") == 5
                and s
            ),
            what="lag 5 on /metrics",
        )
        assert value(samples, "eventpush_waiting_records", runner="orders/r/t") == 5
        assert value(samples, "eventpush_lag_seconds", runner="orders/r/t") >= 0.3
        assert rx.state.count["/ok"] == 0


def test_a_taken_metrics_port_stops_a_standalone_worker_with_one_line(conn, db_url, rx):
    catalog.create_bus(conn, "orders", 1)
    catalog.create_worker(conn, "w1")
    with Receiver() as other:  # a port that is certainly taken
        port = int(other.url.rsplit(":", 1)[1])
        with pytest.raises(
            engine.WorkerFailedError, match=r"metrics cannot be served on 127\.0\.0\.1"
        ):
            engine.run_worker("w1", until_idle=True, max_seconds=5, url=db_url, metrics_port=port)
        # A push slice of the DAG runs on without them.
        report = engine.run_worker(
            "w1",
            until_idle=True,
            max_seconds=5,
            url=db_url,
            metrics_port=port,
            metrics_required=False,
        )
        assert report.delivered == 0


def test_worker_run_refuses_a_bad_metrics_port_in_one_line(conn, cli):
    catalog.create_worker(conn, "w1")
    bad_env = cli("worker", "run", "w1", "--until-idle", env={"EVENTPUSH_METRICS_PORT": "http"})
    assert bad_env.returncode == 3  # configuration, as every EVENTPUSH_* setting
    assert "EVENTPUSH_METRICS_PORT must be a port number, got 'http'" in bad_env.stderr
    assert "Traceback" not in bad_env.stderr
    bad_flag = cli("worker", "run", "w1", "--until-idle", "--metrics-port", "70000")
    assert bad_flag.returncode == 2 and "--metrics-port" in bad_flag.stderr


def test_attempt_figures_expose_what_a_prometheus_histogram_would():
    """The attempt counters are plain lists on the event loop (``AttemptStats``), read at
    scrape time: for the same observations the exposition is prometheus_client's own."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from eventpush.metrics import ATTEMPT_BUCKETS, WorkerMetrics

    worker = WorkerMetrics("w")
    registry = CollectorRegistry()
    histogram = Histogram(
        "eventpush_attempt_duration_seconds",
        "Duration of one HTTP attempt to a target",
        ["runner", "outcome"],
        buckets=ATTEMPT_BUCKETS,
        registry=registry,
    )
    retries = Counter(
        "eventpush_retries",
        "Requests that retried an earlier attempt",
        ["runner"],
        registry=registry,
    )
    # Bounds themselves (le is inclusive), just past them, past the last, and zero.
    seconds = [*ATTEMPT_BUCKETS, *(b * 1.0001 for b in ATTEMPT_BUCKETS), 0.0, 31.0, 1e9]
    for i, s in enumerate(seconds * 3):
        runner, outcome = f"b/r/t{i % 2}", ("delivered", "retry", "final")[i % 3]
        worker.attempted(runner, outcome, s, retry=i % 4 == 0)
        histogram.labels(runner, outcome).observe(s)
        if i % 4 == 0:
            retries.labels(runner).inc()

    def exposition(reg) -> list[str]:
        lines = generate_latest(reg).decode().splitlines()
        # Families' order and the creation times differ; everything else is the same.
        return sorted(
            line.rsplit(" ", 1)[0] if "_created{" in line else line
            for line in lines
            if "eventpush_attempt" in line or "eventpush_retries" in line
        )

    ours = exposition(worker.registry)
    assert len(ours) > 2 * 3 * (len(ATTEMPT_BUCKETS) + 4)
    assert ours == exposition(registry)


def test_a_worker_keeps_no_series_of_the_runners_it_no_longer_holds(conn, db_url, rx, monkeypatch):
    """Weeks of targets created and deleted under one worker, in brief: 12 targets, each
    pushed to (an attempt retried, then delivered) and deleted, leave /metrics with the
    series of the one target still there, not a counter and a histogram per runner that
    ever ran here (each deleted runner left 2 + 17 + 17 + 1 samples behind, for good)."""
    monkeypatch.setattr(engine, "HEARTBEAT_INTERVAL_S", 0.2)
    catalog.create_bus(conn, "orders", 1)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    keep = catalog.TargetSpec(name="keep", url=rx.url + "/ok/keep")
    catalog.create_target(conn, "orders", "r", keep)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)

    def held(worker: RunningWorker) -> set[str]:
        return {r.target.runner for r in list(worker.engine.runners.values())}

    def delivered(runner: str) -> int:
        [(n,)] = rows(
            conn, "SELECT count(*) FROM event_push_delivery WHERE consumer_group = %s", runner
        )
        return n

    with RunningWorker("w1", db_url) as worker:
        for i in range(12):
            runner = f"orders/r/t{i}"
            spec = catalog.TargetSpec(name=f"t{i}", url=f"{rx.url}/flaky/{i}?fail=1", backoff_ms=5)
            catalog.create_target(conn, "orders", "r", spec)
            catalog.assign(conn)
            wait_until(lambda runner=runner: runner in held(worker), what=f"{runner} held")
            publish(conn, "orders", events(1))
            wait_until(lambda runner=runner: delivered(runner) == 1, what=f"{runner} delivered")
            # Seen on /metrics while it is held (the sampler's 0.25 s, a commit's 0.2 s).
            wait_until(
                lambda runner=runner: (
                    value(
                        scrape(worker.port),
                        "eventpush_deliveries_total",
                        runner=runner,
                        outcome="delivered",
                    )
                    == 1
                ),
                what=f"{runner} counted",
            )
            catalog.delete_target(conn, "orders", "r", f"t{i}")
            wait_until(lambda runner=runner: runner not in held(worker), what=f"{runner} gone")
        time.sleep(1.0)  # a few samples of the runners held now
        samples = scrape(worker.port)
        runners = {dict(labels).get("runner") for _, labels in samples} - {None}
        assert runners == {"orders/r/keep"}, sorted(runners)
        attempts = worker.engine.metrics.attempts
        assert {r for r, _ in attempts.counts} == {"orders/r/keep"}
        assert set(attempts.retries) <= {"orders/r/keep"}
        assert (
            value(
                samples, "eventpush_deliveries_total", runner="orders/r/keep", outcome="delivered"
            )
            == 12
        )
