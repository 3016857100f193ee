"""Shared bench helpers: a scratch database of the bench's own, and the machine line."""

from __future__ import annotations

import contextlib
import glob
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

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
def scratch_database(prefix: str = "eventpush_bench", admin_url: str = ADMIN_URL) -> Iterator[str]:
    """A fresh migrated database, dropped afterwards; also set as EVENTPUSH_DATABASE_URL."""
    from eventpush.schema import migrate

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(admin_url)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    url = f"{admin_url.rsplit('/', 1)[0]}/{name}"
    os.environ["EVENTPUSH_DATABASE_URL"] = url
    try:
        migrate(url)
        # A new database's files wait for the next checkpoint's sync (533 of them took 0.63 s,
        # a stall of every commit in whichever measured run that checkpoint fell in): setup's
        # debt is paid before anything is measured.
        with admin.cursor() as cur:
            cur.execute("CHECKPOINT")
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


def compose_postgres_settings() -> list[str]:
    """The ``-c name=value`` settings docker-compose.yaml gives its PostgreSQL service."""
    import yaml

    compose = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "docker-compose.yaml").read_text()
    )
    command = compose["services"]["postgres"].get("command", [])
    return [arg for arg in command if "=" in arg]


@contextlib.contextmanager
def private_postgres(settings: list[str]) -> Iterator[str]:
    """A throwaway PostgreSQL cluster of this machine's release, started with ``settings``
    (``name=value``) on a free loopback port, trusting local connections: its admin URL.
    Stopped and removed afterwards."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise SystemExit("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    bin_dir = Path(found[-1]).parent
    top = Path(tempfile.mkdtemp(prefix="eventpush-bench-pg-"))
    data = top / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(top, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = [f"-p {port}", f"-k {top}", "-c listen_addresses=127.0.0.1"]
    options += [f"-c {setting}" for setting in settings]
    run = {"check": True, "stdout": subprocess.DEVNULL}
    pg_ctl = [*as_user, bin_dir / "pg_ctl", "-D", data]
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    started = False
    try:
        initdb = [*as_user, bin_dir / "initdb", "-D", data, "-U", "postgres", "-A", "trust"]
        subprocess.run(initdb, **run)
        subprocess.run([*pg_ctl, "-l", top / "log", "-w", "-o", " ".join(options), "start"], **run)
        started = True
        _make_wal_files(url, WARM_WAL_FILES)
        yield url
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], **run)
        shutil.rmtree(top, ignore_errors=True)


# WAL files a new cluster makes before it is measured: a running server reuses its WAL files,
# a new one has to write and sync each 16 MB file the first time (a stall of every commit),
# and one API bench writes about 4 GB of WAL.
WARM_WAL_FILES = 320


def _make_wal_files(url: str, count: int) -> None:
    """Have a new cluster make ``count`` WAL files and keep them for reuse (its min_wal_size
    permitting), as a running one has."""
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE wal_warm (n int)")
            for _ in range(count):
                cur.execute("INSERT INTO wal_warm VALUES (1)")
                cur.execute("SELECT pg_switch_wal()")
            cur.execute("DROP TABLE wal_warm")
            cur.execute("CHECKPOINT")
    finally:
        conn.close()
    # The files were written through the page cache: the kernel would write them back during
    # the measured runs (30 s on), and every commit's sync would wait behind that.
    os.sync()


def ab_summary(got: dict[str, list[tuple[float, float]]], new: str, old: str) -> None:
    """Print an in-process A/B of two HTTP clients: each side's median requests/s and loop CPU
    a request (``got``: name -> (requests/s, CPU µs) per block), and in how many blocks side by
    side ``new`` took less CPU than ``old``."""
    for name, rows in got.items():
        cpus = [c for _, c in rows]
        print(
            f"  {name}: {statistics.median(r for r, _ in rows):,.0f} req/s (median), loop CPU "
            f"{statistics.median(cpus):.1f} us a request (median; {min(cpus):.1f}-{max(cpus):.1f})"
        )
    wins = sum(a[1] < b[1] for a, b in zip(got[new], got[old], strict=True))
    print(f"  {new} took less CPU than {old} in {wins} of {len(got[new])} blocks side by side")
