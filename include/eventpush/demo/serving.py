"""An aiohttp application served on a loopback address from a thread of its own: the
lifecycle the demo's and the tests' in-process receivers share (its handlers run on that
thread's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Callable

from aiohttp import web


class AppThread:
    """``start(make_app)`` serves the app on ``host`` (127.0.0.1; another loopback address
    such as 127.0.0.2 stands in for a denied one) at ``port`` (0: a free one) and returns its
    URL (https with ``ssl_context``); ``stop()`` cleans the app up and ends the thread."""

    def __init__(
        self,
        name: str,
        ssl_context: ssl.SSLContext | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._ssl = ssl_context
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._make_app: Callable[[], web.Application] | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        # Handlers still running at the stop (a hanging one) get a second, then are cancelled.
        self._runner = web.AppRunner(self._make_app(), access_log=None, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self._host, self._port, ssl_context=self._ssl)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self._ssl else 'http'}://{self._host}:{port}"
        self._started.set()
        self._loop.run_forever()

    def start(self, make_app: Callable[[], web.Application]) -> str:
        self._make_app = make_app
        self._thread.start()
        assert self._started.wait(10), f"{self._thread.name} did not start"
        return self.url

    def stop(self) -> None:
        done = asyncio.run_coroutine_threadsafe(self._cleanup(), self._loop)
        with contextlib.suppress(Exception):
            done.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _cleanup(self) -> None:
        """Clean up on the app's own loop, then end every task still on it, so nothing is
        left to run on a closed loop (a handler's last callback would raise there)."""
        await self._runner.cleanup()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.sleep(0)  # callbacks the cancellations scheduled run before the stop
