"""The API's PutEvents throughput and latency against its ceiling, ``eventpush publish`` of the
same events, in the same run.

- ceiling: ``eventpush.publish.publish`` (what ``eventpush publish`` runs) appending the same
  events in batches of 50,000 (parse, validate, COPY, commit), before, between and after the
  API's runs (each run's ceiling is the mean of the publish runs on either side of it);
- API: ``eventpush api --workers N`` on loopback, an admin key, one PutEvents of 10 entries
  (~300-byte details) signed with botocore's SigV4 signer (valid 5 minutes: signed again for
  each run), replayed by ``wrk`` on 64 connections (so the load generator is not Python);
  every request answered 200 and every answered event stored are checked after each run.
- ``--rounds`` runs (3 by default), each with its ratio and p99, then their medians and how
  many runs held both goals: one run on a shared two-core machine says little.
- the goal's other reading, right after each run: the same requests offered at half the rate of
  the publish run before it (wrk paced by a schedule per thread, ``PACING``), with its p99 and
  whether the server answered at the offered rate: "at half the publish rate, p99 <= 50 ms"
  rather than "as fast as it goes, at least half the publish rate, and p99 <= 50 ms".
- CPU per event: the server's processes, their PostgreSQL backends, and publish's (its process
  and its backend), so the next reader sees where the API pays more than publish.

Goal (issue 31): API events/s >= 0.5 x the publish rate, p99 <= 50 ms.

.venv/bin/python bench/api.py [--events 200000] [--seconds 20] [--rounds 3] [--connections 64]
    [--workers 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx  # noqa: E402
import psutil  # noqa: E402
import psycopg2  # noqa: E402
from api_support import ApiServer, make_key, signed_request, sockets_by_worker  # noqa: E402
from common import (  # noqa: E402
    ADMIN_URL,
    compose_postgres_settings,
    machine,
    private_postgres,
    scratch_database,
    tree_cpu,
)

from eventpush import catalog  # noqa: E402
from eventpush.publish import publish  # noqa: E402

ENTRIES = 10
GOAL_RATIO = 0.5  # of the publish rate
GOAL_P99_MS = 50.0
KEPT_UP = 0.98  # a paced run answered at least this share of what it offered
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

# The second reading of the goal: the requests offered at a fixed rate (each wrk thread its
# share, on a schedule of its own) rather than as fast as the server answers. wrk's LuaJIT
# reads the monotonic clock through its FFI; a request whose slot has passed goes at once, so
# the offered rate holds while connections are free. Latency is wrk's own, from each
# request's send (a request held back by a busy connection is not counted from its slot).
PACING = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } eventpush_timespec;
int clock_gettime(int clock, eventpush_timespec *ts);
]]
local clock = ffi.new("eventpush_timespec[1]")
local function now_ms()
  ffi.C.clock_gettime(1, clock)
  return tonumber(clock[0].tv_sec) * 1000 + tonumber(clock[0].tv_nsec) / 1e6
end
local period, next_slot = %(period_ms).6f, nil
delay = function()
  local now = now_ms()
  next_slot = next_slot or now
  local slot = next_slot
  next_slot = next_slot + period
  return slot > now and slot - now or 0
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


def put_events_body(bus: str = "orders") -> bytes:
    """The benchmark's request: one PutEvents of ``ENTRIES`` entries for ``bus``."""
    entries = [
        {
            "Source": "shop.orders",
            "DetailType": "OrderPlaced",
            "Detail": json.dumps(detail(i)),
            "EventBusName": bus,
        }
        for i in range(ENTRIES)
    ]
    return json.dumps({"Entries": entries}).encode()


