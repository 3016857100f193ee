"""A source's heads remembered as the queues' ``next_offset`` (``event_bus_queue``), so status,
lag, the push trigger and new runners read a broker's bus as they read a PostgreSQL one."""

from __future__ import annotations

from eventpush.db import Connection, transaction

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


def first_positions(conn: Connection, bus_id: int) -> dict[int, int]:
    """Where each queue of the bus begins (``first_offset``): 0, or the end of a deleted bus's
    store that this bus took over (catalog.buses)."""
    with transaction(conn) as cur:
        cur.execute(
            "SELECT queue_id, first_offset FROM event_bus_queue WHERE bus_id = %s", (bus_id,)
        )
        return dict(cur.fetchall())
