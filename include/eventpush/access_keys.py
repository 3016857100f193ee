"""Access keys of the EventBridge-compatible API: who may call it, as what.

A key is an AWS-style pair: an access key id (20 upper-case letters and digits, starting
``EPAK``) that names it in every request, and a secret access key that signs requests
(Signature Version 4) and is shown once, at creation. The secret is stored sealed
(``eventpush.sealed``) because the server must recompute signatures with it: a hash would
not do. Roles: ``admin`` may call every operation; ``producer`` may only put events on (and
test patterns for) the buses it was given.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

import psycopg2.errors

from eventpush.catalog import CatalogError, ConflictError, NotFoundError, check_name
from eventpush.db import Connection, transaction

ROLES = ("admin", "producer")
KEY_ID_PREFIX = "EPAK"
_KEY_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"  # base32: no 0/1 to misread as O/I


@dataclass(frozen=True)
class KeyInfo:
    name: str
    access_key_id: str
    role: str
    buses: tuple[str, ...]
    created_at: datetime

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "access_key_id": self.access_key_id,
            "role": self.role,
            "buses": list(self.buses),
            "created_at": self.created_at.isoformat(),
        }

    def may_use_bus(self, bus: str) -> bool:
        return self.role == "admin" or bus in self.buses


@dataclass(frozen=True)
class NewKey:
    """What ``create_key`` returns: the only time the secret is seen in clear."""

    info: KeyInfo
    secret_access_key: str


def _new_key_id() -> str:
    return KEY_ID_PREFIX + "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(16))


def create_key(conn: Connection, name: str, role: str, buses: list[str] | tuple = ()) -> NewKey:
    """A new key; a producer names the buses it may publish to (each must exist), an admin
    names none."""
    from eventpush.sealed import seal

    check_name("key", name)
    if role not in ROLES:
        raise CatalogError(f"--role must be admin or producer, got {role!r}")
    buses = tuple(dict.fromkeys(buses))  # order kept, duplicates dropped
    if role == "producer" and not buses:
        raise CatalogError("a producer key needs at least one --bus it may publish to")
    if role == "admin" and buses:
        raise CatalogError("an admin key may use every bus: give no --bus")
    secret = secrets.token_urlsafe(30)  # 40 characters, as AWS's secret access keys
    sealed = seal(secret)
    try:
        with transaction(conn) as cur:
            cur.execute("SELECT name FROM event_bus WHERE name = ANY(%s)", (list(buses),))
            missing = set(buses) - {row[0] for row in cur.fetchall()}
            if missing:
                raise NotFoundError(f"unknown bus {sorted(missing)[0]!r}")
            key_id = _new_key_id()
            cur.execute(
                "INSERT INTO event_api_key (name, access_key_id, secret, role, buses) "
                "VALUES (%s, %s, %s, %s, %s) RETURNING ctime",
                (name, key_id, sealed, role, list(buses)),
            )
            created = cur.fetchone()[0]
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"key {name!r} already exists") from None
    return NewKey(KeyInfo(name, key_id, role, buses, created), secret)


_COLUMNS = "name, access_key_id, role, buses, ctime"


def list_keys(conn: Connection) -> list[KeyInfo]:
    with transaction(conn) as cur:
        cur.execute(f"SELECT {_COLUMNS} FROM event_api_key ORDER BY name")
        return [KeyInfo(n, k, r, tuple(b), c) for n, k, r, b, c in cur.fetchall()]


def delete_key(conn: Connection, name: str) -> None:
    with transaction(conn) as cur:
        cur.execute("DELETE FROM event_api_key WHERE name = %s RETURNING id", (name,))
        if cur.fetchone() is None:
            raise NotFoundError(f"unknown key {name!r}")


def find_key(conn: Connection, access_key_id: str) -> tuple[KeyInfo, str] | None:
    """The key of ``access_key_id`` and its clear secret (to recompute a signature), or
    None for an unknown id."""
    from eventpush.sealed import unseal

    with transaction(conn) as cur:
        cur.execute(
            f"SELECT {_COLUMNS}, secret FROM event_api_key WHERE access_key_id = %s",
            (access_key_id,),
        )
        row = cur.fetchone()
    if row is None:
        return None
    name, key_id, role, buses, created, sealed = row
    return KeyInfo(name, key_id, role, tuple(buses), created), unseal(sealed)
