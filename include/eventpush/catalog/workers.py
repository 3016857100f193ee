"""Workers: creating, enabling, listing and deleting them, and assigning runners to them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psycopg2
import psycopg2.errors
import psycopg2.extras

from eventpush.catalog.common import (
    CatalogError,
    ConflictError,
    NotFoundError,
    check_name,
    iso,
    notify,
)
from eventpush.db import Connection, transaction


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    capacity: int
    enabled: bool
    runners: int
    host: str | None
    pid: int | None  # None when not running
    heartbeat_at: str | None

    def to_json(self) -> dict:
        return asdict(self)


def create_worker(conn: Connection, name: str, capacity: int = 100) -> int:
    check_name("worker", name)
    if not isinstance(capacity, int) or not 1 <= capacity <= 1_000_000:
        raise CatalogError(f"--capacity must be between 1 and 1000000, got {capacity}")
    try:
        with transaction(conn) as cur:
            cur.execute(
                "INSERT INTO event_push_worker (name, capacity) VALUES (%s, %s) RETURNING id",
                (name, capacity),
            )
            return cur.fetchone()[0]
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"worker {name!r} already exists") from None


def list_workers(conn: Connection) -> list[WorkerInfo]:
    with transaction(conn) as cur:
        cur.execute(
            "SELECT w.name, w.capacity, w.enabled, count(r.id), w.host, w.pid, w.heartbeat_at "
            "FROM event_push_worker w LEFT JOIN event_target_runner r "
            "ON r.worker_id = w.id AND r.deleted_at IS NULL "
            "GROUP BY w.id ORDER BY w.name"
        )
        return [
            WorkerInfo(name, cap, enabled, runners, host, pid, iso(beat))
            for name, cap, enabled, runners, host, pid, beat in cur.fetchall()
        ]


def delete_worker(conn: Connection, name: str) -> None:
    """Delete a worker that holds no runner (disable it first: its runners move)."""
    with transaction(conn) as cur:
        cur.execute("LOCK TABLE event_target_runner IN SHARE ROW EXCLUSIVE MODE")
        cur.execute("SELECT id FROM event_push_worker WHERE name = %s FOR UPDATE", (name,))
        row = cur.fetchone()
        if row is None:
            raise NotFoundError(f"unknown worker {name!r}")
        cur.execute(
            "SELECT count(*) FROM event_target_runner WHERE worker_id = %s AND deleted_at IS NULL",
            (row[0],),
        )
        held = cur.fetchone()[0]
        if held:
            raise ConflictError(
                f"worker {name!r} holds {held} runners: disable it first so they move"
            )
        cur.execute("DELETE FROM event_push_worker WHERE id = %s", (row[0],))


def set_worker_enabled(conn: Connection, name: str, enabled: bool) -> int:
    """Enable or disable a worker. Disabling hands its runners to the other enabled workers
    (evenly, as ``assign`` does); returns how many runners moved."""
    with transaction(conn) as cur:
        cur.execute(
            "UPDATE event_push_worker SET enabled = %s WHERE name = %s RETURNING id",
            (enabled, name),
        )
        if cur.fetchone() is None:
            raise NotFoundError(f"unknown worker {name!r}")
        notify(cur)  # a disabled worker lets go of its runners at once
        return _assign(cur, origin=f"worker {'enable' if enabled else 'disable'} {name}")


def assign(conn: Connection) -> int:
    """Give unassigned runners (and those of disabled workers) to enabled workers, evenly
    relative to capacity, without moving the others. Returns how many runners it placed."""
    with transaction(conn) as cur:
        return _assign(cur, origin="assign")


def _assign(cur, origin: str) -> int:
    # Serialises with rebalancing and other assigns; readers are not blocked.
    cur.execute("LOCK TABLE event_target_runner IN SHARE ROW EXCLUSIVE MODE")
    cur.execute(
        "SELECT w.id, w.capacity, count(r.id) FROM event_push_worker w "
        "LEFT JOIN event_target_runner r ON r.worker_id = w.id AND r.deleted_at IS NULL "
        "WHERE w.enabled GROUP BY w.id, w.capacity ORDER BY w.id"
    )
    workers = {wid: [capacity, count] for wid, capacity, count in cur.fetchall()}
    cur.execute(
        "SELECT r.id FROM event_target_runner r "
        "LEFT JOIN event_push_worker w ON w.id = r.worker_id "
        "WHERE r.deleted_at IS NULL AND (r.worker_id IS NULL OR NOT w.enabled) ORDER BY r.id"
    )
    todo = [row[0] for row in cur.fetchall()]
    if not todo:
        return 0
    # Running workers take their new runners (or let go of a disabled worker's) at once,
    # not at their next periodic read.
    notify(cur)
    if not workers:
        cur.execute(
            "UPDATE event_target_runner SET worker_id = NULL WHERE id = ANY(%s)",
            (todo,),
        )
        return 0
    placement: dict[int, int] = {}
    for runner_id in todo:
        wid = min(workers, key=lambda w: ((workers[w][1] + 1) / workers[w][0], w))
        workers[wid][1] += 1
        placement[runner_id] = wid
    cur.execute(
        "INSERT INTO event_assignment (origin, moves) VALUES (%s, %s) RETURNING generation",
        (origin, len(placement)),
    )
    generation = cur.fetchone()[0]
    psycopg2.extras.execute_values(
        cur,
        "UPDATE event_target_runner r SET worker_id = v.worker_id, generation = v.generation "
        "FROM (VALUES %s) AS v(id, worker_id, generation) WHERE r.id = v.id",
        [(rid, wid, generation) for rid, wid in placement.items()],
    )
    return len(placement)
