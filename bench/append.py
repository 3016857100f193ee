"""The database's CPU an event of the API's append (``postgres.publish_anywhere``, what each
group commit runs), in isolation: one connection on a scratch database appends groups of
``--group`` events (the bench's ~300-byte order events) ``--commits`` times, and the CPU its
backend spent is read from ``/proc`` (psutil) before and after; the calling process's own CPU
(``time.process_time``) beside it.

Each round measures the schema as migrated and then (``--with-fk``) the same with the foreign
key from ``bus_event`` to ``event_bus`` that migration 0012 dropped put back, so over the
rounds the two alternate on the same host minutes apart.

    flock /tmp/eventpush-bench.lock .venv/bin/python bench/append.py [--group 200]
        [--commits 300] [--rounds 3] [--with-fk]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from api import backend_cpu, detail  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.catalog.buses import bus_row  # noqa: E402
from eventpush.db import connect_on_loop, execute_on_loop  # noqa: E402
from eventpush.publish import complete_event, encode_event  # noqa: E402
from eventpush.sources import Bus, postgres  # noqa: E402

WARM_UP = 20  # commits before the measured ones: the statement prepared, caches filled
FK = "bus_event_bus_id_fkey"


async def cpu_per_event(url: str, bus: Bus, group: int, commits: int) -> tuple[float, float, float]:
    """(backend CPU µs, this process's CPU µs, wall µs) an event over ``commits`` appends of
    ``group`` events."""
    conn = await connect_on_loop(url)
    try:
        ((pid,),) = await execute_on_loop(conn, "SELECT pg_backend_pid()")
        events = []
        for i in range(group):
            event, event_time, _ = complete_event(
                {"source": "shop.orders", "detail-type": "OrderPlaced", "detail": detail(i)},
                i,
                "2026-11-27T00:00:00Z",
                None,
            )
            events.append(encode_event(event, event_time, 0, i))
        for _ in range(WARM_UP):
            await postgres.publish_anywhere(conn, bus, events)
        before, started = backend_cpu([pid])[pid], time.perf_counter()
        own = time.process_time()
        for _ in range(commits):
            await postgres.publish_anywhere(conn, bus, events)
        own = time.process_time() - own
        cpu, wall = backend_cpu([pid])[pid] - before, time.perf_counter() - started
    finally:
        await conn.close()
    n = commits * group
    return cpu / n * 1e6, own / n * 1e6, wall / n * 1e6


def set_fk(url: str, present: bool) -> None:
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f"ALTER TABLE bus_event DROP CONSTRAINT IF EXISTS {FK}")
            if present:
                cur.execute(
                    f"ALTER TABLE bus_event ADD CONSTRAINT {FK} FOREIGN KEY (bus_id) "
                    "REFERENCES event_bus (id) ON DELETE CASCADE"
                )
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, default=200, help="events a commit")
    parser.add_argument("--commits", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--with-fk", action="store_true", help="also with the dropped key back")
    args = parser.parse_args()
    variants = ["as migrated", "with the foreign key"] if args.with_fk else ["as migrated"]
    figures: dict[str, list[float]] = {v: [] for v in variants}
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4)
        with conn.cursor() as cur:
            bus_id, _ = bus_row(cur, "orders")
        conn.close()
        bus = Bus(bus_id, "orders", 4, None)
        print(f"machine: {machine()}")
        print(f"append of {args.group} events a commit, {args.commits} commits a measure")
        for n in range(1, args.rounds + 1):
            for variant in variants:
                set_fk(url, variant == "with the foreign key")
                cpu, own, wall = asyncio.run(cpu_per_event(url, bus, args.group, args.commits))
                figures[variant].append(cpu)
                print(
                    f"round {n}, {variant}: backend {cpu:.1f} µs an event, this process "
                    f"{own:.1f} µs (the statement's parameters, psycopg, the round trip), wall "
                    f"{wall:.1f} µs"
                )
    for variant, values in figures.items():
        print(f"median, {variant}: backend {statistics.median(values):.1f} µs an event")


if __name__ == "__main__":
    main()
