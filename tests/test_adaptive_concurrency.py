"""Adaptive concurrency (``--concurrency auto``, issue 32): the in-flight limit follows the
destination's answers. The limiter's own rules on made-up answers first, then the engine
against real loopback receivers, asserting on the limiter's recorded decisions (what it
chose and when) rather than on wall-clock throughput."""

from __future__ import annotations

import time

from destination_support import EngineThread
from support import events, wait_until

from eventpush import catalog
from eventpush.demo.congested import Congested
from eventpush.publish import publish
from eventpush.push import adaptive
from eventpush.push.adaptive import AdaptiveLimiter
from eventpush.sinks.contract import DELIVERED, FINAL, RETRY, Outcome

RUNNER = "orders/r/t"


def ok(ms: float) -> Outcome:
    return Outcome(DELIVERED, 200, None, ms)


def window(limiter: AdaptiveLimiter, now: float, outcome: Outcome, used: bool = True) -> float:
    """A window of answers (one per slot) to requests sent after ``now``, with the limit
    fully used or not; returns the time it closed."""
    limiter.in_use = limiter.limit if used else 0
    t = now + outcome.latency_ms / 1000 + 0.001
    for _ in range(limiter.limit):
        limiter.observe(outcome, t)
    t += limiter.window_s
    limiter.observe(outcome, t)  # the answer that closes the window
    limiter.in_use = 0
    return t


def test_slow_start_doubles_until_latency_rises_then_grows_one_by_one():
    limiter = AdaptiveLimiter(1024)
    limiter.set_pool(256)
    now, limits = 0.0, []
    for _ in range(4):
        now = window(limiter, now, ok(20))
        limits.append(limiter.limit)
    assert limits == [2, 4, 8, 16]
    now = window(limiter, now, ok(24))  # latency up by a fifth at 16 in flight
    assert limiter.limit == 14 and limiter.decisions[-1][2] == "latency"
    # Answers to requests sent before the change say nothing of the new limit.
    limiter.in_use = limiter.limit
    for _ in range(10):
        limiter.observe(ok(40), now + 0.039)
    assert limiter.count == 0 and limiter.limit == 14
    for expected in (15, 16):  # near its best again: one by one
        now = window(limiter, now, ok(20))
        assert limiter.limit == expected
    now = window(limiter, now, ok(80))  # far above its best: down in proportion, by half
    assert limiter.limit == 8
    # Windows that did not use the whole limit say nothing about a bigger one.
    decided = len(limiter.decisions)
    for _ in range(3):
        judged = limiter.window_start
        now = window(limiter, now, ok(20), used=False)
        assert limiter.window_start > judged
    assert limiter.limit == 8 and len(limiter.decisions) == decided


