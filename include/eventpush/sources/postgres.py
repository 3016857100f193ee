"""The built-in source: a bus's events in PostgreSQL (``bus_event``, one partition per bus).

Positions are gapless offsets (0, 1, 2, …) until retention drops a day (readers step over
the gap): publishers lock the bus's ``event_bus_queue`` rows while they append, to their
commit, and ``pg_notify('eventpush_publish', bus_id)`` wakes the workers once the events are
committed. ``publish`` (the CLI's: any size, partition keys)
locks every queue of the bus and appends with ``COPY``; ``publish_anywhere`` (the API's group
commits) appends in one statement on one queue no other publisher holds, so concurrent
commits run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING

from eventpush.db import (
    Connection,
    StoreError,
    connect,
    copy_text,
    execute_on_loop,
    int_array,
    is_transient,
    text_array,
    transaction,
)
from eventpush.dbslot import DbSlot
from eventpush.sources.contract import Bus, Chunk, Reader, SourceError, SourceKind, Stored

if TYPE_CHECKING:
    from eventpush.db import LoopConnection

READER_CONNECTIONS = 2
LISTEN_RETRY_S = 2.0
COPY_ROWS = 1000
NOTIFY_CHANNEL = "eventpush_publish"
# The catalog notifies here on every change (payload: the bus id): running workers re-read
# their runners at once; the controller's periodic re-read covers a lost notification.
CATALOG_CHANNEL = "eventpush_catalog"


def check(url: str) -> str:
    raise SourceError("the built-in PostgreSQL store takes no --source URL: leave it out")


def create(conn: Connection, bus: Bus) -> None:
    """Nothing to make: the catalog adds the bus's partition of ``bus_event`` itself."""


def read_window(conn: Connection, bus_id: int, queue_id: int, start: int, stop: int) -> list:
    """Events of one queue with start <= offset < stop: (offset, message_id, body text)."""
    with transaction(conn) as cur:
        cur.execute(
            'SELECT "offset", message_id, body::text FROM bus_event '
            'WHERE bus_id = %s AND queue_id = %s AND "offset" >= %s AND "offset" < %s '
            'ORDER BY "offset"',
            (bus_id, queue_id, start, stop),
        )
        return cur.fetchall()


# Where a queue goes on after an empty window read: its first event at or after the read's
# start, looked for only when the queue's next offset is past it (else this is the end of
# the queue: one key lookup).
_NEXT_KEPT = (
    'SELECT (SELECT min("offset") FROM bus_event WHERE bus_id = %(bus)s AND queue_id = %(q)s '
    'AND "offset" >= %(at)s) FROM event_bus_queue '
    "WHERE bus_id = %(bus)s AND queue_id = %(q)s AND next_offset > %(at)s"
)


def read_chunk(conn: Connection, bus_id: int, queue_id: int, start: int, stop: int) -> Chunk:
    """``read_window`` as the engine reads it. Offsets are gapless as published, but
    retention drops whole days: a runner still behind a dropped day would wait at its gap
    forever, so an empty read says where the queue's next kept event is (a read that found
    some ends at its last row: the next one starts there). Offsets below ``next_offset`` are
    all committed: none below that event can appear later."""
    rows = read_window(conn, bus_id, queue_id, start, stop)
    if rows:
        return Chunk(rows, rows[-1][0] + 1)
    with transaction(conn) as cur:
        cur.execute(_NEXT_KEPT, {"bus": bus_id, "q": queue_id, "at": start})
        found = cur.fetchone()
    return Chunk(rows, start if found is None or found[0] is None else found[0])


def read_offsets(conn: Connection, bus_id: int, queue_id: int, offsets: list[int]) -> list:
    """Events of one queue at the given offsets (ascending): (offset, message_id, body text).
    The range bounds let the planner scan only the index's span that holds them."""
    with transaction(conn) as cur:
        cur.execute(
            'SELECT "offset", message_id, body::text FROM bus_event '
            'WHERE bus_id = %s AND queue_id = %s AND "offset" >= %s AND "offset" <= %s '
            'AND "offset" = ANY(%s) ORDER BY "offset"',
            (bus_id, queue_id, offsets[0], offsets[-1], offsets),
        )
        return cur.fetchall()


def listen(url: str, channel: str = NOTIFY_CHANNEL) -> Connection:
    """A connection listening for notifications: publishes by default, or ``channel`` (a
    fixed name from code, such as the catalog's); the payload is a bus id."""
    conn = connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"LISTEN {channel}")
    return conn


