"""Push engine benchmarks: throughput beside wrk, batching, latency, isolation, memory.

    .venv/bin/python bench/push.py [all|throughput|batch|latency|isolation|memory]
    .venv/bin/python bench/push.py [drain|metrics]   # no wrk; metrics: /metrics scraped or not
    .venv/bin/python bench/push.py clients   # bare client loops, aiohttp vs the engine's
    .venv/bin/python bench/push.py stalls    # the throughput drain with a loop-lag probe
    .venv/bin/python bench/push.py quarters [--placement aligned|mixed|both] [--workers N]
                                              # issue 34

The receiver (``python -m eventpush.demo.receiver``) runs in a process of its own on loopback;
wrk hits the same receiver in the same run with the request the engine sends (the stored
event as body, the engine's headers and the client's ``accept``), so the ratio compares like
with like; wrk's figure for a minimal request (the ceiling of earlier reports) is printed too.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import psycopg2  # noqa: E402
from common import ADMIN_URL, machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.demo.receiver import ReceiverProcess  # noqa: E402
from eventpush.publish import publish  # noqa: E402
from eventpush.push import run_worker  # noqa: E402

PYTHON = sys.executable
EXE = str(Path(sys.executable).with_name("eventpush"))
PYCACHE = Path(__file__).resolve().parents[1] / "var" / "bench" / "pycache"
# What a standalone worker imports, compiled into PYCACHE before a timed run.
WORKER_IMPORTS = (
    "import eventpush.cli, eventpush.push.engine, eventpush.push.lanes, eventpush.rules.patterns, "
    "eventpush.rules.index, eventpush.sinks.http, eventpush.sources.postgres, uvloop"
)


def events(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps(
            {
                "source": "shop.orders",
                "detail-type": "OrderPlaced",
                "detail": {"order": i, "customer": f"c{i % 977}", "total": i * 1.5},
            }
        )
        for i in range(start, start + n)
    ]


def topology(conn, url: str, paths: list[str], queues: int = 4, **spec) -> None:
    catalog.create_bus(conn, "orders", queues)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop.orders"]})
    for i, path in enumerate(paths):
        catalog.create_target(
            conn, "orders", "all", catalog.TargetSpec(name=f"t{i}", url=url + path, **spec)
        )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def wrk_rate(
    url: str, seconds: int = 5, connections: int = 64, request: tuple[bytes, dict] | None = None
) -> float:
    """wrk's requests/s against ``url``: POSTs of ``request`` (body, headers), by default a
    small JSON event with only a content type."""
    if shutil.which("wrk") is None:
        raise SystemExit("bench/push.py: wrk is not installed (Debian: apt-get install wrk)")
    body, headers = request or (
        b'{"source":"shop.orders","detail":{"order":1}}',
        {"content-type": "application/json"},
    )
    lua = 'wrk.method = "POST"\n' + f"wrk.body = {_lua(body.decode())}\n"
    lua += "".join(f"wrk.headers[{_lua(k)}] = {_lua(v)}\n" for k, v in headers.items())
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "post.lua")
        script.write_text(lua)
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def _lua(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lua string literal for these texts


def engine_request(conn) -> tuple[bytes, dict[str, str]]:
    """The request the engine sends for the bus's first events to its first target (one
    event, or a batch of the target's size), with the header the client adds (``accept``)
    and a traceparent: what wrk sends too, so wrk's receiver parses what the engine's does."""
    from eventpush.push import store
    from eventpush.sinks import contract, http
    from eventpush.tracing import unrecorded_traceparent

    with conn.cursor() as cur:
        target = store.load_targets(cur)[0]
        cur.execute(
            'SELECT queue_id, "offset", message_id, body::text FROM bus_event '
            'ORDER BY queue_id, "offset" LIMIT %s',
            (target.batch_size,),
        )
        records = [contract.Record(q, o, m, json.loads(raw), raw) for q, o, m, raw in cur]
    body, headers = http.build_request(target, records, None)
    return body, {**headers, "accept": "*/*", "traceparent": unrecorded_traceparent({})}


def _task_stats(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """Per thread of process ``pid``: name, CPU s, s spent ready to run but waiting for a core
    (the kernel's run-queue wait, a wake-up's latency included), and how often it went to
    sleep (voluntary switches)."""
    out = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            run, wait, _ = map(int, (task / "schedstat").read_text().split())
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue
        sleeps = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
        out[int(task.name)] = (name, run / 1e9, wait / 1e9, sleeps)
    return out


def _thread_group(tid: int, name: str, loop_tid: int) -> str:
    """The part of the worker a thread is: the event loop (and libcurl's I/O on it), or the
    rest (the database calls' threads). The client of before (pyreqwest) had threads of its
    own, counted apart as "http client" when the old tree is measured."""
    if tid == loop_tid:
        return "loop"
    return "http client" if name.startswith(("pyreqwest", "tokio")) else "other"


class CpuWatch:
    """CPU seconds spent meanwhile by this process's threads (grouped: the event loop, the
    HTTP client's tokio threads, the rest), the receiver and the database's backends, sampled
    a few times a second so threads and backends that end before the stop still count. The
    watcher's own thread is left out (``own`` says what it spent)."""

    def __init__(self, rx_pid: int, database_url: str) -> None:
        import threading

        self.me = psutil.Process()
        self.rx = psutil.Process(rx_pid)
        self.dbname = database_url.rsplit("/", 1)[1]
        self.loop_tid = threading.get_native_id()
        self.threads: dict[int, tuple[str, float]] = {}
        self.backends: dict[int, float] = {}
        self.waits: dict[tuple[int, int], float] = {}  # (pid, tid) -> s runnable, not running
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.admin = psycopg2.connect(ADMIN_URL)
        self.admin.autocommit = True
        self.own = 0.0

    def _sample(self) -> None:
        worker = _task_stats(self.me.pid)
        for tid, (name, cpu, _, _) in worker.items():
            group = self.threads.get(tid, (None, 0.0))[0] or _thread_group(tid, name, self.loop_tid)
            self.threads[tid] = (group, cpu)
        with self.admin.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (self.dbname,))
            pids = [row[0] for row in cur.fetchall()]
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            self.backends[pid] = times.user + times.system
        times = self.rx.cpu_times()
        self.rx_cpu = times.user + times.system
        for pid, tasks in ((self.me.pid, worker), (self.rx.pid, _task_stats(self.rx.pid))):
            for tid, (_, _, waited, _) in tasks.items():
                self.waits[pid, tid] = waited

    def _run(self) -> None:
        import threading

        self.watcher_tid = threading.get_native_id()
        while not self.done.wait(0.2):
            self._sample()
        self.own = time.thread_time()

    def __enter__(self) -> CpuWatch:
        self._sample()
        self.start_threads = {tid: cpu for tid, (_, cpu) in self.threads.items()}
        self.start_backends = dict(self.backends)
        self.start_rx = self.rx_cpu
        self.start_waits = dict(self.waits)
        self.started = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self._sample()
        self.admin.close()
        self.seconds = time.perf_counter() - self.started

    def waited(self) -> dict[str, float]:
        """Seconds the worker's and the receiver's threads were ready to run but had no core
        (the kernel's run-queue wait): contention, where idle cores mean hand-over gaps."""
        parts = {"worker": 0.0, "receiver": 0.0}
        for (pid, tid), waited in self.waits.items():
            if tid != getattr(self, "watcher_tid", None):
                part = "worker" if pid == self.me.pid else "receiver"
                parts[part] += waited - self.start_waits.get((pid, tid), 0.0)
        return parts

    def per(self, n: int) -> dict[str, float]:
        """CPU microseconds per unit (n units) by part."""
        parts: dict[str, float] = {}
        for tid, (group, cpu) in self.threads.items():
            if tid != self.watcher_tid:
                parts[group] = parts.get(group, 0.0) + cpu - self.start_threads.get(tid, 0.0)
        parts["receiver"] = self.rx_cpu - self.start_rx
        parts["postgres"] = sum(
            cpu - self.start_backends.get(pid, 0.0) for pid, cpu in self.backends.items()
        )
        return {k: v / n * 1e6 for k, v in parts.items()}


def _drain(n: int, **spec) -> tuple[float, float, int, tuple[float, float]]:
    """Publish n events for four targets and push them all with one worker; returns the
    receiver's wrk ceiling (wrk sending the engine's own request, the mean of a run just
    before and one just after, so a load change on a shared machine hits both sides of the
    ratio alike), seconds, deliveries, and
    CPU microseconds per delivery of the event loop thread and of the whole worker process
    (HTTP client and database threads included): figures a loaded machine bends far less."""
    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, rx.url, ["/ok/a", "/ok/b", "/ok/c", "/ok/d"], **spec)
        for i in range(0, n, 50_000):
            publish(conn, "orders", events(min(50_000, n - i), i))
        request = engine_request(conn)
        before = wrk_rate(rx.url + "/ok/wrk", request=request)
        started, loop_cpu, cpu = time.perf_counter(), time.thread_time(), time.process_time()
        with CpuWatch(rx.proc.pid, url) as watch:
            report = run_worker("w1", until_idle=True, max_seconds=600)
        elapsed = time.perf_counter() - started
        loop_cpu, cpu = time.thread_time() - loop_cpu, time.process_time() - cpu - watch.own
        after = wrk_rate(rx.url + "/ok/wrk", request=request)
        small = wrk_rate(rx.url + "/ok/wrk")
    print(
        f"  wrk with the engine's request ({len(request[0])} B body, {len(request[1])} headers): "
        f"{before:,.0f} and {after:,.0f} req/s; with a minimal one (46 B, 1 header) {small:,.0f}"
    )
    parts = watch.per(report.delivered)
    print(
        "  CPU us per delivery by part: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    )
    busy = sum(parts.values()) * report.delivered / 1e6 / watch.seconds
    waited = watch.waited()
    print(
        f"  cores busy {busy:.2f} of {psutil.cpu_count()}; ready but waiting for a core: "
        f"worker threads {waited['worker']:.2f} s, receiver {waited['receiver']:.2f} s "
        f"(of {watch.seconds:.2f} s)"
    )
    per = 1e6 / report.delivered
    return (before + after) / 2, elapsed, report.delivered, (loop_cpu * per, cpu * per)


def bench_throughput(n: int = 20_000) -> None:
    """Default target settings (16 in flight per target)."""
    ceiling, elapsed, delivered, (loop_us, all_us) = _drain(n)
    rate = delivered / elapsed
    print(
        f"throughput, 1 event/request, 4 targets: {delivered:,} deliveries in "
        f"{elapsed:.1f} s = {rate:,.0f}/s; wrk on the same receiver {ceiling:,.0f} req/s; "
        f"ratio {rate / ceiling:.2f} (goal 0.80); CPU per delivery: loop thread "
        f"{loop_us:.0f} us, process {all_us:.0f} us"
    )


def bench_batch(n: int = 200_000) -> None:
    ceiling, elapsed, delivered, (loop_us, all_us) = _drain(n, batch_size=100)
    rate = delivered / elapsed
    print(
        f"throughput, batches of 100, 4 targets: {delivered:,} event deliveries in "
        f"{elapsed:.1f} s = {rate:,.0f} events/s (goal 50,000: {rate / 50_000:.2f}x); "
        f"requests/s {rate / 100:,.0f} vs wrk {ceiling:,.0f}; CPU per delivery: loop thread "
        f"{loop_us:.1f} us, process {all_us:.1f} us"
    )


def _burn(us: float) -> None:
    """Hold the loop (and the GIL) for ``us`` microseconds, as the engine's own work does."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


# The bare client loops' request (bench/push.py clients, client_ab.py, native_ab.py).
CLIENT_BODY = json.dumps({"source": "shop.orders", "detail": {"order": 1}}).encode()
CLIENT_HEADERS = {"content-type": "application/json", "webhook-id": "msg_x"}


async def _timed_posts(
    post: Callable[[], Awaitable[object]], n: int, in_flight: int, work_us: float = 0.0
) -> tuple[float, float, float]:
    """``post()`` n times, in_flight at a time, each after ``work_us`` of Python on the loop
    (the engine's share of a delivery, ~20 us): requests/s, and CPU us per request of the loop
    thread and of the whole process (any client threads included)."""
    import asyncio

    async def one(k: int) -> None:
        for _ in range(k):
            if work_us:
                _burn(work_us)
            await post()

    started, cpu, all_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    await asyncio.gather(*(one(n // in_flight) for _ in range(in_flight)))
    elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu
    all_cpu = time.process_time() - all_cpu
    return n / elapsed, cpu / n * 1e6, all_cpu / n * 1e6


async def _client_loop(
    kind: str, url: str, n: int, in_flight: int, work_us: float = 0.0, client: object = None
) -> tuple[float, float, float]:
    """n POSTs, in_flight at a time, by a bare client loop (:func:`_timed_posts`).
    ``client``: the module whose ``attempt`` sends (this tree's ``eventpush.sinks.http`` by
    default; bench/client_ab.py passes another tree's)."""
    import aiohttp

    from eventpush.sinks import contract
    from eventpush.sinks import http as this_tree

    http = client or this_tree
    body, headers = CLIENT_BODY, CLIENT_HEADERS
    target = contract.Target(1, "b/r/t", "b", 1, "r", "{}", "t", url)
    if kind == "aiohttp":
        session = aiohttp.ClientSession()

        async def post() -> None:
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
    else:  # the engine's own attempt, pinned, with the body cap
        session = http.new_session()

        async def post() -> None:
            await http.attempt(session, target, body, headers)

    try:
        return await _timed_posts(post, n, in_flight, work_us)
    finally:
        await session.close()


def bench_clients(n: int = 40_000, in_flight: int = 64, rounds: int = 2) -> None:
    """The delivery client chosen by measurement: aiohttp against http.attempt as bare
    loops on uvloop, beside wrk, alternated; each alone and with 20 us of Python work on the
    loop per request, standing in for the engine (a client whose I/O runs on a thread of
    its own pays for a busy loop at every answer). Compare trees with PYTHONPATH."""
    import uvloop

    with ReceiverProcess() as rx:
        for r in range(rounds):
            ceiling = wrk_rate(rx.url + "/ok/wrk")
            for work_us in (0.0, 20.0):
                for kind in ("aiohttp", "http.attempt"):
                    rate, cpu_us, all_us = uvloop.run(
                        _client_loop(kind, rx.url + "/ok/c", n, in_flight, work_us)
                    )
                    print(
                        f"clients round {r + 1}, {kind}, {work_us:.0f} us of loop work a "
                        f"request: {rate:,.0f} req/s = {rate / ceiling:.2f} of wrk "
                        f"{ceiling:,.0f}; CPU/request: loop thread {cpu_us:.1f} us, "
                        f"process {all_us:.1f} us"
                    )
                    sys.stdout.flush()


def bench_latency(rate: int = 1000, seconds: int = 20) -> None:
    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, rx.url, ["/latency"])
        worker = subprocess.Popen([EXE, "worker", "run", "w1", "--max-seconds", str(seconds + 8)])
        time.sleep(3)  # the worker is up and waiting
        tick = 0.05
        per_tick = int(rate * tick)
        started = time.perf_counter()
        sent = 0
        while time.perf_counter() - started < seconds:
            batch = [
                json.dumps(
                    {
                        "source": "shop.orders",
                        "detail-type": "o",
                        "detail": {"n": sent + i, "sent": time.time()},
                    }
                )
                for i in range(per_tick)
            ]
            publish(conn, "orders", batch)
            sent += per_tick
            time.sleep(max(0.0, started + (sent / rate) - time.perf_counter()))
        time.sleep(3)
        stats = rx.stats()
        worker.terminate()
        worker.wait(30)
    print(
        f"latency at {rate:,} events/s for {seconds} s ({stats['latencies']:,} events): "
        f"p50 {stats['p50_ms']:.1f} ms, p99 {stats['p99_ms']:.1f} ms (publish commit to arrival)"
    )


def _time_until(rx: ReceiverProcess, paths: list[str], n: int, started: float) -> float:
    while True:
        counts = rx.stats()["count"]
        if all(counts.get(p, 0) >= n for p in paths):
            return time.perf_counter() - started
        time.sleep(0.05)


def bench_isolation(n: int = 5_000) -> None:
    healthy = ["/slow/a?ms=20", "/slow/b?ms=20", "/slow/c?ms=20"]
    keys = ["/slow/a", "/slow/b", "/slow/c"]
    results = {}
    for label, fourth in (("all healthy", "/slow/d?ms=20"), ("one hanging", "/hang/d")):
        with ReceiverProcess() as rx, scratch_database() as url:
            conn = psycopg2.connect(url)
            topology(conn, rx.url, [*healthy, fourth], concurrency=32, timeout_ms=2000)
            publish(conn, "orders", events(n))
            worker = subprocess.Popen([EXE, "worker", "run", "w1", "--max-seconds", "120"])
            started = time.perf_counter()
            elapsed = _time_until(rx, keys, n, started)
            results[label] = 3 * n / elapsed
            worker.terminate()
            worker.wait(30)
    ratio = results["one hanging"] / results["all healthy"]
    print(
        f"isolation: 3 healthy targets {results['all healthy']:,.0f} deliveries/s with the 4th "
        f"healthy, {results['one hanging']:,.0f}/s with the 4th hanging: {ratio:.2f} (goal 0.90)"
    )


def bench_memory(n: int = 1_000_000, seconds: int = 30) -> None:
    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, rx.url, ["/hang"], timeout_ms=30_000)
        for i in range(0, n, 50_000):
            publish(conn, "orders", events(50_000, i))
        worker = subprocess.Popen([EXE, "worker", "run", "w1", "--max-seconds", str(seconds)])
        proc = psutil.Process(worker.pid)
        peak = 0
        while worker.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
    print(
        f"memory: {n:,} events waiting, stalled target, {seconds} s: peak RSS "
        f"{peak / 2**20:.0f} MiB (ceiling 300 MiB)"
    )


def _drain_only(n: int, metrics_port: int | None, **spec) -> tuple[float, int, int]:
    """Publish n events for four targets and push them with one worker (no wrk); with a
    metrics port, /metrics is scraped once a second meanwhile. Returns seconds, deliveries
    and successful scrapes."""
    import threading
    import urllib.request

    scrapes = 0
    done = threading.Event()

    def scrape() -> None:
        nonlocal scrapes
        while not done.wait(1.0):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    scrapes += bool(r.read())
            except OSError:
                pass

    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, rx.url, ["/ok/a", "/ok/b", "/ok/c", "/ok/d"], **spec)
        for i in range(0, n, 50_000):
            publish(conn, "orders", events(min(50_000, n - i), i))
        extra = {} if metrics_port is None else {"metrics_port": metrics_port}
        scraper = threading.Thread(target=scrape, daemon=True)
        if metrics_port is not None:
            scraper.start()
        started = time.perf_counter()
        report = run_worker("w1", until_idle=True, max_seconds=600, **extra)
        elapsed = time.perf_counter() - started
        done.set()
    return elapsed, report.delivered, scrapes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_drain(n: int = 20_000) -> None:
    """The same drain whatever the engine's version (compare trees with PYTHONPATH)."""
    elapsed, delivered, _ = _drain_only(n, None, concurrency=8)
    print(
        f"drain, 4 targets: {delivered:,} deliveries in {elapsed:.2f} s = "
        f"{delivered / elapsed:,.0f}/s"
    )