def test_backpressure_halves_and_an_opened_breaker_drops_it_to_one():
    limiter = AdaptiveLimiter(64)
    limiter.set_pool(256)
    now = 0.0
    for _ in range(6):
        now = window(limiter, now, ok(10))
    assert limiter.limit == 64  # the ceiling (the runner's concurrency control)
    for status in (503, 429, None):  # a timeout or connection error has no status
        before = limiter.limit
        now = window(limiter, now, Outcome(RETRY, status, "busy", 5))
        assert (limiter.limit, limiter.decisions[-1][2]) == (before // 2, "back-pressure")
    # A final answer (410) or a refused address is no back-pressure.
    assert not adaptive.backpressure(Outcome(FINAL, 410, "gone", 5))
    assert not adaptive.backpressure(Outcome(RETRY, None, "refused", 0, reached=False))
    limiter.breaker_opened(now)
    assert limiter.limit == 1 and limiter.ssthresh == 4
    for expected in (2, 4, 5):  # slow start up to half what it had, then one by one
        now = window(limiter, now, ok(10))
        assert limiter.limit == expected


def test_the_limit_never_passes_the_workers_pool():
    limiter = AdaptiveLimiter(1024)
    limiter.set_pool(6)
    now = 0.0
    for _ in range(5):
        now = window(limiter, now, ok(5))
    assert limiter.limit == 6
    limiter.set_pool(3)  # the worker's pool_max lowered while it runs
    assert limiter.limit == 3 and limiter.decisions[-1][2] == "ceiling"


def limits_between(decisions: list, start: float, end: float) -> list[tuple[float, int]]:
    """(seconds, limit) spans of the limit over [start, end], from its decisions."""
    spans, current, at = [], None, start
    for t, limit, _ in decisions:
        if t <= start:
            current = limit
            continue
        if t >= end:
            break
        if current is not None:
            spans.append((t - at, current))
        current, at = limit, t
    spans.append((end - at, current))
    return spans


def setup_auto_target(conn, url: str, n: int) -> None:
    """As `eventpush destination create api --url URL` and `eventpush target create ...
    --destination api --concurrency auto` make it."""
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_destination(conn, "api", url)
    spec = catalog.TargetSpec(
        name="t", url="", destination="api", concurrency_auto=True, backoff_ms=100
    )
    catalog.create_target(conn, "orders", "r", spec)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    publish(conn, "orders", events(n))


def test_against_latency_that_grows_past_8_in_flight_it_settles_at_the_knee(conn, db_url):
    with Congested(base_ms=40, knee=8) as rx:
        setup_auto_target(conn, rx.url + "/c", 3000)
        worker = EngineThread("w1", db_url).start()
        try:
            runner = wait_until(lambda: worker.runner(RUNNER), what="the runner")
            wait_until(
                lambda: any(why == "latency" for _, _, why in runner.adaptive.decisions),
                timeout=20,
                what="a decrease for latency",
            )
            time.sleep(1)  # the slow start's overshoot undone
            settled = time.monotonic()
            time.sleep(3)
            decisions = list(runner.adaptive.decisions)
            end = time.monotonic()
        finally:
            worker.stop()
    spans = limits_between(decisions, settled, end)
    mean = sum(s * limit for s, limit in spans) / sum(s for s, _ in spans)
    assert 6.5 <= mean <= 10, (mean, decisions[-20:])
    assert max(limit for _, limit in spans) <= 11, decisions[-20:]
    # What the receiver saw: rarely more than a step past its knee once settled.
    seen = [n for t, _, n, _ in rx.log if settled <= t <= end]
    assert sum(n > 10 for n in seen) <= 0.05 * len(seen), seen


def test_a_receiver_answering_503_gets_a_trickle_within_2_s_and_its_flow_back_within_10(
    conn, db_url
):
    with Congested(base_ms=40, knee=8) as rx:
        setup_auto_target(conn, rx.url + "/c", 4000)
        worker = EngineThread("w1", db_url).start()
        try:
            runner = wait_until(lambda: worker.runner(RUNNER), what="the runner")
            limiter = runner.adaptive
            wait_until(lambda: limiter.limit >= 6, timeout=20, what="the limit to grow")
            rx.unavailable = True
            down = time.monotonic()
            wait_until(lambda: limiter.limit <= 1, timeout=5, what="the limit to drop")
            dropped = min(t for t, lim, _ in list(limiter.decisions) if t >= down and lim <= 2)
            assert dropped - down <= 2.0, list(limiter.decisions)
            time.sleep(3)
            rx.unavailable = False
            up = time.monotonic()
            wait_until(lambda: limiter.limit >= 6, timeout=10, what="the limit to grow back")
            back = time.monotonic()
        finally:
            worker.stop()
    # While it answered 503: after the first 2 s, a trickle (the breaker's probes).
    during = [t for t in rx.arrivals(status=503) if down + 2 <= t <= up]
    assert len(during) <= 4, len(during)
    assert back - up <= 10
    assert len(rx.arrivals(status=200)) > len([t for t in rx.arrivals(status=200) if t < up])
