"""Group commit: concurrent publishers of one process share one transaction per bus (one
append, one commit), or one run of acknowledged JetStream publishes, instead of paying a
commit each.

A caller hands :meth:`GroupPublisher.publish` events already validated and placed
(``eventpush.publish.encode_event``) and waits; the committer task takes everything waiting
for a bus, hands it to the bus's source in one call (all or nothing), and wakes each caller
once the events are committed (PostgreSQL) or acknowledged (JetStream). There is no timer:
while commits run the next group gathers, so a lone request pays one commit and a crowd
shares them. Up to ``max_in_flight`` commits run at once, each on its own connection: on a
bus whose source chooses the queue at commit time (``publish_anywhere``: PostgreSQL, where
each commit takes a queue no other one holds, so the server's processes commit side by
side) the next group may start while one commits; any other bus has one commit at a time.
``publish_anywhere`` runs on the event loop itself, on an asynchronous connection (no
thread to hand each commit to and back, no GIL shared with one); other kinds' ``publish``
blocks, so it runs in a worker thread.

Such commits do not wake the workers themselves: a waker task of the process does, on a
connection of its own, for every bus committed since its last wake-up in one statement, at
most once every ``wake_interval``. As the commit's second statement the wake-up held the
connection the next group waited for, and under load it was a transaction (and a signal to
every listening backend) for each commit, where a worker woken once reads all that was
committed until then: bench/api.py's run of 16,689 commits now wakes 7,183 times (it shows
no change in requests/s beyond its spread, docs/BENCHMARKS.md).

A caller woken with success may answer its client: what it handed in is durable. A caller
woken with an error knows none of its events of that bus were stored (the source's publish
is all or nothing; a JetStream publish that failed half-way may have stored some, which AWS
also allows for an unanswered request).

Memory stays bounded: at most ``max_waiting`` events wait at once; further callers wait for
room before they enqueue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eventpush.db import Connection, connect, connect_on_loop
from eventpush.errors import first_line
from eventpush.publish import Prepared
from eventpush.sources import Bus, kind_for

if TYPE_CHECKING:
    from eventpush.db import LoopConnection

log = logging.getLogger("eventpush.group_publish")

MAX_GROUP_EVENTS = 5000  # one append at most this big; the rest goes in the next commit
MAX_WAITING_EVENTS = 20_000
# Commits in flight per process, each on its own connection. One is the default: the
# PostgreSQL source already lets the server's processes commit side by side (each takes a
# queue no other commit holds), and a second commit of the same process only split its
# groups: bench/api.py gave 4,095-4,465 requests/s with two against 4,598-4,956 with one
# (alternating, quiet machine), and more CPU a request. More may pay where commits wait on a
# slow disk rather than on CPU (one server process, a remote database).
MAX_IN_FLIGHT = 1
# At most one wake-up this often per process; the first after a quiet spell goes at once, so
# only a worker already woken within the interval may wait for the next one (that long at
# most). Under load commits end every few milliseconds: this keeps ~100 wake-ups a second
# from each process instead of one a commit.
WAKE_INTERVAL_S = 0.01
CLOSE_WAKE_S = 2.0  # a stop waits this long at most for the last wake-up
APPLICATION = "eventpush-api"  # the connections' application_name, as pg_stat_activity shows
WAKER_APPLICATION = "eventpush-api wake-ups"  # the waker's connection


@dataclass
class _Slot:
    """The connections of one commit in flight, each opened on first use and dropped after a
    failure: an asynchronous one for ``publish_anywhere``, a blocking one for ``publish``."""

    on_loop: LoopConnection | None = None
    blocking: Connection | None = None

    async def close(self) -> None:
        on_loop, blocking, self.on_loop, self.blocking = self.on_loop, self.blocking, None, None
        if on_loop is not None:
            with contextlib.suppress(Exception):
                await on_loop.close()
        if blocking is not None:
            with contextlib.suppress(Exception):
                blocking.close()


@dataclass
class _Waiting:
    events: list[Prepared]
    done: asyncio.Future


@dataclass
class GroupStats:
    """What the committer did, for ``/metrics``: totals only, so a server that runs for
    months holds no more than one that just started."""

    commits: int = 0
    events: int = 0
    failures: int = 0
    seconds: float = 0.0
    wakeups: int = 0


class GroupPublisher:
    """One committer task and up to ``max_in_flight`` commits in flight for the process,
    each with its own connections; start with :meth:`start` inside the event loop, stop
    with :meth:`close`."""

    def __init__(
        self,
        database_url: str,
        *,
        max_group: int = MAX_GROUP_EVENTS,
        max_waiting: int = MAX_WAITING_EVENTS,
        max_in_flight: int = MAX_IN_FLIGHT,
        wake_interval: float = WAKE_INTERVAL_S,
    ) -> None:
        self.url = database_url
        self.max_group = max_group
        self.max_waiting = max_waiting
        self.wake_interval = wake_interval
        self.stats = GroupStats()
        self._free: list[_Slot] = [_Slot() for _ in range(max(1, max_in_flight))]
        self._queues: dict[int, tuple[Bus, list[_Waiting]]] = {}
        self._busy_buses: set[int] = set()  # buses of a kind that takes one commit at a time
        self._commits: set[asyncio.Task] = set()
        self._waiting_events = 0
        self._wake: asyncio.Event | None = None
        self._room: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None
        # Buses committed and not yet announced, with their kind's announce.
        self._unannounced: dict[int, Callable[[LoopConnection, list[int]], Awaitable[None]]] = {}
        self._announce: asyncio.Event | None = None
        self._waker: asyncio.Task | None = None
        self._closing: asyncio.Event | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
        self._announce = asyncio.Event()
        self._closing = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="eventpush-group-commit")
        self._waker = asyncio.create_task(self._wake_workers(), name="eventpush-wake-workers")

    async def close(self) -> None:
        """Stop: commits in flight are cancelled (their callers never told "stored"), then
        the waker announces what committed before it ends (``CLOSE_WAKE_S`` at most)."""
        tasks = [t for t in (self._task, *self._commits) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._waker is not None:
            self._closing.set()
            self._announce.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(CLOSE_WAKE_S):  # cancels the waker when over
                    await self._waker
        for slot in self._free:
            await slot.close()

    async def publish(self, bus: Bus, events: list[Prepared]) -> None:
        """Return once ``events`` are committed on ``bus``; raise what the commit raised."""
        if not events:
            return
        assert self._wake is not None and self._room is not None, "start() first"
        if not self._room_for(len(events)):  # the lock and its wait only when full
            async with self._room:
                await self._room.wait_for(lambda: self._room_for(len(events)))
        self._waiting_events += len(events)
        done = asyncio.get_running_loop().create_future()
        _, waiting = self._queues.setdefault(bus.id, (bus, []))
        waiting.append(_Waiting(events, done))
        self._wake.set()
        await done

    def _room_for(self, count: int) -> bool:
        """Whether ``count`` more events may wait (any number, when none waits)."""
        return self._waiting_events == 0 or self._waiting_events + count <= self.max_waiting

    async def _run(self) -> None:
        """Start a commit for each bus with callers waiting, while a connection is free: a
        bus whose source chooses queues at commit time (``publish_anywhere``) may have
        several in flight (they take different queues), any other one at a time."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            for bus_id in list(self._queues):
                if not self._free:
                    break
                if bus_id in self._busy_buses:
                    continue
                bus, taken = self._take(bus_id)
                one_at_a_time = kind_for(bus.source_url).publish_anywhere is None
                if one_at_a_time:
                    self._busy_buses.add(bus_id)
                slot = self._free.pop()
                task = asyncio.create_task(self._commit(bus, taken, slot, one_at_a_time))
                self._commits.add(task)

    def _take(self, bus_id: int) -> tuple[Bus, list[_Waiting]]:
        """The callers of the next group of ``bus_id``: as many as fit ``max_group`` (at
        least one, whatever its size). A bus with callers left goes behind the other buses,
        so a busy bus cannot starve them when a connection frees up."""
        bus, waiting = self._queues.pop(bus_id)
        taken, size = [], 0
        while waiting and (not taken or size + len(waiting[0].events) <= self.max_group):
            item = waiting.pop(0)
            taken.append(item)
            size += len(item.events)
        if waiting:
            self._queues[bus_id] = (bus, waiting)
        return bus, taken

    async def _commit(
        self, bus: Bus, taken: list[_Waiting], slot: _Slot, one_at_a_time: bool
    ) -> None:
        events = [event for item in taken for event in item.events]
        started = time.perf_counter()
        try:
            await self._publish(slot, bus, events)
        except Exception as exc:
            await slot.close()  # the next group must not inherit a broken session
            self.stats.failures += 1
            for item in taken:
                if not item.done.done():
                    item.done.set_exception(exc)
        except BaseException:  # cancelled mid-statement: the session's state is unknown
            await slot.close()
            raise
        else:
            self.stats.commits += 1
            self.stats.events += len(events)
            for item in taken:
                if not item.done.done():
                    item.done.set_result(None)
        finally:
            self.stats.seconds += time.perf_counter() - started
            self._free.append(slot)
            if one_at_a_time:
                self._busy_buses.discard(bus.id)
            self._commits.discard(asyncio.current_task())
            self._wake.set()
            async with self._room:
                self._waiting_events -= len(events)
                self._room.notify_all()

    async def _publish(self, slot: _Slot, bus: Bus, events: list[Prepared]) -> None:
        """The source's all-or-nothing publish: ``publish_anywhere`` on the loop (its workers
        woken by the waker), any other kind's ``publish`` in a worker thread."""
        kind = kind_for(bus.source_url)
        if kind.publish_anywhere is not None:
            if slot.on_loop is None:
                slot.on_loop = await connect_on_loop(self.url, application_name=APPLICATION)
            await kind.publish_anywhere(slot.on_loop, bus, events)
            self._unannounced[bus.id] = kind.announce
            self._announce.set()
            return
        if slot.blocking is None:
            slot.blocking = await asyncio.to_thread(connect, self.url, application_name=APPLICATION)
        await asyncio.to_thread(kind.publish, slot.blocking, bus, events)

    async def _wake_workers(self) -> None:
        """Announce the buses committed since the last wake-up, one statement for all of them,
        then rest ``wake_interval`` before the next; once closing, announce what is left
        without resting, and end. A wake-up that fails is logged (once until one succeeds
        again) and not repeated: idle workers poll every second, so a lost one costs them
        that at most, as a crash between commit and wake-up always could."""
        conn: LoopConnection | None = None
        failing = False
        try:
            while True:
                await self._announce.wait()
                self._announce.clear()
                pending, self._unannounced = self._unannounced, {}
                if not pending:
                    if self._closing.is_set():
                        return
                    continue
                by_kind: dict[Callable, list[int]] = {}
                for bus_id, announce in pending.items():
                    by_kind.setdefault(announce, []).append(bus_id)
                try:
                    if conn is None:
                        conn = await connect_on_loop(self.url, application_name=WAKER_APPLICATION)
                    for announce, bus_ids in by_kind.items():
                        await announce(conn, bus_ids)
                    self.stats.wakeups += 1
                    failing = False
                except Exception as exc:
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                        conn = None
                    if not failing:
                        log.warning(
                            "events were committed, but waking the workers failed (idle "
                            "workers find them within a second): %s",
                            first_line(exc),
                        )
                    failing = True
                if not self._closing.is_set():  # rest, unless a stop comes meanwhile
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.wake_interval):
                            await self._closing.wait()
                if self._closing.is_set():
                    self._announce.set()  # what came in meanwhile, then the end
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
