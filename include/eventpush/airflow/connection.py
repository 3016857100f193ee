"""Where the eventpush database is, seen from Airflow: the one place that resolves it.

Order: the Airflow connection ``eventpush_db`` (from the Task SDK: the API server, a secrets
backend or ``AIRFLOW_CONN_EVENTPUSH_DB``), then ``EVENTPUSH_DATABASE_URL``. The URL is built
from the connection's fields; only its redacted form ever reaches a log or an error.
"""

from __future__ import annotations

import logging
from urllib.parse import quote, urlencode

from eventpush.config import ConfigError, redact_url
from eventpush.config import database_url as env_database_url

CONN_ID = "eventpush_db"
POSTGRES_TYPES = {"postgres", "postgresql"}

log = logging.getLogger(__name__)


def url_from_connection(conn) -> str:
    """A ``postgresql://`` URL from an Airflow ``Connection`` (login, password, host, port,
    schema as the database, string extras as libpq parameters)."""
    conn_type = (conn.conn_type or "").lower()
    if conn_type not in POSTGRES_TYPES:
        raise ConfigError(
            f"Airflow connection {conn.conn_id!r} must be of type postgres, not {conn_type!r}"
        )
    if not conn.host:
        raise ConfigError(f"Airflow connection {conn.conn_id!r} has no host")
    auth = ""
    if conn.login:
        auth = quote(conn.login, safe="")
        if conn.password:
            auth += ":" + quote(conn.password, safe="")
        auth += "@"
    host = conn.host if ":" not in conn.host else f"[{conn.host}]"
    port = f":{conn.port}" if conn.port else ""
    database = quote(conn.schema or "", safe="")
    extras = {k: str(v) for k, v in (conn.extra_dejson or {}).items() if isinstance(v, str | int)}
    # %20, not urlencode's "+": libpq decodes only %XX, and a "+" would reach the server as
    # is ("options": "-c statement_timeout=5s" would be refused as "-c+statement_timeout").
    query = f"?{urlencode(extras, quote_via=quote)}" if extras else ""
    return f"postgresql://{auth}{host}{port}/{database}{query}"


def _not_found(exc: BaseException) -> bool:
    return type(exc).__name__ in {"AirflowNotFoundException", "ConnectionNotFound"} or (
        "isn't defined" in str(exc) or "not found" in str(exc).lower()
    )


def _fallback(conn_id: str, why: str) -> str:
    url = env_database_url()
    log.info("eventpush database: %s (%s; from EVENTPUSH_DATABASE_URL)", redact_url(url), why)
    return url


def database_url(conn_id: str = CONN_ID) -> str:
    """The eventpush database URL for code running under Airflow (tasks, API server)."""
    try:
        # Deferred: Airflow's SDK is loaded only when an Airflow process calls this.
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # no connection, or no Airflow context to ask
        if not _not_found(exc):
            log.warning("Airflow connection %r unavailable: %s", conn_id, type(exc).__name__)
        return _fallback(conn_id, f"no Airflow connection {conn_id!r}")
    url = url_from_connection(conn)
    log.info("eventpush database: %s (Airflow connection %r)", redact_url(url), conn_id)
    return url


async def adatabase_url(conn_id: str = CONN_ID) -> str:
    """The same, for async code (triggers): the connection is fetched without blocking."""
    try:
        # Deferred: Airflow's SDK is loaded only when an Airflow process calls this.
        from airflow.sdk import BaseHook

        conn = await BaseHook.aget_connection(conn_id)
    except Exception as exc:
        if not _not_found(exc):
            log.warning("Airflow connection %r unavailable: %s", conn_id, type(exc).__name__)
        return _fallback(conn_id, f"no Airflow connection {conn_id!r}")
    return url_from_connection(conn)
