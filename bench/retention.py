"""Books that stay small (issue 35): bytes per event and per delivery before and after a
roll-up, the time to drop a day's partition, and publish and push speed paired with and
without time partitions.

    flock /tmp/eventpush-bench.lock .venv/bin/python bench/retention.py sizes [--events 100000]
    flock /tmp/eventpush-bench.lock .venv/bin/python bench/retention.py drop [--events 10000000]
    flock /tmp/eventpush-bench.lock .venv/bin/python bench/retention.py paired [--events 20000]
    flock /tmp/eventpush-bench.lock .venv/bin/python bench/retention.py lapse [--events N] [--today]

``sizes``: a PostgreSQL bus, two rules with one target each, events with a 200-byte detail;
the delivery rows written as the engine writes them (one per event and runner, by SQL: the
push itself is measured by ``paired``); then every runner's window rolled up
(eventpush.rollups, what ``audit --roll-up`` does once the audit found it clean).
``drop``: one day partition of N events (made by SQL on the server), dropped by
``eventpush.partitions.maintain``; a row DELETE of a tenth of them for comparison.
``paired``: rounds alternating a database at the head revision (day partitions) and one
migrated back to 0007 (one plain table per bus, one delivery table): publish N events into
each, then push them with one worker to a loopback receiver; medians and their ratio.
``lapse``: N events of three missed days (``--today``: and today's, its partition missing
too) in a bus's default partition, made by one maintenance run while a reader reads the
bus by offset and a writer publishes, each every 10 ms: the run's time and their waits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog, rollups  # noqa: E402
from eventpush.partitions import DAY, compact, day_start, maintain  # noqa: E402
from eventpush.publish import publish  # noqa: E402

DETAIL = "x" * 200


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def events(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps(
            {"source": "shop.orders", "detail-type": "OrderPlaced", "detail": {"o": i, "d": DETAIL}}
        )
        for i in range(start, start + n)
    ]


def tree_size(cur, table: str) -> int:
    """The table's bytes with its indexes and TOAST, over all its partitions."""
    cur.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", (table,))
    if cur.fetchone()[0] != "p":
        cur.execute("SELECT pg_total_relation_size(%s::regclass)", (table,))
        return int(cur.fetchone()[0])
    cur.execute(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree(%s)",
        (table,),
    )
    return int(cur.fetchone()[0])


def topology(conn, url: str, targets: int = 2) -> None:
    catalog.create_bus(conn, "orders", 4)
    for i in range(targets):
        catalog.create_rule(conn, "orders", f"r{i}", {"source": ["shop.orders"]})
        catalog.create_target(
            conn, "orders", f"r{i}", catalog.TargetSpec(name=f"t{i}", url=f"{url}/ok/{i}")
        )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


DELIVERIES_SQL = """
INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "offset",
                                 message_id, attempts, http_status, latency_ms)
SELECT r.id, r.name, 'orders', e.queue_id, e."offset", e.message_id, 1, 200, 3.5
FROM bus_event e CROSS JOIN event_target_runner r
"""


