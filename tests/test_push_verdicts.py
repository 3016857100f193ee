"""Verdicts kept for evicted windows (push/reading.py): a runner that reaches a window the cache
let go fetches only the rows its own rule matched, one whose rule matched none reads nothing,
and a change of the bus's runners drops them so events are matched again."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import controls, reading, run_worker
from eventpush.push.reading import (
    CACHE_WINDOWS_PER_QUEUE,
    VERDICT_SHARE,
    WINDOW,
    Sparse,
    Verdicts,
    Window,
    WindowCache,
)
from eventpush.sources import Chunk
from eventpush.sources.postgres import PostgresReader

WINDOWS = CACHE_WINDOWS_PER_QUEUE + 4  # walked by the first runner: window 0 is let go


class Source:
    """Events whose ``k`` is their offset mod 4; counts what the cache asked of it."""

    def __init__(self, by_offset: bool = True) -> None:
        self.ranges: list[tuple[int, int, int]] = []
        self.picks: list[list[int]] = []
        self.by_offset = by_offset

    @staticmethod
    def row(queue: int, offset: int) -> tuple[int, str, str]:
        return (offset, f"m{queue}-{offset}", json.dumps({"k": offset % 4, "pad": "x" * 100}))

    async def read(self, bus_id, queue_id, start, stop):
        self.ranges.append((queue_id, start, stop))
        return Chunk([self.row(queue_id, o) for o in range(start, stop)], stop)

    async def read_at(self, bus_id, queue_id, offsets):
        if not self.by_offset:
            return None
        self.picks.append(list(offsets))
        return [self.row(queue_id, o) for o in offsets]


class Index:
    """Runner ``r`` matches events whose ``k`` is ``wanted[r]``."""

    def __init__(self, wanted: dict[int, int]) -> None:
        self.wanted = wanted

    def matching(self, event):
        return [rid for rid, k in self.wanted.items() if event["k"] == k]


def cache_for(source: Source, index: Index, max_bytes: int = 1 << 30) -> WindowCache:
    return WindowCache(source.read, lambda bus_id: index, max_bytes, read_at=source.read_at)


async def walk(cache: WindowCache, who, windows: int = WINDOWS, queue: int = 0) -> None:
    for pos in range(0, windows * WINDOW, WINDOW):
        got = await cache.events_from(1, queue, pos, who)
        assert got.__class__ is list and got[0].offset == pos


def test_a_lagging_runner_fetches_only_its_own_rows_and_a_filtering_one_none():
    source = Source()
    cache = cache_for(source, Index({1: 1, 2: 2}))

    async def main() -> None:
        await walk(cache, (1, 0, 0))  # runner 1 runs ahead: window 0 goes, its verdicts stay
        assert (1, 0, 0) not in cache.windows and (1, 0, 0) in cache.verdicts
        source.ranges.clear()
        got = await cache.events_from(1, 0, 10, (2, 0, 0))
        assert isinstance(got, Sparse) and got.stop == WINDOW
        mine = [o for o in range(10, WINDOW) if o % 4 == 2]
        assert source.picks == [mine], "only runner 2's rows from pos on, by offset"
        assert [e.offset for e in got.events] == mine
        assert all(e.matches == frozenset({2}) and e.event["k"] == 2 for e in got.events)
        assert list(got.offsets) == list(range(WINDOW)), "every row, to pass the others over"
        got = await cache.events_from(1, 0, 0, (3, 0, 0))  # a runner its rules never match
        assert isinstance(got, Sparse) and got.events == []
        assert len(source.picks) == 1 and source.ranges == [], "nothing read for it"
        assert (1, 0, 0) not in cache.windows, "a sparse fetch is the runner's, not cached"

    asyncio.run(main())


def test_rows_before_a_runners_newest_version_are_fetched_to_be_judged_again():
    source = Source()
    cache = cache_for(source, Index({1: 1, 2: 2}))

    async def main() -> None:
        await walk(cache, (1, 0, 0))
        got = await cache.events_from(1, 0, 0, (2, 0, 40))  # its newest version from 40
        want = [o for o in range(WINDOW) if o < 40 or o % 4 == 2]
        assert source.picks == [want] and [e.offset for e in got.events] == want
        assert got.exact_from == 40

    asyncio.run(main())


def test_a_change_of_the_bus_runners_drops_kept_verdicts_and_events_are_matched_again():
    source = Source()
    index = Index({1: 1, 2: 2})
    cache = cache_for(source, index)

    async def main() -> None:
        await walk(cache, (1, 0, 0))
        assert cache.verdicts
        index.wanted = {1: 1, 2: 3}  # runner 2's rule now matches k == 3
        cache.forget_bus(1)
        assert not cache.verdicts and cache.verdict_bytes == 0
        assert not cache.verdicts_per_queue
        source.ranges.clear()
        got = await cache.events_from(1, 0, 0, (2, cache.epoch, 0))
        assert got.__class__ is list, "the whole window read again"
        assert source.ranges == [(0, 0, WINDOW)] and source.picks == []
        assert {e.offset for e in got if 2 in e.matches} == set(range(3, WINDOW, 4))

    asyncio.run(main())


def test_verdicts_older_than_the_runners_epoch_are_never_trusted():
    source = Source()
    cache = cache_for(source, Index({1: 1, 2: 2}))

    async def main() -> None:
        await walk(cache, (1, 0, 0))
        kept = cache.verdicts[(1, 0, 0)]
        source.ranges.clear()
        got = await cache.events_from(1, 0, 0, (2, kept.epoch + 1, 0))
        assert got.__class__ is list and source.ranges == [(0, 0, WINDOW)]
        assert source.picks == []
        assert (1, 0, 0) not in cache.verdicts, "read again: kept anew when it goes"

    asyncio.run(main())


def test_a_runner_that_wants_most_of_a_window_reads_it_whole_and_a_source_without_picks_too():
    source = Source(by_offset=False)
    cache = cache_for(source, Index({1: 1, 2: 2}))

    async def main() -> None:
        await walk(cache, (1, 0, 0))
        source.ranges.clear()
        got = await cache.events_from(1, 0, 0, (3, 0, 0))  # matches none: no read at all
        assert isinstance(got, Sparse) and got.events == [] and source.ranges == []
        got = await cache.events_from(1, 0, 0, (2, 0, 0))  # the source cannot pick rows
        assert got.__class__ is list and source.ranges == [(0, 0, WINDOW)]

    asyncio.run(main())
    source = Source()
    cache = cache_for(source, Index({1: 1, 2: 2}))

    async def most() -> None:
        await walk(cache, (1, 0, 0))
        source.ranges.clear()
        # runner 2's version took effect at 200: rows 0-199 must all be judged again
        got = await cache.events_from(1, 0, 0, (2, 0, 200))
        assert got.__class__ is list and source.ranges == [(0, 0, WINDOW)]
        assert source.picks == []

    asyncio.run(most())


class CountingIndex(Index):
    def __init__(self, wanted: dict[int, int]) -> None:
        super().__init__(wanted)
        self.calls = 0

    def matching(self, event):
        self.calls += 1
        return super().matching(event)


def test_a_window_read_again_at_its_verdicts_epoch_is_neither_parsed_nor_matched():
    """A runner wanting most of a window it has verdicts for reads it whole again (a queue in
    long runs of one rule's events sends it back to every window): the rows take their kept
    verdicts, unparsed until something asks for the dict. Past a change of any bus's runners
    (a newer epoch) they are matched again."""
    source = Source()
    index = CountingIndex({1: 1, 2: 2})
    cache = cache_for(source, index)

    async def main() -> None:
        await walk(cache, (1, 0, 0))
        calls = index.calls
        got = await cache.events_from(1, 0, 0, (2, 0, 200))  # rows 0-199 judged again
        assert got.__class__ is list and source.ranges[-1] == (0, 0, WINDOW)
        assert index.calls == calls, "the kept verdicts, not the index"
        assert all(e.parsed is None for e in got)
        assert {e.offset for e in got if 2 in e.matches} == set(range(2, WINDOW, 4))
        assert {e.offset for e in got if 1 in e.matches} == set(range(1, WINDOW, 4))
        assert got[7].event == json.loads(Source.row(0, 7)[2]) and got[7].parsed is not None
        # Window 1 went too; now the epoch moves on (another bus's runners changed).
        assert (1, 0, WINDOW) in cache.verdicts
        cache.forget_bus(2)
        calls = index.calls
        got = await cache.events_from(1, 0, WINDOW, (2, cache.epoch, 0))
        assert got.__class__ is list and index.calls == calls + WINDOW, "matched again"
        assert all(e.parsed is not None for e in got)

    asyncio.run(main())


@pytest.mark.parametrize("queues", [1, 40])
def test_kept_verdicts_stay_within_their_bounds(queues, monkeypatch):
    monkeypatch.setattr(reading, "VERDICTS_PER_QUEUE", 16)
    source = Source()
    # A budget of 40 windows of events: verdicts may hold a quarter of it.
    cache = cache_for(source, Index({1: 1, 2: 2}), max_bytes=40 * WINDOW * 120)

    async def main() -> None:
        for queue in range(queues):
            await walk(cache, (1, 0, 0), windows=CACHE_WINDOWS_PER_QUEUE + 30, queue=queue)
            assert cache.verdict_bytes <= cache.max_bytes // VERDICT_SHARE
            assert all(len(keys) <= 16 for keys in cache.verdicts_per_queue.values())

    asyncio.run(main())
    assert cache.verdict_bytes == sum(v.size for v in cache.verdicts.values())
    assert sum(map(len, cache.verdicts_per_queue.values())) == len(cache.verdicts)
    # What a kept window takes in memory, measured, is within what the budget counts for it,
    # and that is a few bytes a row.
    window = Window(0, WINDOW, WINDOW)
    window.events, window.offsets = reading.match_rows(
        [Source.row(0, o) for o in range(WINDOW)], Index({1: 1, 2: 2})
    )
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [Verdicts.of(window) for _ in range(50)]
    used = (tracemalloc.get_traced_memory()[0] - before) / len(kept)
    tracemalloc.stop()
    assert used <= kept[0].size <= 16 * WINDOW, (used, kept[0].size)


def test_a_runner_far_behind_another_delivers_its_own_events_through_kept_verdicts(
    conn, monkeypatch
):
    """One queue, two rules: a slow ordered target far behind a fast one. The window cache keeps
    one window, so the slow runner reaches windows already let go: it fetches only its own
    rows by offset, delivers each once and in order, and the counts add up."""
    monkeypatch.setattr(reading, "CACHE_WINDOWS_PER_QUEUE", 1)
    picks: list[list[int]] = []
    pick = PostgresReader.read_offsets

    async def counted(self, bus, queue_id, offsets):
        picks.append(list(offsets))
        return await pick(self, bus, queue_id, offsets)

    monkeypatch.setattr(PostgresReader, "read_offsets", counted)
    n = 8 * WINDOW
    with Receiver() as rx:
        catalog.create_bus(conn, "orders", 1)
        catalog.create_rule(conn, "orders", "slow", {"detail": {"k": [0]}})
        catalog.create_rule(conn, "orders", "fast", {"detail": {"k": [1, 2]}})
        catalog.create_target(
            conn,
            "orders",
            "slow",
            catalog.TargetSpec(name="t", url=rx.url + "/slow?ms=3", ordered=True),
        )
        catalog.create_target(
            conn, "orders", "fast", catalog.TargetSpec(name="t", url=rx.url + "/ok")
        )
        catalog.create_worker(conn, "w1")
        # Few records in flight: the slow runner's pulls wait for its sends, the fast one's not.
        controls.adjust(conn, "worker", "w1", {"buffer_records": 16})
        catalog.assign(conn)
        body = [
            json.dumps({"source": "shop", "detail-type": "Order", "detail": {"n": i, "k": i % 4}})
            for i in range(n)
        ]
        publish(conn, "orders", body)
        report = run_worker("w1", until_idle=True, max_seconds=120)
        slow = [json.loads(r.body)["detail"]["n"] for r in rx.state.delivered("/slow")]
        fast = sorted(json.loads(r.body)["detail"]["n"] for r in rx.state.delivered("/ok"))
    assert slow == list(range(0, n, 4)), "each of its events once, in queue order"
    assert fast == [i for i in range(n) if i % 4 in (1, 2)]
    assert picks, "the slow runner reached windows let go and fetched rows by offset"
    for offsets in picks:  # always one runner's own rows: k == 0, or k in (1, 2)
        ks = {o % 4 for o in offsets}
        assert ks == {0} or ks <= {1, 2}, ks
    assert report.delivered == len(slow) + len(fast)
    assert report.read == 2 * n and report.filtered == 2 * n - report.delivered
