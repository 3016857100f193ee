"""The SparkSession every eventpush job uses, built in one place.

The master is resolved here and nowhere else: an explicit argument, else what spark-submit
already set, else ``EVENTPUSH_SPARK_MASTER``, else the Airflow connection ``spark_default``
(from ``AIRFLOW_CONN_SPARK_DEFAULT`` or, inside an Airflow task, from Airflow), else
``local[*]``. A missing connection never means YARN, unlike the Spark provider's default.
The PostgreSQL JDBC driver comes from ``EVENTPUSH_JDBC_JAR`` (the Debian jar by default) and
the eventpush package travels to the executors as a zip, so they need not have it installed;
the zip is built in a private directory of this process, never at a path others can predict.
A master that is not ``local[...]`` also gets the packed Python environment of
``eventpush.sparkjobs.pyenv``, so executors need no dependencies of their own.

Secrets never travel on a command line (``ps``, the Spark UI and the task log show those):
Spark's shared secret (``EVENTPUSH_SPARK_SECRET`` or the file ``EVENTPUSH_SPARK_SECRET_FILE``
names) goes to ``spark-submit`` in a properties file of mode 0600 in a private directory.
"""

from __future__ import annotations

import atexit
import hashlib
import ipaddress
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

import eventpush
from eventpush.sparkjobs.errors import SparkSetupError
from eventpush.sparkjobs.pyenv import cluster_conf

DEFAULT_MASTER = "local[*]"
DEFAULT_CONN_ID = "spark_default"
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"


def master_from_connection(conn_type: str | None, host: str | None, port: int | None) -> str:
    """The master URL an Airflow Spark connection stands for (the provider's own reading)."""
    host = host or ""
    if conn_type == "spark" and host and ("://" in host or not port):
        master = host
    else:
        master = f"{conn_type}://{host}"
    return f"{master}:{port}" if port else master


def _master_from_env_conn(value: str) -> str:
    value = value.strip()
    if value.startswith("{"):
        doc = json.loads(value)
        return master_from_connection(doc.get("conn_type"), doc.get("host"), doc.get("port"))
    parts = urlsplit(value)
    # An Airflow URI keeps the master in the host part, e.g. spark://local%5B%2A%5D

    host = unquote(parts.netloc.rsplit("@", 1)[-1].split(":", 1)[0]) if parts.netloc else ""
    return master_from_connection(parts.scheme, host, parts.port)


def airflow_master(conn_id: str = DEFAULT_CONN_ID) -> str | None:
    """The master of Airflow connection ``conn_id``, or None when there is no such connection."""
    env = os.environ.get(f"AIRFLOW_CONN_{conn_id.upper()}")
    if env:
        return _master_from_env_conn(env)
    if "airflow" not in sys.modules:  # not inside Airflow: do not pay for importing it
        return None
    try:
        # Deferred: Airflow's SDK is loaded only when an Airflow process calls this.
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(conn_id)
    except Exception:  # noqa: BLE001 - any lookup failure means "no connection"
        return None
    return master_from_connection(conn.conn_type, conn.host, conn.port)


def resolve_master(explicit: str | None = None, conn_id: str = DEFAULT_CONN_ID) -> str:
    """The Spark master to use; see the module docstring for the order."""
    if explicit:
        return explicit
    env = os.environ.get("EVENTPUSH_SPARK_MASTER", "").strip()
    if env:
        return env
    return airflow_master(conn_id) or DEFAULT_MASTER


def on_loopback(master: str) -> bool:
    """Whether ``master`` is local mode or a cluster listening on a loopback address."""
    if master.startswith("local"):
        return True

    host = urlsplit(master.split(",")[0]).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def jdbc_jar() -> str:
    jar = os.environ.get("EVENTPUSH_JDBC_JAR") or DEFAULT_JDBC_JAR
    if not Path(jar).is_file():
        raise SparkSetupError(
            f"PostgreSQL JDBC driver not found at {jar}: install libpostgresql-jdbc-java "
            "or set EVENTPUSH_JDBC_JAR"
        )
    return jar


_private_dir: Path | None = None


def private_dir() -> Path:
    """A directory of this process only (mode 0700, random name), removed at exit: what is
    written there can be neither read nor planted by another user."""
    global _private_dir
    if _private_dir is None or not _private_dir.is_dir():
        _private_dir = Path(tempfile.mkdtemp(prefix="eventpush-"))
        atexit.register(shutil.rmtree, _private_dir, True)
    return _private_dir


def write_private(name: str, text: str, directory: Path | None = None) -> Path:
    """``text`` in a new file of mode 0600 in ``directory`` (default: ``private_dir()``)."""
    path = (directory or private_dir()) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def spark_secret() -> str | None:
    """Spark's shared authentication secret, from ``EVENTPUSH_SPARK_SECRET`` or the file
    ``EVENTPUSH_SPARK_SECRET_FILE`` names; None when neither is set."""
    secret = os.environ.get("EVENTPUSH_SPARK_SECRET", "").strip()
    path = os.environ.get("EVENTPUSH_SPARK_SECRET_FILE", "").strip()
    if not secret and path:
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SparkSetupError(
                f"EVENTPUSH_SPARK_SECRET_FILE {path}: {exc.strerror or exc}"
            ) from None
        if not secret:
            raise SparkSetupError(f"EVENTPUSH_SPARK_SECRET_FILE {path} is empty")
    return secret or None


