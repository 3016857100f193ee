"""The API's publish path against the real PostgreSQL: ``publish_anywhere`` (one statement on
one queue no other publisher holds; ``announce``, the wake-up) and the group publisher's
commits in flight side by side, their wake-ups paced."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import tracemalloc

import psycopg
import psycopg2
import pytest

from eventpush import catalog, group_publish
from eventpush.db import StoreError, connect_on_loop, execute_on_loop
from eventpush.group_publish import GroupPublisher
from eventpush.publish import Prepared, parse_events
from eventpush.sources import bus_named
from eventpush.sources.postgres import announce, publish_anywhere

ODD = ["tab\there", "new\nline", 'quote" and \\ back', "ünï €", "{a,b}", "NULL", "x'y", " spaced "]


def _events(n: int, seed: int = 0, queues: int = 4) -> list[Prepared]:
    lines = [
        json.dumps(
            {
                "source": ODD[i % len(ODD)],
                "detail-type": ODD[(i + 3) % len(ODD)],
                "detail": {"n": seed * 100_000 + i, "text": ODD[i % len(ODD)]},
                "time": "2026-11-26T09:00:00+01:00",
            }
        )
        for i in range(n)
    ]
    return parse_events(lines, queues)


def _stored(conn, bus_id: int) -> dict[str, tuple]:
    with conn.cursor() as cur:
        cur.execute(
            'SELECT message_id, queue_id, "offset", source, detail_type, event_time, size_bytes, '
            "body::text FROM bus_event WHERE bus_id = %s",
            (bus_id,),
        )
        return {row[0]: row[1:] for row in cur.fetchall()}


def _check_gapless(conn, bus_id: int) -> dict[int, int]:
    """Every queue's offsets 0..n-1 with no gap or repeat, and next_offset == n."""
    with conn.cursor() as cur:
        cur.execute(
            'SELECT q.queue_id, q.next_offset, coalesce(array_agg(e."offset" ORDER BY '
            'e."offset") FILTER (WHERE e."offset" IS NOT NULL), \'{}\') FROM event_bus_queue q '
            "LEFT JOIN bus_event e ON e.bus_id = q.bus_id AND e.queue_id = q.queue_id "
            "WHERE q.bus_id = %s GROUP BY q.queue_id, q.next_offset",
            (bus_id,),
        )
        rows = cur.fetchall()
    for queue_id, next_offset, offsets in rows:
        assert offsets == list(range(next_offset)), f"queue {queue_id}"
    return {queue_id: next_offset for queue_id, next_offset, _ in rows}


async def _on_loop(db_url: str):
    return await connect_on_loop(db_url, application_name="eventpush-api")


def test_concurrent_commits_keep_every_queue_gapless_and_events_verbatim(db_url, conn):
    catalog.create_bus(conn, "orders", 4)
    bus = bus_named(conn, "orders")
    conn.commit()

    async def publisher(seed: int) -> list[list[Prepared]]:
        done = []
        c = await _on_loop(db_url)
        try:
            for k in range(15):
                events = _events(37, seed * 100 + k)
                placed = await publish_anywhere(c, bus, events)
                (queue_id,) = placed  # one queue a commit
                first, last, count = placed[queue_id]
                assert count == len(events) == last - first + 1
                assert {e.queue_id for e in events} == {queue_id}
                done.append(events)
        finally:
            await c.close()
        return done

    async def four() -> list[list[list[Prepared]]]:  # a publisher's failure is raised here
        return await asyncio.gather(*(publisher(seed) for seed in range(4)))

    batches = [events for done in asyncio.run(four()) for events in done]
    heads = _check_gapless(conn, bus.id)
    assert sum(heads.values()) == 4 * 15 * 37
    assert len([q for q, n in heads.items() if n]) > 1, "every commit took the same queue"
    stored = _stored(conn, bus.id)
    for events in batches:
        offsets = sorted(stored[e.message_id][1] for e in events)
        assert offsets == list(range(offsets[0], offsets[0] + len(events)))  # contiguous
        for e in events:
            queue_id, _, source, detail_type, event_time, size, body = stored[e.message_id]
            assert (queue_id, source, detail_type, size, body) == (
                e.queue_id,
                e.source,
                e.detail_type,
                e.size,
                e.body,
            )
            assert event_time.isoformat() == "2026-11-26T08:00:00+00:00"


