"""The push DAG's wait: an async trigger that fires when a worker has work.

``WorkerWorkTrigger`` runs in the triggerer. It fires as soon as a running runner of its worker
has something to do (``status.has_work``: new events or records handed back for retry), and
otherwise ends quietly with a ``timeout`` event after ``timeout`` seconds. No database call
blocks the event loop: connecting and querying go through ``asyncio.to_thread``, and publish
notifications (``pg_notify('eventpush_publish', bus_id)``) are read from the socket with
``loop.add_reader``, so a publish wakes the trigger at once; ``poll_interval`` is the
fallback for due retries and missed notifications.

``eventpush.airflow.push_slice.PushSliceOperator`` checks once with ``worker_has_work`` in its
worker slot (cheap, and free when work is already waiting) and otherwise defers to the trigger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eventpush.airflow.connection import CONN_ID, adatabase_url
from eventpush.db import connect, connection
from eventpush.status import has_work

NOTIFY_CHANNEL = "eventpush_publish"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_POLL_S = 5.0

log = logging.getLogger(__name__)


def worker_has_work(url: str, worker: str) -> bool:
    """Whether a running runner of ``worker`` has events past its committed offset or retries
    due (one query)."""
    with connection(url) as conn:
        return has_work(conn, worker)


def _listen(url: str):
    conn = connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
    return conn


class WorkerWorkTrigger(BaseTrigger):
    """Fires ``{"status": "work", "worker": W}`` once ``W`` has work, or
    ``{"status": "timeout", ...}`` after ``timeout`` seconds without any."""

    def __init__(
        self,
        worker: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        poll_interval: float = DEFAULT_POLL_S,
        conn_id: str = CONN_ID,
    ) -> None:
        super().__init__()
        self.worker = worker
        self.timeout = float(timeout)
        self.poll_interval = float(poll_interval)
        self.conn_id = conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "eventpush.airflow.triggers.WorkerWorkTrigger",
            {
                "worker": self.worker,
                "timeout": self.timeout,
                "poll_interval": self.poll_interval,
                "conn_id": self.conn_id,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        deadline = started + self.timeout
        url = await adatabase_url(self.conn_id)
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        listener = None
        try:
            listener = await asyncio.to_thread(_listen, url)

            def on_readable() -> None:
                try:
                    listener.poll()
                except Exception:  # a broken socket: fall back to polling
                    loop.remove_reader(listener.fileno())
                listener.notifies.clear()
                woken.set()

            loop.add_reader(listener.fileno(), on_readable)
        except Exception as exc:
            log.warning("no publish notifications (%s): polling every %ss", exc, self.poll_interval)
        try:
            while True:
                woken.clear()
                if await asyncio.to_thread(worker_has_work, url, self.worker):
                    yield TriggerEvent(
                        {
                            "status": "work",
                            "worker": self.worker,
                            "waited_s": round(time.monotonic() - started, 3),
                        }
                    )
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    yield TriggerEvent(
                        {"status": "timeout", "worker": self.worker, "waited_s": self.timeout}
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.poll_interval, left)):
                        await woken.wait()
        finally:
            if listener is not None:
                with contextlib.suppress(Exception):
                    loop.remove_reader(listener.fileno())
                with contextlib.suppress(Exception):
                    listener.close()
