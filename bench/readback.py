"""The read-back of ``audit --verify-sinks`` beside a bare nats-py read of the same messages.

    EVENTPUSH_ALLOW_CIDRS=127.0.0.1/32 .venv/bin/python bench/readback.py [--records N] [--rounds R]

One nats-server of the bench's own (``-js``, a temporary store, a free loopback port). N
messages (event bodies of about 200 bytes) are published once to ``sink.orders`` of a stream
capturing ``sink.>``, each with the ``Nats-Msg-Id`` a runner gives its record (4 queues), and
100 of them deleted from the middle. Each round, in this process:

- **read-back**: ``eventpush.sinks.readback.check_url`` for the target URL with the books'
  N delivered records: what one Spark partition of the verifying audit does for one URL
  (the expected keys built, the stream read through ``NatsSink.read_back``: an ephemeral
  pull consumer filtered to the subject, headers only, 10,000 per pull request; each key
  struck off; the 100 not found classified). Its answer is checked: 100 absent;
- **bare**: the ceiling: nats-py alone reads the same messages the same way (a consumer
  filtered to the subject, headers only, a pull request per 10,000 answered on an inbox
  callback) on a connection already open, and does nothing with them. The read-back's own
  costs beside it: connecting through the address policy, the stream's info, the expected
  keys built and each one struck off.

The ratio is bare / read-back from the same round (1.0: the read-back costs what reading
costs). Results are seconds per 100,000 records; the Spark job around the read-back (the
books' read, the shuffle by URL) is not in them.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nats  # noqa: E402
from common import machine  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig  # noqa: E402
from nats_support import NatsServer, nats_server_binary  # noqa: E402

from eventpush.addresses import address_policy  # noqa: E402
from eventpush.sinks import readback  # noqa: E402
from eventpush.sinks.contract import record_key  # noqa: E402

QUEUES = 4
RUNNER = 7
DELETED = 100
SUBJECT = "sink.orders"


def body(i: int) -> bytes:
    return json.dumps(
        {
            "id": f"ev-{i}",
            "source": "shop",
            "detail-type": "order",
            "time": "2026-11-25T22:00:00Z",
            "detail": {"n": i, "amount": i % 1000, "region": "eu"},
        }
    ).encode()


def position(i: int) -> tuple[int, int]:
    return i % QUEUES, i // QUEUES


async def fill(url: str, n: int) -> list[tuple[int, int]]:
    """Publish n messages with their record keys; delete DELETED from the middle; returns
    the deleted positions."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(publish_async_max_pending=4000)
        await js.add_stream(name="SINK", subjects=["sink.>"])
        futures = []
        for i in range(n):
            key = record_key(RUNNER, *position(i))
            futures.append(await js.publish_async(SUBJECT, body(i), headers={"Nats-Msg-Id": key}))
            if len(futures) >= 4000:
                await asyncio.gather(*futures)
                futures = []
        await asyncio.gather(*futures)
        step = n // (DELETED + 1)
        deleted = []
        for k in range(1, DELETED + 1):
            seq = k * step  # stream sequence seq holds message seq - 1
            await js.delete_msg("SINK", seq)
            deleted.append(position(seq - 1))
        return sorted(deleted)
    finally:
        await nc.close()


async def bare(url: str, n: int) -> float:
    """Seconds for nats-py alone to read the subject's messages, headers only, the way the
    read-back reads them (one pull request per 10,000, a callback per message) but doing
    nothing with them: the consumer made on an open connection, no key looked at."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        started = time.perf_counter()
        config = ConsumerConfig(
            filter_subject=SUBJECT,
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            mem_storage=True,
            inactive_threshold=120,
        )
        pull = await js.pull_subscribe(SUBJECT, stream="SINK", config=config)
        info = await pull.consumer_info()
        left = info.num_pending
        seen = [0, 0, None]  # received, due, the batch's future

        async def arrived(msg) -> None:
            seen[0] += 1
            if seen[0] >= seen[1]:
                seen[2].set_result(None)

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=arrived)
        while left > 0:
            want = min(left, 10_000)
            seen[1], seen[2] = seen[0] + want, asyncio.get_running_loop().create_future()
            request = json.dumps({"batch": want, "expires": 30_000_000_000}).encode()
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.SINK.{info.name}", request, reply=inbox)
            async with asyncio.timeout(60):
                await seen[2]
            left -= want
        elapsed = time.perf_counter() - started
        await sub.unsubscribe()
        await pull.unsubscribe()
        assert seen[0] == n - DELETED, seen
        return elapsed
    finally:
        await nc.close()


def read_back(url: str, n: int, deleted: list[tuple[int, int]]) -> float:
    now = time.time()
    delivered = [(RUNNER, *position(i), now - 60, now) for i in range(n)]
    started = time.perf_counter()
    rows = list(readback.check_url(f"{url}/{SUBJECT}", delivered, address_policy()))
    elapsed = time.perf_counter() - started
    absent = sorted((q, o) for _, q, o, state, _, _ in rows if state == readback.ABSENT)
    assert absent == deleted, (len(absent), rows[:3])
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    binary = nats_server_binary()
    if binary is None:
        sys.exit("nats-server is not installed")
    n = args.records
    per = 100_000 / n
    loads = [os.getloadavg()[0]]
    results: dict[str, list[float]] = {"read-back": [], "bare": [], "ratio": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(binary, Path(tmp) / "js")
        server.start()
        try:
            deleted = asyncio.run(fill(server.url, n))
            for r in range(args.rounds):
                first_bare = r % 2 == 0  # alternate the order
                b1 = asyncio.run(bare(server.url, n)) if first_bare else None
                rb = read_back(server.url, n, deleted)
                b = b1 if b1 is not None else asyncio.run(bare(server.url, n))
                results["read-back"].append(rb * per)
                results["bare"].append(b * per)
                results["ratio"].append(b / rb)
                loads.append(os.getloadavg()[0])
                print(
                    f"round {r + 1}: read-back {rb * per:.2f} s / 100k, bare {b * per:.2f} s "
                    f"/ 100k, ratio {b / rb:.2f}",
                    flush=True,
                )
        finally:
            server.stop()
    print(
        json.dumps(
            {
                "records": n,
                "rounds": args.rounds,
                "read_back_s_per_100k": round(statistics.median(results["read-back"]), 3),
                "bare_s_per_100k": round(statistics.median(results["bare"]), 3),
                "ratio_median": round(statistics.median(results["ratio"]), 3),
                "all": {k: [round(v, 3) for v in vs] for k, vs in results.items()},
                "load_1min": [round(x, 1) for x in loads],
                "machine": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
