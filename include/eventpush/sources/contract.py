"""The source contract: what a source kind is told about a bus and what it answers (a bus,
its events as the engine and the batch jobs read them, a kind's functions). The registry that
finds a kind by its URL scheme is ``eventpush.sources``; the built-in kinds import this module
only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from eventpush.addresses import scheme_of
from eventpush.db import Connection, StoreError

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
    retention_s: int | None = None  # for a broker that ages events out itself (max_age)

    @property
    def scheme(self) -> str:
        return source_scheme(self.source_url)


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

    async def read_offsets(
        self, bus: Bus, queue_id: int, offsets: list[int]
    ) -> list[tuple[int, str, str]] | None:
        """The events of ``queue_id`` at ``offsets`` (ascending), as ``Chunk.rows`` (an offset
        no event holds is left out), for a runner that knows which rows of a window it needs.
        None: the source reads whole windows only (the default; the engine then reads the
        window)."""
        return None

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
    - ``publish_anywhere(conn, bus, events)``, optional, a coroutine on an asynchronous
      connection (``eventpush.db.connect_on_loop``): the same for events whose queues the
      kind may choose itself at commit time (no partition key: the API's group commit),
      setting each event's ``queue_id`` to where it went and returning once they are
      durable, without waking the workers; a kind without it is handed ``publish`` (in a
      worker thread) with the queues already chosen.
    - ``announce(conn, bus_ids)``, given with ``publish_anywhere``, a coroutine on such a
      connection: wake the workers of buses whose events ``publish_anywhere`` committed (the
      group publisher calls it off the commits' path, one call for many commits).
    - ``heads(conn, bus)``: ``{queue_id: next position}`` (last position + 1, 0 when empty).
    - ``read_range(conn, bus, queue_id, start, stop)``: ``Stored`` events of one queue with
      ``start <= position < stop``, in order (the batch jobs' reader).
    - ``read_positions(conn, bus, queue_id, positions)``, optional: ``Stored`` events of one
      queue at ``positions`` (ascending; a position no event holds is left out), reading no
      more of the queue than it must: replay's look-ups of scattered events. A kind without it
      is read in runs of near positions through ``read_range`` (:func:`position_runs`).
    - ``position_at(conn, bus, queue_id, when)``: the first position of the queue whose event
      was stored at or after ``when`` (the batch jobs' time windows).
    - ``count(conn, bus)``, optional: how many events the store holds of the bus's queues
      from where each began (``event_bus_queue.first_offset``: 0, or the end of a deleted
      bus's store it took over), without reading them: the archive's ``EventCount``. A kind
      without it gives no count.
    - ``set_retention(conn, bus, seconds)``: for a broker that ages events out itself (a
      JetStream stream's ``max_age``), apply the bus's retention; None where eventpush's
      own partition maintenance is the retention (the PostgreSQL store).
    """

    scheme: str
    check: Callable[[str], str]
    create: Callable[[Connection, Bus], None]
    open_reader: Callable[[str], Reader]
    publish: Callable[[Connection, Bus, Iterable], dict[int, tuple[int, int, int]]]
    heads: Callable[[Connection, Bus], dict[int, int]]
    read_range: Callable[[Connection, Bus, int, int, int], Iterator[Stored]]
    position_at: Callable[[Connection, Bus, int, datetime], int]
    publish_anywhere: (
        Callable[[Connection, Bus, list], Awaitable[dict[int, tuple[int, int, int]]]] | None
    ) = None
    announce: Callable[[Connection, list[int]], Awaitable[None]] | None = None
    set_retention: Callable[[Connection, Bus, int], None] | None = None
    read_positions: Callable[[Connection, Bus, int, list[int]], Iterator[Stored]] | None = None
    count: Callable[[Connection, Bus], int] | None = None


# Scattered positions this close are read as one span (replay's look-ups): at most this many
# unasked positions are passed over per one asked.
RUN_GAP = 64


def position_runs(positions: list[int], gap: int = RUN_GAP) -> list[list[int]]:
    """``positions`` (ascending) cut wherever the next is more than ``gap`` past the last: a
    read of each run's span holds at most ``gap`` unasked positions per one asked, however far
    apart the runs are."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and position - runs[-1][-1] <= gap:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


def source_scheme(url: str | None) -> str:
    """The scheme that chooses a bus's source kind (``eventpush.addresses.scheme_of``, the one
    split of a URL's scheme): POSTGRES without a URL; SourceError when the URL has none."""
    if not url:
        return POSTGRES
    scheme = scheme_of(url)
    if "://" not in url or not scheme:
        raise SourceError(f"source URL {url.split('@')[-1]!r} has no scheme (nats://HOST:PORT)")
    return scheme