def test_a_free_queue_is_taken_without_waiting_and_a_held_one_waited_for(db_url, conn):
    catalog.create_bus(conn, "orders", 2)
    bus = bus_named(conn, "orders")
    conn.commit()
    holder = psycopg2.connect(db_url)

    async def scenario() -> None:
        publisher = await _on_loop(db_url)
        try:
            with holder.cursor() as cur:  # another publisher in the middle of its commit on 0
                cur.execute(
                    "SELECT 1 FROM event_bus_queue WHERE bus_id = %s AND queue_id = 0 FOR UPDATE",
                    (bus.id,),
                )
            # Five commits, each from a random first queue; none waits for the held one.
            async with asyncio.timeout(10):
                placed = [await publish_anywhere(publisher, bus, _events(1)) for _ in range(5)]
            assert [list(p) for p in placed] == [[1]] * 5

            with holder.cursor() as cur:  # now both queues are held
                cur.execute("SELECT 1 FROM event_bus_queue WHERE bus_id = %s FOR UPDATE", (bus.id,))
            waiting = asyncio.create_task(publish_anywhere(publisher, bus, _events(3)))
            await asyncio.sleep(1.0)
            assert not waiting.done(), "published on a queue another commit holds"
            with holder.cursor() as cur:
                cur.execute("SELECT count(*) FROM bus_event WHERE bus_id = %s", (bus.id,))
                assert cur.fetchone()[0] == 5  # nothing of the waiting commit is visible
            holder.commit()
            async with asyncio.timeout(30):
                done = await waiting
            assert sum(n for _, _, n in done.values()) == 3
        finally:
            await publisher.close()

    try:
        asyncio.run(scenario())
    finally:
        holder.close()
    assert sum(_check_gapless(conn, bus.id).values()) == 8


def _listening(db_url: str):
    listener = psycopg2.connect(db_url)
    listener.autocommit = True
    listener.cursor().execute("LISTEN eventpush_publish")
    return listener


def _heard_bus(conn, db_url: str, queues: int):
    """A bus "orders" of ``queues`` queues, and a session listening for the workers' wake-ups."""
    catalog.create_bus(conn, "orders", queues)
    bus = bus_named(conn, "orders")
    conn.commit()
    return bus, _listening(db_url)


async def _notified(listener, count: int, timeout: float = 10) -> list[str]:
    """The payloads of the first ``count`` notifications (waiting for them, the loop free)."""
    deadline = time.monotonic() + timeout
    while len(listener.notifies) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
        listener.poll()
    return [n.payload for n in listener.notifies]


def test_publish_anywhere_wakes_nobody_and_announce_wakes_each_bus(db_url, conn):
    """The append stores and returns without a wake-up; ``announce`` wakes each bus named
    once, in a relaxed commit of its own (the session's own setting unchanged after it)."""
    catalog.create_bus(conn, "orders", 4)
    catalog.create_bus(conn, "refunds", 1)
    orders, refunds = bus_named(conn, "orders"), bus_named(conn, "refunds")
    conn.commit()
    listener = _listening(db_url)

    async def scenario() -> tuple[str, list[str], list[str]]:
        publisher = await _on_loop(db_url)
        try:
            await publish_anywhere(publisher, orders, _events(4))
            assert len(_stored(conn, orders.id)) == 4  # another session sees them: committed
            conn.rollback()
            quiet = await _notified(listener, 1, timeout=0.5)
            await announce(publisher, [orders.id, refunds.id])
            ((setting,),) = await execute_on_loop(publisher, "SHOW synchronous_commit")
            return setting, quiet, await _notified(listener, 2)
        finally:
            await publisher.close()

    try:
        setting, quiet, woken = asyncio.run(scenario())
    finally:
        listener.close()
    assert setting == "on"
    assert quiet == []
    assert sorted(woken) == sorted([str(orders.id), str(refunds.id)])