def bench_metrics(n: int = 20_000, rounds: int = 2) -> None:
    """The drain without and with /metrics served and scraped every second, alternated."""
    for r in range(rounds):
        for port in (None, _free_port()):
            elapsed, delivered, scrapes = _drain_only(n, port, concurrency=8)
            what = "no /metrics server" if port is None else f"/metrics scraped {scrapes}x"
            print(
                f"metrics round {r + 1}, {what}: {delivered:,} deliveries in "
                f"{elapsed:.2f} s = {delivered / elapsed:,.0f}/s"
            )
            sys.stdout.flush()


def _machine_idle() -> tuple[int, int]:
    ticks = list(map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]))
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, all


def bench_stalls(n: int = 20_000) -> None:
    """The throughput drain with a probe on the engine's event loop: a task that sleeps 1 ms
    and records how late it wakes (a stall of the loop delays every answered request, and
    the receiver idles meanwhile), the cyclic collector's pauses, and how long the loop and
    the HTTP client's threads waited for a CPU."""
    import asyncio
    import gc
    import os
    import threading

    from eventpush.push import engine

    lags: list[float] = []
    supervise = engine.Engine._supervise

    async def probed(self, started: float) -> None:
        async def probe() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        task = asyncio.get_running_loop().create_task(probe())
        try:
            await supervise(self, started)
        finally:
            task.cancel()

    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    began: dict[int, float] = {}

    def collector(phase: str, info: dict) -> None:
        if phase == "start":
            began[info["generation"]] = time.perf_counter()
        elif info["generation"] in began:
            pauses[info["generation"]].append(time.perf_counter() - began[info["generation"]])

    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        topology(conn, rx.url, ["/ok/a", "/ok/b", "/ok/c", "/ok/d"])
        publish(conn, "orders", events(n))
        engine.Engine._supervise = probed
        gc.callbacks.append(collector)
        me, loop_tid = os.getpid(), threading.get_native_id()
        threads, idle = _task_stats(me), _machine_idle()
        started = time.perf_counter()
        try:
            report = run_worker("w1", until_idle=True, max_seconds=600)
        finally:
            engine.Engine._supervise = supervise
            gc.callbacks.remove(collector)
        elapsed = time.perf_counter() - started
        idle_end, threads_end = _machine_idle(), _task_stats(me)
    lags.sort()
    q = {p: lags[min(int(len(lags) * p / 100), len(lags) - 1)] * 1e3 for p in (50, 90, 99)}
    over = [lag for lag in lags if lag > 0.002]
    print(
        f"stalls: {report.delivered:,} deliveries in {elapsed:.2f} s = "
        f"{report.delivered / elapsed:,.0f}/s; loop lag p50 {q[50]:.2f} ms, p90 {q[90]:.2f}, "
        f"p99 {q[99]:.2f}, max {lags[-1] * 1e3:.1f}; {len(over)} over 2 ms, "
        f"{sum(over):.2f} s in all"
    )
    print(
        "  collector: "
        + ", ".join(
            f"gen{g} {len(p)}x {sum(p) * 1e3:.0f} ms (max {max(p, default=0) * 1e3:.1f})"
            for g, p in pauses.items()
        )
    )
    waited: dict[str, list[float]] = {}
    for tid, (name, cpu, wait, sleeps) in threads_end.items():
        _, cpu0, wait0, sleeps0 = threads.get(tid, (name, 0.0, 0.0, 0))
        total = waited.setdefault(_thread_group(tid, name, loop_tid), [0.0, 0.0, 0])
        total[0] += cpu - cpu0
        total[1] += wait - wait0
        total[2] += sleeps - sleeps0
    idle_share = (idle_end[0] - idle[0]) / max(idle_end[1] - idle[1], 1)
    print(
        "  threads (CPU s / s runnable waiting for a CPU / sleeps per delivery): "
        + ", ".join(
            f"{g} {c:.2f}/{w:.2f}/{z / report.delivered:.2f}"
            for g, (c, w, z) in sorted(waited.items())
        )
        + f"; machine idle {idle_share:.0%}"
    )


