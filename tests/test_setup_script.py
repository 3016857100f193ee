"""scripts/setup.sh's private PostgreSQL (the fallback when nothing answers on 5432): a real
cluster on a free loopback port in a temporary directory, asking for a generated password."""

from __future__ import annotations

import glob
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg2
import pytest
from ports import free_port

REPO = Path(__file__).resolve().parents[1]
BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
pytestmark = pytest.mark.skipif(not BINS, reason="no PostgreSQL server binaries (initdb)")
AS_POSTGRES = ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else []


@pytest.fixture
def pg_dir():
    # Not pytest's tmp_path: as root the cluster runs as postgres, who cannot enter
    # /tmp/pytest-of-root (0700).
    root = Path(tempfile.mkdtemp(prefix="eventpush-setup-"))
    root.chmod(0o755)
    port = free_port()
    try:
        yield root / "var" / "postgres", port
    finally:
        data = root / "var" / "postgres" / "data"
        if (data / "postmaster.pid").exists():
            bindir = Path(BINS[-1]).parent
            subprocess.run(
                [*AS_POSTGRES, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(root, ignore_errors=True)


def _start(pg_dir: Path, port: int) -> str:
    script = (
        'source "$REPO/scripts/setup.sh"; PRIVATE_PG_DIR="$PG_DIR"; PRIVATE_PG_PORT="$PG_PORT"; '
        "start_private_postgres"
    )
    env = {**os.environ, "REPO": str(REPO), "ROOT": str(REPO), "PG_DIR": str(pg_dir)}
    env["PG_PORT"] = str(port)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _refused_without_password(port: int) -> None:
    with pytest.raises(psycopg2.OperationalError, match="password"):
        psycopg2.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=5)


def _hba_methods(pg_dir: Path) -> set[str]:
    lines = (pg_dir / "data" / "pg_hba.conf").read_text().splitlines()
    return {
        line.split()[-1] for line in lines if line.strip() and not line.lstrip().startswith("#")
    }


def test_private_cluster_asks_for_a_generated_password(pg_dir):
    pg_dir, port = pg_dir
    url = _start(pg_dir, port)
    password = (pg_dir / "password").read_text()
    assert len(password) == 48 and url == f"postgresql://postgres:{password}@127.0.0.1:{port}"
    assert stat.S_IMODE((pg_dir / "password").stat().st_mode) == 0o600
    assert stat.S_IMODE(pg_dir.stat().st_mode) == 0o700
    assert _hba_methods(pg_dir) == {"scram-sha-256"}
    _refused_without_password(port)
    psycopg2.connect(f"{url}/postgres", connect_timeout=5).close()
    assert _start(pg_dir, port) == url  # idempotent: same password, server left running


def test_an_older_trust_cluster_is_given_the_password(pg_dir):
    pg_dir, port = pg_dir
    pg_dir.mkdir(parents=True)
    if AS_POSTGRES:
        shutil.chown(pg_dir, "postgres")
    bindir = Path(BINS[-1]).parent
    subprocess.run(
        [*AS_POSTGRES, str(bindir / "initdb"), "-D", str(pg_dir / "data"), "-U", "postgres"]
        + ["--auth=trust"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    url = _start(pg_dir, port)
    assert "trust" not in _hba_methods(pg_dir)
    _refused_without_password(port)
    psycopg2.connect(f"{url}/postgres", connect_timeout=5).close()


def test_the_lock_pins_every_package_by_hash_and_setup_requires_them():
    """A swapped or tampered wheel is refused at install: every pin carries its hashes."""
    lock = (REPO / "requirements.lock").read_text()
    blocks = re.split(r"\n(?=[a-z0-9])", lock.split("\n", 2)[2])
    pins = [b for b in blocks if "==" in b.split("\n", 1)[0]]
    assert len(pins) > 100
    unhashed = [b.split(" ", 1)[0] for b in pins if "--hash=sha256:" not in b]
    assert unhashed == []
    assert "--require-hashes" in (REPO / "scripts" / "setup.sh").read_text()


def _missing_packages(purpose: str) -> list[str]:
    """What setup.sh would install for ``purpose`` on a machine that has none of it (no
    command on PATH, no JDBC jar)."""
    script = 'source "$ROOT/scripts/setup.sh"; JDBC_JAR=/nonexistent; PATH=/nonexistent; '
    script += f"missing_packages {purpose}"
    env = {**os.environ, "ROOT": str(REPO)}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_the_demo_installs_what_it_needs_and_the_browser_is_for_the_tests():
    demo, tests = _missing_packages("demo"), _missing_packages("test")
    assert demo == ["openjdk-17-jre-headless", "libpostgresql-jdbc-java"]
    assert set(demo) < set(tests) and "chromium" in tests
    assert "chromium" not in _missing_packages("airflow")
    commands = (REPO / "dev").read_text()
    assert re.search(r"\n  demo\)\n    setup_all demo\n", commands)
    assert re.search(r"\n  test\)\n    setup_all test\n", commands)


def test_cluster_down_stops_a_task_that_outlived_its_worker(tmp_path):
    """A task process of a Celery worker killed mid-task runs in a session of its own, out of
    every process group `scripts/cluster.sh down` stops; it held its log file open and lived
    on for hours after the cluster tests. `down` stops what of Airflow still holds a file
    under the cluster's directory, and nothing else."""
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "attempt=2.log"
    stray = subprocess.Popen(  # noqa: S603 (a fixed command)
        ["bash", "-c", f"exec 3>'{log}'; exec -a 'airflow worker -- t1' sleep 600"],
        start_new_session=True,
    )
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)  # not Airflow's
    try:
        cmdline = Path(f"/proc/{stray.pid}/cmdline")
        deadline = time.monotonic() + 10
        while not cmdline.read_bytes().startswith(b"airflow worker"):  # exec'd, file open
            assert time.monotonic() < deadline, "the stand-in task did not start"
            time.sleep(0.05)
        r = subprocess.run(
            ["bash", str(REPO / "scripts" / "cluster.sh"), "down"],
            env={**os.environ, "EVENTPUSH_CLUSTER_DIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert f"task process {stray.pid} outlived its worker: SIGKILL" in r.stdout + r.stderr
        assert stray.wait(10) == -9
        assert bystander.poll() is None
    finally:
        for proc in (stray, bystander):
            proc.kill()
            proc.wait()
