"""Replay benchmark: re-pushes per second of failed records, Spark local mode.

    .venv/bin/python bench/replay.py [--records 5000] [--rate-limit R]

A scratch database with one runner whose target is the loopback receiver's ``/ok`` (in a
process of its own), ``--records`` events each with an open failure row. One ``failed``
replay re-pushes them all from the executors (the engine's delivery code, 16 requests in
flight per partition); the figure is records delivered over the wall time of the whole
replay (selection, GX checks, pushes, bookkeeping).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.catalog import TargetSpec  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed(url: str, target_url: str, records: int) -> None:
    conn = psycopg2.connect(url)
    bus_id = catalog.create_bus(conn, "bench", 4)
    catalog.create_rule(conn, "bench", "all", {"source": ["app"]})
    catalog.create_target(conn, "bench", "all", TargetSpec(name="t", url=target_url))
    with conn.cursor() as cur:
        cur.execute(
            'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, '
            "detail_type, event_time, size_bytes, body) SELECT %(bus)s, i %% 4, i / 4, 'm' || i, "
            "'app', 'created', now(), 120, json_build_object('source', 'app', 'detail-type', "
            "'created', 'id', 'm' || i, 'detail', json_build_object('n', i)) "
            "FROM generate_series(0, %(n)s - 1) i",
            {"bus": bus_id, "n": records},
        )
        cur.execute(
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, last_error) '
            "SELECT r.id, r.name, 'bench', e.queue_id, e.\"offset\", e.message_id, 5, 503, "
            "'HTTP 503' FROM event_target_runner r, bus_event e"
        )
    conn.commit()
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--rate-limit", type=float)
    args = parser.parse_args()

    from eventpush.sparkjobs.replay import ReplayRequest, run_replay
    from eventpush.sparkjobs.session import get_spark

    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-m", "eventpush.demo.receiver", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ok", data=b"{}", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        spark = get_spark("local[*]", app_name="bench-replay")
        print(f"machine: {machine()}; Spark local[*]; receiver in its own process")
        with scratch_database("eventpush_bench_replay") as url:
            seed(url, f"http://127.0.0.1:{port}/ok", 200)
            run_replay(spark, url, ReplayRequest(what="failed"))  # warm-up
        with scratch_database("eventpush_bench_replay") as url:
            seed(url, f"http://127.0.0.1:{port}/ok", args.records)
            started = time.perf_counter()
            result = run_replay(
                spark, url, ReplayRequest(what="failed", rate_limit=args.rate_limit)
            )
            elapsed = time.perf_counter() - started
        print(
            f"{result.delivered:,} of {result.selected:,} re-pushed in {elapsed:.1f} s: "
            f"{result.delivered / elapsed:,.0f} re-pushes/s end to end"
            + (f" (rate limit {args.rate_limit}/s)" if args.rate_limit else "")
        )
    finally:
        receiver.terminate()
        receiver.wait(10)


if __name__ == "__main__":
    main()
