"""The push DAG's wait: an async trigger that fires when a worker's slice is due.

``WorkerWorkTrigger`` runs in the triggerer. It fires as soon as ``slice_due`` says a slice of
its worker should run: a running runner has something to do (``status.has_work``: new events
or records handed back for retry), or a slice of the DAG holds the worker's lease (the next
slice takes over from it), or another process does (the sensor then skips). Otherwise it ends
quietly with a ``timeout`` event after ``timeout`` seconds. No database call blocks the event
loop: connecting and querying go through ``asyncio.to_thread``, and publish notifications
(``pg_notify('eventpush_publish', bus_id)``) are read from the socket with
``loop.add_reader``, so a publish wakes the trigger at once; ``poll_interval`` is the
fallback for due retries, missed notifications and a slice taking the lease.

``eventpush.airflow.push_slice.PushSliceSensor`` pokes once with ``slice_due`` in its worker
slot (cheap, and free when the slice is due already) and otherwise defers to the trigger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eventpush.airflow.connection import CONN_ID, adatabase_url
from eventpush.db import KEEPALIVES, Connection, connect, transaction
from eventpush.status import has_work

NOTIFY_CHANNEL = "eventpush_publish"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_POLL_S = 5.0
# A database that stops answering (a half-open connection after a failover or a network cut,
# a lock held for long) must not hold a check, a triggerer thread or the trigger past its
# timeout: the server cancels a check's statement after QUERY_TIMEOUT_S, the socket gives up
# on a silent peer (keepalives while waiting for an answer, tcp_user_timeout for a request
# never acknowledged), and the trigger stops waiting for a check at its own deadline.
QUERY_TIMEOUT_S = 10
DEADLINES = {**KEEPALIVES, "tcp_user_timeout": QUERY_TIMEOUT_S * 1000}

log = logging.getLogger(__name__)
T = TypeVar("T")


WORK = "work"  # the worker has events to push or retries due
HAND_OVER = "hand-over"  # a slice of the DAG pushes it: the next one takes over
ELSEWHERE = "elsewhere"  # another process (a standalone worker) holds its lease


@contextlib.contextmanager
def _bounded(url: str) -> Iterator[Connection]:
    """A connection whose statements and socket waits all have a deadline, closed on exit."""
    conn = connect(url, **DEADLINES)
    try:
        with transaction(conn) as cur:
            cur.execute(
                "SELECT set_config('statement_timeout', %s, false)", (f"{QUERY_TIMEOUT_S}s",)
            )
        yield conn
    finally:
        conn.close()


def worker_has_work(url: str, worker: str) -> bool:
    """Whether a running runner of ``worker`` has events past its committed offset or retries
    due (one query)."""
    with _bounded(url) as conn:
        return has_work(conn, worker)


def slice_due(url: str, worker: str) -> str | None:
    """Why a slice of ``worker`` should run now (``HAND_OVER``, ``WORK``), ``ELSEWHERE`` when
    a process other than a push slice holds its lease, or None when nothing is to be done."""
    from eventpush.push.store import SLICE_APP, lease_holder, worker_id

    with _bounded(url) as conn:
        holder = lease_holder(conn, worker_id(conn, worker))
        if holder == SLICE_APP:
            return HAND_OVER
        if holder is not None:
            return ELSEWHERE
        return WORK if has_work(conn, worker) else None


def _listen(url: str) -> Connection:
    conn = connect(url, **DEADLINES)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
    except BaseException:
        conn.close()
        raise
    return conn


async def _in_thread(deadline: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, waited for until ``deadline`` (``time.monotonic()``), then
    TimeoutError. A thread cannot be stopped: one given up on ends at its connection's own
    deadlines, and a connection it opens after all is closed, as nobody will use it."""
    if deadline <= time.monotonic():
        raise TimeoutError  # not even started: a thread left hanging helps nobody
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            return await asyncio.shield(job)
    except BaseException:
        job.add_done_callback(_discard)
        raise


def _discard(job: asyncio.Future) -> None:
    if job.cancelled() or job.exception() is not None:  # retrieved: nobody waits for it
        return
    if isinstance(job.result(), Connection):
        job.result().close()


class WorkerWorkTrigger(BaseTrigger):
    """Fires ``{"status": S, "worker": W}`` once a slice of ``W`` is due (``S``: what
    ``slice_due`` said), or ``{"status": "timeout", ...}`` after ``timeout`` seconds."""

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
            listener = await _in_thread(deadline, _listen, url)

            def on_readable() -> None:
                try:
                    listener.poll()
                except Exception:  # a broken socket: fall back to polling
                    loop.remove_reader(listener.fileno())
                listener.notifies.clear()
                woken.set()

            loop.add_reader(listener.fileno(), on_readable)
        except Exception as exc:
            why = str(exc) or "no answer in time"  # a TimeoutError says nothing itself
            log.warning("no publish notifications (%s): polling every %ss", why, self.poll_interval)
        try:
            while True:
                woken.clear()
                try:
                    due = await _in_thread(deadline, slice_due, url, self.worker)
                except TimeoutError:
                    log.warning(
                        "worker %s: no answer from the database by the trigger's timeout (%ss)",
                        self.worker,
                        self.timeout,
                    )
                    due = None
                if due is not None:
                    yield TriggerEvent(
                        {
                            "status": due,
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
