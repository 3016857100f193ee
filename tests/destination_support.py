"""What the rate-limit and adaptive-concurrency tests share (issue 32).

- ``through_destination(monkeypatch, t1={...}, ...)``: the fields a target gets from its API
  destination (``destination``, ``rate_limit``, ``concurrency_auto``), set by target name on
  the targets the engine loads. The catalog's destinations (``eventpush destination``,
  ``target create --destination/--concurrency auto``) are built by another helper of issue
  32 and are not merged yet: this stands in for them (the one monkeypatch here, over
  ``store.load_targets``; everything else is real) until they are, then the tests switch to
  the catalog.
- ``Congested``: a loopback HTTP receiver in a thread of its own whose latency grows past
  ``knee`` requests in flight (``base_ms * (in_flight / knee) ** 2``), that answers 503
  while ``unavailable`` is set, and logs every request: (monotonic time, path, in flight
  at its arrival, status).
- ``EngineThread``: an ``Engine`` run on a thread of its own, its runners readable meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

from aiohttp import web

from eventpush.push import engine as engine_mod
from eventpush.push import store


def through_destination(monkeypatch, **fields_by_target: dict) -> None:
    real = store.load_targets

    def load(cur, where: str = "TRUE", params: tuple = ()):
        return [
            dataclasses.replace(t, **fields_by_target.get(t.name, {}))
            for t in real(cur, where, params)
        ]

    monkeypatch.setattr(store, "load_targets", load)


class Congested:
    def __init__(self, base_ms: float = 20.0, knee: int = 8) -> None:
        self.base_ms = base_ms
        self.knee = knee
        self.unavailable = False
        self.active = 0
        self.log: list[tuple[float, str, int, int]] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="congested")
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

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._started.set()
        self._loop.run_forever()

    def __enter__(self) -> Congested:
        self._thread.start()
        assert self._started.wait(10), "receiver did not start"
        return self

    def __exit__(self, *exc) -> None:
        done = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        with contextlib.suppress(Exception):
            done.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def arrivals(self, path: str | None = None, status: int | None = None) -> list[float]:
        return [
            t
            for t, p, _, s in list(self.log)
            if (path is None or p == path) and (status is None or s == status)
        ]


class EngineThread:
    """``Engine(worker, url, **kwargs).run()`` on a thread of its own (uvloop, as
    ``run_worker`` runs it); ``stop()`` ends it gracefully and returns its report."""

    def __init__(self, worker: str, url: str, **kwargs) -> None:
        self.engine = engine_mod.Engine(worker, url, **kwargs)
        self.report = None
        self.error: BaseException | None = None
        self._loop = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine {worker}")

    def _run(self) -> None:
        import uvloop

        async def main():
            self._loop = asyncio.get_running_loop()
            return await self.engine.run()

        try:
            self.report = uvloop.run(main())
        except BaseException as exc:  # the test thread raises it at stop()
            self.error = exc

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def runner(self, name: str):
        for r in list(self.engine.runners.values()):
            if r.target.runner == name:
                return r
        return None

    def stop(self, timeout: float = 30.0):
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.engine.stop)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "engine did not stop"
        if self.error is not None:
            raise self.error
        return self.report
