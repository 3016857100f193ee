"""Group commit: concurrent publishers of one process share one transaction (one COPY, one
commit) per bus, or one run of acknowledged JetStream publishes, instead of paying a commit
each.

A caller hands :meth:`GroupPublisher.publish` events already validated and placed
(``eventpush.publish.encode_event``) and waits; the committer task takes everything waiting
for a bus, hands it to the bus's source in one ``publish`` call (all or nothing), and wakes
each caller once that call returned, that is once the events are committed (PostgreSQL) or
acknowledged (JetStream). There is no timer: while one commit runs the next group gathers,
so a lone request pays one commit and a crowd shares them. A caller woken with success may
answer its client: what it handed in is durable. A caller woken with an error knows none of
its events of that bus were stored (the source's publish is all or nothing; a JetStream
publish that failed half-way may have stored some, which AWS also allows for an unanswered
request).

Memory stays bounded: at most ``max_waiting`` events wait at once; further callers wait for
room before they enqueue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eventpush.db import Connection, connect
from eventpush.publish import Prepared
from eventpush.sources import Bus, kind_for

log = logging.getLogger("eventpush.group_publish")

MAX_GROUP_EVENTS = 5000  # one COPY at most this big; the rest goes in the next commit
MAX_WAITING_EVENTS = 20_000


@dataclass
class _Waiting:
    events: list[Prepared]
    done: asyncio.Future


@dataclass
class GroupStats:
    """What the committer did, for ``/metrics``."""

    commits: int = 0
    events: int = 0
    failures: int = 0
    seconds: float = 0.0
    sizes: list[int] = field(default_factory=list)  # events per commit, since last read

    def take_sizes(self) -> list[int]:
        sizes, self.sizes = self.sizes, []
        return sizes


class GroupPublisher:
    """One committer task and one database connection for the process; start with
    :meth:`start` inside the event loop, stop with :meth:`close`."""

    def __init__(
        self,
        database_url: str,
        *,
        max_group: int = MAX_GROUP_EVENTS,
        max_waiting: int = MAX_WAITING_EVENTS,
        connect_fn: Callable[[str], Connection] | None = None,
    ) -> None:
        self.url = database_url
        self.max_group = max_group
        self.max_waiting = max_waiting
        self.stats = GroupStats()
        self._connect = connect_fn or (lambda url: connect(url, application_name="eventpush-api"))
        self._conn: Connection | None = None
        self._queues: dict[int, tuple[Bus, list[_Waiting]]] = {}
        self._waiting_events = 0
        self._wake: asyncio.Event | None = None
        self._room: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
        self._task = asyncio.create_task(self._run(), name="eventpush-group-commit")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    async def publish(self, bus: Bus, events: list[Prepared]) -> None:
        """Return once ``events`` are committed on ``bus``; raise what the commit raised."""
        if not events:
            return
        assert self._wake is not None and self._room is not None, "start() first"
        async with self._room:
            await self._room.wait_for(
                lambda: (
                    self._waiting_events == 0
                    or self._waiting_events + len(events) <= self.max_waiting
                )
            )
            self._waiting_events += len(events)
        done = asyncio.get_running_loop().create_future()
        _, waiting = self._queues.setdefault(bus.id, (bus, []))
        waiting.append(_Waiting(events, done))
        self._wake.set()
        await done

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queues:
                for bus_id in list(self._queues):
                    await self._commit_one(bus_id)

    def _take(self, bus_id: int) -> tuple[Bus, list[_Waiting]]:
        """The callers of the next group of ``bus_id``: as many as fit ``max_group`` (at
        least one, whatever its size)."""
        bus, waiting = self._queues[bus_id]
        taken, size = [], 0
        while waiting and (not taken or size + len(waiting[0].events) <= self.max_group):
            item = waiting.pop(0)
            taken.append(item)
            size += len(item.events)
        if not waiting:
            del self._queues[bus_id]
        return bus, taken

    async def _commit_one(self, bus_id: int) -> None:
        bus, taken = self._take(bus_id)
        events = [event for item in taken for event in item.events]
        started = time.perf_counter()
        try:
            await asyncio.to_thread(self._publish, bus, events)
        except Exception as exc:
            self.stats.failures += 1
            for item in taken:
                if not item.done.done():
                    item.done.set_exception(exc)
        else:
            self.stats.commits += 1
            self.stats.events += len(events)
            self.stats.sizes.append(len(events))
            for item in taken:
                if not item.done.done():
                    item.done.set_result(None)
        finally:
            self.stats.seconds += time.perf_counter() - started
            async with self._room:
                self._waiting_events -= len(events)
                self._room.notify_all()

    def _publish(self, bus: Bus, events: list[Prepared]) -> None:
        """In a worker thread: the source's all-or-nothing publish on our one connection,
        opened again after a failure (the next group must not inherit a broken session)."""
        if self._conn is None:
            self._conn = self._connect(self.url)
        try:
            kind_for(bus.source_url).publish(self._conn, bus, events)
        except BaseException:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
            raise
