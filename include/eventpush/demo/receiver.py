"""A local HTTP receiver for the demo, the tests and the benchmarks.

Each path behaves like a kind of target:

| path | answers |
| --- | --- |
| ``/ok`` | 200 at once |
| ``/slow?ms=N`` | 200 after N milliseconds |
| ``/flaky?fail=N`` | 500 for the first N attempts of each webhook-id, then 200 |
| ``/down`` | 500 until recovered (``state.recover`` or ``POST /_recover?path=/down``) |
| ``/gone`` | 410, for good |
| ``/ratelimit?after=S`` | 429 with ``Retry-After: S`` on each id's first attempt, then 200 |
| ``/hang`` | never answers (until the client gives up) |
| ``/reset`` | closes the connection without an answer |
| ``/latency`` | 200, recording now minus each event's ``detail.sent`` |
| ``/redirect?code=C&to=URL`` | C (a 3xx) with ``Location: URL`` (no ``to``: itself, a loop) |
| ``/retryafter?value=V`` | 503 with ``Retry-After: V`` on each id's first attempt, then 200 |
| ``/huge?mib=N`` | 200 with an N MiB body, streamed |

A path's first segment picks its behaviour (``/ok/a`` is ``/ok``); counts are per full path,
and ``GET /_stats`` returns them with the latency percentiles.

Every request is recorded (path, webhook and traceparent headers, body) so a test can check
what arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from eventpush.demo.serving import AppThread


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes
    at: float = 0.0  # monotonic time of arrival


@dataclass
class ReceiverState:
    keep_bodies: bool = True
    requests: list[Received] = field(default_factory=list)
    attempts: Counter = field(default_factory=Counter)
    count: Counter = field(default_factory=Counter)
    recovered: set = field(default_factory=set)
    latencies: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def recover(self, path: str) -> None:
        self.recovered.add(path)

    def delivered(self, path: str) -> list[Received]:
        """Requests to ``path`` that were answered 2xx."""
        with self.lock:
            return [r for r in self.requests if r.path == path and r.headers.get("status") == 200]


def _events_of(body: bytes) -> list[dict]:
    doc = json.loads(body)
    return doc if isinstance(doc, list) else [doc]


async def _stream_huge(request: web.Request, mib: int) -> web.StreamResponse:
    """A body far bigger than any client should hold, written as it goes (never in memory);
    stops quietly when the client hangs up, as a well-capped client does."""
    resp = web.StreamResponse(status=200)
    resp.content_length = mib * 2**20
    await resp.prepare(request)
    chunk = b"x" * 2**20
    with contextlib.suppress(ConnectionError, RuntimeError):
        for _ in range(mib):
            await resp.write(chunk)
        await resp.write_eof()
    return resp


def make_app(state: ReceiverState) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        path = request.path
        body = await request.read()
        hook_id = request.headers.get("webhook-id", "")
        with state.lock:
            state.attempts[(path, hook_id)] += 1
            attempt = state.attempts[(path, hook_id)]
            state.count[path] += 1
        status, headers = 200, {}
        kind = "/" + path.split("/", 2)[1]  # /ok/a behaves as /ok, counted on its own
        if kind == "/latency":
            # The sender stamps detail.sent (epoch seconds): record publish-to-arrival time.
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for event in _events_of(body):
                    state.latencies.append(time.time() - float(event["detail"]["sent"]))
        elif kind == "/slow":
            await asyncio.sleep(int(request.query.get("ms", "100")) / 1000)
        elif kind == "/flaky":
            status = 500 if attempt <= int(request.query.get("fail", "2")) else 200
        elif kind == "/down":
            status = 200 if path in state.recovered else 500
        elif kind == "/gone":
            status = 410
        elif kind == "/ratelimit":
            if attempt == 1:
                status, headers = 429, {"Retry-After": request.query.get("after", "1")}
        elif kind == "/redirect":
            status = int(request.query.get("code", "307"))
            headers = {"Location": request.query.get("to", str(request.rel_url))}  # or a loop
        elif kind == "/retryafter":
            if attempt == 1:
                status, headers = 503, {"Retry-After": request.query.get("value", "1")}
        elif kind == "/huge":
            return await _stream_huge(request, int(request.query.get("mib", "256")))
        elif kind == "/hang":
            await asyncio.sleep(3600)
        elif kind == "/reset":
            request.transport.close()
            return web.Response(status=500)
        if state.keep_bodies or status != 200:
            record = {
                k.lower(): v
                for k, v in request.headers.items()
                if k.lower().startswith("webhook") or k.lower() == "traceparent"
            }
            record["status"] = status
            with state.lock:
                state.requests.append(Received(path, record, body, arrived))
        return web.Response(status=status, headers=headers)

    async def stats(request: web.Request) -> web.Response:
        with state.lock:
            lat = sorted(state.latencies)
            doc = {"count": dict(state.count), "latencies": len(lat)}
        if lat:
            doc.update(p50_ms=lat[len(lat) // 2] * 1000, p99_ms=lat[int(len(lat) * 0.99)] * 1000)
        return web.json_response(doc)

    async def recover(request: web.Request) -> web.Response:
        state.recover(request.query.get("path", ""))
        return web.json_response({"recovered": sorted(state.recovered)})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("GET", "/_stats", stats)
    app.router.add_route("POST", "/_recover", recover)
    app.router.add_route("POST", "/{tail:.*}", handle)
    return app


class Receiver:
    """The receiver on a loopback address (``host``; 127.0.0.2 stands in for a denied one)
    and ``port`` (0: a free one), served from a thread of its own (``AppThread``)."""

    def __init__(self, port: int = 0, keep_bodies: bool = True, host: str = "127.0.0.1") -> None:
        self.state = ReceiverState(keep_bodies=keep_bodies)
        self._server = AppThread("receiver", host=host, port=port)
        self.url = ""

    def __enter__(self) -> Receiver:
        self.url = self._server.start(lambda: make_app(self.state))
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()


class ReceiverProcess:
    """The receiver in a process of its own (``python -m eventpush.demo.receiver PORT``), for the
    demo and benchmarks: Airflow's task processes reach it, and it does not share our GIL."""

    def __init__(self, port: int | None = None) -> None:
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eventpush.demo.receiver", str(port), str(os.getpid())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(300):  # 30 s: a loaded machine starts a Python process slowly
            try:
                self.stats()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the receiver did not start on port {port}")

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/_stats", timeout=5) as resp:
            return json.loads(resp.read())

    def recover(self, path: str) -> None:
        req = urllib.request.Request(self.url + f"/_recover?path={path}", method="POST")
        urllib.request.urlopen(req, timeout=5).close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # handlers such as /hang hold a graceful stop up
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    """``python -m eventpush.demo.receiver [PORT [PARENT_PID]]``: serve in the foreground; with
    PARENT_PID, stop once that process is gone."""

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8787
    if len(sys.argv) > 2:
        _stop_with_parent(int(sys.argv[2]))
    web.run_app(make_app(ReceiverState(keep_bodies=False)), host="127.0.0.1", port=port)


def _stop_with_parent(parent: int) -> None:
    """A SIGKILL or SIGTERM of the test or benchmark that started this process runs none of
    its clean-up: without this the receiver would keep its port for good."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # aiohttp's graceful stop

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    main()
