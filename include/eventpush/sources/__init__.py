"""Sources: where a bus's events are stored and read from, behind one interface.

A bus's row in ``event_bus`` records its source URL (``source_url``; NULL is the built-in
PostgreSQL store). The URL's scheme chooses the **kind** of source: a :class:`SourceKind`,
built in (``postgres``, ``nats``) or found through the Python entry-point group
``eventpush.sources`` (name = the scheme, value = a ``SourceKind`` object), so a third party
adds a broker without editing eventpush (docs/ARCHITECTURE.md, "Sources and sinks").

Whatever the source, positions are kept in PostgreSQL: committed offsets, delivery rows and
failure rows are written in one transaction by the engine's committer, with ``topic_name``
the bus, ``queue_id`` and ``offset`` the source's position (and ``broker_name`` the source
kind on ``event_push_offset``; the delivery and failure rows keep the default ``eventpush``).
A position grows within a queue; it may have gaps (a broker's own sequence).

``event_bus_queue.next_offset`` of a bus on another source is the last head this side has
seen (:func:`sync_heads`), so status, lag, the push trigger and the new runners' start offsets
read it as they read a PostgreSQL bus's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import entry_points

from eventpush.db import Connection, StoreError, transaction

log = logging.getLogger("eventpush.sources")

GROUP = "eventpush.sources"
POSTGRES = "postgres"


class SourceError(ValueError):
    """A refused source URL or an unknown kind, said in one line."""


class SourceUnavailableError(StoreError):
    """A source that did not answer (a broker down, unreachable), said in one line."""


@dataclass(frozen=True)
class Bus:
    """What a source is told about a bus."""

    id: int
    name: str
    queues: int
    source_url: str | None  # None: the built-in PostgreSQL store

    @property
    def scheme(self) -> str:
        return scheme_of(self.source_url)


@dataclass
class Chunk:
    """What one read of a queue returned: ``rows`` of (position, message id, event JSON
    text) in position order, and ``end``: every event of the queue below ``end`` is in
    ``rows`` or before the read's start. A source whose positions have gaps must say where
    the queue's next event is when it knows one exists past ``stop`` (``end`` >= ``stop``,
    up to that event's position): the engine steps over the gap instead of waiting there."""

    rows: list[tuple[int, str, str]]
    end: int


@dataclass
class Stored:
    """One event as the batch jobs read it: its place, id, creation time and JSON text."""

    queue_id: int
    position: int
    message_id: str
    ctime: datetime
    body: str


class Reader:
    """The engine's side of a source kind: opened once per worker for every bus of the kind,
    used from the worker's event loop. Subclasses implement ``read``; the rest may stay."""

    window: int = 256  # positions per engine window of a queue

    def window_for(self, bus: Bus) -> int:
        return self.window

    async def read(self, bus: Bus, queue_id: int, start: int, stop: int) -> Chunk:
        """Events of ``queue_id`` with ``start <= position < stop`` (fewer when the queue has
        not reached ``stop``). Waits out an unavailable source; raises only what is fatal."""
        raise NotImplementedError

    async def watch(self, buses: Callable[[], Iterable[Bus]], wake: Callable[[int], None]) -> None:
        """Until cancelled: call ``wake(bus_id)`` when new events may have arrived on one of
        ``buses()``. Without it feeders at the end of a queue poll every second."""
        return None

    async def heads(self, bus: Bus) -> dict[int, int] | None:
        """The queues' next positions, to record for status and lag (None: the database
        already holds them)."""
        return None

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class SourceKind:
    """One kind of source: what bus creation, publishing, status and the batch jobs need.
    Every function but ``check`` and ``open_reader`` takes an open eventpush database
    connection first (a broker's kind may ignore it).

    - ``check(url)``: the URL, checked (``SourceError`` or ``ValueError``); nothing contacted.
    - ``create(conn, bus)``: make or adopt the store of a new bus (or refuse, one line).
    - ``open_reader(database_url)``: the engine's :class:`Reader` for every bus of the kind.
    - ``publish(conn, bus, events)``: append validated events (``eventpush.publish``'s
      prepared events, in order); returns ``{queue_id: (first, last, count)}`` positions.
    - ``heads(conn, bus)``: ``{queue_id: next position}`` (last position + 1, 0 when empty).
    - ``read_range(conn, bus, queue_id, start, stop)``: ``Stored`` events of one queue with
      ``start <= position < stop``, in order (the batch jobs' reader).
    - ``position_at(conn, bus, queue_id, when)``: the first position of the queue whose event
      was stored at or after ``when`` (the batch jobs' time windows).
    """

    scheme: str
    check: Callable[[str], str]
    create: Callable[[Connection, Bus], None]
    open_reader: Callable[[str], Reader]
    publish: Callable[[Connection, Bus, Iterable], dict[int, tuple[int, int, int]]]
    heads: Callable[[Connection, Bus], dict[int, int]]
    read_range: Callable[[Connection, Bus, int, int, int], Iterator[Stored]]
    position_at: Callable[[Connection, Bus, int, datetime], int]