def test_commits_wake_the_workers_at_once_then_once_an_interval_after_the_last(db_url, conn):
    """A lone commit's wake-up goes at once; the commits within the interval after it share
    one wake-up, which comes after the last of them and not before the interval is over."""
    bus, listener = _heard_bus(conn, db_url, 2)
    interval = 3.0

    async def scenario() -> None:
        publisher = GroupPublisher(db_url, wake_interval=interval)
        publisher.start()
        try:
            started = time.monotonic()
            await publisher.publish(bus, _events(1, queues=2))
            assert await _notified(listener, 1) == [str(bus.id)]
            first = time.monotonic()
            assert first - started < interval / 2
            for i in range(20):  # each caller waits for its commit
                await publisher.publish(bus, _events(2, i, queues=2))
            last_commit = time.monotonic()
            assert last_commit - first < interval / 2, "the commits outlasted the interval"
            listener.poll()
            assert len(listener.notifies) == 1  # the twenty wait for the interval's end
            assert len(await _notified(listener, 2)) == 2
            second = time.monotonic()
            assert second > last_commit and second - first > interval * 0.9
            assert len(await _notified(listener, 3, timeout=interval + 1)) == 2
            assert (publisher.stats.commits, publisher.stats.wakeups) == (21, 2)
        finally:
            await publisher.close()

    try:
        asyncio.run(scenario())
    finally:
        listener.close()
    assert sum(_check_gapless(conn, bus.id).values()) == 41


def test_a_stop_announces_what_was_committed_before_it(db_url, conn):
    """A commit within the interval after a wake-up waits for the next one; a stop in
    between still announces it (else the workers found those events only by their poll)."""
    bus, listener = _heard_bus(conn, db_url, 1)

    async def scenario() -> float:
        publisher = GroupPublisher(db_url, wake_interval=30.0)
        publisher.start()
        try:
            await publisher.publish(bus, _events(1, 1, queues=1))
            assert len(await _notified(listener, 1)) == 1
            await publisher.publish(bus, _events(1, 2, queues=1))  # waits for the interval
            listener.poll()
            assert len(listener.notifies) == 1
        finally:
            started = time.monotonic()
            await publisher.close()
        assert publisher.stats.wakeups == 2
        return time.monotonic() - started

    try:
        took = asyncio.run(scenario())
        assert asyncio.run(_notified(listener, 2)) == [str(bus.id)] * 2
    finally:
        listener.close()
    assert took < 5


