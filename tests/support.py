"""Helpers the test modules share, in one place instead of a copy in each.

- ``rx``: a function-scoped receiver (``eventpush.demo.receiver``) on loopback; a module takes
  it with ``from support import rx`` (not in conftest: modules with a receiver of another
  scope or host name theirs differently, see receiver_support.py).
- ``events(n)``: n shop order events as JSON text, ``detail.n`` numbering them.
- ``rows(conn, sql, *params)``: every row of a parameterised query.
- ``wait_until(check, timeout, what)``: poll ``check`` until it answers something true; fail
  with ``what`` past the timeout.
- ``free_port`` is ``ports.free_port`` (below the ephemeral range).
- ``RunningWorker(worker, url)``: an engine on a thread of its own for a ``with`` block,
  serving metrics on a free loopback port; its ``engine`` is there to look at.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
from ports import free_port

from eventpush.demo.receiver import Receiver
from eventpush.push import engine

__all__ = ["RunningWorker", "events", "free_port", "rows", "rx", "wait_until"]


@pytest.fixture
def rx() -> Iterator[Receiver]:
    with Receiver() as receiver:
        yield receiver


def events(n: int) -> list[str]:
    return [
        json.dumps({"source": "shop", "detail-type": "Order", "detail": {"n": i}}) for i in range(n)
    ]


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def wait_until(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class RunningWorker:
    """An engine on its own thread, serving metrics on a free loopback port."""

    def __init__(self, worker: str, url: str) -> None:
        self.engine = engine.Engine(worker, url, metrics_port=0)
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main():
            self.loop = asyncio.get_running_loop()
            await self.engine.run()

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def __enter__(self) -> RunningWorker:
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.engine.metrics.server is None:
            assert time.monotonic() < deadline and self.error is None, self.error
            time.sleep(0.02)
        self.port = self.engine.metrics.server.server_address[1]
        return self

    def __exit__(self, *exc) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.engine.stop)
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.error is None, self.error
