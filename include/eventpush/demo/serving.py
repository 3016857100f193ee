"""An aiohttp application served on 127.0.0.1 from a thread of its own: the lifecycle the
demo's and the tests' in-process receivers share (its handlers run on that thread's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Callable

from aiohttp import web


class AppThread:
    """``start(make_app)`` serves the app on a free loopback port and returns its URL (https
    with ``ssl_context``); ``stop()`` cleans the app up and ends the thread."""

    def __init__(self, name: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._make_app: Callable[[], web.Application] | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self._make_app(), access_log=None, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self._ssl else 'http'}://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()

    def start(self, make_app: Callable[[], web.Application]) -> str:
        self._make_app = make_app
        self._thread.start()
        assert self._started.wait(10), f"{self._thread.name} did not start"
        return self.url

    def stop(self) -> None:
        done = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        with contextlib.suppress(Exception):
            done.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