def test_a_failed_wake_up_fails_no_caller_and_the_next_one_reconnects(db_url, conn, caplog):
    """The waker's backend ended (a restart, pg_terminate_backend): the commits and their
    callers go on, the failure is one warning without the password, and the next wake-up
    connects again."""
    bus, listener = _heard_bus(conn, db_url, 1)

    async def scenario() -> None:
        publisher = GroupPublisher(db_url, wake_interval=0.05)
        publisher.start()
        try:
            await publisher.publish(bus, _events(1, 1, queues=1))
            assert len(await _notified(listener, 1)) == 1
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = %s",
                    (group_publish.WAKER_APPLICATION,),
                )
                assert [ok for (ok,) in cur.fetchall()] == [True]
            conn.rollback()
            await publisher.publish(bus, _events(1, 2, queues=1))  # stored, answered
            async with asyncio.timeout(30):
                while "waking the workers failed" not in caplog.text:
                    await asyncio.sleep(0.01)
            await publisher.publish(bus, _events(1, 3, queues=1))
            assert len(await _notified(listener, 2)) == 2
            assert (publisher.stats.commits, publisher.stats.failures) == (3, 0)
            assert publisher.stats.wakeups == 2
        finally:
            await publisher.close()

    try:
        with caplog.at_level("WARNING", logger="eventpush.group_publish"):
            asyncio.run(scenario())
    finally:
        listener.close()
    warnings = [r for r in caplog.records if "waking the workers failed" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert _check_gapless(conn, bus.id) == {0: 3}


def test_a_failed_append_stores_nothing(db_url, conn):
    catalog.create_bus(conn, "orders", 1)
    bus = bus_named(conn, "orders")
    conn.commit()
    events = _events(3)
    events[2].body = '{"not": json'  # the database refuses it: the whole statement fails

    async def scenario() -> None:
        publisher = await _on_loop(db_url)
        try:
            with pytest.raises(psycopg.DataError):
                await publish_anywhere(publisher, bus, events)
            assert _stored(conn, bus.id) == {}
            conn.rollback()
            events[2].body = '{"a":\n1}'  # valid JSON, but the bodies travel a line each
            with pytest.raises(ValueError, match="raw newline"):
                await publish_anywhere(publisher, bus, events)
            events[2].body = events[1].body
            await publish_anywhere(publisher, bus, events)
        finally:
            await publisher.close()

    asyncio.run(scenario())
    assert _check_gapless(conn, bus.id) == {0: 3}


def test_a_connection_that_cannot_be_made_is_one_line_without_the_password(monkeypatch):
    bad = "postgresql://postgres:hunter2@127.0.0.1:{port}/nowhere"
    with pytest.raises(StoreError) as refused:  # nothing listens on port 1
        asyncio.run(connect_on_loop(bad.format(port=1)))
    # A server that accepts and never answers: refused after the timeout, not waited on.
    monkeypatch.setattr("eventpush.db.CONNECT_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        started = time.monotonic()
        with pytest.raises(StoreError) as timed_out:
            asyncio.run(connect_on_loop(bad.format(port=silent.getsockname()[1])))
        assert time.monotonic() - started < 5
    assert "no answer in 0.5 s" in str(timed_out.value)
    for raised in (refused, timed_out):
        assert "hunter2" not in str(raised.value) and "\n" not in str(raised.value)
        assert str(raised.value).startswith("cannot connect to")


def _held(db_url: str, scenario, **publisher_args) -> None:
    """Run ``scenario(publisher, release)`` with a GroupPublisher while another transaction
    holds every queue row of the database's buses, until ``release()`` commits it."""
    holder = psycopg2.connect(db_url)

    async def run() -> None:
        publisher = GroupPublisher(db_url, **publisher_args)
        publisher.start()
        try:
            with holder.cursor() as cur:
                cur.execute("SELECT 1 FROM event_bus_queue FOR UPDATE")
            await scenario(publisher, holder.commit)
        finally:
            await publisher.close()

    try:
        asyncio.run(run())
    finally:
        holder.close()


def test_group_publisher_runs_a_second_commit_while_one_waits(db_url, conn):
    """Two groups in flight at once (two connections), each caller answered once its own
    commit is durable."""
    catalog.create_bus(conn, "orders", 1)
    bus = bus_named(conn, "orders")
    conn.commit()

    async def scenario(publisher: GroupPublisher, release) -> None:
        first = asyncio.create_task(publisher.publish(bus, _events(2, 1)))
        await asyncio.sleep(0.5)
        second = asyncio.create_task(publisher.publish(bus, _events(3, 2)))

        def waiting() -> int:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = 'eventpush-api' AND wait_event_type = 'Lock'"
                )
                n = cur.fetchone()[0]
            conn.rollback()  # a transaction's reads of pg_stat_activity: one snapshot
            return n

        deadline = time.monotonic() + 30  # both groups in the database, each waiting
        while waiting() < 2:
            assert time.monotonic() < deadline, "two groups never waited at once"
            await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        release()
        async with asyncio.timeout(30):
            await asyncio.gather(first, second)
        assert publisher.stats.commits == 2 and publisher.stats.events == 5

    _held(db_url, scenario, max_in_flight=2)
    assert _check_gapless(conn, bus.id) == {0: 5}


def test_callers_past_max_waiting_wait_for_room_and_all_are_stored(db_url, conn):
    """Memory stays bounded: while a commit is held, callers past ``max_waiting`` events
    wait before they enqueue; once it commits, room frees up and every caller is stored."""
    catalog.create_bus(conn, "orders", 1)
    bus = bus_named(conn, "orders")
    conn.commit()

    async def scenario(publisher: GroupPublisher, release) -> None:
        callers = [asyncio.create_task(publisher.publish(bus, _events(3, i))) for i in range(8)]
        await asyncio.sleep(1.0)
        assert not any(c.done() for c in callers)
        # three callers (9 events) fit under 10; the other five wait outside the queue
        assert publisher._waiting_events == 9
        assert sum(len(w.events) for _, ws in publisher._queues.values() for w in ws) <= 9
        release()
        async with asyncio.timeout(30):
            await asyncio.gather(*callers)
            while publisher._waiting_events:  # a commit gives its room back after its callers
                await asyncio.sleep(0.01)
        assert publisher.stats.events == 24

    _held(db_url, scenario, max_waiting=10)
    assert _check_gapless(conn, bus.id) == {0: 24}


def test_a_busy_bus_does_not_starve_another(db_url, conn):
    """One connection, groups of one caller: callers of two buses are served in turn."""
    catalog.create_bus(conn, "busy", 1)
    catalog.create_bus(conn, "quiet", 1)
    busy, quiet = bus_named(conn, "busy"), bus_named(conn, "quiet")
    conn.commit()
    order: list[str] = []

    async def scenario(publisher: GroupPublisher, release) -> None:
        async def put(bus, label: str) -> None:
            await publisher.publish(bus, _events(1, queues=1))
            order.append(label)

        tasks = [asyncio.create_task(put(busy, "busy 1"))]  # its commit waits; others queue
        await asyncio.sleep(0.3)
        tasks += [asyncio.create_task(put(busy, f"busy {i}")) for i in (2, 3, 4)]
        await asyncio.sleep(0.1)
        tasks.append(asyncio.create_task(put(quiet, "quiet")))
        await asyncio.sleep(0.1)
        release()
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)

    _held(db_url, scenario, max_group=1, max_in_flight=1)
    assert order == ["busy 1", "busy 2", "quiet", "busy 3", "busy 4"]