def auth_properties_file(directory: Path | None = None) -> str | None:
    """A ``--properties-file`` (mode 0600) turning on Spark's authentication with the shared
    secret, or None when no secret is set. A file, because ``--conf`` shows in ``ps``."""
    secret = spark_secret()
    if secret is None:
        return None
    if any(c in secret for c in "\r\n\\"):
        raise SparkSetupError("the Spark secret must be one line without backslashes")
    # "key=value": after "=" a properties file keeps the value whole, "=" and ":" included
    text = f"spark.authenticate=true\nspark.authenticate.secret={secret}\n"
    return str(write_private("spark-auth.properties", text, directory))


_zips: dict[str, str] = {}


def package_zip() -> str:
    """A zip of the eventpush package for spark.submit.pyFiles, rebuilt when the code changes."""

    root = Path(eventpush.__file__).resolve().parent
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix
    )
    digest = hashlib.sha256()
    for p in files:
        stat = p.stat()
        digest.update(f"{p}:{stat.st_mtime_ns}:{stat.st_size}".encode())
    key = digest.hexdigest()[:16]
    target = Path(_zips.get(key, ""))
    if key not in _zips or not target.is_file():
        # Never a shared /tmp path: another user could plant a zip there for the workers to run.
        target = private_dir() / f"eventpush-{key}.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in files:
                zf.write(p, Path("eventpush") / p.relative_to(root))
        _zips[key] = str(target)
    return str(target)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment for the block, then restored."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def get_spark(master: str | None = None, app_name: str = "eventpush", shuffle_partitions: int = 8):
    """The active SparkSession, or a new one configured for eventpush."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    # Under spark-submit the master is already set; otherwise resolve it here.
    launching = not os.environ.get("PYSPARK_GATEWAY_PORT")
    if master or launching:
        master = resolve_master(master)
        builder = builder.master(master)
    if master and on_loopback(master):
        # A local session, or a cluster on this machine's loopback: its driver binds
        # loopback, not the first interface.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if (master or "").startswith("local") and not os.environ.get("PYSPARK_PYTHON"):
        # Local Python workers must be this interpreter (with pyarrow), not any python3;
        # PySpark reads the variable when the context starts.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    launch_env: dict[str, str] = {}
    if launching and master and not master.startswith("local"):
        # A cluster's executors get this job's Python environment shipped with it.
        for key, value in cluster_conf(master).items():
            builder = builder.config(key, value)
            if key == "spark.pyspark.python":
                # An in-process driver reads the executors' interpreter from the environment
                # when the context starts; later local sessions must not inherit it.
                launch_env["PYSPARK_PYTHON"] = value
    jar = jdbc_jar()
    builder = (
        builder.config("spark.jars", jar)
        .config("spark.driver.extraClassPath", jar)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", os.environ.get("EVENTPUSH_SPARK_DRIVER_MEMORY", "2g"))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    # Builder options reach the JVM as --conf arguments (visible in ps), so the secret goes
    # in a private properties file that PySpark's own launcher passes along. Under
    # spark-submit the JVM is already up and the submitting side passed the file.
    properties = auth_properties_file() if launching else None
    if properties:
        rest = os.environ.get("PYSPARK_SUBMIT_ARGS") or "pyspark-shell"
        launch_env["PYSPARK_SUBMIT_ARGS"] = f"--properties-file {shlex.quote(properties)} {rest}"
    try:
        with environment(launch_env):
            spark = builder.getOrCreate()
    finally:
        if properties:
            os.unlink(properties)  # the JVM has read it
    spark.sparkContext.setLogLevel("WARN")
    spark.sparkContext.addPyFile(package_zip())
    if not spark.sparkContext.master.startswith("local"):
        # On a cluster, say which Python the executors run: a wrong one is the first suspect.
        print(EXECUTOR_PYTHON_MARK, json.dumps(executor_pythons(spark)), file=sys.stderr)
    return spark


_sharing = 0  # > 0 while an in-process run keeps its session for the process's next job


@contextmanager
def shared_sessions() -> Iterator[None]:
    """Within, ``release`` keeps the session running: an in-process job's JVM and Python
    workers then serve the next job of the same process (the Airflow operator's in-process
    mode) rather than being started again; they end with the process."""
    global _sharing
    _sharing += 1
    try:
        yield
    finally:
        _sharing -= 1


def release(spark) -> None:
    """A job is done with ``spark``: stopped, unless inside ``shared_sessions``."""
    if not _sharing:
        spark.stop()


EXECUTOR_PYTHON_MARK = "eventpush: executors' Python:"


def executor_pythons(spark) -> list[dict[str, str]]:
    """The interpreters the executors run Python tasks with, as the tasks report them."""
    sc = spark.sparkContext
    slots = max(2, sc.defaultParallelism)

    def probe(_rows):
        yield (sys.executable, sys.prefix, platform.python_version())

    seen = set(sc.parallelize(range(slots), slots).mapPartitions(probe).collect())
    return [
        dict(zip(("executable", "prefix", "version"), row, strict=True)) for row in sorted(seen)
    ]


def require_airflow_master(conn_id: str = DEFAULT_CONN_ID) -> str:
    """The master of Airflow connection ``conn_id``; a missing connection is an error here,
    because the Spark provider would quietly submit to YARN instead."""
    master = airflow_master(conn_id)
    if master is None:
        raise SparkSetupError(
            f"Airflow connection {conn_id!r} is missing: create it (type spark, host "
            "local[*] or spark://HOST:7077), e.g. AIRFLOW_CONN_SPARK_DEFAULT='spark://local[*]'"
        )
    return master
