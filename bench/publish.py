"""Publish throughput: events/s appended to a bus (parse, validate, COPY, commit).

.venv/bin/python bench/publish.py [--events 200000] [--batch 50000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.publish import publish  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000)
    args = parser.parse_args()
    lines = [
        json.dumps(
            {
                "source": "shop.orders",
                "detail-type": "OrderPlaced",
                "detail": {"order": i, "customer": f"c{i % 977}", "total": i * 1.5, "items": 3},
            }
        )
        for i in range(args.events)
    ]
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 8)
        started = time.perf_counter()
        for i in range(0, len(lines), args.batch):
            publish(conn, "orders", lines[i : i + args.batch])
        elapsed = time.perf_counter() - started
        conn.close()
    rate = args.events / elapsed
    print(f"machine: {machine()}")
    print(f"published {args.events:,} events in batches of {args.batch:,}: {elapsed:.2f} s")
    print(f"publish rate: {rate:,.0f} events/s (goal 50,000: {rate / 50_000:.2f}x)")


if __name__ == "__main__":
    main()
