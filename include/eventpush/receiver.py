"""A local HTTP receiver for the demo, the tests and the benchmarks.

Each path behaves like a kind of target:

| path | answers |
| --- | --- |
| ``/ok`` | 200 at once |
| ``/slow?ms=N`` | 200 after N milliseconds |
| ``/flaky?fail=N`` | 500 for the first N attempts of each webhook-id, then 200 |
| ``/down`` | 500 until ``state.recover("/down")`` is called, then 200 |
| ``/gone`` | 410, for good |
| ``/ratelimit?after=S`` | 429 with ``Retry-After: S`` on each id's first attempt, then 200 |
| ``/hang`` | never answers (until the client gives up) |
| ``/reset`` | closes the connection without an answer |

Every request is recorded (path, webhook headers, body) so a test can check what arrived.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web


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
    lock: threading.Lock = field(default_factory=threading.Lock)

    def recover(self, path: str) -> None:
        self.recovered.add(path)

    def delivered(self, path: str) -> list[Received]:
        """Requests to ``path`` that were answered 2xx."""
        with self.lock:
            return [r for r in self.requests if r.path == path and r.headers.get("status") == 200]


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
        if path == "/slow":
            await asyncio.sleep(int(request.query.get("ms", "100")) / 1000)
        elif path == "/flaky":
            status = 500 if attempt <= int(request.query.get("fail", "2")) else 200
        elif path == "/down":
            status = 200 if path in state.recovered else 500
        elif path == "/gone":
            status = 410
        elif path == "/ratelimit":
            if attempt == 1:
                status, headers = 429, {"Retry-After": request.query.get("after", "1")}
        elif path == "/hang":
            await asyncio.sleep(3600)
        elif path == "/reset":
            request.transport.close()
            return web.Response(status=500)
        if state.keep_bodies or status != 200:
            record = {k.lower(): v for k, v in request.headers.items() if k.startswith("webhook")}
            record["status"] = status
            with state.lock:
                state.requests.append(Received(path, record, body, arrived))
        return web.Response(status=status, headers=headers)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("POST", "/{tail:.*}", handle)
    return app


class Receiver:
    """The receiver running on a loopback port in a thread of its own."""

    def __init__(self, port: int = 0, keep_bodies: bool = True) -> None:
        self.state = ReceiverState(keep_bodies=keep_bodies)
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="receiver")
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(make_app(self.state), access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self._port)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._runner = runner
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> Receiver:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    """``python -m eventpush.receiver [PORT]``: serve in the foreground."""
    import sys

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8787
    web.run_app(make_app(ReceiverState(keep_bodies=False)), host="127.0.0.1", port=port)


if __name__ == "__main__":
    main()
