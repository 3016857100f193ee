"""Shared fixtures: every test run makes its own uniquely named databases and drops them.

``EVENTPUSH_ADMIN_URL`` (set by ``./dev test``) names a server and a database we may connect
to with the right to create databases; the default is the machine's local PostgreSQL.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from nats_support import nats_server  # noqa: F401  (a fixture for every test module)

from eventpush.sealed import write_key_file

REPO = Path(__file__).resolve().parents[1]
ADMIN_URL = os.environ.get("EVENTPUSH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RUN_ID = uuid.uuid4().hex[:8]

# Loopback is denied by default (issue 16); the tests' receivers live on 127.0.0.1, so the
# suite opens exactly that, and nothing else. Set at import, before any worker, CLI
# subprocess or Airflow task inherits the environment; a developer's own ranges are not let in.
# 127.0.0.2 stays denied: tests of refusals stand it in for a forbidden address.
TEST_ALLOW_CIDRS = "127.0.0.1/32,::1/128"
os.environ["EVENTPUSH_ALLOW_CIDRS"] = TEST_ALLOW_CIDRS
os.environ.pop("EVENTPUSH_DENY_CIDRS", None)

# Stored secrets are sealed with a key of this run's own (eventpush.sealed), in a private
# directory removed at exit; every worker and CLI subprocess inherits it.
_KEY_DIR = tempfile.mkdtemp(prefix="eventpush-test-key-")
atexit.register(shutil.rmtree, _KEY_DIR, True)
SECRET_KEY_FILE = Path(_KEY_DIR) / "secret.key"
os.environ["EVENTPUSH_SECRET_KEY_FILE"] = str(SECRET_KEY_FILE)
write_key_file(SECRET_KEY_FILE)


def pytest_collection_finish(session: pytest.Session) -> None:
    """With cluster tests selected, the cluster's slow one-time setup (the executors' packed
    Python, Airflow's metadata database) starts now, in the background, while the modules
    before test_cluster.py run (tests/cluster_support.py)."""
    import cluster_support

    if session.config.option.collectonly:
        return
    wanted = any(item.get_closest_marker("cluster") for item in session.items)
    if wanted and cluster_support.redis_up():  # without Redis the cluster tests skip
        cluster_support.begin(ADMIN_URL, RUN_ID)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import cluster_support

    cluster_support.end()


def _server(url: str) -> str:
    return url.rsplit("/", 1)[0]


def _admin(sql: str) -> None:
    conn = psycopg2.connect(ADMIN_URL)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


def _drop(name: str) -> None:
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """A migrated database that per-test databases are cloned from."""
    from eventpush.schema import migrate

    name = f"eventpush_test_{RUN_ID}_tpl"
    _admin(f'CREATE DATABASE "{name}"')
    url = f"{_server(ADMIN_URL)}/{name}"
    try:
        migrate(url)
        yield name
    finally:
        _drop(name)


@pytest.fixture
def empty_db_url() -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = f"eventpush_test_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin(f'CREATE DATABASE "{name}"')
    try:
        yield f"{_server(ADMIN_URL)}/{name}"
    finally:
        _drop(name)


@pytest.fixture
def db_url(template_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh migrated database of this test's own, also set as EVENTPUSH_DATABASE_URL."""
    name = f"eventpush_test_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    url = f"{_server(ADMIN_URL)}/{name}"
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL", url)
    try:
        yield url
    finally:
        _drop(name)


@pytest.fixture
def conn(db_url: str):
    c = psycopg2.connect(db_url)
    try:
        yield c
    finally:
        c.close()


def run_cli(*args: str, input: str | None = None, env: dict | None = None):
    """Run the real ``eventpush`` console script; returns the CompletedProcess."""
    exe = Path(sys.executable).with_name("eventpush")
    return subprocess.run(
        [str(exe), *args],
        input=input,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.fixture
def cli():
    return run_cli
