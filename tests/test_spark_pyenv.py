"""The executors' Python environment: locked like the driver's, shipped only to clusters.

The archive itself is built for real once (about 100 MB from uv's cache, seconds when the
wheels are cached) and unpacked to check that its interpreter imports what the jobs need,
with no help from this venv. Running it on a real cluster is tests/test_cluster.py's part.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from eventpush.sparkjobs import pyenv
from eventpush.sparkjobs.session import SparkSetupError

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([a-z0-9][a-z0-9._-]*)==(\S+)", re.M)


def _pins(path: Path) -> dict[str, str]:
    return dict(PIN.findall(path.read_text()))


def test_executor_lock_pins_what_the_driver_runs():
    executor, driver = _pins(REPO / "requirements-executor.lock"), _pins(REPO / "requirements.lock")
    assert {"pyarrow", "pandas", "numpy", "pycurl", "psycopg2-binary"} <= set(executor)
    assert {name: driver.get(name) for name in executor} == executor
    assert "--hash=sha256:" in (REPO / "requirements-executor.lock").read_text()


def test_local_masters_ship_nothing(monkeypatch):
    monkeypatch.setenv(pyenv.PYENV_ENV_VAR, "/nonexistent/never-read.tar.gz")
    assert pyenv.cluster_conf("local[2]") == {} and pyenv.cluster_conf("local[*]") == {}


def test_off_ships_nothing_and_a_missing_archive_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(pyenv.PYENV_ENV_VAR, "off")
    assert pyenv.cluster_conf("spark://127.0.0.1:7077") == {}
    monkeypatch.setenv(pyenv.PYENV_ENV_VAR, str(tmp_path / "nope.tar.gz"))
    with pytest.raises(SparkSetupError, match="EVENTPUSH_SPARK_PYENV names .*nope.tar.gz"):
        pyenv.cluster_conf("spark://127.0.0.1:7077")


def test_a_given_archive_is_shipped_with_the_interpreter_inside_it(monkeypatch, tmp_path):
    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"")
    monkeypatch.setenv(pyenv.PYENV_ENV_VAR, str(archive))
    monkeypatch.delenv("EVENTPUSH_SECRET_KEY_FILE", raising=False)
    assert pyenv.cluster_conf("spark://127.0.0.1:7077", driver_python="/opt/py") == {
        "spark.archives": f"{archive}#pyenv",
        "spark.pyspark.python": "./pyenv/bin/python",
        "spark.pyspark.driver.python": "/opt/py",
    }


def test_executors_are_told_where_the_secret_key_is_never_the_key(monkeypatch, tmp_path):
    """Replay's executors open target secrets: they get the key file's path, not its text."""
    archive, key = tmp_path / "env.tar.gz", tmp_path / "secret.key"
    archive.write_bytes(b"")
    key.write_text("not-shipped-key-text\n")
    monkeypatch.setenv(pyenv.PYENV_ENV_VAR, str(archive))
    monkeypatch.setenv("EVENTPUSH_SECRET_KEY_FILE", str(key))
    conf = pyenv.cluster_conf("spark://127.0.0.1:7077")
    assert conf["spark.executorEnv.EVENTPUSH_SECRET_KEY_FILE"] == str(key)
    assert not any("not-shipped-key-text" in value for value in conf.values())


def test_the_operator_submits_the_archive_to_a_cluster(monkeypatch, tmp_path):
    """What spark-submit would be given for a spark:// master (the submit itself is the
    cluster test's): --archives with the environment, the executors' interpreter in it."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from eventpush.airflow.spark_submit import spark_job

    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"")
    monkeypatch.setenv(pyenv.PYENV_ENV_VAR, str(archive))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "spark://127.0.0.1:7077"}'
    )
    monkeypatch.setenv("AIRFLOW_CONN_EVENTPUSH_DB", "postgresql://u@127.0.0.1:1/db")
    seen = {}

    def record(hook, application="", **kwargs):
        seen["command"] = hook._build_spark_submit_command(application)

    monkeypatch.setattr(SparkSubmitHook, "submit", record)
    op = spark_job("audit", "[]")
    op.application_args = []
    op.execute({})
    args = seen["command"]
    assert args[args.index("--archives") + 1] == f"{archive}#pyenv"
    confs = [args[i + 1] for i, a in enumerate(args) if a == "--conf"]
    assert "spark.pyspark.python=./pyenv/bin/python" in confs
    assert f"spark.pyspark.driver.python={sys.executable}" in confs
    assert op.env_vars["SPARK_LOCAL_IP"] == "127.0.0.1"  # a loopback master: driver on loopback


def test_the_archive_is_built_once_and_runs_without_this_venv(tmp_path):
    cache = tmp_path / "cache"
    first = pyenv.build_archive(cache_dir=cache)
    assert pyenv.build_archive(cache_dir=cache) == first  # cached by the lock's hash
    assert first.name == f"pyenv-{pyenv.cache_key()}.tar.gz"
    target = tmp_path / "unpacked"
    with tarfile.open(first) as tar:
        tar.extractall(target, filter="tar")
    # What executors import: the jobs' task-side modules (the package travels as a zip; here
    # it comes from the checkout), nothing from this venv.
    code = (
        "import sys, pyarrow, pandas; "
        "import eventpush.push, eventpush.sinks.contract, eventpush.rules.transforms, "
        "eventpush.sinks.http, eventpush.sinks.nats, eventpush.sources.nats, "
        "eventpush.sparkjobs.replay, eventpush.sparkjobs.audit, "
        "eventpush.sparkjobs.rebalance; print(sys.prefix)"
    )
    done = subprocess.run(
        [str(target / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "include")},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    assert "airflow" not in {p.name for p in (target / "lib").glob("python*/site-packages/*")}