def quarter_events(n: int, start: int = 0, placement: str = "aligned") -> list[str]:
    """Events whose detail is 200 bytes of JSON, ``detail.k`` in 0-3. ``aligned``: k cycles
    with the event's position, so the bus's round-robin placement puts each k on a queue of
    its own (each queue holds one rule's events: the other runners only filter it);
    ``mixed``: k drawn at random (seeded), so every queue holds all four rules' events."""
    rng = random.Random(start)
    out = []
    for i in range(start, start + n):
        k = i % 4 if placement == "aligned" else rng.randrange(4)
        head = {"k": k, "order": i, "customer": f"c{i % 977}", "pad": ""}
        pad = 200 - len(json.dumps(head, separators=(",", ":")))
        head["pad"] = "x" * pad
        out.append(
            json.dumps(
                {"source": "shop.orders", "detail-type": "OrderPlaced", "detail": head},
                separators=(",", ":"),
            )
        )
    return out


def quarters_topology(conn, url: str, workers: int = 1) -> None:
    """Four rules, each matching a quarter of the events, one target each (default settings),
    their runners given to ``workers`` workers (w1, w2, ...) evenly."""
    catalog.create_bus(conn, "orders", 4)
    for k in range(4):
        catalog.create_rule(conn, "orders", f"q{k}", {"detail": {"k": [k]}})
        catalog.create_target(
            conn, "orders", f"q{k}", catalog.TargetSpec(name=f"t{k}", url=f"{url}/ok/q{k}")
        )
    for w in range(workers):
        catalog.create_worker(conn, f"w{w + 1}")
    catalog.assign(conn)


