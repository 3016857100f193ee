"""Secrets on the way to Spark (issue 16): the database URL and Spark's shared secret never on
a command line, the package zip never at a predictable path."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from eventpush.config import ConfigError, database_url

REPO = Path(__file__).resolve().parents[1]
PASSWORD = "s3cr3t-Pa55word"
DB_URL = f"postgresql://eventpush:{PASSWORD}@db.internal:5432/eventpush"
SPARK_SECRET = "0123456789abcdef=spark:shared-secret"  # "=" and ":" survive the file


def _private(path: Path, mode: int) -> bool:
    st = path.stat()
    return stat.S_IMODE(st.st_mode) == mode and st.st_uid == os.getuid()


@pytest.mark.parametrize(
    "master",
    [
        '{"conn_type": "spark", "host": "yarn"}',
        '{"conn_type": "spark", "host": "spark://spark-master", "port": 7077}',
    ],
    # Kubernetes takes the same env_vars-to---conf path as YARN in the provider, but its
    # hook needs the kubernetes client, which is not installed here.
    ids=["yarn", "standalone"],
)
def test_rendered_spark_submit_command_carries_no_secret(monkeypatch, master):
    """The operator's real execute, up to the point where spark-submit would start: no YARN or
    Kubernetes runs here, so the hook's submit is replaced by a recorder of what it would run
    (the command line, the environment and the files it points to)."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from eventpush.airflow.spark_submit import spark_job

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", master)
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL", DB_URL)
    monkeypatch.setenv("EVENTPUSH_SPARK_SECRET", SPARK_SECRET)
    seen = {}

    def record(hook, application="", **kwargs):
        command = hook._build_spark_submit_command(application)
        seen["command"] = command
        seen["env"] = dict(hook._env or {})
        args = dict(zip(command, command[1:], strict=False))
        url_file = Path(hook._env_vars["EVENTPUSH_DATABASE_URL_FILE"])
        seen["url_file"] = url_file
        seen["url_file_private"] = _private(url_file, 0o600) and _private(url_file.parent, 0o700)
        seen["url"] = url_file.read_text()
        props = Path(args["--properties-file"])
        seen["props"] = props.read_text()
        seen["props_private"] = _private(props, 0o600)
        seen["shipped"] = str(url_file) in args["--files"].split(",")

    monkeypatch.setattr(SparkSubmitHook, "submit", record)
    op = spark_job("audit", "[]")
    op.application_args = []
    op.execute({})

    shown = " ".join(seen["command"]) + json.dumps(seen["env"])
    assert PASSWORD not in shown and SPARK_SECRET not in shown
    assert seen["url"] == DB_URL and seen["url_file_private"] and seen["shipped"]
    assert f"spark.authenticate.secret={SPARK_SECRET}" in seen["props"]
    assert "spark.authenticate=true" in seen["props"] and seen["props_private"]
    assert not seen["url_file"].exists()  # removed once spark-submit returned


def test_database_url_from_a_file_wins_over_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "database-url"
    path.write_text(DB_URL + "\n")
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL", "postgresql://other@h/db")
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL_FILE", str(path))
    assert database_url() == DB_URL
    # A cluster-mode driver finds the --files copy in its working directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL_FILE", "/elsewhere/database-url")
    assert database_url() == DB_URL
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL_FILE", "/elsewhere/nothing")
    with pytest.raises(ConfigError, match="does not exist"):
        database_url()


def test_package_zip_is_built_in_a_private_directory():
    from eventpush.sparkjobs.session import package_zip

    path = Path(package_zip())
    assert path.is_file() and _private(path.parent, 0o700)
    assert path.parent != Path(tempfile.gettempdir())
    assert path.parent.name.startswith("eventpush-") and len(path.parent.name) > len("eventpush-")
    assert package_zip() == str(path)  # built once per process and code version


def test_package_zip_directory_differs_per_process():
    code = "from eventpush.sparkjobs.session import package_zip; print(package_zip())"
    env = {**os.environ, "PYTHONPATH": str(REPO / "include")}
    paths = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(paths) == 2  # not predictable: each process draws its own directory
    assert not any(Path(p).exists() for p in paths)  # and removes it at exit


def test_local_session_authenticates_without_the_secret_on_the_command_line(tmp_path):
    """A real local Spark session started with the secret from a file: authentication is on
    with that secret, and the JVM's command line does not carry it."""
    secret_file = tmp_path / "spark-secret"
    secret_file.write_text(SPARK_SECRET + "\n")
    code = """
import json
from pathlib import Path
from eventpush.sparkjobs.session import get_spark
spark = get_spark("local[1]", app_name="secret-test")
conf = spark.sparkContext.getConf()
pid = spark.sparkContext._gateway.proc.pid
cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\\0", " ")
print(json.dumps({"auth": conf.get("spark.authenticate"),
                  "secret": conf.get("spark.authenticate.secret"),
                  "cmdline": cmdline,
                  "count": spark.range(10).count()}))
spark.stop()
"""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "include"),
        "EVENTPUSH_SPARK_SECRET_FILE": str(secret_file),
    }
    env.pop("EVENTPUSH_SPARK_SECRET", None)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["auth"] == "true" and doc["secret"] == SPARK_SECRET and doc["count"] == 10
    assert "org.apache.spark" in doc["cmdline"] and SPARK_SECRET not in doc["cmdline"]


def test_a_real_submission_reads_the_database_url_from_the_private_file(db_url, monkeypatch):
    """The operator runs a real ``spark-submit`` (local mode) with Spark's authentication on:
    the job finds the database through the private file (the worker's own environment
    points elsewhere), writes its report, and the file is gone afterwards."""
    from eventpush.airflow.spark_submit import spark_job

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "local[1]"}')
    monkeypatch.setenv("AIRFLOW_CONN_EVENTPUSH_DB", db_url)
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("EVENTPUSH_SPARK_SECRET", SPARK_SECRET)
    op = spark_job("audit", "[]")
    op.application_args = ["--since", "2026-01-01T00:00:00+00:00"]
    op.execute({})
    import psycopg2

    with psycopg2.connect(db_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT window_start FROM event_audit_report")
        assert [r[0].isoformat() for r in cur.fetchall()] == ["2026-01-01T00:00:00+00:00"]
    assert not Path(op.env_vars["EVENTPUSH_DATABASE_URL_FILE"]).exists()
    assert not Path(op.properties_file).exists()
