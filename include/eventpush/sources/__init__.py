"""Sources: where a bus's events are stored and read from, behind one interface.

A bus's row in ``event_bus`` records its source URL (``source_url``; NULL is the built-in
PostgreSQL store). The URL's scheme chooses the **kind** of source: a :class:`SourceKind`,
built in (``postgres``, ``nats``) or found through the Python entry-point group
``eventpush.sources`` (name = the scheme, value = a ``SourceKind`` object), so a third party
adds a broker without editing eventpush (docs/ARCHITECTURE.md, "Sources and sinks"). The
registry is :class:`eventpush.plugins.Registry`, as for sinks: a scheme claimed twice, or a
built-in's claimed by a plug-in, is refused.

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
from collections.abc import Iterable

from eventpush.config import redact
from eventpush.db import Connection, read_only, transaction
from eventpush.errors import CatalogError
from eventpush.plugins import Registry
from eventpush.sources.contract import (
    POSTGRES,
    Bus,
    Chunk,
    Reader,
    SourceError,
    SourceKind,
    SourceUnavailableError,
    Stored,
    source_scheme,
)
from eventpush.sources.heads import HEADS_SQL, record_heads, write_heads

__all__ = [
    "POSTGRES",
    "Bus",
    "Chunk",
    "Reader",
    "SourceError",
    "SourceKind",
    "SourceUnavailableError",
    "Stored",
    "HEADS_SQL",
    "record_heads",
    "source_scheme",
    "write_heads",
]

log = logging.getLogger("eventpush.sources")

GROUP = "eventpush.sources"
REGISTRY = Registry(
    GROUP,
    # Loaded on first use: the NATS source loads the nats client library, which a
    # PostgreSQL-only deployment never needs.
    {POSTGRES: "eventpush.sources.postgres:KIND", "nats": "eventpush.sources.nats:KIND"},
    "source scheme",
)


def kind_for(url: str | None) -> SourceKind:
    """The source kind of a bus's source URL (None: PostgreSQL), built in or by entry point."""
    return kind_named(source_scheme(url))


def kind_named(scheme: str) -> SourceKind:
    """The source kind serving ``scheme``: built in, else the entry point of that name."""
    found = REGISTRY.load(scheme)
    if found is None:
        raise SourceError(
            f"no source kind for scheme {scheme!r} (known: {', '.join(REGISTRY.names())})"
        )
    if not isinstance(found, SourceKind):
        raise SourceError(
            f"entry point {scheme} = {REGISTRY.points()[scheme.lower()].value} in {GROUP} "
            "is not a SourceKind"
        )
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
    with transaction(conn) as cur:
        cur.execute(BUS_SQL + " WHERE name = %s AND deleted_at IS NULL", (name,))
        row = cur.fetchone()
    if row is None:
        raise CatalogError(f"unknown bus {name!r}")
    return Bus(*row)


def broker_name(source_url: str | None) -> str:
    """The ``broker_name`` of a bus's position rows: its source kind (``eventpush`` for the
    built-in store, RocketMQ EventBridge's value)."""
    return "eventpush" if source_url is None else source_scheme(source_url)


def _ask_heads(conn: Connection, worker: str | None) -> dict[int, dict[int, int]]:
    """Every bus on another source (or only those of ``worker``'s runners) asked for its
    heads: ``{bus id: {queue: head}}`` of those that answered (one that did not is logged in
    one line and keeps its last heads)."""
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
    found: dict[int, dict[int, int]] = {}
    for bus in buses:
        try:
            found[bus.id] = kind_for(bus.source_url).heads(conn, bus)
        except Exception as exc:
            log.warning("%s", redact(f"bus {bus.name}: source not read: {exc}", bus.source_url))
    return found


def sync_heads(conn: Connection, *, worker: str | None = None) -> dict[int, dict[int, int]]:
    """Ask every bus on another source (or only those of ``worker``'s runners) for its heads
    and record them where the database takes writes; on a read-only one (a standby, a
    failover's old primary) nothing is written. Returns the heads asked, ``{bus id: {queue:
    head}}``, for a reader that cannot have them recorded first. A source that does not
    answer keeps its last heads (logged, one line)."""
    found = _ask_heads(conn, worker)
    if found and not read_only(conn):
        for bus_id, heads in found.items():
            record_heads(conn, bus_id, heads)
    return found
