"""What one API server process holds: its settings, a small pool of database connections
for catalog calls, the keys and buses it has looked up lately, and the group publisher.

The server keeps no state of its own beyond these caches (stateless: several instances run
behind one load balancer). Cached keys and buses live ``CACHE_S`` seconds, so a deleted key
is refused, and a changed bus seen, within that time (``EVENTPUSH_API_CACHE_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from json.encoder import encode_basestring as _json_string
from pathlib import Path

import psycopg2

from eventpush.access_keys import KeyInfo, find_key
from eventpush.api.errors import ApiError
from eventpush.config import setting
from eventpush.db import Connection, StoreError, connect
from eventpush.group_publish import GroupPublisher

CACHE_S = 5.0
DEFAULT_REGION = "us-east-1"  # as the buses' (eventpush.rules.transforms)
DEFAULT_ACCOUNT = "000000000000"
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # 10 entries of 256 KiB, with room for JSON escaping
DB_CONNECTIONS = 4


@dataclass(frozen=True)
class Settings:
    database_url: str
    region: str = DEFAULT_REGION
    account: str = DEFAULT_ACCOUNT
    max_body: int = DEFAULT_MAX_BODY
    cache_s: float = CACHE_S
    airflow_url: str | None = None
    airflow_token_file: Path | None = None

    @classmethod
    def from_env(cls, database_url: str) -> Settings:
        """The server's settings; ``eventpush api`` passes them to its workers through the
        environment (``EVENTPUSH_API_*``) as uvicorn starts each worker afresh."""
        token = os.environ.get("EVENTPUSH_API_AIRFLOW_TOKEN_FILE") or None
        return cls(
            database_url=database_url,
            region=os.environ.get("EVENTPUSH_API_REGION") or DEFAULT_REGION,
            account=os.environ.get("EVENTPUSH_API_ACCOUNT") or DEFAULT_ACCOUNT,
            max_body=int(os.environ.get("EVENTPUSH_API_MAX_BODY") or DEFAULT_MAX_BODY),
            cache_s=float(setting("EVENTPUSH_API_CACHE_S", CACHE_S, minimum=0)),
            airflow_url=os.environ.get("EVENTPUSH_API_AIRFLOW_URL") or None,
            airflow_token_file=Path(token) if token else None,
        )


class DbPool:
    """A few connections, each used by one thread at a time; a connection that failed is
    dropped and opened again on next use."""

    def __init__(self, url: str, size: int = DB_CONNECTIONS) -> None:
        self.url = url
        self._free: asyncio.Queue[Connection | None] = asyncio.Queue()
        for _ in range(size):
            self._free.put_nowait(None)

    async def call(self, fn: Callable, *args, **kwargs):
        """``fn(conn, *args, **kwargs)`` in a worker thread on a pooled connection."""
        conn = await self._free.get()
        try:
            if conn is None:
                conn = await asyncio.to_thread(connect, self.url, application_name="eventpush-api")
            return await asyncio.to_thread(fn, conn, *args, **kwargs)
        except (psycopg2.OperationalError, psycopg2.InterfaceError, StoreError) as exc:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            conn = None
            raise ApiError(
                "ServiceUnavailableException", "the database is not reachable; try again"
            ) from exc
        finally:
            self._free.put_nowait(conn)

    async def close(self) -> None:
        while not self._free.empty():
            conn = self._free.get_nowait()
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()


class TimedCache:
    """Values by key for ``CACHE_S`` seconds."""

    def __init__(self, ttl: float = CACHE_S) -> None:
        self.ttl = ttl
        self._items: dict[str, tuple[float, object]] = {}

    def get(self, key: str) -> object | None:
        found = self._items.get(key)
        if found is None or time.monotonic() - found[0] > self.ttl:
            return None
        return found[1]

    def put(self, key: str, value: object) -> None:
        if len(self._items) > 10_000:  # bounded: unknown ids are never cached
            self._items.clear()
        self._items[key] = (time.monotonic(), value)

    def drop(self, key: str) -> None:
        self._items.pop(key, None)


class Service:
    """The process's shared parts; made by the app's lifespan."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db = DbPool(settings.database_url)
        self.publisher = GroupPublisher(settings.database_url)
        self.keys = TimedCache(settings.cache_s)
        self.buses = TimedCache(settings.cache_s)

    async def start(self) -> None:
        self.publisher.start()

    async def close(self) -> None:
        await self.publisher.close()
        await self.db.close()

    async def key(self, access_key_id: str) -> tuple[KeyInfo, str] | None:
        found = self.keys.get(access_key_id)
        if found is None:
            found = await self.db.call(find_key, access_key_id)
            if found is not None:
                self.keys.put(access_key_id, found)
        return found


@dataclass(frozen=True)
class BusView:
    """A bus as the API needs it: the catalog's view (account, region, description, ...)
    and the source's (id, queues, source URL) for publishing."""

    info: object  # catalog.BusInfo
    source: object  # sources.Bus

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def account(self) -> str:
        return self.info.account

    @property
    def region(self) -> str:
        return self.info.region

    @cached_property
    def envelope_json(self) -> tuple[str, str]:
        """The bus's account and region as JSON strings, as every event's envelope spells
        them: escaped once per bus, not once per entry."""
        return _json_string(self.info.account), _json_string(self.info.region)


def _read_bus(conn: Connection, name: str) -> BusView:
    from eventpush.catalog import get_bus
    from eventpush.sources import bus_named

    return BusView(get_bus(conn, name), bus_named(conn, name))


@dataclass(frozen=True)
class Call:
    """One authenticated request: the service, the caller's key and what it may touch."""

    service: Service
    key: KeyInfo

    @property
    def settings(self) -> Settings:
        return self.service.settings

    async def db(self, fn: Callable, *args, **kwargs):
        """A catalog call on a pooled connection; its refusals become AWS's error codes."""
        from eventpush.api.errors import catalog_error

        try:
            return await self.service.db.call(fn, *args, **kwargs)
        except ValueError as exc:
            raise catalog_error(exc) from None

    async def bus(self, name: str, *, fresh: bool = False) -> BusView:
        """The bus ``name`` (cached for ``CACHE_S``; ``fresh`` reads it again)."""
        cached = None if fresh else self.service.buses.get(name)
        if cached is None:
            cached = await self.db(_read_bus, name)
            self.service.buses.put(name, cached)
        return cached

    def allow_bus(self, name: str) -> None:
        if not self.key.may_use_bus(name):
            raise ApiError(
                "AccessDeniedException",
                f"key {self.key.name} (producer) is not authorized for event bus {name}",
            )
