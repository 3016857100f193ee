"""The JetStream target beside a bare nats-py loop publishing the same messages with acks.

    .venv/bin/python bench/nats_target.py [--events N] [--rounds R]

One nats-server of the bench's own (``-js``, a temporary store, a free loopback port; never
the machine's shared server). Each round, in one run:

- **bare**: ``nats-py`` publishes the round's N events (the bodies and headers the target
  sends: ``Nats-Msg-Id``, ``webhook-id``, content type, ``traceparent``) with
  ``publish_async``, at most 64 unacknowledged (``publish_async_max_pending``), and waits
  for every acknowledgement;
- **target**: the same N events published to a PostgreSQL bus (not timed), then one worker
  pushes them to ``nats://.../SUBJECT`` until idle: read, matched, published, acknowledged and
  committed. Each configuration keeps 64 messages in flight (concurrency x batch size).

Every run publishes to a stream of its own, so de-duplication never makes one side cheaper;
each target run is bracketed by two bare runs and its ratio taken against their mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nats  # noqa: E402
import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402
from nats_support import NatsServer, nats_server_binary  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.publish import publish  # noqa: E402
from eventpush.push import run_worker  # noqa: E402

IN_FLIGHT = 64
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
CONFIGS = [(64, 1), (8, 8), (1, 64)]  # (concurrency, batch size): 64 messages in flight each


def events(n: int) -> list[str]:
    return [
        json.dumps(
            {
                "id": uuid.uuid4().hex,
                "source": "shop.orders",
                "detail-type": "OrderPlaced",
                "detail": {"order": i, "customer": f"c{i % 977}", "total": i * 1.5},
            }
        )
        for i in range(n)
    ]


async def bare(url: str, subject: str, bodies: list[str]) -> float:
    """Seconds for nats-py alone to publish ``bodies`` with 64 unacknowledged at most."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(publish_async_max_pending=IN_FLIGHT)
        started = time.perf_counter()
        futures = []
        for raw in bodies:
            mid = f"msg_{json.loads(raw)['id']}"
            headers = {  # what the target sends with each message
                "content-type": "application/json",
                "webhook-id": mid,
                "Nats-Msg-Id": mid,
                "traceparent": TRACEPARENT,
            }
            futures.append(await js.publish_async(subject, raw.encode(), headers=headers))
        acks = await asyncio.gather(*futures)
        elapsed = time.perf_counter() - started
    finally:
        await nc.close()
    assert len(acks) == len(bodies) and not any(a.duplicate for a in acks)
    return elapsed


async def add_stream(url: str, name: str, subject: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(name=name, subjects=[subject])
    finally:
        await nc.close()


async def stream_count(url: str, name: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(name)).state.messages
    finally:
        await nc.close()


def target(server_url: str, stream: str, bodies: list[str], concurrency: int, batch: int) -> float:
    """Seconds for one worker to push ``bodies`` from a PostgreSQL bus to a JetStream target."""
    subject = f"{stream.lower()}.orders"
    asyncio.run(add_stream(server_url, stream, subject))
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4)
        catalog.create_rule(conn, "orders", "all", {"source": ["shop.orders"]})
        spec = catalog.TargetSpec(
            name="js", url=f"{server_url}/{subject}", concurrency=concurrency, batch_size=batch
        )
        catalog.create_target(conn, "orders", "all", spec)
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(conn, "orders", bodies)
        conn.close()
        started = time.perf_counter()
        report = run_worker("w1", until_idle=True, max_seconds=600)
        elapsed = time.perf_counter() - started
    assert report.delivered == len(bodies) and report.failed == 0, report
    landed = asyncio.run(stream_count(server_url, stream))
    assert landed == len(bodies), f"{landed} of {len(bodies)} on the stream"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    binary = nats_server_binary()
    if binary is None:
        sys.exit("nats-server is not installed")
    n = args.events
    ratios: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(binary, Path(tmp) / "js")
        server.start()
        streams = iter(range(1_000_000))

        def bare_rate(bodies: list[str]) -> float:
            k = next(streams)
            asyncio.run(add_stream(server.url, f"BARE{k}", f"bare{k}.orders"))
            return n / asyncio.run(bare(server.url, f"bare{k}.orders", bodies))

        try:
            for r in range(args.rounds):
                for concurrency, batch in CONFIGS:
                    # The bare loop just before and just after: the machine is shared, so
                    # each ratio compares runs seconds apart.
                    bodies = events(n)
                    before = bare_rate(bodies)
                    stream = f"T{next(streams)}"
                    rate = n / target(server.url, stream, bodies, concurrency, batch)
                    after = bare_rate(events(n))
                    key = f"c{concurrency} b{batch}"
                    ceiling = (before + after) / 2
                    ratios.setdefault(key, []).append(rate / ceiling)
                    rates.setdefault(key, []).append(rate)
                    rates.setdefault("bare", []).extend([before, after])
                    print(
                        f"round {r + 1} {key}: target {rate:,.0f}/s, bare {before:,.0f} and "
                        f"{after:,.0f}/s, ratio {rate / ceiling:.2f}",
                        flush=True,
                    )
        finally:
            server.stop()
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{n:,} messages per run, {args.rounds} rounds, medians:")
    print(f"  bare nats-py, 64 in flight  {statistics.median(rates['bare']):9,.0f} msg/s")
    for key, values in ratios.items():
        print(
            f"  target {key:20} {statistics.median(rates[key]):9,.0f} msg/s  "
            f"ratio {statistics.median(values):.2f} (goal 0.70)"
        )


if __name__ == "__main__":
    main()
