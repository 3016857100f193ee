"""The API's PutEvents throughput and latency against its ceiling, ``eventpush publish`` of the
same events, in the same run.

- ceiling: ``eventpush.publish.publish`` (what ``eventpush publish`` runs) appending the same
  events in batches of 50,000 (parse, validate, COPY, commit), just before the API's run and
  just after (the mean is the ceiling);
- API: ``eventpush api --workers N`` on loopback, an admin key, one PutEvents of 10 entries
  (~300-byte details) signed once with botocore's SigV4 signer (valid 5 minutes), replayed by
  ``wrk`` on 64 connections (so the load generator is not Python); every request answered 200
  and every answered event stored are checked after.

Goal (issue 31): API events/s >= 0.5 x the publish rate, p99 <= 50 ms.

.venv/bin/python bench/api.py [--events 200000] [--seconds 20] [--connections 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx  # noqa: E402
import psycopg2  # noqa: E402
from api_support import ApiServer, make_key, signed_request  # noqa: E402
from common import machine, scratch_database, tree_cpu  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.publish import publish  # noqa: E402

ENTRIES = 10
LUA = """
local f = io.open("%(body)s", "rb")
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
%(headers)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%.3f %%.3f %%.3f\\n", summary.requests,
    e.status, e.connect + e.read + e.write + e.timeout, latency:percentile(50) / 1000,
    latency:percentile(99) / 1000, summary.duration / 1e6))
end
"""


def detail(i: int) -> dict:
    """About 300 bytes of JSON, like an order event."""
    return {
        "order": f"o-{i:08d}",
        "customer": f"c-{i % 977:05d}",
        "status": "paid",
        "total": round(i * 1.37 % 1000, 2),
        "currency": "EUR",
        "items": [{"sku": f"sku-{(i + k) % 5000:05d}", "qty": k + 1} for k in range(3)],
        "channel": "web",
        "coupon": None if i % 3 else f"SPRING-{i % 97:02d}",
        "region": "eu-central",
        "placed_at": "2026-11-25T21:00:00Z",
    }


def ceiling(url: str, events: int, bus: str) -> float:
    lines = [
        json.dumps({"source": "shop.orders", "detail-type": "OrderPlaced", "detail": detail(i)})
        for i in range(events)
    ]
    conn = psycopg2.connect(url)
    try:
        catalog.create_bus(conn, bus, 4)
        started = time.perf_counter()
        for i in range(0, len(lines), 50_000):
            publish(conn, bus, lines[i : i + 50_000])
        return events / (time.perf_counter() - started)
    finally:
        conn.close()


def stored(url: str, bus: str) -> int:
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM bus_event e JOIN event_bus b ON b.id = e.bus_id "
                "WHERE b.name = %s",
                (bus,),
            )
            return cur.fetchone()[0]
    finally:
        conn.close()


def checkpoints(url: str) -> int:
    """The server's checkpoints so far: each makes commits wait longer for the disk, and every
    DROP DATABASE (any test run on the machine) forces one."""
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter")
            return cur.fetchone()[0]
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    args = parser.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("wrk is not installed: apt-get install -y wrk (scripts/setup.sh does)")
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        from eventpush.sealed import KEY_FILE_ENV, write_key_file

        write_key_file(Path(tmp) / "secret.key")  # the access key's secret is sealed with it
        env = {
            **os.environ,
            "EVENTPUSH_DATABASE_URL": url,
            KEY_FILE_ENV: str(Path(tmp) / "secret.key"),
        }
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4)
        conn.close()
        before = ceiling(url, args.events, "ceiling_before")
        key = make_key(env, "bench", "admin")
        server = ApiServer(env, "--workers", str(args.workers))
        try:
            entries = [
                {
                    "Source": "shop.orders",
                    "DetailType": "OrderPlaced",
                    "Detail": json.dumps(detail(i)),
                    "EventBusName": "orders",
                }
                for i in range(ENTRIES)
            ]
            body = json.dumps({"Entries": entries}).encode()
            request = signed_request(server.url, "PutEvents", body, key)
            check = httpx.post(
                request.url, content=body, headers=dict(request.headers.items()), timeout=10
            )
            assert check.status_code == 200 and check.json()["FailedEntryCount"] == 0, check.text
            body_path = Path(tmp) / "body.json"
            body_path.write_bytes(body)
            headers = "\n".join(
                f'wrk.headers["{k}"] = "{v}"'
                for k, v in request.headers.items()
                if k.lower() not in ("host", "content-length")
            )
            script = Path(tmp) / "put_events.lua"
            script.write_text(LUA % {"body": body_path, "headers": headers})
            before_api = stored(url, "orders")
            cpu_before = tree_cpu(server.proc.pid)
            checkpoints_before = checkpoints(url)
            run = subprocess.run(
                [
                    wrk,
                    f"-t{args.threads}",
                    f"-c{args.connections}",
                    f"-d{args.seconds}s",
                    "--timeout",
                    "10s",
                    "-s",
                    str(script),
                    server.url + "/",
                ],
                capture_output=True,
                text=True,
                timeout=args.seconds + 120,
            )
            cpu = tree_cpu(server.proc.pid) - cpu_before
            checkpointed = checkpoints(url) - checkpoints_before
            metrics = httpx.get(server.url + "/metrics").text
        finally:
            server.stop()
        found = re.search(r"^RESULT (\d+) (\d+) (\d+) (\S+) (\S+) (\S+)$", run.stdout, re.M)
        if found is None:
            sys.exit(f"wrk gave no result:\n{run.stdout}\n{run.stderr}")
        requests, bad_status, socket_errors = (int(found[i]) for i in (1, 2, 3))
        p50, p99, seconds = (float(found[i]) for i in (4, 5, 6))
        events_stored = stored(url, "orders") - before_api
        after = ceiling(url, args.events, "ceiling_after")
    # The mean of a run just before the API's and one just after: a load change on a shared
    # machine then bends both sides of the ratio alike.
    rate_publish = (before + after) / 2
    rate_api = requests * ENTRIES / seconds
    commits = sum(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("eventpush_api_commits_total")
    )
    print(f"machine: {machine()}")
    print(
        f"ceiling: eventpush publish of {args.events:,} such events: {rate_publish:,.0f} events/s "
        f"(the mean of {before:,.0f} just before the API's run and {after:,.0f} just after)"
    )
    print(
        f"API: {args.connections} connections, PutEvents of {ENTRIES} entries, "
        f"{args.workers} server workers, {args.seconds} s (wrk -t{args.threads})"
    )
    print(f"  requests {requests:,}: {requests / seconds:,.0f}/s, {rate_api:,.0f} events/s")
    print(f"  non-200 answers {bad_status}, socket errors {socket_errors}")
    print(f"  events stored {events_stored:,} (answered: {requests * ENTRIES:,})")
    print(f"  latency p50 {p50:.1f} ms, p99 {p99:.1f} ms (goal <= 50)")
    print(f"  server CPU {cpu:.1f} s: {cpu / max(requests, 1) * 1e6:,.0f} µs per request")
    if commits:
        print(f"  group commits in the last worker scraped: {commits:,.0f}")
    print(f"  PostgreSQL checkpoints during the run: {checkpointed}")
    print(f"ratio API / publish: {rate_api / rate_publish:.2f} (goal >= 0.5)")
    if bad_status or events_stored < requests * ENTRIES:
        sys.exit("some requests failed or answered events are missing")


if __name__ == "__main__":
    main()
