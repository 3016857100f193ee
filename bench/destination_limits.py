"""Destination benchmarks (issue 32): what a rate limit costs per delivery, how close a binding
one comes to its limit, and adaptive concurrency beside the best fixed concurrency.

    .venv/bin/python bench/destination_limits.py [all|ratelimit|binding|adaptive]

- ``ratelimit``: the same drain (20,000 events, four targets, 16 in flight each, one worker,
  the receiver in a process of its own) with plain targets and with all four behind one
  destination whose limit never binds (100,000/s, the most the catalog takes: the tokens
  still come from the database in slices), alternated; deliveries per second and CPU
  microseconds per delivery of the whole worker process (less bent by a loaded machine than
  the rate). Goal: within 5 %.
- ``binding``: four targets behind one destination limited to 2,000/s: the rate reached.
- ``adaptive``: one target against ``eventpush.demo.congested`` (latency 20 ms up to 8 in
  flight, growing with the square past it), pushed for a fixed time at fixed concurrencies
  and with ``concurrency_auto``: deliveries per second after a warm-up and the p99 latency
  the engine recorded. Goals: auto within 10 % of the best fixed throughput, p99 at most 1.5x
  that setting's.

The targets are made through the catalog as a user makes them: ``eventpush destination
create api --url URL --rate-limit N`` and ``eventpush target create ... --destination api``
(``--concurrency N|auto`` for the adaptive runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402
from push import events, topology  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.catalog.destinations import MAX_RATE_LIMIT  # noqa: E402
from eventpush.demo.congested import Congested  # noqa: E402
from eventpush.demo.receiver import ReceiverProcess  # noqa: E402
from eventpush.publish import publish  # noqa: E402
from eventpush.push import run_worker  # noqa: E402

PATHS = ["/ok/a", "/ok/b", "/ok/c", "/ok/d"]


def limited_topology(conn, url: str, rate_limit: float) -> None:
    """Four targets on one rule, all through the destination ``api`` limited to
    ``rate_limit`` (``bench/push.py``'s topology otherwise)."""
    catalog.create_bus(conn, "orders", 4)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop.orders"]})
    catalog.create_destination(conn, "api", url + "/ok/api", rate_limit=rate_limit)
    for i in range(len(PATHS)):
        spec = catalog.TargetSpec(name=f"t{i}", url="", destination="api")
        catalog.create_target(conn, "orders", "all", spec)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def _drain(n: int, rate_limit: float | None) -> tuple[float, float, int]:
    """Seconds, CPU microseconds per delivery of the process, deliveries (``rate_limit``
    None: plain targets)."""
    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        if rate_limit is None:
            topology(conn, rx.url, PATHS)
        else:
            limited_topology(conn, rx.url, rate_limit)
        publish(conn, "orders", events(n))
        started, cpu = time.perf_counter(), time.process_time()
        report = run_worker("w1", until_idle=True, max_seconds=600)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        conn.close()
    return elapsed, cpu / report.delivered * 1e6, report.delivered


def bench_ratelimit(n: int = 20_000, rounds: int = 3) -> None:
    limited = MAX_RATE_LIMIT  # never binds here
    totals = {"plain": [], "limited": []}
    for r in range(rounds):
        for kind, rate_limit in (("plain", None), ("limited", limited)):
            elapsed, us, delivered = _drain(n, rate_limit)
            totals[kind].append((delivered / elapsed, us))
            print(
                f"ratelimit round {r + 1}, {kind}: {delivered:,} deliveries in {elapsed:.2f} s "
                f"= {delivered / elapsed:,.0f}/s, process CPU {us:.0f} us/delivery "
                f"(load {os.getloadavg()[0]:.1f})"
            )
            sys.stdout.flush()
    plain_rate = sum(r for r, _ in totals["plain"]) / rounds
    plain_us = sum(u for _, u in totals["plain"]) / rounds
    rate = sum(r for r, _ in totals["limited"]) / rounds
    us = sum(u for _, u in totals["limited"]) / rounds
    print(
        f"ratelimit, mean of {rounds}: plain {plain_rate:,.0f}/s {plain_us:.0f} us, limited "
        f"{rate:,.0f}/s {us:.0f} us: rate ratio {rate / plain_rate:.3f}, CPU ratio "
        f"{us / plain_us:.3f} (goal: within 5 %)"
    )


def bench_binding(n: int = 12_000, limit: float = 2_000.0) -> None:
    elapsed, _, delivered = _drain(n, limit)
    rate = delivered / elapsed
    print(
        f"binding limit {limit:,.0f}/s, four targets: {delivered:,} in {elapsed:.2f} s = "
        f"{rate:,.0f}/s ({rate / limit:.3f} of the limit, start-up and the last commit "
        f"included; load {os.getloadavg()[0]:.1f})"
    )


def _congested_run(spec: dict, seconds: float, warm_s: float) -> tuple[float, float, float]:
    """Deliveries per second after ``warm_s``, p99 latency (ms) the engine recorded for
    them, and the mean limit seen by the receiver (requests in flight at arrival)."""
    with Congested(base_ms=20, knee=8) as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, rx.url, ["/c"], queues=4, backoff_ms=100, **spec)
        publish(conn, "orders", events(int(seconds * 600)))
        started = time.monotonic()
        run_worker("w1", max_seconds=seconds)
        ok = [(t, n) for t, _, n, s in rx.log if s == 200 and t >= started + warm_s]
        span = max(t for t, _ in ok) - (started + warm_s)
        with conn.cursor() as cur:
            cur.execute(
                "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY latency_ms) "
                "FROM (SELECT latency_ms FROM event_push_delivery ORDER BY id "
                "OFFSET (SELECT count(*) / 4 FROM event_push_delivery)) late"
            )
            (p99,) = cur.fetchone()
        conn.close()
    return len(ok) / span, p99, sum(n for _, n in ok) / len(ok)


def bench_adaptive(seconds: float = 10.0, warm_s: float = 3.0) -> None:
    fixed = {}
    for c in (4, 6, 8, 10, 12, 16):
        rate, p99, seen = _congested_run({"concurrency": c}, seconds, warm_s)
        fixed[c] = (rate, p99)
        print(
            f"adaptive bench, fixed {c:2d}: {rate:,.0f}/s, p99 {p99:.1f} ms, in flight at the "
            f"receiver {seen:.1f} (load {os.getloadavg()[0]:.1f})"
        )
        sys.stdout.flush()
    best = max(fixed, key=lambda c: fixed[c][0])
    rate, p99, seen = _congested_run({"concurrency_auto": True}, seconds, warm_s)
    print(
        f"adaptive bench, auto: {rate:,.0f}/s, p99 {p99:.1f} ms, in flight at the receiver "
        f"{seen:.1f} (load {os.getloadavg()[0]:.1f})"
    )
    brate, bp99 = fixed[best]
    print(
        f"adaptive vs best fixed ({best}): throughput {rate / brate:.3f} (goal >= 0.90), "
        f"p99 {p99 / bp99:.2f}x (goal <= 1.5)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", nargs="?", default="all")
    what = parser.parse_args().what
    print(f"machine: {machine()}; load average {os.getloadavg()}")
    if what in ("all", "ratelimit"):
        bench_ratelimit()
    if what in ("all", "binding"):
        bench_binding()
    if what in ("all", "adaptive"):
        bench_adaptive()
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
