"""A destination's rate limit (issue 32): one token bucket in PostgreSQL for the destination
as a whole, whichever workers and runners send through it."""

from __future__ import annotations

import json
import threading
import time

import psycopg2
from destination_support import EngineThread
from support import events, rows, wait_until

from eventpush import catalog
from eventpush.demo.congested import Congested
from eventpush.publish import publish
from eventpush.push import rates, run_worker

LIMIT = 50.0
WINDOW_S = 10.0


def most_in_any_window(times: list[float], window: float) -> int:
    """The most arrivals in any window of ``window`` seconds (windows starting at arrivals
    are enough: any other window holds no more than the one starting at its first)."""
    times = sorted(times)
    best, j = 0, 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] < start + window:
            j += 1
        best = max(best, j - i)
    return best


def move(conn, runner: str, worker: str) -> None:
    """Move one runner to a worker as the rebalancer applies a move (a new generation: the
    table locked, then the row updated; a worker's commit never deadlocks with it, see
    test_push_rooms)."""
    with conn, conn.cursor() as cur:
        cur.execute("LOCK TABLE event_target_runner IN SHARE ROW EXCLUSIVE MODE")
        cur.execute(
            "INSERT INTO event_assignment (origin, moves) VALUES ('test move', 1) "
            "RETURNING generation"
        )
        cur.execute(
            "UPDATE event_target_runner SET generation = %s, "
            "worker_id = (SELECT id FROM event_push_worker WHERE name = %s) WHERE name = %s",
            (cur.fetchone()[0], worker, runner),
        )


def test_a_bucket_leased_from_two_connections_at_once_never_gives_more_than_its_rate(db_url):
    rate, seconds = 200.0, 1.5
    granted: list[int] = []
    lock = threading.Lock()

    def hammer() -> None:
        conn = psycopg2.connect(db_url)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                n, wait = rates.lease(conn, "d", rate, rates.slice_size(rate))
                assert n > 0 or wait > 0
                with lock:
                    granted.append(n)
        finally:
            conn.close()

    started = time.monotonic()
    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    total = sum(granted)
    # A new bucket starts empty and holds at most BURST_S of the rate.
    assert total <= rate * elapsed + rates.bucket_size(rate)
    assert total >= rate * (seconds - 0.2)
    assert max(granted) <= rates.slice_size(rate)


