"""What a native driver of libcurl would save the push engine's HTTP client: the loop thread's
CPU per request of ``eventpush.sinks.http.attempt`` against the same requests through
``bench/native_client.c`` (libcurl's multi interface driven from C: Python only submits a
request and takes finished ones), in one process, blocks in turn, each with ``--work-us`` of
Python on the loop before each request (the engine's share of a delivery). The native side
does the same Python per request that ``http.post`` does around libcurl (header lines, a
future, classifying the status, an Outcome), and nothing the real client does besides (the
address policy, pinned routes, TLS files, Retry-After).

Needs gcc and libcurl's headers (Debian: ``apt-get install libcurl4-openssl-dev``); the
module is built in a temporary directory on each run.

    .venv/bin/python bench/native_ab.py [--work-us 0 20] [--blocks 10] [--requests 6400]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import uvloop  # noqa: E402
from push import CLIENT_BODY, CLIENT_HEADERS, _client_loop, _timed_posts  # noqa: E402

from eventpush.demo.receiver import ReceiverProcess  # noqa: E402
from eventpush.sinks import contract, http  # noqa: E402
from eventpush.sinks.retry import classify  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "native_client.c"


def build(where: Path) -> ModuleType:
    """bench/native_client.c compiled and imported (exits saying what is missing)."""
    headers = [
        *Path("/usr/include").glob("curl/curl.h"),
        *Path("/usr/include").glob("*/curl/curl.h"),
    ]
    if shutil.which("gcc") is None or not headers:
        sys.exit("native_ab needs gcc and libcurl's headers: apt-get install libcurl4-openssl-dev")
    target = where / f"native_client{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-shared",
            "-fPIC",
            f"-I{include}",
            str(SOURCE),
            "-o",
            str(target),
            "-lcurl",
        ],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("native_client", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Native:
    """The C driver on the running loop: its epoll set watched as one reader."""

    def __init__(self, native: ModuleType) -> None:
        self.loop = asyncio.get_running_loop()
        self.multi = native.Multi()
        self.loop.add_reader(self.multi.fileno(), self._ready)

    def _ready(self) -> None:
        for future, code, status in self.multi.run():
            if not future.done():
                future.set_result((code, status))

    def close(self) -> None:
        self.loop.remove_reader(self.multi.fileno())
        self.multi.close()


async def native_loop(
    native: ModuleType, url: str, n: int, in_flight: int, work_us: float
) -> tuple[float, float]:
    """``_client_loop``'s requests through the C driver: requests/s and loop CPU µs each."""
    client = Native(native)
    loop = asyncio.get_running_loop()
    url_bytes = url.encode()
    target = contract.Target(1, "b/r/t", "b", 1, "r", "{}", "t", url)

    async def post() -> None:
        started = time.perf_counter()
        lines = [line.encode() for line in http.header_lines(CLIENT_HEADERS)]
        future = loop.create_future()
        client.multi.submit(url_bytes, CLIENT_BODY, lines, target.timeout_ms, future)
        code, status = await future
        kind = classify(status) if status else contract.RETRY
        outcome = contract.Outcome(kind, status, None, (time.perf_counter() - started) * 1000)
        if outcome.http_status != 200:
            raise RuntimeError(f"the receiver answered {outcome}")

    try:
        rate, cpu_us, _ = await _timed_posts(post, n, in_flight, work_us)
    finally:
        client.close()
    return rate, cpu_us


async def compare(native: ModuleType, url: str, blocks: int, n: int, work_us: float) -> None:
    got: dict[str, list[tuple[float, float]]] = {"pycurl": [], "native": []}
    for b in range(blocks):
        for name in ("pycurl", "native") if b % 2 else ("native", "pycurl"):
            if name == "pycurl":
                rate, cpu_us, _ = await _client_loop("http.attempt", url, n, 64, work_us)
            else:
                rate, cpu_us = await native_loop(native, url, n, 64, work_us)
            got[name].append((rate, cpu_us))
    print(f"{work_us:.0f} us of loop work a request:")
    common.ab_summary(got, "native", "pycurl")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-us", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--requests", type=int, default=6400)
    args = parser.parse_args()
    print(f"machine: {common.machine()}")
    with tempfile.TemporaryDirectory() as where:
        native = build(Path(where))
        with ReceiverProcess() as rx:
            for work_us in args.work_us:
                uvloop.run(compare(native, rx.url + "/ok/c", args.blocks, args.requests, work_us))


if __name__ == "__main__":
    main()