def scheme_of(url: str | None) -> str:
    if not url:
        return POSTGRES
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise SourceError(f"source URL {url.split('@')[-1]!r} has no scheme (nats://HOST:PORT)")
    return scheme.lower()


def _builtin(scheme: str) -> SourceKind | None:
    if scheme == POSTGRES:
        from eventpush.sources.postgres import KIND

        return KIND
    if scheme == "nats":
        from eventpush.sources.nats import KIND

        return KIND
    return None


_plugins: dict[str, SourceKind] = {}


def kind_for(url: str | None) -> SourceKind:
    """The source kind of a bus's source URL (None: PostgreSQL), built in or by entry point."""
    return kind_named(scheme_of(url))


def kind_named(scheme: str) -> SourceKind:
    """The source kind serving ``scheme``: built in, else the entry point of that name."""
    found = _builtin(scheme) or _plugins.get(scheme)
    if found is None:
        for ep in entry_points(group=GROUP):
            if ep.name.lower() == scheme:
                found = ep.load()
                if not isinstance(found, SourceKind):
                    raise SourceError(
                        f"entry point {ep.name} = {ep.value} in {GROUP} is not a SourceKind"
                    )
                _plugins[scheme] = found
                break
    if found is None:
        known = sorted({POSTGRES, "nats", *(ep.name for ep in entry_points(group=GROUP))})
        raise SourceError(f"no source kind for scheme {scheme!r} (known: {', '.join(known)})")
    return found


# --- the catalog's side -------------------------------------------------------------------------

BUS_SQL = "SELECT id, name, queues, source_url FROM event_bus"


def read_buses(conn: Connection, bus_ids: Iterable[int] | None = None) -> dict[int, Bus]:
    """Buses by id (every bus when ``bus_ids`` is None)."""
    with transaction(conn) as cur:
        if bus_ids is None:
            cur.execute(BUS_SQL)
        else:
            cur.execute(BUS_SQL + " WHERE id = ANY(%s)", (list(bus_ids),))
        return {row[0]: Bus(*row) for row in cur.fetchall()}


def bus_named(conn: Connection, name: str) -> Bus:
    from eventpush.catalog import CatalogError

    with transaction(conn) as cur:
        cur.execute(BUS_SQL + " WHERE name = %s AND deleted_at IS NULL", (name,))
        row = cur.fetchone()
    if row is None:
        raise CatalogError(f"unknown bus {name!r}")
    return Bus(*row)


HEADS_SQL = (
    "UPDATE event_bus_queue q SET next_offset = greatest(q.next_offset, v.head) "
    "FROM unnest(%s::int[], %s::bigint[]) AS v(queue_id, head) "
    "WHERE q.bus_id = %s AND q.queue_id = v.queue_id"
)


def write_heads(cur, bus_id: int, heads: dict[int, int]) -> None:
    """Remember a source's heads as the queues' ``next_offset`` (never backwards), in the
    caller's transaction."""
    if heads:
        cur.execute(HEADS_SQL, (list(heads), list(heads.values()), bus_id))


def record_heads(conn: Connection, bus_id: int, heads: dict[int, int]) -> None:
    """``write_heads`` in a transaction of its own."""
    with transaction(conn) as cur:
        write_heads(cur, bus_id, heads)


def broker_name(source_url: str | None) -> str:
    """The ``broker_name`` of a bus's position rows: its source kind (``eventpush`` for the
    built-in store, RocketMQ EventBridge's value)."""
    return "eventpush" if source_url is None else scheme_of(source_url)


def sync_heads(conn: Connection, *, worker: str | None = None) -> list[str]:
    """Ask every bus on another source (or only those of ``worker``'s runners) for its heads
    and record them. A source that does not answer keeps its last heads; the one-line reasons
    are returned (and logged)."""
    from eventpush.config import redact

    with transaction(conn) as cur:
        cur.execute(
            "SELECT DISTINCT b.id, b.name, b.queues, b.source_url FROM event_bus b "
            "LEFT JOIN event_rule ru ON ru.bus_id = b.id "
            "LEFT JOIN event_target t ON t.rule_id = ru.id "
            "LEFT JOIN event_target_runner r ON r.target_id = t.id "
            "LEFT JOIN event_push_worker w ON w.id = r.worker_id "
            "WHERE b.source_url IS NOT NULL AND b.deleted_at IS NULL "
            "AND (%s::text IS NULL OR w.name = %s)",
            (worker, worker),
        )
        buses = [Bus(*row) for row in cur.fetchall()]
    problems = []
    for bus in buses:
        try:
            heads = kind_for(bus.source_url).heads(conn, bus)
        except Exception as exc:
            why = redact(f"bus {bus.name}: source not read: {exc}", bus.source_url)
            log.warning("%s", why)
            problems.append(why.splitlines()[0])
            continue
        record_heads(conn, bus.id, heads)
    return problems