def test_two_workers_two_rules_one_destination_hold_its_rate_while_runners_move(conn, db_url):
    with Congested(base_ms=1) as rx:
        catalog.create_bus(conn, "orders", 2)
        # As `eventpush destination create api --url URL --rate-limit 50` and `eventpush
        # target create ... --destination api` make them: both targets send through it.
        catalog.create_destination(conn, "api", f"{rx.url}/api", rate_limit=LIMIT)
        for rule in ("a", "b"):
            catalog.create_rule(conn, "orders", rule, {"source": ["shop"]})
            catalog.create_target(
                conn, "orders", rule, catalog.TargetSpec(name=f"t{rule}", url="", destination="api")
            )
        catalog.create_worker(conn, "w1")
        catalog.create_worker(conn, "w2")
        catalog.assign(conn)
        assert rows(
            conn,
            "SELECT r.name, w.name FROM event_target_runner r "
            "JOIN event_push_worker w ON w.id = r.worker_id ORDER BY r.name",
        ) == [("orders/a/ta", "w1"), ("orders/b/tb", "w2")]
        publish(conn, "orders", events(500))  # 1,000 sends wanted: 20 s at the limit
        workers = [EngineThread(w, db_url).start() for w in ("w1", "w2")]
        try:
            wait_until(lambda: rx.log, timeout=30, what="the first delivery")
            first = rx.log[0][0]
            # Runners move while the limit binds, one at a time (the other keeps the
            # destination busy meanwhile): each to the other worker and back, so that each
            # worker ends with one (a worker left with no runner of the destination drops
            # its gate, and its figures with it).
            where = {"orders/a/ta": "w1", "orders/b/tb": "w2"}
            for name in ("orders/a/ta", "orders/b/tb", "orders/a/ta", "orders/b/tb"):
                time.sleep(2.5)
                where[name] = "w2" if where[name] == "w1" else "w1"
                move(conn, name, where[name])
            wait_until(
                lambda: all(workers[int(w[1]) - 1].runner(n) for n, w in where.items()),
                what="each runner pushed where it went",
            )
            time.sleep(3)  # each worker's new gate waits for the destination's tokens a while
            wait_until(
                lambda: time.monotonic() - first > WINDOW_S + 1.5, timeout=30, what="the window"
            )
            figures = [w.engine.rates.figures() for w in workers]
        finally:
            reports = [w.stop() for w in workers]
    arrivals = rx.arrivals()
    most = most_in_any_window(arrivals, WINDOW_S)
    # Within 10 % over any 10-second window, and the limit used (events wait, never fail).
    assert most <= LIMIT * WINDOW_S * 1.1, most
    assert most >= LIMIT * WINDOW_S * 0.85, most
    assert {p for _, p, _, _ in rx.log} == {"/api"}
    # Both rules' targets sent through it.
    assert rows(
        conn,
        "SELECT r.name, count(*) > 0 FROM event_push_delivery d "
        "JOIN event_target_runner r ON r.id = d.runner_id GROUP BY r.name ORDER BY r.name",
    ) == [("orders/a/ta", True), ("orders/b/tb", True)]
    assert sum(r.failed for r in reports) == 0
    # Every move happened, and the runners were pushed where they went.
    assert rows(
        conn,
        "SELECT r.name, w.name FROM event_target_runner r "
        "JOIN event_push_worker w ON w.id = r.worker_id ORDER BY r.name",
    ) == sorted(where.items())
    assert rows(conn, "SELECT count(DISTINCT generation) FROM event_target_runner") == [(2,)]
    assert rows(conn, "SELECT count(*) FROM event_push_failure") == [(0,)]
    # Both workers sent through the one destination and waited for its tokens.
    assert all(f["api"]["sent"] > 0 and f["api"]["throttled_s"] > 1 for f in figures), figures
    assert all(f["api"]["rate_limit"] == LIMIT for f in figures)
    # The waiting shows in /metrics and in each worker's heartbeat (status).
    for worker in workers:
        scraped = {
            (m.name, s.name): s.value
            for m in worker.engine.metrics.registry.collect()
            for s in m.samples
            if s.labels.get("destination") == "api"
        }
        assert (
            scraped[("eventpush_destination_rate_limit", "eventpush_destination_rate_limit")] == 50
        )
        assert (
            scraped[
                (
                    "eventpush_destination_throttled_seconds",
                    "eventpush_destination_throttled_seconds_total",
                )
            ]
            > 1
        )
    beats = rows(conn, "SELECT metrics->'destinations'->'api' FROM event_push_worker ORDER BY name")
    assert [b["rate_limit"] for (b,) in beats] == [LIMIT, LIMIT]
    assert all(b["throttled_s"] > 0 for (b,) in beats)


def test_an_ordered_target_waits_for_its_destinations_tokens_in_order(conn, db_url):
    rate, n = 20.0, 30
    with Congested(base_ms=1) as rx:
        catalog.create_bus(conn, "orders", 1)
        catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
        catalog.create_destination(conn, "slow-api", f"{rx.url}/o", rate_limit=rate)
        spec = catalog.TargetSpec(name="t", url="", destination="slow-api", ordered=True)
        catalog.create_target(conn, "orders", "r", spec)
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(conn, "orders", events(n))
        report = run_worker("w1", until_idle=True, max_seconds=60)
    arrivals = rx.arrivals()
    assert report.delivered == n and len(arrivals) == n
    # The bucket starts empty: n sends need (n - 1) / rate seconds at least.
    assert arrivals[-1] - arrivals[0] >= (n - 1) / rate * 0.95
    # The promise of push/rates.py over any window of T seconds: rate * (T + BURST_S) plus one
    # slice (one worker). A stalled sender may spend a burst's tokens at once, so a short
    # window is held to that bound, not to the rate alone.
    window = 0.5
    bound = rate * (window + rates.BURST_S) + rates.slice_size(rate)
    assert most_in_any_window(arrivals, window) <= bound < n
    assert [o for (o,) in rows(conn, 'SELECT "offset" FROM event_push_delivery ORDER BY id')] == (
        list(range(n))
    )