def backend_cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far of each PostgreSQL backend of ``pids`` still there."""
    spent = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        spent[pid] = times.user + times.system
    return spent


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def ceiling(url: str, events: int, bus: str) -> tuple[float, float]:
    """Events/s of ``publish`` and its CPU µs an event (this process and its backend)."""
    lines = [
        json.dumps({"source": "shop.orders", "detail-type": "OrderPlaced", "detail": detail(i)})
        for i in range(events)
    ]
    conn = psycopg2.connect(url)
    try:
        catalog.create_bus(conn, bus, 4)
        with conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            backend = [cur.fetchone()[0]]
        conn.commit()
        cpu = time.process_time() + sum(backend_cpu(backend).values())
        started = time.perf_counter()
        for i in range(0, len(lines), 50_000):
            publish(conn, bus, lines[i : i + 50_000])
        elapsed = time.perf_counter() - started
        cpu = time.process_time() + sum(backend_cpu(backend).values()) - cpu
        return events / elapsed, cpu / events * 1e6
    finally:
        conn.close()


def api_backends(url: str) -> list[int]:
    """The API server's PostgreSQL backends (its group commits and its catalog pool)."""
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            return [pid for (pid,) in cur.fetchall()]
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


@dataclass
class Round:
    """One wrk run against the server, between two ceiling runs."""

    requests: int
    seconds: float
    p50: float
    p99: float
    bad_status: int
    socket_errors: int
    stored: int
    server_cpu: float
    db_cpu: float
    wrk_cpu: float
    busy: float  # of the machine's cores, the share busy during the run
    checkpoints: int
    ceiling: float = 0.0  # the mean of the publish runs just before and just after
    offered: float | None = None  # requests/s offered (paced), None: as fast as answered
    spread: list[int] = field(default_factory=list)  # wrk's connections held by each worker

    @property
    def events_per_s(self) -> float:
        return self.requests * ENTRIES / self.seconds

    @property
    def ratio(self) -> float:
        return self.events_per_s / self.ceiling

    @property
    def lost(self) -> bool:
        return bool(self.bad_status) or self.stored < self.requests * ENTRIES


def put_events_script(
    tmp: Path,
    server_url: str,
    body: bytes,
    key: tuple[str, str],
    paced: tuple[float, int] | None = None,
) -> Path:
    """wrk's script replaying one PutEvents signed now, checked once first (200, no failed
    entry); ``paced``: (requests/s, threads) to offer instead of as many as are answered."""
    request = signed_request(server_url, "PutEvents", body, key)
    check = httpx.post(request.url, content=body, headers=dict(request.headers.items()), timeout=10)
    assert check.status_code == 200 and check.json()["FailedEntryCount"] == 0, check.text
    body_path = tmp / "body.json"
    body_path.write_bytes(body)
    headers = "\n".join(
        f'wrk.headers["{k}"] = "{v}"'
        for k, v in request.headers.items()
        if k.lower() not in ("host", "content-length")
    )
    script = tmp / "put_events.lua"
    text = LUA % {"body": body_path, "headers": headers}
    if paced is not None:
        rate, threads = paced
        text += PACING % {"period_ms": threads * 1000 / rate}
    script.write_text(text)
    return script


def connections_by_process(pid: int, port: int) -> list[int]:
    """How many of wrk's connections each server worker under ``pid`` holds, most first: the
    busier worker sets the tail, so the split is printed with each run."""
    return sorted(sockets_by_worker(pid, port, psutil.CONN_ESTABLISHED).values(), reverse=True)


