"""The JetStream target beside a bare nats-py loop publishing the same messages with acks.

    .venv/bin/python bench/nats_target.py [--events N] [--rounds R] [--configs 64x1,8x8,1x64]
        [--old-tree PATH]

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
each target run is bracketed by two bare runs and its ratio taken against their mean. Beside
the rates, the CPU time of this process per message (the bare loop's, or the worker's: it runs
in this process; PostgreSQL's and nats-server's CPU are not counted) bends less with the load.
With ``--old-tree`` the target runs twice within each bracket, once with the code of that
checkout and once with this one (each in a child process, the order alternating by round).
With ``--engine-only`` the target answers at once without publishing (see
``install_engine_only``): the engine's own cost per message, the floor under any sink. With
``--sink-only`` the JetStream sink is driven by plain tasks (``sink_alone``), without the
engine: the sink's own cost beside the bare loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
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
        cpu = time.process_time()
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
        cpu = time.process_time() - cpu
    finally:
        await nc.close()
    assert len(acks) == len(bodies) and not any(a.duplicate for a in acks)
    return elapsed, cpu


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


ENGINE_ONLY = False


def install_engine_only() -> None:
    """Replace the JetStream sink with one that builds each message as the real one does and
    answers "delivered" after one turn of the loop: what is left is the engine's own cost
    (reading, matching, lanes, committing), the floor under any sink."""
    global ENGINE_ONLY
    from eventpush import sinks
    from eventpush.sinks.contract import DELIVERED, Outcome
    from eventpush.sinks.http import build_request
    from eventpush.sinks.nats import NatsSink

    class EngineOnlySink(NatsSink):
        async def send(self, target, records, transform) -> Outcome:
            for record in records:
                build_request(target, [record], transform)
            await asyncio.sleep(0)
            return Outcome(DELIVERED, None, None, 0.0)

    sinks.sink_kind = lambda scheme: EngineOnlySink
    ENGINE_ONLY = True


SINK_ONLY = False


async def sink_alone(
    server_url: str, subject: str, bodies: list[str], concurrency: int, batch: int
) -> tuple[float, float]:
    """Seconds (wall clock, CPU) for the JetStream sink alone: ``concurrency`` tasks, as the
    engine's senders, each sending ``batch`` records at a time until all are sent; no
    PostgreSQL, no lanes."""
    from eventpush import tracing
    from eventpush.addresses import address_policy
    from eventpush.sinks.contract import DELIVERED, Record, Target
    from eventpush.sinks.nats import NatsSink

    url = f"{server_url}/{subject}"
    spec = Target(1, "js", "orders", 1, "all", "{}", "js", url, batch_size=batch)
    records = [Record(0, i, json.loads(b)["id"], json.loads(b), b) for i, b in enumerate(bodies)]
    sink = NatsSink(address_policy())
    starts = iter(range(0, len(records), batch))

    async def sender() -> None:
        for i in starts:
            traceparent = tracing.unrecorded_traceparent(records[i].event)
            outcome = await sink.send(spec, records[i : i + batch], None, traceparent)
            assert outcome.kind == DELIVERED, outcome

    try:
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return time.perf_counter() - started, time.process_time() - cpu
    finally:
        await sink.close()


def target(
    server_url: str, stream: str, bodies: list[str], concurrency: int, batch: int
) -> tuple[float, float]:
    """Seconds (wall clock, and CPU of this process: the worker's) for one worker to push
    ``bodies`` from a PostgreSQL bus to a JetStream target."""
    subject = f"{stream.lower()}.orders"
    asyncio.run(add_stream(server_url, stream, subject))
    if SINK_ONLY:
        import uvloop  # as the worker runs

        elapsed, cpu = uvloop.run(sink_alone(server_url, subject, bodies, concurrency, batch))
        landed = asyncio.run(stream_count(server_url, stream))
        assert landed == len(bodies), f"{landed} of {len(bodies)} on the stream"
        return elapsed, cpu
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
        started, cpu = time.perf_counter(), time.process_time()
        report = run_worker("w1", until_idle=True, max_seconds=600)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert report.delivered == len(bodies) and report.failed == 0, report
    if ENGINE_ONLY:
        return elapsed, cpu
    landed = asyncio.run(stream_count(server_url, stream))
    assert landed == len(bodies), f"{landed} of {len(bodies)} on the stream"
    return elapsed, cpu


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``64x1,8x8``: (concurrency, batch size) pairs."""
    try:
        pairs = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"--configs {text!r}: want e.g. 64x1,8x8,1x64")
    return pairs