# Where a Python frame's time goes, by the innermost frame of a sample that says (file part,
# function or None for any): the parts of a delivery in the split.
_PARTS = (
    ("rules/", None, "match"),
    ("push/reading.py", "_parse", "read and parse"),
    ("msgspec", None, "read and parse"),
    ("sources/", None, "read and parse"),
    ("push/reading.py", None, "read and parse"),
    ("push/committing.py", None, "commit"),
    ("push/store.py", None, "commit"),
    ("sinks/", None, "send"),
    ("push/lanes.py", "feed", "feed (lanes)"),
    ("push/lanes.py", None, "send"),
    ("tracing.py", None, "send"),
    ("push/cursor.py", None, "commit"),
)


def _part_of(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        m = re.match(r"(.*) \((.*):\d+\)$", frame.strip())
        if not m:
            continue
        func, path = m.groups()
        for file_part, name, part in _PARTS:
            if file_part in path and (name is None or name == func):
                return part
    return "loop and other"


def _spy_split(raw: Path) -> dict[str, float]:
    """Shares of the samples by part (py-spy's raw output, ``--gil``: only the thread holding
    the GIL is sampled, so waits for the database, a queue or the GIL itself count nowhere)."""
    counts: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            part = _part_of(stack)
            counts[part] = counts.get(part, 0) + int(n)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}


