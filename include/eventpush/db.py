"""Connections and transactions on the eventpush PostgreSQL database (psycopg2), and
asynchronous connections driven by the running event loop (for the API's group commit)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from eventpush.config import database_url, redact_url
from eventpush.errors import first_line

Connection = psycopg2.extensions.connection
CONNECT_TIMEOUT_S = 10


class StoreError(RuntimeError):
    """A database problem, said in one line, with no secret in it."""


def connect(
    url: str | None = None, *, application_name: str = "eventpush", **libpq: object
) -> Connection:
    """A new connection; ``url`` defaults to ``EVENTPUSH_DATABASE_URL``; ``libpq`` adds
    connection parameters (e.g. TCP keepalives)."""
    url = url or database_url()
    try:
        conn = psycopg2.connect(
            url, application_name=application_name, connect_timeout=CONNECT_TIMEOUT_S, **libpq
        )
    except psycopg2.OperationalError as exc:
        raise _unreachable(url, first_line(exc)) from None
    return conn


def _unreachable(url: str, why: str) -> StoreError:
    return StoreError(f"cannot connect to {redact_url(url)}: {why}")


async def connect_on_loop(url: str, *, application_name: str = "eventpush") -> Connection:
    """A new asynchronous connection (psycopg2's ``async_``: always autocommit), opened
    without blocking the running event loop; use it with :func:`execute_on_loop`."""
    try:
        conn = psycopg2.connect(url, application_name=application_name, async_=True)
    except psycopg2.OperationalError as exc:
        raise _unreachable(url, first_line(exc)) from None
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):  # libpq's connect_timeout is for blocking
            await _ready(conn)
    except psycopg2.OperationalError as exc:
        conn.close()
        raise _unreachable(url, first_line(exc)) from None
    except TimeoutError:
        conn.close()
        raise _unreachable(url, f"no answer in {CONNECT_TIMEOUT_S} s") from None
    except BaseException:  # cancelled: the half-open connection goes too
        conn.close()
        raise
    return conn


async def execute_on_loop(conn: Connection, sql: str, params: object = None) -> list[tuple]:
    """Run one statement (or several, in one implicit transaction) on an asynchronous
    connection while the loop serves others; the last statement's rows ([] for none). An
    error is the database's, as a blocking ``execute`` raises it; after a cancellation the
    connection's state is unknown: close it."""
    cur = conn.cursor()
    cur.execute(sql, params)
    await _ready(conn)
    return cur.fetchall() if cur.description is not None else []


async def _ready(conn: Connection) -> None:
    """Wait on the loop, with no thread, until psycopg2 says the connection is ready."""
    loop = asyncio.get_running_loop()
    while True:
        state = conn.poll()
        if state == psycopg2.extensions.POLL_OK:
            return
        if state == psycopg2.extensions.POLL_READ:
            watch, unwatch = loop.add_reader, loop.remove_reader
        elif state == psycopg2.extensions.POLL_WRITE:
            watch, unwatch = loop.add_writer, loop.remove_writer
        else:
            raise psycopg2.OperationalError(f"unexpected connection poll state {state}")
        fd = conn.fileno()  # may change while a connection is made
        ready = loop.create_future()
        watch(fd, _wake, ready)
        try:
            await ready
        finally:
            unwatch(fd)


def _wake(ready: asyncio.Future) -> None:
    if not ready.done():
        ready.set_result(None)


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
