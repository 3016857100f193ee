"""Instructions a unit of work costs, counted by valgrind's callgrind: a request of the
delivery client, a delivery of the worker, a PutEvents of the API.

Each workload runs twice under callgrind, with ``--units`` and five times as many units, and
the difference of the two totals divided by the difference of the units is the instructions a
unit: start-up, imports and shut-down cancel out. Unlike CPU time, the count does not move
with the load on the machine or the host's speed (on this project's shared 2-core machines
CPU time a delivery moved by a third between runs of one tree minutes apart), so two trees
compare in one run each: ``PYTHONPATH=<tree>/include``. ``--top K`` lists the K functions
whose count grew most per unit (``callgrind_annotate``), where a hot spot shows.

What it does not count: the kernel's work (the system calls: ``strace -c`` counts them), and
instructions valgrind runs otherwise than the CPU would (the SHA-256 of the SigV4 check: the
host's SHA extensions are not emulated, so it counts several times what it costs). Under
valgrind the program runs ~50 times slower, so work that batches by time (the API's group
commit, the worker's windows) batches differently than at full speed: compare trees, not
this count with a CPU-time figure.

    .venv/bin/python bench/instructions.py client|worker|fanout|api [--units N] [--top K]

- ``client``: ``eventpush.sinks.http.attempt`` in a bare loop, 64 requests in flight, to the
  demo receiver (another process, not counted): instructions a request;
- ``worker``: ``eventpush worker run w1 --until-idle`` draining the quarters workload of
  ``bench/push.py quarters`` (mixed placement) to the receiver: instructions a delivery;
- ``fanout``: the same worker on ``bench/push.py throughput``'s workload, one rule and four
  targets (each event read, parsed and matched once for four deliveries; its events' details
  are smaller): instructions a delivery, what the quarters' own reading costs beside it;
- ``api``: ``eventpush api --workers 1`` answering signed PutEvents of 10 entries, sent over
  16 kept-alive connections by this process (not counted): instructions a request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402
from push import EXE, PYTHON, ReceiverProcess, quarter_events, quarters_topology  # noqa: E402

from eventpush import catalog  # noqa: E402

DEFAULT_UNITS = {"client": 1024, "worker": 2000, "fanout": 2000, "api": 320}
SCALE = 5  # the second run's units, as a multiple of the first's
API_CONNECTIONS = 16


def callgrind(out: Path) -> tuple[str, ...]:
    """The command prefix that runs a program under callgrind, its counts written to ``out``."""
    return ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}")


def total(out: Path) -> int:
    """The instructions a callgrind output file counted (its ``totals:`` line)."""
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise SystemExit(f"{out}: no totals line (did the program end normally?)")


# --- the workloads, each run once with ``units`` under callgrind into ``out`` ---------------


def run_client(units: int, out: Path) -> None:
    with ReceiverProcess() as rx:
        subprocess.run(
            [*callgrind(out), PYTHON, __file__, "_client", rx.url, str(units)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def _client(url: str, units: int) -> None:
    """The bare client loop itself (the process callgrind counts)."""
    import uvloop
    from push import _client_loop

    uvloop.run(_client_loop("http.attempt", url + "/ok/count", units, 64, 0.0))


def run_worker(units: int, out: Path, fanout: bool = False) -> None:
    from push import _worker_env, events, topology

    from eventpush.publish import publish

    with ReceiverProcess() as rx, scratch_database() as url:
        conn = psycopg2.connect(url)
        if fanout:  # one rule, four targets: each event read, parsed and matched once
            topology(conn, rx.url, ["/ok/a", "/ok/b", "/ok/c", "/ok/d"])
            publish(conn, "orders", events(units // 4))
        else:
            quarters_topology(conn, rx.url, 1)
            publish(conn, "orders", quarter_events(units, 0, "mixed"))
        conn.close()
        command = [EXE, "worker", "run", "w1", "--until-idle", "--max-seconds", "3600"]
        subprocess.run(
            [*callgrind(out), *command],
            env=_worker_env(url),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def run_api(units: int, out: Path) -> None:
    from api import put_events_body
    from api_support import ApiServer, make_key, signed_request

    from eventpush.sealed import KEY_FILE_ENV, write_key_file

    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        write_key_file(Path(tmp) / "secret.key")
        env = {**os.environ, "EVENTPUSH_DATABASE_URL": url, KEY_FILE_ENV: f"{tmp}/secret.key"}
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4)
        conn.close()
        key = make_key(env, "bench", "admin")
        # Slow to start and to stop under valgrind; the stop (SIGTERM: uvicorn ends, and
        # callgrind writes its file) must not turn into a SIGKILL.
        server = ApiServer(env, "--workers", "1", wrapper=callgrind(out), start_s=300, stop_s=600)
        try:
            body = put_events_body()
            signed = signed_request(server.url, "PutEvents", body, key)
            head = "".join(f"{k}: {v}\r\n" for k, v in signed.headers.items())
            request = (
                f"POST / HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
            )
            asyncio.run(_put_events(server.port, request, units))
        finally:
            server.stop()


async def _put_events(port: int, request: bytes, units: int) -> None:
    """``units`` requests over API_CONNECTIONS kept-alive connections, each answered 200."""

    async def one(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(n):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"the API answered {head[:200]!r}")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            await reader.readexactly(int(length.group(1)) if length else 0)
        writer.close()

    per, rest = divmod(units, API_CONNECTIONS)
    await asyncio.gather(*(one(per + (i < rest)) for i in range(API_CONNECTIONS)))


def run_fanout(units: int, out: Path) -> None:
    run_worker(units, out, fanout=True)


WORKLOADS = {"client": run_client, "worker": run_worker, "fanout": run_fanout, "api": run_api}
UNIT_NAMES = {
    "client": "a request",
    "worker": "a delivery",
    "fanout": "a delivery",
    "api": "a PutEvents of 10",
}


def by_function(out: Path) -> Counter:
    """Instructions by function (self cost), as ``callgrind_annotate`` lists them."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(out)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counted: Counter = Counter()
    for line in text.splitlines():
        found = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(\S.*)", line)
        if found and "PROGRAM TOTALS" not in line:
            name = re.sub(r"'\d+", "", found.group(2))  # recursion depths folded together
            name = re.sub(r"\[(?:.*/)?([^/\]]+)\]", r"[\1]", name)  # a library's file name
            name = re.sub(r"^/tmp/python-build[^ ]*?/Python-[\d.]+/", "", name)
            counted[name] += int(found.group(1).replace(",", ""))
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=[*WORKLOADS, "_client"])
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--units", type=int, help="the first run's units (the second: 5 x)")
    parser.add_argument("--top", type=int, default=0, help="list the K functions that grew most")
    args = parser.parse_args()
    if args.workload == "_client":
        _client(args.args[0], int(args.args[1]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: apt-get install -y valgrind")
    small = args.units or DEFAULT_UNITS[args.workload]
    large = small * SCALE
    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for units in (small, large):
            outs[units] = Path(tmp) / f"callgrind.{units}"
            started = time.monotonic()
            WORKLOADS[args.workload](units, outs[units])
            print(
                f"{args.workload}, {units:,} units: {total(outs[units]):,} instructions "
                f"({time.monotonic() - started:.0f} s under valgrind)"
            )
        per = (total(outs[large]) - total(outs[small])) / (large - small)
        print(f"machine: {machine()}")
        print(f"{args.workload}: {per:,.0f} instructions {UNIT_NAMES[args.workload]}")
        if args.top:
            grew = by_function(outs[large])
            grew.subtract(by_function(outs[small]))
            for name, count in grew.most_common(args.top):
                print(f"  {count / (large - small):9,.0f}  {name[:150]}")


if __name__ == "__main__":
    main()