def target_in(include: Path, server_url: str, stream: str, n: int, concurrency: int, batch: int):
    """``target`` run by a child process importing eventpush from ``include`` (another tree)."""
    env = {**os.environ, "PYTHONPATH": str(include)}
    args = [sys.executable, __file__, "--one-target", server_url, stream]
    args += [str(n), str(concurrency), str(batch)]
    args += (["--engine-only"] if ENGINE_ONLY else []) + (["--sink-only"] if SINK_ONLY else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the target run under {include} failed:\n{done.stderr[-2000:]}")
    elapsed, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--configs",
        type=parse_configs,
        default=CONFIGS,
        help="concurrency x batch size pairs, e.g. 64x1,8x8,1x64 (the default)",
    )
    parser.add_argument(
        "--old-tree",
        type=Path,
        help="a checkout of older code: its target runs beside this tree's, same brackets",
    )
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="targets answer at once without NATS: the engine's own cost per message",
    )
    parser.add_argument(
        "--sink-only",
        action="store_true",
        help="the JetStream sink driven by plain tasks: no PostgreSQL, no engine",
    )
    parser.add_argument("--one-target", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_only and args.sink_only:
        parser.error("--engine-only and --sink-only exclude each other")
    if args.engine_only:
        install_engine_only()
    if args.sink_only:
        global SINK_ONLY
        SINK_ONLY = True
    if args.one_target:  # a child of --old-tree: one target run, its seconds on stdout
        url, stream, n, concurrency, batch = args.one_target
        print(json.dumps(target(url, stream, events(int(n)), int(concurrency), int(batch))))
        return
    binary = nats_server_binary()
    if binary is None:
        sys.exit("nats-server is not installed")
    trees: list[tuple[str, Path | None]] = [("", None)]
    if args.old_tree is not None:
        here = Path(catalog.__file__).resolve().parents[1]
        trees = [("old", (args.old_tree / "include").resolve()), ("new", here)]
    n = args.events
    ratios: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}  # CPU microseconds per message of the worker's process
    loads: list[float] = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(binary, Path(tmp) / "js")
        server.start()
        streams = iter(range(1_000_000))

        def bare_run(bodies: list[str]) -> float:
            k = next(streams)
            asyncio.run(add_stream(server.url, f"BARE{k}", f"bare{k}.orders"))
            elapsed, cpu = asyncio.run(bare(server.url, f"bare{k}.orders", bodies))
            cpus.setdefault("bare", []).append(cpu / n * 1e6)
            return n / elapsed

        try:
            for r in range(args.rounds):
                for concurrency, batch in args.configs:
                    # The bare loop just before and just after: the machine is shared, so
                    # each ratio compares runs seconds apart (old and new trees alternate
                    # which goes first).
                    bodies = events(n)
                    before = bare_run(bodies)
                    runs = []
                    for label, include in trees if r % 2 == 0 else trees[::-1]:
                        stream = f"T{next(streams)}"
                        if include is None:
                            elapsed, cpu = target(server.url, stream, bodies, concurrency, batch)
                        else:
                            elapsed, cpu = target_in(
                                include, server.url, stream, n, concurrency, batch
                            )
                        runs.append((label, n / elapsed, cpu / n * 1e6))
                    after = bare_run(events(n))
                    ceiling = (before + after) / 2
                    rates.setdefault("bare", []).extend([before, after])
                    loads.append(os.getloadavg()[0])
                    for label, rate, cpu_us in sorted(runs):
                        key = f"c{concurrency} b{batch} {label}".strip()
                        ratios.setdefault(key, []).append(rate / ceiling)
                        rates.setdefault(key, []).append(rate)
                        cpus.setdefault(key, []).append(cpu_us)
                        print(
                            f"round {r + 1} {key}: target {rate:,.0f}/s ({cpu_us:.0f} us "
                            f"CPU/msg), bare {before:,.0f} and {after:,.0f}/s, ratio "
                            f"{rate / ceiling:.2f}, load {loads[-1]:.1f}",
                            flush=True,
                        )
        finally:
            server.stop()
    print(f"machine: {machine()}, load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{n:,} messages per run, {args.rounds} rounds, medians:")
    print(
        f"  bare nats-py, 64 in flight  {statistics.median(rates['bare']):9,.0f} msg/s  "
        f"{statistics.median(cpus['bare']):4.0f} us CPU/msg"
    )
    for key in sorted(ratios, key=lambda k: (-int(k.split()[0][1:]), k)):
        print(
            f"  target {key:20} {statistics.median(rates[key]):9,.0f} msg/s  "
            f"{statistics.median(cpus[key]):4.0f} us CPU/msg  "
            f"ratio {statistics.median(ratios[key]):.2f} (goal 0.70)"
        )


if __name__ == "__main__":
    main()
