"""Publish-to-delivery latency: through the push DAG (scheduler and triggerer running) or the
standalone worker, at a steady publish rate, with slice hand-overs measured.

    # the DAG path: Airflow must be running on this database (scripts/airflow-standalone.sh)
    EVENTPUSH_DATABASE_URL=... python bench/dag_latency.py dag --rate 100 --duration 600
    # the standalone path: `eventpush worker run` in a process of its own
    EVENTPUSH_DATABASE_URL=... python bench/dag_latency.py standalone --rate 1000 --duration 60

Events are published on a fixed schedule (``rate`` per second, paced against the clock), one
per call, or every event already due in one call when a publish took longer than the interval
(so a loaded machine does not lower the rate); each carries its sequence number and publish
time; a receiver on loopback computes the latency when an event first arrives and
counts copies. Loopback is denied by the address policy by default: this process opens
127.0.0.1 for itself, and the DAG path needs Airflow started with
``EVENTPUSH_ALLOW_CIDRS=127.0.0.1/32`` in its environment too. The catalog (bus, rule, target,
worker) is made once, with names unique to the run.

Hand-overs: a thread watches the worker's row (its lease holder's pid) every 20 ms, so each
moment no process holds the lease is recorded (``lease_free_s``, one per hand-over, in
order); ``hand_over_gaps_s`` is, per hand-over, the receiver's silence around it (last
arrival before the lease went free to the first after it was taken: what a hand-over costs
end to end); ``arrival_gaps_s`` the longest silences anywhere (over 0.2 s). Prints one JSON
summary.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid

from aiohttp import web

from eventpush import catalog
from eventpush.catalog import TargetSpec
from eventpush.config import allow_loopback_receiver, database_url
from eventpush.db import connection
from eventpush.publish import publish
from eventpush.push.controls import set_paused

WATCH_INTERVAL_S = 0.02
GAP_REPORTED_S = 0.2


class Sink:
    """A loopback HTTP receiver that records publish-to-arrival latency per event."""

    def __init__(self) -> None:
        self.latencies: dict[int, float] = {}
        self.copies = 0
        self.arrivals: list[float] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        arrived = time.time()
        self.arrivals.append(arrived)
        for event in body if isinstance(body, list) else [body]:
            seq, sent = event["detail"]["seq"], event["detail"]["sent"]
            if seq in self.latencies:
                self.copies += 1
            else:
                self.latencies[seq] = (arrived - sent) * 1000
        return web.Response(status=200)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook"
        self.ready.set()
        self.loop.run_forever()


class LeaseWatch:
    """Records when nobody holds ``worker``'s lease, and how many leases were taken."""

    def __init__(self, url: str, worker: str) -> None:
        self.url, self.worker = url, worker
        self.free: list[tuple[float, float]] = []  # (since, until) wall-clock seconds
        self.taken = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with connection(self.url) as conn:
            conn.autocommit = True
            free_since, last_start, last_look = None, None, time.time()
            with conn.cursor() as cur:
                while not self.done.is_set():
                    cur.execute(
                        "SELECT pid, started_at FROM event_push_worker WHERE name = %s",
                        (self.worker,),
                    )
                    pid, started = cur.fetchone()
                    now = time.time()
                    if pid is None and free_since is None:
                        free_since = now
                    if pid is not None and started != last_start:
                        if last_start is not None:
                            # a hand-over quicker than one look: free since the last look
                            self.free.append((free_since or last_look, now))
                        last_start = started
                        self.taken += 1
                    if pid is not None:
                        free_since = None
                    last_look = now
                    time.sleep(WATCH_INTERVAL_S)

    def stop(self, since: float) -> list[tuple[float, float]]:
        """The moments (since, until) nobody held the lease, from ``since`` on."""
        self.done.set()
        self.thread.join(5)
        return [(a, b) for a, b in self.free if b >= since]


def hand_over_gaps(arrivals: list[float], free: list[tuple[float, float]]) -> list[float]:
    """Per hand-over, in order: the receiver's silence around it, from the last arrival
    before the lease went free to the first one after it was taken again (what an event
    published during the hand-over waited for it, at most)."""
    times = sorted(arrivals)
    gaps = []
    for since, until in free:
        before = bisect.bisect_right(times, since)
        after = bisect.bisect_left(times, until)
        if before and after < len(times):
            gaps.append(round(times[after] - times[before - 1], 3))
    return gaps


def make_catalog(url: str, sink: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:6]
    bus, worker = f"lat-{tag}", f"lat-{tag}"
    with connection(url) as conn:
        catalog.create_bus(conn, bus, 4)
        catalog.create_rule(conn, bus, "all", {"source": ["bench.latency"]})
        catalog.create_worker(conn, worker)
        # only this worker may take the new runner
        with conn.cursor() as cur:
            cur.execute("UPDATE event_push_worker SET enabled = false WHERE name <> %s", (worker,))
        conn.commit()
        catalog.create_target(conn, bus, "all", TargetSpec(name="sink", url=sink))
        catalog.assign(conn)
        with conn.cursor() as cur:
            cur.execute("UPDATE event_push_worker SET enabled = true WHERE name <> %s", (worker,))
        conn.commit()
    return bus, worker


