"""Live catalog changes under load: change-to-effect time, and push throughput with and
without changes, paired in one run.

    flock /tmp/eventpush-bench.lock .venv/bin/python bench/live_changes.py \
        [--rate 5000] [--changes 100] [--seconds 60]

A worker (``eventpush worker run``, a process of its own) pushes a bus at ``--rate`` events
per second to a steady target (rule ``all``) in a receiver process. A second rule
(``changing``) matches only marker events whose ``detail.k`` is its current value; each tick
of the publisher adds one marker carrying the value of the change under way. A change is
``catalog.update_rule`` (what ``eventpush rule update`` calls) to the next value: its
*change-to-effect* time runs from the update returning to the arrival of the first marker the
new pattern matched (so it includes that marker's own delivery). Phase one runs without
changes, phase two with ``--changes`` changes spread over the same time; the steady target's
deliveries per second in each are the throughput pair, against the offered rate (the
ceiling). The 2 s of the contract is the ceiling of the change-to-effect time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.demo.receiver import Receiver, ReceiverProcess  # noqa: E402
from eventpush.publish import publish  # noqa: E402

EXE = str(Path(sys.executable).with_name("eventpush"))
TICK_S = 0.05
EFFECT_CEILING_S = 2.0  # the contract: a change applies within 2 s
GIVE_UP_S = 15.0


class Publisher(threading.Thread):
    """``rate`` steady events a second, in ticks, each tick with one marker of ``value``."""

    def __init__(self, url: str, rate: int) -> None:
        super().__init__(daemon=True, name="publisher")
        self.conn = psycopg2.connect(url)
        self.rate = rate
        self.value = "v0"
        self.sent = 0
        self.late_ticks = 0
        self.done = threading.Event()

    def run(self) -> None:
        per_tick = int(self.rate * TICK_S)
        started = time.perf_counter()
        ticks = 0
        while not self.done.is_set():
            lines = [
                json.dumps({"source": "bench", "detail-type": "o", "detail": {"n": self.sent + i}})
                for i in range(per_tick)
            ]
            marker = {"k": self.value, "n": ticks}
            lines.append(json.dumps({"source": "marker", "detail-type": "m", "detail": marker}))
            publish(self.conn, "live", lines)
            self.sent += per_tick
            ticks += 1
            wait = started + ticks * TICK_S - time.perf_counter()
            if wait < 0:
                self.late_ticks += 1
            time.sleep(max(0.0, wait))


class Arrivals:
    """The markers' arrivals, read once each as they come in."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.seen = 0
        self.first: dict[str, float] = {}  # value -> first arrival after its change returned
        self.after: dict[str, float] = {}

    def first_arrival(self, value: str) -> float | None:
        with self.rx.state.lock:
            new = self.rx.state.requests[self.seen :]
        self.seen += len(new)
        for r in new:
            k = json.loads(r.body)["detail"]["k"]
            if k in self.after and r.at >= self.after[k] and k not in self.first:
                self.first[k] = r.at
        return self.first.get(value)


def steady_count(rx: ReceiverProcess) -> int:
    return rx.stats()["count"].get("/ok/steady", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=5000, help="steady events per second")
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    args = parser.parse_args()
    with ReceiverProcess() as steady, Receiver() as markers, scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "live", 4)
        catalog.create_rule(conn, "live", "all", {"source": ["bench"]})
        catalog.create_target(
            conn, "live", "all", catalog.TargetSpec("steady", steady.url + "/ok/steady")
        )
        catalog.create_rule(conn, "live", "changing", {"detail": {"k": ["v0"]}})
        catalog.create_target(
            conn, "live", "changing", catalog.TargetSpec("marker", markers.url + "/ok/marker")
        )
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        worker = subprocess.Popen([EXE, "worker", "run", "w1"], stdout=subprocess.DEVNULL)
        publisher = Publisher(url, args.rate)
        try:
            time.sleep(3)  # the worker is up
            publisher.start()
            time.sleep(5)  # warm-up: the lanes are full, the receiver's pool open
            before, t0 = steady_count(steady), time.monotonic()
            time.sleep(args.seconds)
            quiet = (steady_count(steady) - before) / (time.monotonic() - t0)
            before, t0 = steady_count(steady), time.monotonic()
            effects, lost = [], 0
            arrivals = Arrivals(markers)
            spacing = args.seconds / args.changes
            for i in range(1, args.changes + 1):
                due = t0 + i * spacing - spacing
                time.sleep(max(0.0, due - time.monotonic()))
                value = f"v{i}"
                publisher.value = value  # markers of this value on both sides of the change
                catalog.update_rule(conn, "live", "changing", pattern={"detail": {"k": [value]}})
                returned = arrivals.after[value] = time.monotonic()
                while (arrived := arrivals.first_arrival(value)) is None:
                    if time.monotonic() - returned > GIVE_UP_S:
                        lost += 1
                        break
                    time.sleep(0.005)
                if arrived is not None:
                    effects.append(arrived - returned)
            elapsed = time.monotonic() - t0
            changing = (steady_count(steady) - before) / elapsed
        finally:
            publisher.done.set()
            worker.terminate()
            worker.wait(60)
    cuts = statistics.quantiles(effects, n=100) if len(effects) > 1 else [float("nan")] * 99
    print(f"machine: {machine()}")
    print(
        f"offered {args.rate:,} events/s ({publisher.late_ticks} late publish ticks); "
        f"{args.changes} changes over {elapsed:.1f} s"
    )
    print(
        f"change-to-effect: p50 {cuts[49] * 1000:.0f} ms, p99 {cuts[98] * 1000:.0f} ms, "
        f"max {max(effects) * 1000:.0f} ms, not seen within {GIVE_UP_S:g} s: {lost}; "
        f"p99 / {EFFECT_CEILING_S:g} s ceiling: {cuts[98] / EFFECT_CEILING_S:.2f}"
    )
    print(
        f"throughput without changes {quiet:,.0f}/s ({quiet / args.rate:.2f} of offered), "
        f"with changes {changing:,.0f}/s ({changing / args.rate:.2f}); "
        f"with / without: {changing / quiet:.2f}"
    )


if __name__ == "__main__":
    main()