class CopySource:
    """A file-like COPY source that formats rows as psycopg2 reads them, so parsing in Python
    overlaps with the server's work, and memory stays bounded whatever the input size."""

    def __init__(self, chunks: Iterator[str]) -> None:
        self._chunks = chunks
        self._buf = ""
        self.error: BaseException | None = None

    def read(self, size: int = -1) -> str:
        try:
            while size < 0 or len(self._buf) < size:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._buf += chunk
        except BaseException as exc:
            self.error = exc  # psycopg2 wraps it; publish re-raises the original
            raise
        if size < 0:
            out, self._buf = self._buf, ""
        else:
            out, self._buf = self._buf[:size], self._buf[size:]
        return out


class PostgresReader(Reader):
    """Window reads on a few pooled connections, and LISTEN for publishes."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.slots: asyncio.Queue = asyncio.Queue()
        self.all = [DbSlot(database_url) for _ in range(READER_CONNECTIONS)]
        for slot in self.all:
            self.slots.put_nowait(slot)

    async def _call(self, fn: Callable, *args):
        slot = await self.slots.get()
        try:
            return await slot.call(fn, *args)
        finally:
            self.slots.put_nowait(slot)

    async def read(self, bus: Bus, queue_id: int, start: int, stop: int) -> Chunk:
        return await self._call(read_chunk, bus.id, queue_id, start, stop)

    async def read_offsets(self, bus: Bus, queue_id: int, offsets: list[int]) -> list:
        if not offsets:
            return []
        return await self._call(read_offsets, bus.id, queue_id, offsets)

    async def watch(self, buses, wake: Callable[[int], None]) -> None:
        """LISTEN until cancelled, reconnecting while the database is away."""
        await watch_channel(self.url, NOTIFY_CHANNEL, wake)

    async def close(self) -> None:
        for slot in self.all:
            await slot.settle(timeout=30)
            slot.close()


async def watch_channel(url: str, channel: str, wake: Callable[[int], None]) -> None:
    """LISTEN on ``channel`` until cancelled, calling ``wake(bus id)`` per notification and
    reconnecting while the database is away (publishes here; the catalog's changes too)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn = await asyncio.to_thread(listen, url, channel)
        except Exception as exc:
            if not is_transient(exc):
                raise
            await asyncio.sleep(LISTEN_RETRY_S)
            continue
        broken = asyncio.Event()

        def on_readable(conn=conn, broken=broken) -> None:
            try:
                conn.poll()
            except Exception:
                broken.set()
                return
            for note in conn.notifies:
                with contextlib.suppress(ValueError):
                    wake(int(note.payload))
            conn.notifies.clear()

        fd = conn.fileno()  # kept: a closed connection no longer tells it
        loop.add_reader(fd, on_readable)
        try:
            await broken.wait()
        finally:
            loop.remove_reader(fd)
            with contextlib.suppress(Exception):
                conn.close()


def publish(conn: Connection, bus: Bus, events: Iterable) -> dict[int, tuple[int, int, int]]:
    """Append ``events`` at contiguous offsets in one transaction, or none of them."""
    per_queue: dict[int, int] = {}
    with transaction(conn) as cur:
        # The bus's queue rows stay locked to commit: offsets are gapless and in order per
        # queue, and concurrent publishers to one bus take turns (in one lock order).
        cur.execute(
            "SELECT queue_id, next_offset FROM event_bus_queue "
            "WHERE bus_id = %s ORDER BY queue_id FOR UPDATE",
            (bus.id,),
        )
        next_offset = dict(cur.fetchall())

        def rows() -> Iterator[str]:
            chunk: list[str] = []
            for event in events:
                offset = next_offset[event.queue_id]
                next_offset[event.queue_id] = offset + 1
                per_queue[event.queue_id] = per_queue.get(event.queue_id, 0) + 1
                chunk.append(
                    f"{bus.id}\t{event.queue_id}\t{offset}\t{copy_text(event.message_id)}"
                    f"\t{copy_text(event.source)}\t{copy_text(event.detail_type)}\t{event.time}"
                    f"\t{event.size}\t{copy_text(event.body)}\n"
                )
                if len(chunk) == COPY_ROWS:
                    yield "".join(chunk)
                    chunk.clear()
            if chunk:
                yield "".join(chunk)

        source = CopySource(rows())
        try:
            cur.copy_expert(
                'COPY bus_event (bus_id, queue_id, "offset", message_id, source, detail_type, '
                "event_time, size_bytes, body) FROM STDIN",
                source,
                size=1 << 20,
            )
        except Exception:
            if source.error is not None:
                raise source.error from None
            raise
        if per_queue:
            cur.execute(
                "UPDATE event_bus_queue q SET next_offset = v.next_offset "
                "FROM unnest(%s::int[], %s::bigint[]) AS v(queue_id, next_offset) "
                "WHERE q.bus_id = %s AND q.queue_id = v.queue_id",
                (list(per_queue), [next_offset[q] for q in per_queue], bus.id),
            )
            # Wakes workers waiting on this bus; delivered only when the transaction commits.
            cur.execute("SELECT pg_notify('eventpush_publish', %s)", (str(bus.id),))
    return {q: (next_offset[q] - n, next_offset[q] - 1, n) for q, n in sorted(per_queue.items())}


# One statement, one round trip, committed on its own (autocommit): lock one of the bus's
# queue rows that no other transaction holds (SKIP LOCKED, from a random start), append the
# events there at its next offsets and move the offset on. Concurrent publishers (the API's
# processes, each with commits in flight) take different queues instead of waiting for each
# other's commits, and the row stays locked until the commit, so offsets stay gapless and in
# commit order per queue. The events' small fields come as one array literal a column, their
# bodies as one text, a line each (a body is compact JSON, never a raw newline): the server
# splits it with a scan and parses each body once, as COPY does (a body inside a JSON
# document was parsed twice, and cost the statement a third more; the small fields as one
# JSON document cost the backend 0.6 µs an event more than the arrays, docs/BENCHMARKS.md).
_APPEND_ANYWHERE = """
WITH queue AS MATERIALIZED (
    SELECT queue_id, next_offset FROM event_bus_queue
    WHERE bus_id = %(bus)s
    ORDER BY (queue_id + %(start)s) %% %(queues)s
    LIMIT 1
    FOR UPDATE {skip}
), stored AS (
    INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, detail_type,
                           event_time, size_bytes, body)
    SELECT %(bus)s, queue.queue_id, queue.next_offset + e.i - 1, e.message_id, e.source,
           e.detail_type, e.event_time, e.size_bytes, e.body::json
    FROM queue, ROWS FROM (
             unnest(%(ids)s::text[]), unnest(%(sources)s::text[]),
             unnest(%(types)s::text[]), unnest(%(times)s::timestamptz[]),
             unnest(%(sizes)s::int[]), string_to_table(%(bodies)s, E'\n'))
         WITH ORDINALITY AS e(message_id, source, detail_type, event_time, size_bytes, body, i)
), moved AS (
    UPDATE event_bus_queue q SET next_offset = queue.next_offset + %(count)s
    FROM queue WHERE q.bus_id = %(bus)s AND q.queue_id = queue.queue_id
    RETURNING q.queue_id, queue.next_offset
)
SELECT queue_id, next_offset FROM moved
"""
_SKIP_LOCKED = _APPEND_ANYWHERE.format(skip="SKIP LOCKED")
_WAIT_LOCKED = _APPEND_ANYWHERE.format(skip="")
# The wake-ups, in a transaction of their own that does not wait for its commit to reach the
# disk: NOTIFY holds one lock for the whole database from its commit's start to its end, so a
# NOTIFY inside the append would line every publisher's disk flush up behind that lock. A
# wake-up lost in a crash costs a second at most (idle feeders poll every second). One
# statement (set_config's local form is SET LOCAL), as the extended protocol takes one.
_NOTIFY = (
    "SELECT set_config('synchronous_commit', 'off', true), pg_notify('eventpush_publish', b) "
    "FROM unnest(%s::text[]) AS b"
)


async def publish_anywhere(
    conn: LoopConnection, bus: Bus, events: list
) -> dict[int, tuple[int, int, int]]:
    """Append ``events``, whose queue is free to choose (no partition key: the API's), in one
    transaction or not at all, on one queue that no other publisher holds now (waiting for
    one only when all are held); each event's ``queue_id`` is set to it. ``conn`` is an
    asynchronous connection (``eventpush.db.connect_on_loop``): the statement runs while the
    loop serves others, with no thread to hand it to. The append is one statement, its own
    transaction (autocommit), so the queue is held for one round trip and the commit, not for
    a conversation with this process. Returns once the events are durable; the workers are
    not woken here (:func:`announce`, which the caller may pace)."""
    if not events:
        return {}
    bodies = [e.body for e in events]
    # One search for a newline a body (memchr), not a count over the joined text (a loop
    # over every character, 2 % of the API's instructions a request).
    if any("\n" in body for body in bodies):
        raise ValueError("an event body holds a raw newline: not compact JSON")
    params = {
        "bus": bus.id,
        "start": random.randrange(bus.queues),
        "queues": bus.queues,
        "count": len(events),
        "ids": text_array([e.message_id for e in events]),
        "sources": text_array([e.source for e in events]),
        "types": text_array([e.detail_type for e in events]),
        "times": text_array([e.time for e in events]),
        "sizes": int_array(e.size for e in events),
        "bodies": "\n".join(bodies),
    }
    rows = await execute_on_loop(conn, _SKIP_LOCKED, params)
    if not rows:  # every queue is held: wait for one (holding none: no deadlock)
        rows = await execute_on_loop(conn, _WAIT_LOCKED, params)
    if not rows:
        raise StoreError(f"bus {bus.name} has no queues to publish on")
    ((queue_id, first),) = rows
    for event in events:
        event.queue_id = queue_id
    return {queue_id: (first, first + len(events) - 1, len(events))}


async def announce(conn: LoopConnection, bus_ids: list[int]) -> None:
    """Wake the workers of ``bus_ids``, whose events ``publish_anywhere`` committed: one
    notification a bus, in one statement."""
    await execute_on_loop(conn, _NOTIFY, ([str(bus_id) for bus_id in bus_ids],))


def heads(conn: Connection, bus: Bus) -> dict[int, int]:
    with transaction(conn) as cur:
        cur.execute(
            "SELECT queue_id, next_offset FROM event_bus_queue WHERE bus_id = %s", (bus.id,)
        )
        return dict(cur.fetchall())


# The events a bus holds, per queue from its first kept offset to its head: offsets are
# gapless as published and retention drops whole days from the oldest on, so what is kept is
# gapless from there. One index probe per queue and day partition (as _NEXT_KEPT finds where
# a queue goes on), never a count(*) of the bus's events.
_KEPT_COUNT = (
    'SELECT coalesce(sum(q.next_offset - coalesce((SELECT min("offset") FROM bus_event '
    'WHERE bus_id = %(bus)s AND queue_id = q.queue_id AND "offset" >= q.first_offset), '
    "q.next_offset)), 0) FROM event_bus_queue q WHERE q.bus_id = %(bus)s"
)


def count(conn: Connection, bus: Bus) -> int:
    """Events kept, each queue from its first kept offset at or past its ``first_offset``."""
    with transaction(conn) as cur:
        cur.execute(_KEPT_COUNT, {"bus": bus.id})
        return int(cur.fetchone()[0])


def read_range(
    conn: Connection, bus: Bus, queue_id: int, start: int, stop: int
) -> Iterator[Stored]:
    with transaction(conn) as cur:
        cur.execute(
            'SELECT "offset", message_id, ctime, body::text FROM bus_event '
            'WHERE bus_id = %s AND queue_id = %s AND "offset" >= %s AND "offset" < %s '
            'ORDER BY "offset"',
            (bus.id, queue_id, start, stop),
        )
        rows = cur.fetchall()
    for offset, message_id, ctime, body in rows:
        yield Stored(queue_id, offset, message_id, ctime, body)


def position_at(conn: Connection, bus: Bus, queue_id: int, when: datetime) -> int:
    with transaction(conn) as cur:
        cur.execute(
            'SELECT coalesce(min("offset"), (SELECT next_offset FROM event_bus_queue '
            "WHERE bus_id = %s AND queue_id = %s)) FROM bus_event "
            "WHERE bus_id = %s AND queue_id = %s AND ctime >= %s",
            (bus.id, queue_id, bus.id, queue_id, when),
        )
        return cur.fetchone()[0]


KIND = SourceKind(
    scheme="postgres",
    check=check,
    create=create,
    open_reader=PostgresReader,
    publish=publish,
    publish_anywhere=publish_anywhere,
    announce=announce,
    heads=heads,
    read_range=read_range,
    position_at=position_at,
    count=count,
)