def retire(url: str, worker: str, runner: str) -> None:
    """Take the bench's worker and runner out of the always-on push DAG (worker disabled,
    runner paused), so later runs neither map a worker nobody publishes to nor push a runner
    whose receiver is gone."""
    with connection(url) as conn:
        set_paused(conn, "runner", runner, True)
        with conn.cursor() as cur:
            cur.execute("UPDATE event_push_worker SET enabled = false WHERE name = %s", (worker,))
        conn.commit()


def publish_due(conn, bus: str, seqs: range) -> None:
    sent = time.time()
    lines = [
        json.dumps(
            {"source": "bench.latency", "detail-type": "tick", "detail": {"seq": seq, "sent": sent}}
        )
        for seq in seqs
    ]
    publish(conn, bus, lines)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted ``values``."""
    return round(values[min(len(values) - 1, int(p / 100 * len(values)))], 1)


def arrival_gaps(arrivals: list[float], since: float) -> list[float]:
    times = sorted(t for t in arrivals if t >= since)
    gaps = (b - a for a, b in zip(times, times[1:], strict=False))
    return sorted((round(g, 3) for g in gaps if g > GAP_REPORTED_S), reverse=True)


def summarize(mode: str, sink: Sink, sent: int, extra: dict) -> dict:
    values = sorted(sink.latencies.values())
    return {
        "mode": mode,
        "sent": sent,
        "delivered": len(values),
        "missing": sent - len(values),
        "duplicates": sink.copies,
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
        "p999_ms": percentile(values, 99.9),
        "max_ms": round(values[-1], 1),
        "mean_ms": round(statistics.fmean(values), 1),
        "over_1s": sum(v > 1000 for v in values),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["dag", "standalone"])
    parser.add_argument("--rate", type=float, default=100.0, help="events published per second")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of publishing")
    parser.add_argument("--timeout", type=float, default=600, help="give up waiting after")
    args = parser.parse_args()
    if args.rate <= 0 or args.duration <= 0:
        parser.error("--rate and --duration must be positive")
    allow_loopback_receiver()
    url = database_url()
    sink = Sink()
    bus, worker = make_catalog(url, sink.url)
    watch = LeaseWatch(url, worker)
    stop = None
    if args.mode == "standalone":
        # `eventpush worker run` in a process of its own, as deployed: in a thread here it
        # would share one interpreter lock with the publisher and the receiver
        cli = "from eventpush.cli import main; main()"
        worker_run = subprocess.Popen([sys.executable, "-c", cli, "worker", "run", worker])

        def stop() -> None:
            worker_run.terminate()  # SIGTERM: a graceful stop
            worker_run.wait(30)

    try:
        with connection(url) as conn:
            # warm-up: the first event waits for the DAG to map the new worker (or the engine)
            publish_due(conn, bus, range(-1, 0))
            deadline = time.monotonic() + args.timeout
            while -1 not in sink.latencies:
                if time.monotonic() > deadline:
                    raise SystemExit("warm-up event never arrived: is the DAG running?")
                time.sleep(0.1)
            warmup = sink.latencies.pop(-1)
            events = int(args.rate * args.duration)
            started_wall, started = time.time(), time.monotonic()
            seq = 0
            while seq < events:
                time.sleep(max(0.0, started + seq / args.rate - time.monotonic()))
                # every event whose time has come goes out in this call: a publish slower than
                # the interval (a loaded machine) does not lower the rate
                due = min(events, int((time.monotonic() - started) * args.rate) + 1)
                publish_due(conn, bus, range(seq, max(due, seq + 1)))
                seq = max(due, seq + 1)
            published_s = time.monotonic() - started
            deadline = time.monotonic() + args.timeout
            while len(sink.latencies) < events and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1)  # late copies still count as duplicates
        free = watch.stop(started_wall)
        result = summarize(
            args.mode,
            sink,
            events,
            {
                "rate": args.rate,
                "published_rate": round(events / published_s, 1),
                "duration_s": args.duration,
                "warmup_ms": round(warmup, 1),
                "leases_taken": watch.taken,
                "lease_free_s": [round(b - a, 3) for a, b in free],
                "hand_over_gaps_s": hand_over_gaps(sink.arrivals, free),
                "arrival_gaps_s": arrival_gaps(sink.arrivals, started_wall)[:20],
            },
        )
        print(json.dumps(result))
    finally:
        watch.done.set()
        if stop:
            stop()
        retire(url, worker, f"{bus}/all/sink")


if __name__ == "__main__":
    main()
