"""A loopback receiver for adaptive concurrency and rate limits (issue 32), run in a thread
of its own: its latency grows past ``knee`` requests in flight (``base_ms * (in_flight /
knee) ** 2``, so its throughput peaks at ``knee``), it answers 503 while ``unavailable`` is
set, and it logs every request: (monotonic time of the answer, path, requests in flight at
its arrival, status). The tests and ``bench/destination_limits.py`` push to it.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from eventpush.demo.serving import AppThread


class Congested:
    def __init__(self, base_ms: float = 20.0, knee: int = 8) -> None:
        self.base_ms = base_ms
        self.knee = knee
        self.unavailable = False
        self.active = 0
        self.log: list[tuple[float, str, int, int]] = []
        self._server = AppThread("congested")
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.active += 1
        n = self.active
        try:
            if self.unavailable:
                status = 503
            else:
                status = 200
                await asyncio.sleep(self.base_ms / 1000 * max(1.0, (n / self.knee) ** 2))
        finally:
            self.active -= 1
        self.log.append((time.monotonic(), request.path, n, status))
        return web.Response(status=status)

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", self._handle)
        return app

    def __enter__(self) -> Congested:
        self.url = self._server.start(self._app)
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    def arrivals(self, path: str | None = None, status: int | None = None) -> list[float]:
        return [
            t
            for t, p, _, s in list(self.log)
            if (path is None or p == path) and (status is None or s == status)
        ]
