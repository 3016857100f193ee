"""Reading and matching: bus queues read in shared, aligned windows, each event parsed and
matched once against every rule of the worker on its bus.

Runners walk the windows with cursors of their own (see ``lanes``). Windows are cached up to
``CACHE_WINDOWS_PER_QUEUE`` per queue and within a total size, least recently used first out,
so runners near one another on a queue share one read while the cache's memory stays within a
fixed budget whatever the events weigh.

Runners of a queue drift apart by their own targets' pace, so a runner often reaches a window
the cache has already let go. An evicted window leaves its match verdicts behind
(:class:`Verdicts`: each row's offset and which runners matched it, a few bytes a row, far
more windows of them than of events): a runner reaching it fetches from the source only the
rows it must see (:class:`Sparse`), and one that matched none of them reads nothing. Verdicts
go with the windows when a bus's runners change, and one matched before a runner's newest
version (an older epoch) is never trusted.

The rows come from the bus's source (eventpush.sources: PostgreSQL or a broker), whose watcher
wakes the feeders waiting at the end of a queue (``BusSignals``); polling is the fallback.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from eventpush.sinks.contract import parse_event
from eventpush.sources import Chunk

log = logging.getLogger("eventpush.push")

WINDOW = 256
# Windows kept per queue, under the cache's byte budget. Runners of one queue drift apart by
# their own targets' pace, and a window evicted before the last of them reaches it is read
# again; 64 a queue cut those reads by a quarter but not the CPU per delivery, for ~40 MiB
# more (docs/BENCHMARKS.md, issue 34).
CACHE_WINDOWS_PER_QUEUE = 8
# Evicted windows' verdicts kept per queue (131,072 positions at 256 a window, ~2.5 KiB a
# window of 256 rows), and in all within 1/VERDICT_SHARE of the cache's byte budget.
VERDICTS_PER_QUEUE = 512
VERDICT_SHARE = 4
# A runner that must see more than this share of a kept window's rows reads the whole window
# again into the cache (one range read, shared with the runners near it), not row by row.
SPARSE_MOST = 0.5
_VERDICT_OVERHEAD = 300  # bytes a kept window costs beyond its rows (objects, dict entries)
_KIND_BYTES = 216  # a distinct set of runner ids (sys.getsizeof of a small frozenset)


@dataclass(slots=True)
class BusEvent:
    """An event read from a queue, with the ids of the worker's runners whose rule matches.
    ``parsed`` is None when the matches came from kept verdicts (nothing needed the dict);
    ``event`` parses it then."""

    offset: int
    message_id: str
    raw: str
    parsed: dict | None
    size: int
    matches: frozenset
    epoch: int = 0  # the cache's epoch when matched: older than a runner's, judged again

    @property
    def event(self) -> dict:
        if self.parsed is None:
            self.parsed = parse_event(self.raw)
        return self.parsed


@dataclass
class Window:
    start: int
    stop: int
    end: int  # next offset not yet read into this window
    events: list[BusEvent] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    size: int = 0  # bytes of event text held
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True)
class Verdicts:
    """What is kept of an evicted window (read to its stop): each row's offset and the set of
    runner ids whose rule matched it (``kinds[codes[i]]``), matched at ``epoch`` or later."""

    stop: int
    epoch: int
    offsets: array
    codes: bytes | array
    kinds: tuple[frozenset, ...]
    size: int  # bytes it holds, about

    @classmethod
    def of(cls, window: Window) -> Verdicts:
        index: dict[frozenset, int] = {}
        codes = []
        epoch = None
        for ev in window.events:
            code = index.get(ev.matches)
            if code is None:
                code = index[ev.matches] = len(index)
            codes.append(code)
            if epoch is None or ev.epoch < epoch:
                epoch = ev.epoch
        kinds = tuple(index)
        packed = bytes(codes) if len(kinds) <= 256 else array("I", codes)
        offsets = array("q", window.offsets)
        size = (
            _VERDICT_OVERHEAD
            + offsets.itemsize * len(offsets)
            + len(codes) * (1 if isinstance(packed, bytes) else 4)
            + _KIND_BYTES * len(kinds)
        )
        return cls(window.stop, epoch or 0, offsets, packed, kinds, size)


@dataclass(slots=True)
class Sparse:
    """One runner's part of a window whose verdicts were kept: ``events``, the rows it must
    see (matched by it, or before its newest version took effect: judged again), fetched
    alone; every other row of ``offsets`` (the whole window's) is one its rule did not match.
    ``epoch`` and ``exact_from``: what the choice trusted (a runner whose own moved on since
    asks again)."""

    events: list[BusEvent]
    offsets: array
    stop: int
    epoch: int
    exact_from: int


def match_rows(rows: list, index, epoch: int = 0) -> tuple[list[BusEvent], list[int]]:
    """Parse a window's rows and match each once against every rule (runs in a thread);
    ``epoch``: the cache's epoch the index was built at."""
    parsed = [parse_event(raw) for _, _, raw in rows]
    offsets = [row[0] for row in rows]
    # The whole window against the index at once: events alike are matched once.
    each = getattr(index, "matching_each", None)  # a RuleIndex's; else one by one
    matches = each(parsed) if each else [frozenset(index.matching(e)) for e in parsed]
    events = [
        BusEvent(offset, message_id, raw, event, len(raw), found, epoch)
        for (offset, message_id, raw), event, found in zip(rows, parsed, matches, strict=True)
    ]
    return events, offsets


def _from_kept(rows: list, kept: Verdicts | None, epoch: int) -> list[BusEvent] | None:
    """A window read again, its rows given the verdicts it left behind, neither parsed nor
    matched: when they were reached at this very epoch (no runner of the bus changed since)
    and cover every row read. A runner wanting most of a window it has verdicts for reads it
    whole again (SPARSE_MOST); when a queue holds long runs of one rule's events, that runner
    comes back to every window, and parsing and matching it again was a tenth of its CPU a
    delivery (docs/BENCHMARKS.md, issue 34)."""
    if kept is None or kept.epoch != epoch:
        return None
    at = {offset: i for i, offset in enumerate(kept.offsets)}
    codes, kinds = kept.codes, kept.kinds
    events = []
    for offset, message_id, raw in rows:
        i = at.get(offset)
        if i is None:  # a row it never saw: matched as usual
            return None
        events.append(BusEvent(offset, message_id, raw, None, len(raw), kinds[codes[i]], epoch))
    return events


def parse_rows(rows: list, kinds: dict[int, frozenset], epoch: int) -> list[BusEvent]:
    """Rows fetched by offset, parsed, with the verdicts kept for them (runs in a thread)."""
    return [
        BusEvent(offset, message_id, raw, parse_event(raw), len(raw), kinds[offset], epoch)
        for offset, message_id, raw in rows
        if offset in kinds
    ]


def _unlist(per_queue: dict[tuple[int, int], OrderedDict], key: tuple[int, int, int]) -> None:
    """``key`` out of its queue's order (the queue's entry too once it holds none)."""
    queue = key[:2]
    keys = per_queue[queue]
    del keys[key]
    if not keys:
        del per_queue[queue]


class WindowCache:
    """Aligned windows of every queue this worker reads, within ``max_bytes`` in all, and the
    verdicts of windows let go, within ``max_bytes / VERDICT_SHARE``."""

    def __init__(
        self,
        read: Callable[[int, int, int, int], Awaitable[Chunk]],
        index_for: Callable[[int], object],
        max_bytes: int,
        window_for: Callable[[int], int] = lambda bus_id: WINDOW,
        read_at: Callable[[int, int, list[int]], Awaitable[list | None]] | None = None,
    ) -> None:
        self.read = read  # a source's read (eventpush.sources.Reader.read) for one bus
        # A source's read of given offsets (Reader.read_offsets): None, or None from it, when
        # the source reads whole windows only.
        self.read_at = read_at
        self.index_for = index_for
        self.max_bytes = max_bytes
        self.window_for = window_for  # positions per window of the bus's queues
        self.windows: OrderedDict[tuple[int, int, int], Window] = OrderedDict()
        # Each queue's windows, least recently used first: the per-queue bound's eviction
        # looks at that queue's windows only, however many other queues are cached.
        self.per_queue: dict[tuple[int, int], OrderedDict[tuple[int, int, int], None]] = {}
        self.bytes = 0
        # Verdicts of evicted windows, kept the same way under bounds of their own.
        self.verdicts: OrderedDict[tuple[int, int, int], Verdicts] = OrderedDict()
        self.verdicts_per_queue: dict[tuple[int, int], OrderedDict] = {}
        self.verdict_bytes = 0
        # Moves on whenever a bus's runners change: events matched at an older epoch than a
        # runner's own were matched without its newest version (push/versions.py).
        self.epoch = 0

    def forget_bus(self, bus_id: int) -> None:
        """The bus's runners changed: cached matches and kept verdicts are stale."""
        self.epoch += 1
        for key in [k for k in self.windows if k[0] == bus_id]:
            self._drop(key)
        for key in [k for k in self.verdicts if k[0] == bus_id]:
            self._drop_verdicts(key)

    def _drop(self, key: tuple[int, int, int]) -> Window:
        window = self.windows.pop(key)
        self.bytes -= window.size
        _unlist(self.per_queue, key)
        return window

    def _let_go(self, key: tuple[int, int, int]) -> None:
        """An evicted window: its verdicts are kept when it was read to its stop (a window
        still being read has rows it has not matched)."""
        window = self._drop(key)
        if window.end >= window.stop and window.events:
            self._keep(key, Verdicts.of(window))

    def _keep(self, key: tuple[int, int, int], kept: Verdicts) -> None:
        if key in self.verdicts:
            self._drop_verdicts(key)
        self.verdicts[key] = kept
        self.verdict_bytes += kept.size
        queue = key[:2]
        keys = self.verdicts_per_queue.setdefault(queue, OrderedDict())
        keys[key] = None
        # Least recently used out, as for windows: past the queue's count, then past the budget.
        while len(keys) > VERDICTS_PER_QUEUE:
            self._drop_verdicts(next(iter(keys)))
        budget = self.max_bytes // VERDICT_SHARE
        while self.verdict_bytes > budget and self.verdicts:
            self._drop_verdicts(next(iter(self.verdicts)))

    def _drop_verdicts(self, key: tuple[int, int, int]) -> None:
        kept = self.verdicts.pop(key)
        self.verdict_bytes -= kept.size
        _unlist(self.verdicts_per_queue, key)

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
                self._let_go(key)
        # Over the budget, the least recently used window goes first, one at a time: with
        # many queues cached the budget binds often, and no list of every window is made.
        while self.bytes > self.max_bytes and len(self.windows) > 1:
            key = next(iter(self.windows))
            if key == keep:  # in use (touched before a read that then filled it): kept
                self.windows.move_to_end(key)
                continue
            self._let_go(key)

    async def events_from(
        self, bus_id: int, queue_id: int, pos: int, who: tuple[int, int, int] | None = None
    ) -> list[BusEvent] | Sparse:
        """Events at positions >= pos in the first window from pos's on that has any, reading
        what the cache lacks; [] at the end of the queue. Positions may have gaps (a broker's
        sequence): a window read to its stop with nothing past pos is stepped over.

        ``who``: the runner asking (id, epoch, offset from which its newest version judges,
        on this queue). Given, a window whose verdicts were kept answers with that runner's
        part of it alone (:class:`Sparse`), when it may trust them."""
        while True:
            events, known = await self._events_in_window(bus_id, queue_id, pos, who)
            if events or known <= pos:
                return events
            pos = known

    async def _events_in_window(
        self, bus_id: int, queue_id: int, pos: int, who: tuple[int, int, int] | None
    ) -> tuple[list[BusEvent] | Sparse, int]:
        """Events >= pos in pos's window, and the position below which the queue is known
        (pos when it is not known past the window's events)."""
        size = self.window_for(bus_id)
        start = pos - pos % size
        key = (bus_id, queue_id, start)
        window = self.windows.get(key)
        if window is None:
            kept = self.verdicts.get(key)
            if kept is not None and who is not None:
                found = await self._from_verdicts(key, kept, pos, who)
                if found is not None:
                    return found
                window = self.windows.get(key)  # read meanwhile by another runner
        kept = None
        if window is None:
            window = self.windows[key] = Window(start, start + size, start)
            self.per_queue.setdefault(key[:2], OrderedDict())[key] = None
            kept = self.verdicts.get(key)
            if kept is not None:  # read again: its verdicts are kept anew when it goes
                self._drop_verdicts(key)
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
                    events = _from_kept(chunk.rows, kept, epoch)
                    if events is not None:
                        offsets = [e.offset for e in events]
                    else:
                        # Not in the read's own thread call: one hand-over fewer, but it holds
                        # one of the reader's two connections while it matches, and was slower
                        # in the issue 34 bench (docs/BENCHMARKS.md).
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

    async def _from_verdicts(
        self, key: tuple[int, int, int], kept: Verdicts, pos: int, who: tuple[int, int, int]
    ) -> tuple[list[BusEvent] | Sparse, int] | None:
        """The runner's part of a window whose verdicts were kept; None when it must read
        the whole window (verdicts older than the runner, most rows wanted, or a source that
        reads whole windows only)."""
        rid, epoch, exact_from = who
        offsets = kept.offsets
        i = bisect.bisect_left(offsets, pos)
        if i == len(offsets):  # nothing left in it: the next window
            return [], kept.stop
        if kept.epoch < epoch:  # matched before the runner's newest version: never trusted
            return None
        hit = [rid in kind for kind in kept.kinds]
        codes = kept.codes
        if exact_from <= pos:
            need = [j for j in range(i, len(offsets)) if hit[codes[j]]] if any(hit) else []
        else:  # rows before its newest version took effect are judged again: fetched too
            need = [j for j in range(i, len(offsets)) if hit[codes[j]] or offsets[j] < exact_from]
        if len(need) > SPARSE_MOST * (len(offsets) - i):
            return None
        self.verdicts.move_to_end(key)
        self.verdicts_per_queue[key[:2]].move_to_end(key)
        events: list[BusEvent] = []
        if need:
            if self.read_at is None:
                return None
            rows = await self.read_at(key[0], key[1], [offsets[j] for j in need])
            if rows is None:
                return None
            kinds = {offsets[j]: kept.kinds[codes[j]] for j in need}
            events = await asyncio.to_thread(parse_rows, rows, kinds, kept.epoch)
        return Sparse(events, offsets, kept.stop, kept.epoch, exact_from), pos


class BusSignals:
    """One event per bus, set when a publish on it is heard."""

    def __init__(self) -> None:
        self.events: dict[int, asyncio.Event] = {}

    def signal(self, bus_id: int) -> asyncio.Event:
        event = self.events.get(bus_id)
        if event is None or event.is_set():
            event = self.events[bus_id] = asyncio.Event()
        return event

    def forget(self, bus_id: int) -> None:
        """The bus is no longer read here (its feeders are gone): its event goes too."""
        self.events.pop(bus_id, None)

    def wake(self, bus_id: int) -> None:
        """Something may have been published on the bus: its waiting feeders look again."""
        event = self.events.get(bus_id)
        if event is not None:
            event.set()
