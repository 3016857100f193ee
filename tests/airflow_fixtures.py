"""Shared Airflow test setup for the push DAG and plugin tests (self-contained).

Importing this module points Airflow at a temporary AIRFLOW_HOME with the repository's
``dags/`` and ``plugins/``, no examples, a SQLite metadata database and the simple auth manager
with three known users (admin, an editor with the ``user`` role, a ``viewer``). The
``airflow_db`` session fixture creates the metadata schema once per session.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOME = Path(tempfile.mkdtemp(prefix="eventpush-airflow-"))
_OWNER = os.getpid()
# Removed when the process that made it ends (each run left one in /tmp); not by a forked
# child (an executor's worker) that happens to exit through Python's own exit.
atexit.register(lambda: os.getpid() == _OWNER and shutil.rmtree(HOME, ignore_errors=True))
PASSWORDS = {"admin": "admin-pw", "editor": "editor-pw", "viewer": "viewer-pw"}
(HOME / "passwords.json").write_text(json.dumps(PASSWORDS))

ENV = {
    "AIRFLOW_HOME": str(HOME),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
    "AIRFLOW__CORE__LAZY_LOAD_PLUGINS": "False",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{HOME}/airflow.db",
    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,editor:user,viewer:viewer",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(HOME / "passwords.json"),
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
    "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
    "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
    "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
    "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "60",
    "GX_ANALYTICS_ENABLED": "False",
}
os.environ.update(ENV)


def _reconfigure_if_needed() -> None:
    """When Airflow was imported before us (another suite's setup), re-point it here."""
    if "airflow.settings" not in sys.modules:
        return
    from airflow import settings
    from airflow.configuration import conf

    if conf.get("database", "sql_alchemy_conn") != ENV["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]:
        raise RuntimeError("Airflow config did not pick up the test environment")
    if str(settings.engine.url) != ENV["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]:
        settings.dispose_orm()
        settings.configure_vars()
        settings.configure_orm()


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[Path]:
    """A migrated Airflow metadata database (SQLite) for this session; yields AIRFLOW_HOME."""
    os.environ.update(ENV)
    _reconfigure_if_needed()
    from airflow.utils import db

    db.initdb()
    yield HOME


@pytest.fixture(scope="module")
def client(airflow_db):
    """The real Airflow API server app (with the eventpush plugin), in process."""
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    with TestClient(create_app("core")) as c:
        yield c


@pytest.fixture
def airflow_conn_env(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The ``eventpush_db`` Airflow connection, from the environment, at this test's database."""
    monkeypatch.setenv("AIRFLOW_CONN_EVENTPUSH_DB", db_url)
    return db_url


def seed(conn, url: str, workers=("w1", "w2"), bus: str = "orders") -> dict[str, str]:
    """A bus, a rule on ``app.orders`` events and, per worker, one runner whose target is
    ``url``; every runner assigned. Returns {worker: runner name}."""
    from eventpush import catalog
    from eventpush.catalog import TargetSpec

    catalog.create_bus(conn, bus, 2)
    catalog.create_rule(conn, bus, "orders-rule", {"source": ["app.orders"]})
    runners = {}
    for i, worker in enumerate(workers):
        catalog.create_worker(conn, worker)
        runners[worker] = catalog.create_target(
            conn, bus, "orders-rule", TargetSpec(name=f"t{i}", url=url, backoff_ms=20)
        )
        catalog.assign(conn)
    return runners


def order_events(n: int, start: int = 0, source: str = "app.orders") -> list[str]:
    return [
        json.dumps({"source": source, "detail-type": "created", "detail": {"n": start + i}})
        for i in range(n)
    ]


class StandaloneWorker:
    """``eventpush worker run``'s engine in a thread of its own, stopped on exit."""

    def __init__(self, worker: str, url: str) -> None:
        from eventpush.push import Engine

        self.engine = Engine(worker, url)
        self.loop = asyncio.new_event_loop()
        self.report = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.report = self.loop.run_until_complete(self.engine.run())

    def __enter__(self) -> StandaloneWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.engine.stop)
        self.thread.join(30)


def wait_for(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
