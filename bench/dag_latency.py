"""Publish-to-delivery latency: through the push DAG (scheduler and triggerer running) or the
standalone worker.

    # the DAG path: Airflow must be running on this database (scripts/airflow-standalone.sh)
    EVENTPUSH_DATABASE_URL=... python bench/dag_latency.py dag --events 40 --interval 1.5
    # the standalone path: the engine runs here, as `eventpush worker run` does
    EVENTPUSH_DATABASE_URL=... python bench/dag_latency.py standalone --events 200

Each event is published alone, carrying its publish time; a receiver on loopback computes the
latency when the event arrives. Loopback is denied by the address policy by default: this
process opens 127.0.0.1 for itself, and the DAG path needs Airflow started with
``EVENTPUSH_ALLOW_CIDRS=127.0.0.1/32`` in its environment too. The catalog (bus, rule, target,
worker) is made once, with names unique to the run. Prints a JSON summary (p50, p90, p99,
max in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
import uuid

from aiohttp import web

from eventpush import catalog
from eventpush.catalog import TargetSpec
from eventpush.config import allow_loopback_receiver, database_url
from eventpush.db import connection
from eventpush.publish import publish


class Sink:
    """A loopback HTTP receiver that records publish-to-arrival latency per event."""

    def __init__(self) -> None:
        self.latencies: dict[int, float] = {}
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        arrived = time.time()
        for event in body if isinstance(body, list) else [body]:
            seq, sent = event["detail"]["seq"], event["detail"]["sent"]
            self.latencies.setdefault(seq, (arrived - sent) * 1000)
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


def publish_one(conn, bus: str, seq: int) -> None:
    line = {"source": "bench.latency", "detail-type": "tick"}
    line["detail"] = {"seq": seq, "sent": time.time()}
    publish(conn, bus, [json.dumps(line)])


def summarize(mode: str, values: list[float], sent: int, extra: dict) -> dict:
    values = sorted(values)

    def pct(p: float) -> float:
        return round(values[min(len(values) - 1, int(p / 100 * len(values)))], 1)

    return {
        "mode": mode,
        "sent": sent,
        "delivered": len(values),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": round(values[-1], 1),
        "mean_ms": round(statistics.fmean(values), 1),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["dag", "standalone"])
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.1, help="mean seconds between")
    parser.add_argument("--timeout", type=float, default=600, help="give up after")
    args = parser.parse_args()
    allow_loopback_receiver()
    url = database_url()
    sink = Sink()
    bus, worker = make_catalog(url, sink.url)
    stop = None
    if args.mode == "standalone":
        from eventpush.push import Engine

        engine = Engine(worker, url)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=lambda: loop.run_until_complete(engine.run()))
        thread.start()

        def stop() -> None:
            loop.call_soon_threadsafe(engine.stop)
            thread.join(30)

    try:
        with connection(url) as conn:
            # warm-up: the first event waits for the DAG to map the new worker (or the engine)
            publish_one(conn, bus, -1)
            deadline = time.monotonic() + args.timeout
            while -1 not in sink.latencies:
                if time.monotonic() > deadline:
                    raise SystemExit("warm-up event never arrived: is the DAG running?")
                time.sleep(0.1)
            warmup = sink.latencies.pop(-1)
            started = time.monotonic()
            for seq in range(args.events):
                publish_one(conn, bus, seq)
                time.sleep(random.expovariate(1 / args.interval))
            while len(sink.latencies) < args.events and time.monotonic() < deadline:
                time.sleep(0.1)
        result = summarize(
            args.mode,
            list(sink.latencies.values()),
            args.events,
            {
                "interval_s": args.interval,
                "warmup_ms": round(warmup, 1),
                "seconds": round(time.monotonic() - started, 1),
            },
        )
        print(json.dumps(result))
    finally:
        if stop:
            stop()


if __name__ == "__main__":
    main()
