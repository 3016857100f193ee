"""Connections and transactions on the eventpush PostgreSQL database (psycopg2), and
asynchronous connections driven by the running event loop (psycopg 3, for the API's group
commit: its statements travel with their parameters apart from the text, the extended
protocol, so a commit's ~150 KB of event bodies is neither quoted on our side nor parsed out
of the statement's text on the server's)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from eventpush.config import ENV_VAR, ConfigError, database_url, redact, redact_url
from eventpush.errors import first_line

Connection = psycopg2.extensions.connection
if TYPE_CHECKING:  # psycopg 3 is imported where the API's group commit runs, not by every job
    from psycopg import AsyncConnection as LoopConnection
CONNECT_TIMEOUT_S = 10
# libpq parameters for a connection that must notice a dead peer (a host gone, a network cut:
# a half-open connection) in about idle + interval x count seconds rather than wait forever.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}


class StoreError(RuntimeError):
    """A database problem, said in one line, with no secret in it."""


def connect(
    url: str | None = None, *, application_name: str = "eventpush", **libpq: object
) -> Connection:
    """A new connection; ``url`` defaults to ``EVENTPUSH_DATABASE_URL``; ``libpq`` adds
    connection parameters (e.g. TCP keepalives)."""
    where = "the database URL" if url else ENV_VAR
    url = url or database_url()
    try:
        conn = psycopg2.connect(
            url, application_name=application_name, connect_timeout=CONNECT_TIMEOUT_S, **libpq
        )
    except psycopg2.OperationalError as exc:
        raise _unreachable(url, first_line(exc)) from None
    except psycopg2.ProgrammingError as exc:
        # libpq refuses a URL it cannot parse ("invalid dsn"), quoting it whole, password
        # included: a configuration error, said redacted, and not retried as an outage.
        raise ConfigError(
            f"{where} {redact_url(url)!r} is not a usable PostgreSQL URL: "
            + redact(first_line(exc).replace(url, "the URL"), url)
        ) from None
    return conn


def _unreachable(url: str, why: str) -> StoreError:
    return StoreError(f"cannot connect to {redact_url(url)}: {why}")


async def connect_on_loop(url: str, *, application_name: str = "eventpush") -> LoopConnection:
    """A new asynchronous connection (autocommit), opened without blocking the running event
    loop; use it with :func:`execute_on_loop` and close it with ``await conn.close()``."""
    import psycopg

    try:
        # asyncio's timeout, not only libpq's connect_timeout, which counts whole seconds
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await psycopg.AsyncConnection.connect(
                url,
                autocommit=True,
                application_name=application_name,
                connect_timeout=CONNECT_TIMEOUT_S,
            )
    except psycopg.OperationalError as exc:
        raise _unreachable(url, first_line(exc)) from None
    except TimeoutError:
        raise _unreachable(url, f"no answer in {CONNECT_TIMEOUT_S} s") from None


async def execute_on_loop(conn: LoopConnection, sql: str, params: object = None) -> list[tuple]:
    """Run one statement, its own transaction, while the loop serves others; its rows ([] for
    none). psycopg prepares a statement on a connection once it has run a few times, so the
    group commit's append is planned once. An error is the database's (``psycopg.Error``);
    after a cancellation the connection's state is unknown: close it."""
    cur = await conn.execute(sql, params)
    return await cur.fetchall() if cur.description is not None else []


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


def read_only(conn: Connection) -> bool:
    """True when this connection's transactions may not write: a hot standby, or a database
    or role set ``default_transaction_read_only`` (as a failover's old primary may be)."""
    with transaction(conn) as cur:
        cur.execute("SHOW transaction_read_only")
        return cur.fetchone()[0] == "on"


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


def int_array(values) -> str:
    """Integers as the text of a PostgreSQL array, for an ``%s::int[]`` (or ``bigint[]``)
    parameter: a driver adapts a list element by element, several times slower, and these
    lists run to a partition's every record or a group commit's every event."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


def text_array(values: list[str]) -> str:
    """Strings as the text of a PostgreSQL array, for an ``%s::text[]`` (or another type's)
    parameter: each element double-quoted (so commas, braces and white space are its own), a
    backslash or a double quote escaped; the escaping walks the elements only when one of
    them holds such a character."""
    plain = "".join(values)
    if "\\" in plain or '"' in plain:
        values = [v.replace("\\", "\\\\").replace('"', '\\"') for v in values]
    return '{"' + '","'.join(values) + '"}'


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
