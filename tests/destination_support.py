"""What the rate-limit and adaptive-concurrency tests share (issue 32).

- ``Congested`` (``eventpush.demo.congested``): the loopback receiver whose latency grows
  past 8 requests in flight and that answers 503 on demand.
- ``EngineThread``: an ``Engine`` run on a thread of its own, its runners readable meanwhile.
"""

from __future__ import annotations

import asyncio
import threading

from eventpush.push import engine as engine_mod


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