def _worker_env(url: str) -> dict[str, str]:
    """The environment of a standalone worker on ``url``, its imports compiled beforehand.

    The worker starts from compiled modules, as an installed one does: with
    PYTHONDONTWRITEBYTECODE (set in some shells) every start compiled its imports anew, ~0.9 s
    of every run on a loaded 2-core machine. The cache is filled before the clock starts."""
    import os

    env = {**os.environ, "EVENTPUSH_DATABASE_URL": url}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    subprocess.run([PYTHON, "-c", WORKER_IMPORTS], env=env, check=True)
    return env


def _standalone_drain(
    url: str, n_expected: int
) -> tuple[float, int, float, dict, dict | None, float]:
    """``eventpush worker run w1 --until-idle`` in a process of its own, sampled by py-spy when
    it is installed (``pip install py-spy``: not a dependency, the split needs it): seconds,
    deliveries, process CPU s, CPU s by thread group, py-spy shares of the Python part, peak
    RSS in MiB."""
    import os

    env = _worker_env(url)
    spy = shutil.which("py-spy") or (
        str(Path(PYTHON).with_name("py-spy")) if Path(PYTHON).with_name("py-spy").exists() else None
    )
    started = time.perf_counter()
    worker = subprocess.Popen(
        [EXE, "worker", "run", "w1", "--until-idle", "--max-seconds", "900"],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    tmp = Path(tempfile.mkdtemp())
    sampler = None
    if spy:
        sampler = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(worker.pid),
                "--format",
                "raw",
                "--rate",
                # A higher rate (EVENTPUSH_BENCH_SPY_RATE) resolves lines, at some cost to the run.
                os.environ.get("EVENTPUSH_BENCH_SPY_RATE", "97"),
                "--nonblocking",
                "--gil",
                "--threads",
                "-o",
                str(tmp / "raw.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    groups: dict[int, tuple[str, float]] = {}
    main_tid = worker.pid
    while True:  # reaped here (not by Popen) for its resource usage
        pid, status, usage = os.wait4(worker.pid, os.WNOHANG)
        if pid:
            worker.returncode = os.waitstatus_to_exitcode(status)
            break
        for tid, (name, cpu, _, _) in _task_stats(worker.pid).items():
            group = "loop" if tid == main_tid else _thread_group(tid, name, main_tid)
            groups[tid] = (group, cpu)
        time.sleep(0.2)
    elapsed = time.perf_counter() - started
    if worker.returncode:
        raise SystemExit(f"bench/push.py quarters: the worker exited {worker.returncode}")
    cpu_total = usage.ru_utime + usage.ru_stime
    by_group: dict[str, float] = {}
    for group, cpu in groups.values():
        by_group[group] = by_group.get(group, 0.0) + cpu
    # CPU the last samples missed (threads that ended, the last 0.2 s) counts as "other"
    by_group["other"] = by_group.get("other", 0.0) + cpu_total - sum(by_group.values())
    shares = None
    if sampler is not None:
        sampler.wait(60)
        if (tmp / "raw.txt").exists():
            shares = _spy_split(tmp / "raw.txt")
        keep = os.environ.get("EVENTPUSH_BENCH_SPY_RAW")  # a path: the samples kept for reading
        if keep and (tmp / "raw.txt").exists():
            shutil.copy(tmp / "raw.txt", keep)
    shutil.rmtree(tmp, ignore_errors=True)
    return elapsed, n_expected, cpu_total, by_group, shares, usage.ru_maxrss / 1024


def _drain_by_processes(url: str, workers: int) -> tuple[float, float, float]:
    """``eventpush worker run wK --until-idle`` for K = 1..workers, side by side, each in a
    process of its own: seconds until the last exits, their CPU seconds together, the highest
    peak RSS in MiB. No split by thread or part (that is for one worker)."""
    import os

    env = _worker_env(url)
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [EXE, "worker", "run", f"w{w + 1}", "--until-idle", "--max-seconds", "900"],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        for w in range(workers)
    ]
    cpu, peak = 0.0, 0.0
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise SystemExit(f"bench/push.py quarters: a worker exited {proc.returncode}")
        cpu += usage.ru_utime + usage.ru_stime
        peak = max(peak, usage.ru_maxrss / 1024)
    return time.perf_counter() - started, cpu, peak


def _bus_rows_read(url: str, settled: int | None = None) -> int:
    """Rows of the bus's events PostgreSQL has handed out (its statistics: every scan of
    ``bus_event``'s partitions, whatever the reader). After a worker exits, its sessions send
    their counts as they end: with ``settled`` (the count before), wait until it stops moving."""
    sql = (
        "SELECT coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0) "
        "FROM pg_stat_user_tables WHERE relname LIKE 'bus_event%'"
    )
    last, deadline = settled, time.monotonic() + 10
    while True:
        conn = psycopg2.connect(url)
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                now = int(cur.fetchone()[0])
        finally:
            conn.close()
        if settled is None or (now == last and now != settled) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.5)


