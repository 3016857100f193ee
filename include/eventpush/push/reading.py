"""Reading and matching: bus queues read in shared, aligned windows, each event parsed and
matched once against every rule of the worker on its bus.

Runners walk the windows with cursors of their own (see ``lanes``). Windows are cached up to
``CACHE_WINDOWS_PER_QUEUE`` per queue and within a total size, least recently used first out,
so runners near one another on a queue share one read while the cache's memory stays within a
fixed budget whatever the events weigh.
The rows come from the bus's source (eventpush.sources: PostgreSQL or a broker), whose watcher
wakes the feeders waiting at the end of a queue (``BusSignals``); polling is the fallback.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from eventpush.sources import Chunk

log = logging.getLogger("eventpush.push")

WINDOW = 256
# Windows kept per queue, under the cache's byte budget. Runners of one queue drift apart by
# their own targets' pace, and a window evicted before the last of them reaches it is read
# again; 64 a queue cut those reads by a quarter but not the CPU per delivery, for ~40 MiB
# more (docs/BENCHMARKS.md, issue 34).
CACHE_WINDOWS_PER_QUEUE = 8
_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class BusEvent:
    """An event read from a queue, with the ids of the worker's runners whose rule matches."""

    offset: int
    message_id: str
    raw: str
    event: dict
    size: int
    matches: frozenset
    epoch: int = 0  # the cache's epoch when matched: older than a runner's, judged again


@dataclass
class Window:
    start: int
    stop: int
    end: int  # next offset not yet read into this window
    events: list[BusEvent] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    size: int = 0  # bytes of event text held
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _parse(raw: str) -> dict:
    """msgspec (several times faster than json); json for what msgspec refuses and PostgreSQL
    may still hold, such as a number past a float's range."""
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def match_rows(rows: list, index, epoch: int = 0) -> tuple[list[BusEvent], list[int]]:
    """Parse a window's rows and match each once against every rule (runs in a thread);
    ``epoch``: the cache's epoch the index was built at."""
    parsed = [_parse(raw) for _, _, raw in rows]
    offsets = [row[0] for row in rows]
    # The whole window against the index at once: events alike are matched once.
    each = getattr(index, "matching_each", None)  # a RuleIndex's; else one by one
    matches = each(parsed) if each else [frozenset(index.matching(e)) for e in parsed]
    events = [
        BusEvent(offset, message_id, raw, event, len(raw), found, epoch)
        for (offset, message_id, raw), event, found in zip(rows, parsed, matches, strict=True)
    ]
    return events, offsets


class WindowCache:
    """Aligned windows of every queue this worker reads, within ``max_bytes`` in all."""

    def __init__(
        self,
        read: Callable[[int, int, int, int], Awaitable[Chunk]],
        index_for: Callable[[int], object],
        max_bytes: int,
        window_for: Callable[[int], int] = lambda bus_id: WINDOW,
    ) -> None:
        self.read = read  # a source's read (eventpush.sources.Reader.read) for one bus
        self.index_for = index_for
        self.max_bytes = max_bytes
        self.window_for = window_for  # positions per window of the bus's queues
        self.windows: OrderedDict[tuple[int, int, int], Window] = OrderedDict()
        # Each queue's windows, least recently used first: the per-queue bound's eviction
        # looks at that queue's windows only, however many other queues are cached.
        self.per_queue: dict[tuple[int, int], OrderedDict[tuple[int, int, int], None]] = {}
        self.bytes = 0
        # Moves on whenever a bus's runners change: events matched at an older epoch than a
        # runner's own were matched without its newest version (push/versions.py).
        self.epoch = 0

    def forget_bus(self, bus_id: int) -> None:
        """The bus's runners changed: cached matches are stale."""
        self.epoch += 1
        for key in [k for k in self.windows if k[0] == bus_id]:
            self._drop(key)

    def _drop(self, key: tuple[int, int, int]) -> None:
        window = self.windows.pop(key)
        self.bytes -= window.size
        queue = key[:2]
        windows = self.per_queue[queue]
        del windows[key]
        if not windows:
            del self.per_queue[queue]

    def _evict(self, keep: tuple[int, int, int]) -> None:
        """Least recently used windows out until both bounds hold (never the one in use)."""
        queue = keep[:2]
        # Each bound's scan only when it is passed (on every new window, the scans of every
        # window held were a cost of their own).
        windows = self.per_queue.get(queue)
        if windows is not None and len(windows) > CACHE_WINDOWS_PER_QUEUE:
            for key in [k for k in windows if k != keep]:
                if len(windows) <= CACHE_WINDOWS_PER_QUEUE:
                    break
                self._drop(key)
        # Over the budget, the least recently used window goes first, one at a time: with
        # many queues cached the budget binds often, and no list of every window is made.
        while self.bytes > self.max_bytes and len(self.windows) > 1:
            key = next(iter(self.windows))
            if key == keep:  # in use (touched before a read that then filled it): kept
                self.windows.move_to_end(key)
                continue
            self._drop(key)

    async def events_from(self, bus_id: int, queue_id: int, pos: int) -> list[BusEvent]:
        """Events at positions >= pos in the first window from pos's on that has any, reading
        what the cache lacks; [] at the end of the queue. Positions may have gaps (a broker's
        sequence): a window read to its stop with nothing past pos is stepped over."""
        while True:
            events, known = await self._events_in_window(bus_id, queue_id, pos)
            if events or known <= pos:
                return events
            pos = known

    async def _events_in_window(
        self, bus_id: int, queue_id: int, pos: int
    ) -> tuple[list[BusEvent], int]:
        """Events >= pos in pos's window, and the position below which the queue is known
        (pos when it is not known past the window's events)."""
        size = self.window_for(bus_id)
        start = pos - pos % size
        key = (bus_id, queue_id, start)
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = Window(start, start + size, start)
            self.per_queue.setdefault(key[:2], OrderedDict())[key] = None
            self._evict(key)
        else:
            self.windows.move_to_end(key)
            self.per_queue[key[:2]].move_to_end(key)
        known = window.end
        async with window.lock:
            # A window always holds [start, end): read from where it ends, never from pos,
            # so a runner behind another on the same window finds every offset it needs.
            if window.end <= pos:
                chunk = await self.read(bus_id, queue_id, window.end, window.stop)
                known = chunk.end
                if chunk.rows:
                    epoch = self.epoch  # the index below reflects every change before it
                    events, offsets = await asyncio.to_thread(
                        match_rows, chunk.rows, self.index_for(bus_id), epoch
                    )
                    window.events.extend(events)
                    window.offsets.extend(offsets)
                    added = sum(e.size for e in events)
                    window.size += added
                    if self.windows.get(key) is window:  # not forgotten while we read
                        self.bytes += added
                        self._evict(key)
                window.end = max(window.end, min(known, window.stop))
        i = bisect.bisect_left(window.offsets, pos)
        if i < len(window.events) or window.end < window.stop:
            return window.events[i:], pos
        return [], max(known, window.stop)


class BusSignals:
    """One event per bus, set when a publish on it is heard."""

    def __init__(self) -> None:
        self.events: dict[int, asyncio.Event] = {}

    def signal(self, bus_id: int) -> asyncio.Event:
        event = self.events.get(bus_id)
        if event is None or event.is_set():
            event = self.events[bus_id] = asyncio.Event()
        return event

    def wake(self, bus_id: int) -> None:
        """Something may have been published on the bus: its waiting feeders look again."""
        event = self.events.get(bus_id)
        if event is not None:
            event.set()