def test_the_publisher_keeps_nothing_per_commit(db_url, conn):
    """A server runs for months: after a warm-up, 600 more commits leave no more memory
    allocated by the group publisher than before them (a list of every commit's size,
    kept for a metric nobody read, grew by one entry a commit)."""
    catalog.create_bus(conn, "orders", 1)
    bus = bus_named(conn, "orders")
    conn.commit()

    def held_here(snapshot: tracemalloc.Snapshot) -> int:
        mine = snapshot.filter_traces([tracemalloc.Filter(True, group_publish.__file__)])
        return sum(stat.size for stat in mine.statistics("filename"))

    async def run() -> tuple[int, int]:
        publisher = GroupPublisher(db_url)
        publisher.start()
        try:
            for _ in range(100):
                await publisher.publish(bus, _events(1, queues=1))
            before = held_here(tracemalloc.take_snapshot())
            for _ in range(600):
                await publisher.publish(bus, _events(1, queues=1))
            return before, held_here(tracemalloc.take_snapshot())
        finally:
            await publisher.close()

    tracemalloc.start()
    try:
        before, after = asyncio.run(run())
    finally:
        tracemalloc.stop()
    assert after - before < 1024, f"{after - before} bytes more after 600 commits"


def test_a_commit_whose_connection_died_fails_its_callers_and_the_next_one_reconnects(db_url, conn):
    """The server's backend ended under the publisher (a PostgreSQL restart, an operator's
    pg_terminate_backend): the group on it fails as a whole (its callers answer 'send it
    again'), the broken session is dropped, and the next group commits on a new one."""
    catalog.create_bus(conn, "orders", 2)
    bus = bus_named(conn, "orders")
    conn.commit()

    async def scenario() -> None:
        publisher = GroupPublisher(db_url)
        publisher.start()
        try:
            await publisher.publish(bus, _events(3, 1, queues=2))
            # The commit's time is counted once its connection is free again.
            async with asyncio.timeout(30):
                while publisher.stats.seconds == 0:
                    await asyncio.sleep(0.01)
            with conn.cursor() as cur:  # the timeout: returns once ended, not just signalled
                cur.execute(
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = 'eventpush-api'"
                )
                assert [ok for (ok,) in cur.fetchall()] == [True]
            conn.rollback()
            with pytest.raises(psycopg.OperationalError):
                await publisher.publish(bus, _events(4, 2, queues=2))
            async with asyncio.timeout(30):
                await publisher.publish(bus, _events(5, 3, queues=2))
            assert (publisher.stats.commits, publisher.stats.failures) == (2, 1)
        finally:
            await publisher.close()

    asyncio.run(scenario())
    assert sum(_check_gapless(conn, bus.id).values()) == 3 + 5  # none of the failed group