def test_a_rate_limited_destination_and_an_auto_target_from_the_command_line(conn, cli):
    """The real script (one subprocess family): `destination create --rate-limit`, `target
    create --destination --concurrency auto`, a worker run, and what `status --json` and
    `destination show --json` then say."""
    rate, n = 4, 40  # 10 s of sends at the limit: the worker's 6 s leave events waiting
    with Congested(base_ms=1) as rx:
        catalog.create_bus(conn, "orders", 2)
        catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
        catalog.create_worker(conn, "w1")
        done = cli(
            "destination", "create", "api", "--url", f"{rx.url}/api", "--rate-limit", str(rate),
            "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        done = cli(
            "target", "create", "--bus", "orders", "--rule", "r", "--name", "t",
            "--destination", "api", "--concurrency", "auto", "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        created = json.loads(done.stdout)
        assert (created["destination"], created["concurrency_auto"]) == ("api", True)
        catalog.assign(conn)
        publish(conn, "orders", events(n))
        # Past one heartbeat (every 5 s) with the limit binding.
        done = cli("worker", "run", "w1", "--max-seconds", "6", "--json")
        assert done.returncode == 0, done.stderr
        status = cli("status", "--json")
        shown = cli("destination", "show", "api", "--json")
    assert status.returncode == 0 and shown.returncode == 0, status.stderr + shown.stderr
    destination = json.loads(shown.stdout)
    assert (destination["rate_limit"], destination["targets"]) == (rate, 1)
    assert destination["url"] == f"{rx.url}/api"
    doc = json.loads(status.stdout)
    [worker] = doc["workers"]
    api = worker["metrics"]["destinations"]["api"]
    assert api["rate_limit"] == rate and api["sent"] > 0 and api["throttled_s"] > 0, api
    # Since the heartbeat before (at the start, the bucket empty): about the limit.
    assert 0.5 * rate <= api["invocations_per_s"] <= 1.5 * rate, api
    lane = worker["metrics"]["lanes"]["orders/r/t"]
    assert (lane["destination"], lane["concurrency_auto"]) == ("api", True)
    assert 1 <= lane["concurrency"] <= worker["metrics"]["pool"]["max"]
    # Over the limit, events wait (lag) and never fail; the receiver saw at most the limit.
    [runner] = doc["runners"]
    assert runner["failed"] == 0 and runner["lag"] > 0 and 0 < runner["delivered"] < n
    arrivals = rx.arrivals()
    assert len(arrivals) == runner["delivered"]
    assert most_in_any_window(arrivals, 5.0) <= rate * (5 + rates.BURST_S) + 1


def test_a_running_worker_takes_a_new_limit_and_a_new_url_of_its_destination_live(conn, db_url):
    """`destination update api --rate-limit 8` and then `--url`: the running worker's bucket
    enforces the new limit and its sends go to the new URL, without a restart."""
    fast, slow = 40.0, 8.0
    with Congested(base_ms=1) as rx:
        catalog.create_bus(conn, "orders", 2)
        catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
        catalog.create_destination(conn, "api", f"{rx.url}/one", rate_limit=fast)
        catalog.create_target(
            conn, "orders", "r", catalog.TargetSpec(name="t", url="", destination="api")
        )
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(conn, "orders", events(300))
        worker = EngineThread("w1", db_url).start()
        try:
            runner = wait_until(lambda: worker.runner("orders/r/t"), what="the runner")
            wait_until(lambda: len(rx.log) >= 20, timeout=30, what="sends at the first limit")
            before = time.monotonic()
            catalog.update_destination(conn, "api", rate_limit=slow)
            wait_until(lambda: runner.gate.rate == slow, what="the worker to take the new limit")
            took = time.monotonic()
            time.sleep(3)
            catalog.update_destination(conn, "api", url=f"{rx.url}/two")
            wait_until(
                lambda: runner.target.url == f"{rx.url}/two", what="the worker to take the URL"
            )
            moved = time.monotonic()
            wait_until(lambda: rx.arrivals("/two"), timeout=10, what="a send to the new URL")
            time.sleep(1)
            report_figures = worker.engine.rates.figures()
            # `--no-rate-limit`: the gate goes, and with it the limit from the heartbeat.
            catalog.update_destination(conn, "api", rate_limit=None)
            wait_until(lambda: runner.gate is None, what="the worker to drop the limit")
            wait_until(lambda: "api" not in worker.engine.rates.figures(), what="the gate to go")
        finally:
            report = worker.stop()
    one, two = rx.arrivals("/one"), rx.arrivals("/two")
    first = one[0]
    # At the first limit (the bucket starts empty, so from the first send on).
    assert len([t for t in one if t < before]) / (before - first) >= fast * 0.6
    # From when the worker took it, at most the new limit (plus the burst and one slice
    # leased at the old limit), and still used: events wait, they are not failed.
    under_slow = [t for t in one + two if took <= t <= took + 3]
    slice_then = rates.slice_size(fast)
    assert len(under_slow) <= slow * (3 + rates.BURST_S) + slice_then, len(under_slow)
    assert len(under_slow) >= slow * 3 * 0.6, len(under_slow)
    # Once the worker had the new URL, nothing more went to the old one.
    assert not [t for t in one if t > moved + 0.5], (one[-3:], moved)
    assert two and report.failed == 0
    assert report_figures["api"]["rate_limit"] == slow
    assert rows(conn, "SELECT url FROM event_target") == [(f"{rx.url}/two",)]


def test_a_worker_keeps_no_gate_of_a_destination_whose_targets_were_deleted(conn, db_url):
    """Weeks of API destinations created and deleted, in brief: 10 rate-limited destinations,
    each with a target pushed through it and then deleted with it, leave the worker no gate
    (a lease task's state, waiters) and no series on /metrics for any of them. A deleted
    target's gate went only when some runner of the worker took a new version."""
    with Congested(base_ms=1) as rx:
        catalog.create_bus(conn, "orders", 1)
        catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
        catalog.create_worker(conn, "w1")
        worker = EngineThread("w1", db_url).start()
        try:
            for i in range(10):
                name = f"t{i}"
                catalog.create_destination(conn, f"api{i}", f"{rx.url}/{i}", rate_limit=100.0)
                spec = catalog.TargetSpec(name=name, url="", destination=f"api{i}")
                catalog.create_target(conn, "orders", "r", spec)
                catalog.assign(conn)
                runner = f"orders/r/{name}"
                wait_until(lambda runner=runner: worker.runner(runner), what=f"{runner} held")
                publish(conn, "orders", events(1))
                wait_until(lambda i=i: rx.arrivals(f"/{i}"), what=f"a send through api{i}")
                catalog.delete_target(conn, "orders", "r", name)
                catalog.delete_destination(conn, f"api{i}")
                wait_until(lambda runner=runner: not worker.runner(runner), what=f"{runner} gone")
            time.sleep(1.0)  # a few samples of the metrics
            gates = sorted(worker.engine.rates.gates)
            labelled = {
                s.labels["destination"]
                for family in worker.engine.metrics.registry.collect()
                for s in family.samples
                if "destination" in s.labels
            }
        finally:
            worker.stop()
    assert gates == [], gates
    assert labelled == set(), sorted(labelled)