def wrk_round(wrk: str, args, script: Path, server: ApiServer, url: str) -> Round:
    before_api = stored(url, "orders")
    db_cpu_before = backend_cpu(api_backends(url))
    cpu_before = tree_cpu(server.proc.pid)
    wrk_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, all_before = machine_cpu()
    checkpoints_before = checkpoints(url)
    wrk_proc = subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(min(2.0, args.seconds / 2))
    spread = connections_by_process(server.proc.pid, server.port)
    stdout, stderr = wrk_proc.communicate(timeout=args.seconds + 120)
    cpu = tree_cpu(server.proc.pid) - cpu_before
    busy_after, all_after = machine_cpu()
    busy, everything = busy_after - busy_before, all_after - all_before
    wrk_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk is the child that ended
    wrk_cpu = sum(getattr(wrk_after, f) - getattr(wrk_before, f) for f in ("ru_utime", "ru_stime"))
    # A backend opened during the run (a group commit's connection, made on first use)
    # counts from zero.
    db_cpu = sum(
        spent - db_cpu_before.get(pid, 0.0) for pid, spent in backend_cpu(api_backends(url)).items()
    )
    checkpointed = checkpoints(url) - checkpoints_before
    found = re.search(r"^RESULT (\d+) (\d+) (\d+) (\S+) (\S+) (\S+)$", stdout, re.M)
    if found is None:
        sys.exit(f"wrk gave no result:\n{stdout}\n{stderr}")
    time.sleep(1)  # requests in flight when wrk stopped are answered (and stored) by now
    return Round(
        requests=int(found[1]),
        bad_status=int(found[2]),
        socket_errors=int(found[3]),
        p50=float(found[4]),
        p99=float(found[5]),
        seconds=float(found[6]),
        stored=stored(url, "orders") - before_api,
        server_cpu=cpu,
        db_cpu=db_cpu,
        wrk_cpu=wrk_cpu,
        busy=busy / everything,
        checkpoints=checkpointed,
        spread=spread,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--rounds", type=int, default=3, help="API runs, a ceiling run between")
    parser.add_argument(
        "--postgres",
        choices=("machine", "compose"),
        default="machine",
        help="the machine's PostgreSQL (EVENTPUSH_ADMIN_URL), or a private cluster of its "
        "release started with docker-compose.yaml's settings for its postgres service",
    )
    args = parser.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("wrk is not installed: apt-get install -y wrk (scripts/setup.sh does)")
    settings = compose_postgres_settings() if args.postgres == "compose" else []
    postgres = (
        private_postgres(settings)
        if args.postgres == "compose"
        else contextlib.nullcontext(ADMIN_URL)
    )
    with (
        postgres as admin_url,
        scratch_database(admin_url=admin_url) as url,
        tempfile.TemporaryDirectory() as tmp,
    ):
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
        rate, cpu = ceiling(url, args.events, "ceiling_0")
        ceilings, publish_cpu = [rate], [cpu]
        key = make_key(env, "bench", "admin")
        server = ApiServer(env, "--workers", str(args.workers))
        rounds: list[Round] = []
        paced: list[Round] = []
        try:
            body = put_events_body()
            for n in range(args.rounds):
                # Signed afresh for each run: a signature is good for five minutes.
                script = put_events_script(Path(tmp), server.url, body, key)
                rounds.append(wrk_round(wrk, args, script, server, url))
                # The other reading of the goal: half the publish rate offered, its p99.
                offered = GOAL_RATIO * ceilings[-1] / ENTRIES
                script = put_events_script(
                    Path(tmp), server.url, body, key, paced=(offered, args.threads)
                )
                paced.append(wrk_round(wrk, args, script, server, url))
                paced[-1].offered = offered
                # The ceiling between API runs, with the server idle: each API run is judged
                # against the mean of the publish runs just before and just after it, so a
                # load change on a shared machine bends both sides of its ratio alike.
                rate, cpu = ceiling(url, args.events, f"ceiling_{n + 1}")
                ceilings.append(rate)
                publish_cpu.append(cpu)
            metrics = httpx.get(server.url + "/metrics").text
        finally:
            server.stop()
    for n, (one, other) in enumerate(zip(rounds, paced, strict=True)):
        one.ceiling = other.ceiling = (ceilings[n] + ceilings[n + 1]) / 2
    scraped = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("eventpush_api_")
    }
    commits = scraped.get("eventpush_api_commits_total", 0.0)
    print(f"machine: {machine()}")
    where = "the machine's" if args.postgres == "machine" else "a private cluster with"
    print(f"PostgreSQL: {where} settings {' '.join(settings) or '(as configured)'}")
    print(
        f"API: {args.connections} connections, PutEvents of {ENTRIES} entries, "
        f"{args.workers} server workers, {args.rounds} runs of {args.seconds} s (wrk "
        f"-t{args.threads}); ceiling: eventpush publish of {args.events:,} such events before, "
        "between and after them"
    )
    for n, one in enumerate(rounds, 1):
        answered = max(one.requests * ENTRIES, 1)
        print(
            f"run {n}: {one.requests / one.seconds:,.0f} requests/s = {one.events_per_s:,.0f} "
            f"events/s against publish {one.ceiling:,.0f} (mean of {ceilings[n - 1]:,.0f} "
            f"and {ceilings[n]:,.0f}): ratio {one.ratio:.2f} (goal >= {GOAL_RATIO}); p50 "
            f"{one.p50:.1f} ms, p99 {one.p99:.1f} ms (goal <= {GOAL_P99_MS:.0f})"
        )
        print(
            f"  non-200 answers {one.bad_status}, socket errors {one.socket_errors}; events "
            f"stored {one.stored:,} (answered: {one.requests * ENTRIES:,}); checkpoints "
            f"{one.checkpoints}; wrk's connections by server worker "
            f"{'/'.join(map(str, one.spread)) or '?'}"
        )
        print(
            f"  CPU per event: server {one.server_cpu / answered * 1e6:.1f} µs "
            f"({one.server_cpu / max(one.requests, 1) * 1e6:,.0f} a request), its PostgreSQL "
            f"backends {one.db_cpu / answered * 1e6:.1f} µs, wrk "
            f"{one.wrk_cpu / answered * 1e6:.1f} µs; publish (process and backend) "
            f"{statistics.mean(publish_cpu):.1f} µs; the machine's cores "
            f"{one.busy:.0%} busy"
        )
    for n, one in enumerate(paced, 1):
        achieved = one.requests / one.seconds
        print(
            f"paced {n} (right after run {n}): {one.offered:,.0f} requests/s offered (half the "
            f"publish run before it), {achieved:,.0f} answered ({achieved / one.offered:.0%}), "
            f"ratio {one.ratio:.2f} to the mean ceiling; p50 {one.p50:.1f} ms, p99 "
            f"{one.p99:.1f} ms (goal <= {GOAL_P99_MS:.0f}); the machine's cores "
            f"{one.busy:.0%} busy; non-200 {one.bad_status}, socket errors {one.socket_errors}; "
            f"connections by worker {'/'.join(map(str, one.spread)) or '?'}"
        )
    if commits:
        print(
            f"group commits in the last worker scraped: {commits:,.0f}, "
            f"{scraped['eventpush_api_events_stored_total'] / commits:,.0f} events and "
            f"{scraped['eventpush_api_commit_seconds_total'] / commits * 1e3:.1f} ms a commit, "
            f"{scraped.get('eventpush_api_wakeups_total', commits):,.0f} wake-ups of the workers"
        )
    both = sum(1 for one in rounds if one.ratio >= GOAL_RATIO and one.p99 <= GOAL_P99_MS)
    print(
        f"median of {len(rounds)} runs: ratio {statistics.median(r.ratio for r in rounds):.2f}, "
        f"p99 {statistics.median(r.p99 for r in rounds):.1f} ms; both goals held in {both} of "
        f"{len(rounds)}"
    )
    kept_up = [one for one in paced if one.requests / one.seconds >= KEPT_UP * one.offered]
    held = sum(1 for one in kept_up if one.p99 <= GOAL_P99_MS)
    print(
        f"paced at half the publish rate: answered at the offered rate in {len(kept_up)} of "
        f"{len(paced)}, p99 {statistics.median(r.p99 for r in paced):.1f} ms (median); "
        f"both held in {held} of {len(paced)}"
    )
    if any(one.lost for one in (*rounds, *paced)):
        sys.exit("some requests failed or answered events are missing")


if __name__ == "__main__":
    main()
