"""Shared bench helpers: a scratch database of the bench's own, and the machine line."""

from __future__ import annotations

import contextlib
import os
import platform
import uuid
from collections.abc import Iterator

import psutil
import psycopg2

from eventpush.config import allow_loopback_receiver

# The benches' receivers and placeholder targets are on 127.0.0.1, which the address policy
# denies by default; workers and replays the benches start inherit this.
allow_loopback_receiver()

ADMIN_URL = os.environ.get("EVENTPUSH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def machine() -> str:
    cores = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cores} cores, {mem:.0f} GiB, Python {platform.python_version()}"


@contextlib.contextmanager
def scratch_database(prefix: str = "eventpush_bench") -> Iterator[str]:
    """A fresh migrated database, dropped afterwards; also set as EVENTPUSH_DATABASE_URL."""
    from eventpush.schema import migrate

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(ADMIN_URL)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    os.environ["EVENTPUSH_DATABASE_URL"] = url
    try:
        migrate(url)
        yield url
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def tree_cpu(pid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid`` (this one when None) and every process
    under it; PostgreSQL's backends are not counted."""
    total = 0.0
    top = psutil.Process(pid)
    for proc in [top, *top.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total
