"""Push from a NATS JetStream bus against push from a PostgreSQL bus, in one run; and the two
ways of reading a JetStream queue the NATS source could use.

    .venv/bin/python bench/nats_bus.py [all|push|read] [--events N] [--rounds R]

``push``: the same events (4 queues), one rule, four targets on the loopback receiver (its own
process), one worker until idle (in-process, as bench/push.py's drain); PostgreSQL and NATS
buses alternate, ``--rounds`` times each, each in a fresh database; the ratio is of the
medians (goal: NATS within 10% of PostgreSQL). ``read``: one queue of a stream read three
ways: eventpush.sources.nats.Puller (what the NATS source uses), nats-py's
``PullSubscription.fetch``, and message gets of the next message by subject, one request
each. A nats-server of the bench's own runs on a free loopback port with a store in a
temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402
from nats_support import NatsServer, nats_server_binary  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.demo.receiver import ReceiverProcess  # noqa: E402
from eventpush.publish import publish  # noqa: E402
from eventpush.push import run_worker  # noqa: E402

TARGETS = ["/ok/a", "/ok/b", "/ok/c", "/ok/d"]


def events(n: int) -> list[str]:
    return [
        json.dumps(
            {
                "source": "shop.orders",
                "detail-type": "OrderPlaced",
                "detail": {"order": i, "customer": f"c{i % 977}", "total": i * 1.5},
            }
        )
        for i in range(n)
    ]


def drain(rx_url: str, n: int, source: str | None) -> tuple[float, int]:
    """Seconds for one worker to push n events to four targets, and its deliveries."""
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4, source=source)
        catalog.create_rule(conn, "orders", "all", {"source": ["shop.orders"]})
        for i, path in enumerate(TARGETS):
            catalog.create_target(
                conn,
                "orders",
                "all",
                catalog.TargetSpec(name=f"t{i}", url=rx_url + path, concurrency=8),
            )
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        lines = events(n)
        for i in range(0, n, 50_000):
            publish(conn, "orders", lines[i : i + 50_000])
        started = time.perf_counter()
        report = run_worker("w1", until_idle=True, max_seconds=600)
        elapsed = time.perf_counter() - started
        conn.close()
    return elapsed, report.delivered


def bench_push(server: NatsServer, n: int, rounds: int) -> None:
    times: dict[str, list[float]] = {"postgres": [], "nats": []}
    with ReceiverProcess() as rx:
        for r in range(rounds):
            for label, source in (("postgres", None), ("nats", server.url)):
                if label == "nats":
                    _drop_stream(server.url, "orders")
                elapsed, delivered = drain(rx.url, n, source)
                assert delivered == 4 * n, (label, delivered)
                times[label].append(elapsed)
                print(
                    f"  round {r + 1} {label:8}: {delivered:,} deliveries in {elapsed:.2f} s "
                    f"= {delivered / elapsed:,.0f}/s",
                    flush=True,
                )
    pg, nats_ = statistics.median(times["postgres"]), statistics.median(times["nats"])
    print(
        f"push, {n:,} events x 4 targets, 8 in flight each, one worker: PostgreSQL bus "
        f"{4 * n / pg:,.0f}/s, NATS bus {4 * n / nats_:,.0f}/s (medians of {rounds}); "
        f"NATS/PostgreSQL throughput {pg / nats_:.2f} (goal >= 0.90)"
    )


def _drop_stream(url: str, name: str) -> None:
    import nats
    from nats.js.errors import NotFoundError

    async def go() -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().delete_stream(name)
        except NotFoundError:
            pass
        finally:
            await nc.close()

    asyncio.run(go())


def bench_read(server: NatsServer, n: int) -> None:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from eventpush.sources import Bus
    from eventpush.sources.nats import Puller

    async def go() -> tuple[float, float, float]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="readbench", subjects=["readbench.*"])
        body = events(1)[0].encode()
        for i in range(0, 2 * n, 1000):
            await asyncio.gather(
                *(js.publish(f"readbench.{(i + k) % 2}", body) for k in range(1000))
            )
        started = time.perf_counter()
        sub = await js.pull_subscribe(
            "readbench.0",
            stream="readbench",
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=1,
                ack_policy=AckPolicy.NONE,
                mem_storage=True,
            ),
        )
        got = 0
        while got < n:
            got += len(await sub.fetch(512, timeout=1))
        fetched = time.perf_counter() - started
        started = time.perf_counter()
        puller = await Puller(nc, Bus(0, "readbench", 2, server.url), 0).open(1)
        got = 0
        while got < n:
            got += len(await puller.fetch(512))
        pulled = time.perf_counter() - started
        await puller.close()
        started = time.perf_counter()
        seq, got = 1, 0
        while got < min(n, 5000):
            msg = await js.get_msg("readbench", seq=seq, subject="readbench.0", next=True)
            seq, got = msg.seq + 1, got + 1
        direct = (time.perf_counter() - started) * n / got
        await js.delete_stream("readbench")
        await nc.close()
        return fetched, pulled, direct

    fetched, pulled, direct = asyncio.run(go())
    print(
        f"reading one queue of {n:,} events (of a 2-queue stream), no acks: "
        f"eventpush's Puller (no-wait pull requests of 512 on a subscription) "
        f"{n / pulled:,.0f} events/s; nats-py PullSubscription.fetch(512) {n / fetched:,.0f}/s; "
        f"next-by-subject message gets, one request each, {n / direct:,.0f}/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", nargs="?", default="all", choices=["all", "push", "read"])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    binary = nats_server_binary()
    if binary is None:
        sys.exit("nats-server is not installed (scripts/setup.sh installs Debian's)")
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(binary, Path(tmp) / "jetstream")
        server.start()
        try:
            if args.what in ("all", "read"):
                bench_read(server, args.events)
            if args.what in ("all", "push"):
                bench_push(server, args.events, args.rounds)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
