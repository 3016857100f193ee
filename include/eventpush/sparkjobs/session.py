"""The SparkSession every eventpush job uses, built in one place.

The master is resolved here and nowhere else: an explicit argument, else what spark-submit
already set, else ``EVENTPUSH_SPARK_MASTER``, else the Airflow connection ``spark_default``
(from ``AIRFLOW_CONN_SPARK_DEFAULT`` or, inside an Airflow task, from Airflow), else
``local[*]``. A missing connection never means YARN, unlike the Spark provider's default.
The PostgreSQL JDBC driver comes from ``EVENTPUSH_JDBC_JAR`` (the Debian jar by default) and
the eventpush package travels to the executors as a zip, so they need not have it installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_MASTER = "local[*]"
DEFAULT_CONN_ID = "spark_default"
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"


class SparkSetupError(RuntimeError):
    """Spark cannot be set up as asked; the message says what to fix."""


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
    from urllib.parse import unquote

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


def jdbc_jar() -> str:
    jar = os.environ.get("EVENTPUSH_JDBC_JAR") or DEFAULT_JDBC_JAR
    if not Path(jar).is_file():
        raise SparkSetupError(
            f"PostgreSQL JDBC driver not found at {jar}: install libpostgresql-jdbc-java "
            "or set EVENTPUSH_JDBC_JAR"
        )
    return jar


def package_zip() -> str:
    """A zip of the eventpush package for spark.submit.pyFiles, rebuilt when the code changes."""
    import eventpush

    root = Path(eventpush.__file__).resolve().parent
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix
    )
    digest = hashlib.sha256()
    for p in files:
        stat = p.stat()
        digest.update(f"{p}:{stat.st_mtime_ns}:{stat.st_size}".encode())
    target = Path(tempfile.gettempdir()) / f"eventpush-{digest.hexdigest()[:16]}.zip"
    if not target.exists():
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in files:
                zf.write(p, Path("eventpush") / p.relative_to(root))
        tmp.replace(target)  # atomic: concurrent builders never see half a zip
    return str(target)


def get_spark(master: str | None = None, app_name: str = "eventpush", shuffle_partitions: int = 8):
    """The active SparkSession, or a new one configured for eventpush."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    # Under spark-submit the master is already set; otherwise resolve it here.
    if master or not os.environ.get("PYSPARK_GATEWAY_PORT"):
        master = resolve_master(master)
        builder = builder.master(master)
    if (master or "").startswith("local") and not os.environ.get("PYSPARK_PYTHON"):
        # Local Python workers must be this interpreter (with pyarrow), not any python3;
        # PySpark reads the variable when the context starts.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    jar = jdbc_jar()
    spark = (
        builder.config("spark.jars", jar)
        .config("spark.driver.extraClassPath", jar)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", os.environ.get("EVENTPUSH_SPARK_DRIVER_MEMORY", "2g"))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    spark.sparkContext.addPyFile(package_zip())
    return spark


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