def bench_sizes(n: int) -> None:
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, "http://127.0.0.1:9")
        since = datetime.now(UTC) - timedelta(minutes=1)
        for i in range(0, n, 50_000):
            publish(conn, "orders", events(min(50_000, n - i), i))
        until = datetime.now(UTC)
        with conn, conn.cursor() as cur:
            cur.execute(DELIVERIES_SQL)
            deliveries = cur.rowcount
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("VACUUM ANALYZE")
            ev = tree_size(cur, "bus_event")
            dv = tree_size(cur, "event_push_delivery")
        conn.autocommit = False
        print(f"machine: {machine()}; {load()}")
        print(
            f"{n:,} events (200-byte detail), {deliveries:,} deliveries (2 runners): "
            f"bus_event {ev / n:.0f} B/event, event_push_delivery {dv / deliveries:.0f} "
            "B/delivery"
        )
        with conn, conn.cursor() as cur:
            cur.execute(
                'SELECT r.id, e.queue_id, array_agg(e."offset") FROM bus_event e '
                "CROSS JOIN event_target_runner r GROUP BY r.id, e.queue_id"
            )
            per: dict[int, dict[int, list[int]]] = {}
            for rid, q, offs in cur.fetchall():
                per.setdefault(rid, {})[q] = offs
        windows = [rollups.RunnerWindow(rid, n, n, 0, 0, offsets) for rid, offsets in per.items()]
        started = time.perf_counter()
        replaced = rollups.roll_up(conn, since, until, windows)
        took = time.perf_counter() - started
        print(
            f"roll-up of {sum(replaced.values()):,} delivery rows into {len(replaced)} rows: "
            f"{took:.2f} s; {load()}"
        )
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("VACUUM event_push_delivery")
            vacuumed = tree_size(cur, "event_push_delivery") + tree_size(
                cur, "event_delivery_rollup"
            )
        conn.autocommit = False
        print(
            f"  after a plain VACUUM: {vacuumed / deliveries:.1f} B/delivery (the heap's "
            "empty end is cut, the indexes keep their pages)"
        )
        started = time.perf_counter()
        compacted = compact(conn, day_start(datetime.now(UTC)) + DAY)  # as maintain tomorrow
        compact_s = time.perf_counter() - started
        with conn, conn.cursor() as cur:
            after_compact = tree_size(cur, "event_push_delivery")
            roll = tree_size(cur, "event_delivery_rollup")
        print(
            f"  after maintenance's compaction of past days ({', '.join(compacted)}: VACUUM, "
            f"REINDEX CONCURRENTLY; {compact_s:.2f} s): delivery log + roll-ups "
            f"{(after_compact + roll) / deliveries:.2f} B/delivery"
        )
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("VACUUM FULL event_push_delivery")
            cur.execute("VACUUM FULL event_delivery_rollup")
            after_full = tree_size(cur, "event_push_delivery")
            roll_full = tree_size(cur, "event_delivery_rollup")
        print(
            "  for reference, after VACUUM FULL: "
            f"{(after_full + roll_full) / deliveries:.2f} B/delivery "
            f"(delivery log {after_full:,} B, roll-ups {roll_full:,} B: the empty "
            "partitions' and indexes' own pages)"
        )
        conn.close()


EVENTS_SQL = """
INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, detail_type,
                       event_time, ctime, size_bytes, body)
SELECT %(bus)s, g %% 4, g / 4, 'id-' || g, 'shop.orders', 'OrderPlaced', %(at)s,
       %(at)s + (g %% 80000) * interval '1 second', 300,
       json_build_object('source', 'shop.orders', 'detail-type', 'OrderPlaced',
                         'detail', json_build_object('o', g, 'd', %(detail)s))
FROM generate_series(%(lo)s, %(hi)s - 1) AS g
"""


