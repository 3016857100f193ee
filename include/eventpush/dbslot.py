"""Database connections shared by the engine's tasks: one slot, one connection, one user at a
time, reconnected after a transient error.

A psycopg2 call runs in a thread; if the task awaiting it is cancelled, the thread goes on
using the connection, so the slot remembers it and its next user waits for it to finish
before touching the connection again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from eventpush.backoff import Backoff
from eventpush.db import StoreError, connect, is_transient
from eventpush.errors import first_line

log = logging.getLogger("eventpush.push")


class DbSlot:
    """One database connection, used by one task at a time, reconnected on failure."""

    def __init__(self, url: str, on_connect: Callable | None = None, **libpq: object) -> None:
        self.url = url
        self.on_connect = on_connect
        self.libpq = libpq
        self.conn = None
        self.lock = asyncio.Lock()
        self.orphan: asyncio.Future | None = None

    def _connect(self):
        return connect(self.url, **self.libpq)

    async def _run(self, fn: Callable, *args):
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if not work.done():
                self.orphan = work
            raise

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for a call abandoned by a cancelled task to end (it holds the connection)."""
        orphan, self.orphan = self.orphan, None
        if orphan is not None:
            # asyncio.timeout, not wait_for: a cancel of the waiting task must never be lost.
            with contextlib.suppress(Exception):  # its own error was its caller's business
                async with asyncio.timeout(_timeout(timeout)):
                    await asyncio.shield(orphan)
            if not orphan.done():
                self.orphan = orphan

    async def call(self, fn: Callable, *args, give_up_s: float | None = None, retry: bool = True):
        """``fn(conn, *args)`` in a thread. Transient errors close the connection and, with
        ``retry``, are retried with backoff until ``give_up_s``; any other error is raised."""
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        backoff = Backoff()
        async with self.lock:
            while True:
                await self.settle(None if deadline is None else deadline - time.monotonic())
                if self.orphan is not None:
                    raise StoreError("the connection is still busy with an abandoned call")
                try:
                    if self.conn is None or self.conn.closed:
                        self.conn = await self._run(self._connect)
                        if self.on_connect:
                            await self._run(self.on_connect, self.conn)
                    return await self._run(fn, self.conn, *args)
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    self.close()
                    if not retry or (deadline is not None and time.monotonic() > deadline):
                        raise
                    log.warning(
                        "database unavailable (%s); retrying in %.1fs",
                        first_line(exc),
                        backoff.delay,
                    )
                    await backoff.wait()

    def close(self) -> None:
        if self.orphan is not None:
            return  # a thread still uses it: closing under it would crash the call
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None


def _timeout(seconds: float | None) -> float | None:
    return None if seconds is None else max(seconds, 0.0)