def bench_quarters(
    n: int = 300_000,
    fanout_n: int = 20_000,
    placements: tuple[str, ...] = ("aligned", "mixed"),
    workers: int = 1,
) -> None:
    """Issue 34: one event per request, four rules each matching a quarter of the events,
    one target each, default settings; a standalone worker process drains n events, wrk
    sends the engine's request to the same receiver in the same run. The issue's words
    allow two placements of the quarters on the bus's queues (``quarter_events``): each is
    measured. The fan-out figure (``throughput``: one rule, four targets) follows.
    ``workers`` > 1 drains with that many worker processes instead (the runners shared out),
    to see whether one process's loop or the machine's cores are the limit."""
    for placement in placements:
        _quarters(n, placement, workers)
        sys.stdout.flush()
    bench_throughput(fanout_n)


def _quarters(n: int, placement: str, workers: int = 1) -> None:
    import os

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        quarters_topology(conn, rx.url, workers)
        for i in range(0, n, 50_000):
            publish(conn, "orders", quarter_events(min(50_000, n - i), i, placement))
        request = engine_request(conn)
        before = wrk_rate(rx.url + "/ok/wrk", request=request)
        got_before = sum(rx.stats()["count"].values())
        rows_before = _bus_rows_read(url)
        if workers == 1:
            elapsed, _, cpu, groups, shares, peak_mib = _standalone_drain(url, n)
        else:
            elapsed, cpu, peak_mib = _drain_by_processes(url, workers)
            groups, shares = None, None
        delivered = sum(rx.stats()["count"].values()) - got_before
        rows_read = _bus_rows_read(url, settled=rows_before) - rows_before
        after = wrk_rate(rx.url + "/ok/wrk", request=request)
        conn.close()
    ceiling = (before + after) / 2
    rate = delivered / elapsed
    per = 1e6 / max(delivered, 1)
    by = f", {workers} worker processes" if workers > 1 else ""
    print(
        f"quarters ({placement}{by}), 1 event/request, 4 rules x 1 target: {delivered:,} "
        f"deliveries in {elapsed:.1f} s = {rate:,.0f}/s; wrk (engine's request, "
        f"{len(request[0])} B) {before:,.0f} and {after:,.0f} req/s; ratio "
        f"{rate / ceiling:.2f} (goal 0.80); "
        f"worker CPU {cpu * per:.0f} us per delivery"
    )
    print(
        f"  rows read from the bus {rows_read:,} ({rows_read / max(n, 1):.2f} an event, "
        f"PostgreSQL's count); worker peak RSS {peak_mib:.0f} MiB"
    )
    if groups is None:
        return
    print(
        "  CPU us per delivery by thread: "
        + ", ".join(f"{k} {v * per:.1f}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1]))
    )
    if shares is None:
        print("  split by part: py-spy not installed (pip install py-spy into the venv)")
    else:
        python_cpu = cpu - groups.get("http client", 0.0)
        parts = {k: v * python_cpu for k, v in shares.items()}
        parts["send"] = parts.get("send", 0.0) + groups.get("http client", 0.0)
        print(
            "  CPU us per delivery by part (the process's CPU less the HTTP client's threads, "
            "shared out as py-spy's samples of the GIL's holder; those threads as send): "
            + ", ".join(
                f"{k} {v * per:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "which",
        nargs="?",
        default="all",
        choices=[
            "all",
            "throughput",
            "batch",
            "latency",
            "isolation",
            "memory",
            "drain",
            "metrics",
            "clients",
            "stalls",
            "quarters",
        ],
    )
    parser.add_argument("--events", type=int, help="events for quarters (default 300,000)")
    parser.add_argument(
        "--workers", type=int, default=1, help="quarters: worker processes draining (default 1)"
    )
    parser.add_argument(
        "--placement",
        choices=["aligned", "mixed", "both"],
        default="both",
        help="quarters: each rule's events on a queue of their own, mixed on every queue, or both",
    )
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if args.which == "quarters":
        placements = ("aligned", "mixed") if args.placement == "both" else (args.placement,)
        bench_quarters(args.events or 300_000, placements=placements, workers=args.workers)
        return
    extra = ("drain", "metrics", "clients", "stalls", "quarters")
    for name in ("throughput", "batch", "latency", "isolation", "memory", *extra):
        if args.which == name or (args.which == "all" and name not in extra):
            globals()[f"bench_{name}"]()
            sys.stdout.flush()


if __name__ == "__main__":
    main()