def bench_drop(n: int) -> None:
    today = day_start(datetime.now(UTC))
    yesterday = today - DAY
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4, retention="1d")
        maintain(conn, now=yesterday)  # yesterday's partition, as it was made then
        with conn, conn.cursor() as cur:
            cur.execute("SELECT id FROM event_bus WHERE name = 'orders'")
            bus = cur.fetchone()[0]
        started = time.perf_counter()
        step = 1_000_000
        for lo in range(0, n, step):
            with conn, conn.cursor() as cur:
                cur.execute(
                    EVENTS_SQL,
                    {
                        "bus": bus,
                        "at": yesterday,
                        "detail": DETAIL,
                        "lo": lo,
                        "hi": min(n, lo + step),
                    },
                )
        filled = time.perf_counter() - started
        part = f"bus_event_{bus}_p{yesterday:%Y%m%d}"
        with conn, conn.cursor() as cur:
            cur.execute(f'SELECT count(*), pg_total_relation_size(\'"{part}"\') FROM "{part}"')
            count, size = cur.fetchone()
        print(f"machine: {machine()}")
        print(
            f"{count:,} events in {part} ({size / 2**30:.2f} GiB) made in {filled:.0f} s; {load()}"
        )
        tenth = max(1, count // 10)
        started = time.perf_counter()
        with conn, conn.cursor() as cur:
            cur.execute(f'DELETE FROM "{part}" WHERE "offset" < %s', (tenth // 4,))
            deleted = cur.rowcount
            conn.rollback()  # measured, not kept
        delete_s = time.perf_counter() - started
        started = time.perf_counter()
        report = maintain(conn, now=today + DAY)  # past a day's retention of yesterday
        drop_s = time.perf_counter() - started
        assert part in report.dropped, report.dropped
        print(
            f"maintain dropped {part} ({count:,} events): {drop_s:.3f} s, the whole run "
            f"({len(report.dropped)} dropped, {len(report.created)} made); {load()}"
        )
        print(
            f"  for comparison a row DELETE of {deleted:,} of them (rolled back): "
            f"{delete_s:.1f} s, and it would leave that much vacuum debt"
        )
        conn.close()


def bench_lapse(n: int, days: int = 3, today_too: bool = False) -> None:
    """A lapse: ``n`` events of ``days`` past days (``today_too``: and of today, whose
    partition is missing too) wait in the bus's default partition; one maintenance run makes
    those days while a reader reads the bus as a worker does (a window by offset, every 10
    ms) and a writer publishes one event every 10 ms: how long the run takes and how long
    each of them waited."""
    import threading

    today = day_start(datetime.now(UTC))
    missed = [today - (days + 1 - k) * DAY for k in range(days)]
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4, retention="30d")  # days from today on
        with conn, conn.cursor() as cur:
            cur.execute("SELECT id FROM event_bus WHERE name = 'orders'")
            bus = cur.fetchone()[0]
            if today_too:  # its rows land in the default partition, as after a long lapse
                part = f"bus_event_{bus}_p{today:%Y%m%d}"
                cur.execute(f'ALTER TABLE "bus_event_{bus}" DETACH PARTITION "{part}"')
                cur.execute(f'DROP TABLE "{part}"')
                missed.append(today)
                days += 1
        started = time.perf_counter()
        per_day = n // days
        for k, day in enumerate(missed):
            for lo in range(k * per_day, (k + 1) * per_day, 1_000_000):
                with conn, conn.cursor() as cur:
                    cur.execute(
                        EVENTS_SQL,
                        {
                            "bus": bus,
                            "at": day,
                            "detail": DETAIL,
                            "lo": lo,
                            "hi": min((k + 1) * per_day, lo + 1_000_000),
                        },
                    )
        with conn, conn.cursor() as cur:
            cur.execute(f"SELECT pg_total_relation_size('bus_event_{bus}_default')")
            size = cur.fetchone()[0]
            cur.execute("CHECKPOINT")
        print(f"machine: {machine()}")
        print(
            f"{days * per_day:,} events of {days} missed days in bus_event_{bus}_default "
            f"({size / 2**30:.2f} GiB), made in {time.perf_counter() - started:.0f} s; {load()}"
        )
        waits: list[float] = []
        writes: list[float] = []
        done = threading.Event()

        def write() -> None:
            writer = psycopg2.connect(url)
            writer.autocommit = True
            with writer.cursor() as cur:
                offset = n
                while not done.is_set():
                    began = time.perf_counter()
                    cur.execute(
                        'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, '
                        "detail_type, event_time, size_bytes, body) VALUES (%s, 3, %s, %s, "
                        "'shop.orders', 'OrderPlaced', now(), 2, '{}')",
                        (bus, offset, f"w-{offset}"),
                    )
                    writes.append(time.perf_counter() - began)
                    offset += 1
                    time.sleep(0.01)
            writer.close()

        def read() -> None:
            reader = psycopg2.connect(url)
            reader.autocommit = True
            with reader.cursor() as cur:
                cur.execute("SET statement_timeout = '300s'")
                at = 0
                while not done.is_set():
                    began = time.perf_counter()
                    cur.execute(
                        'SELECT "offset" FROM bus_event WHERE bus_id = %s AND queue_id = 0 '
                        'AND "offset" >= %s AND "offset" < %s ORDER BY "offset"',
                        (bus, at, at + 100),
                    )
                    cur.fetchall()
                    waits.append(time.perf_counter() - began)
                    at = (at + 100) % max(1, per_day // 4)
                    time.sleep(0.01)
            reader.close()

        threads = [threading.Thread(target=read), threading.Thread(target=write)]
        for thread in threads:
            thread.start()
        time.sleep(1)
        started = time.perf_counter()
        report = maintain(conn, now=datetime.now(UTC))
        run_s = time.perf_counter() - started
        time.sleep(1)
        done.set()
        for thread in threads:
            thread.join()
        assert sorted(report.moved) == [f"bus_event_{bus}_p{day:%Y%m%d}" for day in missed], report
        print(
            f"maintain made the {days} days ({sum(report.moved.values()):,} rows moved) in "
            f"{run_s:.1f} s; {load()}"
        )
        for who, times in (("reader", waits), ("writer", writes)):
            slow = [w for w in times if w > 0.05]
            print(
                f"  the {who}: {len(times):,} statements, the longest {max(times):.2f} s, "
                f"{len(slow)} over 50 ms ({sum(slow):.1f} s in all)"
            )
        conn.close()


def _unpartitioned(url: str) -> None:
    """The database migrated back to 0007: one plain table per bus, one delivery table."""
    from alembic import command

    from eventpush.schema import _alembic_config

    command.downgrade(_alembic_config(url), "0007_verify_sinks")


def bench_paired(n: int, rounds: int) -> None:
    from eventpush.demo.receiver import ReceiverProcess
    from eventpush.push import run_worker

    publish_rates: dict[str, list[float]] = {"partitioned": [], "plain": []}
    push_rates: dict[str, list[float]] = {"partitioned": [], "plain": []}
    with (
        ReceiverProcess() as rx,
        scratch_database("eventpush_bench_part") as part_url,
        scratch_database("eventpush_bench_plain") as plain_url,
    ):
        urls = {"partitioned": part_url, "plain": plain_url}
        conns = {}
        for kind, url in urls.items():
            conns[kind] = psycopg2.connect(url)
            topology(conns[kind], rx.url)
        conns["plain"].close()
        _unpartitioned(plain_url)
        conns["plain"] = psycopg2.connect(plain_url)
        print(f"machine: {machine()}; {load()}")
        for r in range(rounds):
            order = ["partitioned", "plain"] if r % 2 == 0 else ["plain", "partitioned"]
            batch = events(n, r * n)
            for kind in order:
                started = time.perf_counter()
                for i in range(0, n, 10_000):
                    publish(conns[kind], "orders", batch[i : i + 10_000])
                publish_rates[kind].append(n / (time.perf_counter() - started))
            for kind in order:
                os.environ["EVENTPUSH_DATABASE_URL"] = urls[kind]
                started = time.perf_counter()
                report = run_worker("w1", until_idle=True, max_seconds=600, url=urls[kind])
                push_rates[kind].append(report.delivered / (time.perf_counter() - started))
            print(
                f"  round {r + 1}: publish {publish_rates['partitioned'][-1]:,.0f} vs "
                f"{publish_rates['plain'][-1]:,.0f} events/s, push "
                f"{push_rates['partitioned'][-1]:,.0f} vs {push_rates['plain'][-1]:,.0f} "
                f"deliveries/s (partitioned vs plain); {load()}"
            )
        for conn in conns.values():
            conn.close()
    for name, rates in (("publish", publish_rates), ("push", push_rates)):
        a, b = statistics.median(rates["partitioned"]), statistics.median(rates["plain"])
        print(
            f"{name}: median {a:,.0f}/s partitioned, {b:,.0f}/s plain: ratio {a / b:.2f} "
            f"({rounds} rounds of {n:,} events, 2 targets)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("sizes", "drop", "paired", "lapse"))
    parser.add_argument("--events", type=int)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--today", action="store_true", help="lapse: today's partition missing")
    args = parser.parse_args()
    if args.what == "sizes":
        bench_sizes(args.events or 100_000)
    elif args.what == "drop":
        bench_drop(args.events or 10_000_000)
    elif args.what == "lapse":
        bench_lapse(args.events or 3_000_000, today_too=args.today)
    else:
        bench_paired(args.events or 20_000, args.rounds)


if __name__ == "__main__":
    main()
