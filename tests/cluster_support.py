"""The test cluster's setup (tests/test_cluster.py), begun before its tests run.

A first ``scripts/cluster.sh up`` spends minutes on work that needs no port and no running
service: packing the Spark executors' Python environment (once per lock file, so on every
fresh clone) and migrating Airflow's metadata database. When the session has cluster tests,
``tests/conftest.py`` calls :func:`begin` once collection is done, and ``cluster.sh prepare``
does that work in the background while the modules before ``test_cluster.py`` run; the
cluster fixture waits for it (:meth:`Setup.prepared`) and then starts the services.
:func:`end` stops and removes whatever is left when the session ends (the fixture normally
has: ``down --purge`` drops the metadata database and the directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent
SCRIPT = REPO / "scripts" / "cluster.sh"
PASSWORD = "cluster-test-pw"


def redis_up() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=2).close()
        return True
    except OSError:
        return False


@dataclass
class Setup:
    """The cluster's directory, environment (without ports: they are chosen at ``up``, when
    they are free) and eventpush database name, and the background ``prepare``."""

    directory: Path
    env: dict[str, str]
    db_name: str
    db_url: str
    proc: subprocess.Popen | None = None
    log: Path = field(init=False)
    down: bool = False

    def __post_init__(self) -> None:
        self.log = self.directory / "prepare.log"

    def start_prepare(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", str(SCRIPT), "prepare"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def prepared(self, timeout: float = 900) -> None:
        """Wait for ``prepare``; a failure is the fixture's, with the script's own words."""
        if self.proc is None:
            self.start_prepare()
        assert self.proc is not None
        code = self.proc.wait(timeout)
        assert code == 0, f"cluster.sh prepare failed:\n{self.log.read_text(errors='replace')}"

    def script(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


_setup: Setup | None = None


def begin(admin_url: str, run_id: str, *, background: bool = True) -> Setup:
    """This session's cluster setup (made once); ``prepare`` started in the background."""
    global _setup
    if _setup is not None:
        return _setup
    directory = Path(tempfile.mkdtemp(prefix=f"eventpush-cluster-{run_id}-"))
    (directory / "passwords.json").write_text(json.dumps({"admin": PASSWORD}))
    db_name = f"eventpush_test_{run_id}_cluster"
    db_url = f"{admin_url.rsplit('/', 1)[0]}/{db_name}"
    # Nothing of the session's in-process Airflow setup (tests/airflow_fixtures.py: its home,
    # executor, log level...) leaks into the cluster: the script and the settings below decide.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
        "EVENTPUSH_VENV": str(VENV),
        # made later from the dataset (test_cluster's dbs fixture); Airflow only keeps the URL
        # until a task uses it, and with no schedules (below) no task runs before the tests
        "EVENTPUSH_DATABASE_URL": db_url,
        "EVENTPUSH_ADMIN_URL": admin_url,
        "EVENTPUSH_CLUSTER_DIR": str(directory),
        "EVENTPUSH_CLUSTER_AIRFLOW_DB": f"eventpush_test_{run_id}_airflow",
        "EVENTPUSH_CLUSTER_QUEUE": f"eventpush-test-{run_id}",
        # one core per Spark application: the audit's and the rebalance's jobs run side by side
        "EVENTPUSH_CLUSTER_APP_CORES": "1",
        "EVENTPUSH_JDBC_JAR": os.environ.get(
            "EVENTPUSH_JDBC_JAR", "/usr/share/java/postgresql.jar"
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(directory / "passwords.json"),
        # Only the runs the tests trigger: no scheduled audit or rebalance of the test data
        # beside theirs, no continuous push rounds or slice checks using the machine meanwhile.
        "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
        # a dead Celery worker's task is failed (and retried) after this long without heartbeat
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "45",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
    }
    _setup = Setup(directory, env, db_name, db_url)
    if background:
        _setup.start_prepare()
    return _setup


def end() -> None:
    """Stop a ``prepare`` still running and remove what a cluster fixture that never ran (or
    never finished) left: the metadata database and the directory."""
    if _setup is None or _setup.down:
        return
    proc = _setup.proc
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    _setup.script("down", "--purge")
    _setup.down = True
