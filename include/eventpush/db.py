"""Connections and transactions on the eventpush PostgreSQL database (psycopg2)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from eventpush.config import database_url, redact_url
from eventpush.errors import first_line

Connection = psycopg2.extensions.connection


class StoreError(RuntimeError):
    """A database problem, said in one line, with no secret in it."""


def connect(
    url: str | None = None, *, application_name: str = "eventpush", **libpq: object
) -> Connection:
    """A new connection; ``url`` defaults to ``EVENTPUSH_DATABASE_URL``; ``libpq`` adds
    connection parameters (e.g. TCP keepalives)."""
    url = url or database_url()
    try:
        conn = psycopg2.connect(url, application_name=application_name, connect_timeout=10, **libpq)
    except psycopg2.OperationalError as exc:
        raise StoreError(f"cannot connect to {redact_url(url)}: {first_line(exc)}") from None
    return conn


@contextlib.contextmanager
def transaction(conn: Connection) -> Iterator[psycopg2.extensions.cursor]:
    """A cursor inside one transaction: committed on success, rolled back on any error."""
    try:
        with conn.cursor() as cur:
            yield cur
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


@contextlib.contextmanager
def connection(url: str | None = None) -> Iterator[Connection]:
    """A connection closed on exit."""
    conn = connect(url)
    try:
        yield conn
    finally:
        conn.close()


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def copy_text(value: object) -> str:
    """A field for COPY's text format: NULL as \\N, escapes only when a field needs them
    (JSON bodies rarely do, and this sits on the publish and commit hot paths)."""
    if value is None:
        return "\\N"
    text = str(value)
    if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
        return text.translate(_COPY_ESCAPES)
    return text


# SQLSTATE classes worth waiting out: connection exceptions, invalid transaction state (25006
# read-only after a failover), transaction rollback (40001 serialization, 40P01 deadlock),
# insufficient resources, operator intervention (57P01 admin shutdown), system errors.
TRANSIENT_CLASSES = frozenset({"08", "25", "40", "53", "57", "58"})


def is_transient(exc: BaseException) -> bool:
    """A database error that goes away by waiting and reconnecting (of any class)."""
    if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError | StoreError):
        return True
    code = getattr(exc, "pgcode", None)
    return bool(code) and code[:2] in TRANSIENT_CLASSES
