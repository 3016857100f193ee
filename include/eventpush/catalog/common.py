"""What every part of the catalog shares: its errors, name rules, live-row look-ups and the
notification that wakes running workers.

Every catalog function takes an open psycopg2 connection and does its work in one
transaction, so a refused input leaves nothing half-written. Errors are ``CatalogError``
(one line); ``NotFoundError`` and ``ConflictError`` say which kind, for the API's error codes.
Deleted rows stay, marked (``deleted_at``): every look-up by name here reads live rows only.
"""

from __future__ import annotations

import re
from datetime import datetime

from eventpush.errors import CatalogError
from eventpush.sources.postgres import CATALOG_CHANNEL  # workers LISTEN there

# fullmatch, never match with "$": "$" also matches before a trailing newline ("bus\n").
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class NotFoundError(CatalogError):
    """No live bus, rule, target or worker of that name."""


class ConflictError(CatalogError):
    """Already exists, still in use, or changed by someone else since it was read."""


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise CatalogError(
            f"{kind} name {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


# AWS's limit for every description (buses, rules, connections, API destinations).
MAX_DESCRIPTION = 512


def check_description(where: str, description: object) -> str:
    """A description of at most 512 characters (PostgreSQL's text holds no NUL)."""
    if not isinstance(description, str):
        raise CatalogError(f"{where}: --description must be text")
    if len(description) > MAX_DESCRIPTION or "\x00" in description:
        raise CatalogError(
            f"{where}: --description must be at most {MAX_DESCRIPTION} characters without NUL, "
            f"got {len(description)}"
        )
    return description


def runner_name(bus: str, rule: str, target: str) -> str:
    return f"{bus}/{rule}/{target}"


def bus_row(cur, bus: str) -> tuple[int, int]:
    """(id, queues) of the live bus named ``bus``."""
    cur.execute("SELECT id, queues FROM event_bus WHERE name = %s AND deleted_at IS NULL", (bus,))
    row = cur.fetchone()
    if row is None:
        raise NotFoundError(f"unknown bus {bus!r}")
    return row


def live_id(cur, table: str, parent: str, parent_id: int, name: str, lock: bool) -> int | None:
    """The id of the live row ``name`` under ``parent_id`` (FOR UPDATE with ``lock``);
    ``table`` and ``parent`` are fixed names from this package."""
    cur.execute(
        f"SELECT id FROM {table} WHERE {parent} = %s AND name = %s AND deleted_at IS NULL"
        + (" FOR UPDATE" if lock else ""),
        (parent_id, name),
    )
    row = cur.fetchone()
    return None if row is None else row[0]


def rule_row(cur, bus: str, rule: str, lock: bool = False) -> tuple[int, int]:
    """(rule id, bus id) of the live rule ``bus``/``rule`` (FOR UPDATE with ``lock``)."""
    bus_id, _ = bus_row(cur, bus)
    rule_id = live_id(cur, "event_rule", "bus_id", bus_id, rule, lock)
    if rule_id is None:
        raise NotFoundError(f"unknown rule {rule!r} on bus {bus!r}")
    return rule_id, bus_id


def check_version(kind: str, name: str, current: int, expected: int | None) -> None:
    if expected is not None and expected != current:
        raise ConflictError(
            f"{kind} {name} changed meanwhile: it is at version {current}, not {expected}; "
            "read it again and retry"
        )


def notify(cur, bus_id: int = 0) -> None:
    """Running workers re-read their assignment and runners when the transaction commits
    (the payload names the bus changed; 0, no bus, for a change of who holds what)."""
    cur.execute("SELECT pg_notify(%s, %s)", (CATALOG_CHANNEL, str(bus_id)))


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


LOCKS = {"": "", "share": " FOR SHARE", "update": " FOR UPDATE"}


def named_row(cur, table: str, kind: str, name: str, columns: str = "id", lock: str = ""):
    """``columns`` of the live row ``name`` of a top-level table (connections, destinations);
    ``table`` and ``columns`` are fixed names from this package, ``lock`` a key of LOCKS."""
    cur.execute(
        f"SELECT {columns} FROM {table} WHERE name = %s AND deleted_at IS NULL" + LOCKS[lock],
        (name,),
    )
    row = cur.fetchone()
    if row is None:
        raise NotFoundError(f"unknown {kind} {name!r}")
    return row


def check_changes(kind: str, name: str, changes: dict, allowed) -> None:
    """An update names fields that exist, and at least one."""
    unknown = sorted(set(changes) - set(allowed))
    if unknown:
        raise CatalogError(f"{kind} {name!r}: no such field {unknown[0]!r}")
    if not changes:
        raise CatalogError(f"{kind} {name!r}: nothing to change")


def refuse_if_used(kind: str, name: str, users: list[str], what: str, hint: str) -> None:
    """A delete refused while ``users`` (names of ``what``) still use the row."""
    if users:
        shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
        plural = "s" if len(users) > 1 else ""
        raise ConflictError(f"{kind} {name!r} is used by {what}{plural} {shown}: {hint}")
