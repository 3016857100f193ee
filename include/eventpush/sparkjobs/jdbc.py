"""PostgreSQL over JDBC for the Spark jobs: partitioned reads, pushed-down windows, bulk writes.

Events are read by queue and offset range, one JDBC partition per slice, so no single query
scans a bus and each slice uses the primary key. Time windows are DataFrame filters that
Spark pushes down into each slice's WHERE clause. The password travels only in the JDBC
properties, never in the URL, so it stays out of Spark's logs and plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import parse_qsl, unquote, urlsplit

DRIVER = "org.postgresql.Driver"
# Offsets per JDBC partition: big enough that a slice is worth a query, small enough that
# a 10-million-event bus still spreads over every core.
DEFAULT_SLICE = 250_000


@dataclass(frozen=True)
class JdbcDatabase:
    """Where and how Spark reaches the eventpush database. Never log ``properties``."""

    url: str
    properties: dict = field(repr=False)


def jdbc_database(db_url: str) -> JdbcDatabase:
    """A ``postgresql://user:pass@host:port/db?opts`` URL as a JDBC URL and properties."""
    parts = urlsplit(db_url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("the database URL must be a postgresql:// URL")
    host = parts.hostname or "localhost"
    port = parts.port or 5432
    dbname = unquote(parts.path.lstrip("/")) or "postgres"
    props = {"driver": DRIVER, "user": unquote(parts.username or "postgres")}
    if parts.password:
        props["password"] = unquote(parts.password)
    for key, value in parse_qsl(parts.query):
        if key == "sslmode":
            props["sslmode"] = value
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return JdbcDatabase(url=f"jdbc:postgresql://{host}:{port}/{dbname}", properties=props)


def read_query(spark, db: JdbcDatabase, query: str, predicates: list[str] | None = None):
    """A DataFrame over ``query`` (a fixed SQL text, aliased as a table), optionally sliced."""
    table = f"({query}) AS q"
    props = {**db.properties, "fetchsize": "10000"}
    if predicates:
        return spark.read.jdbc(db.url, table, predicates=predicates, properties=props)
    return spark.read.jdbc(db.url, table, properties=props)


@dataclass(frozen=True)
class QueueRange:
    """Offsets ``[start, end)`` of one queue of one bus."""

    bus_id: int
    queue_id: int
    start: int
    end: int


def offset_predicates(ranges: list[QueueRange], slice_size: int = DEFAULT_SLICE) -> list[str]:
    """One WHERE condition per slice of every range. Values are integers we computed, so the
    text is safe to build; Spark runs each as one partition's query."""
    predicates = []
    for r in ranges:
        lo = int(r.start)
        while lo < int(r.end):
            hi = min(lo + slice_size, int(r.end))
            predicates.append(
                f"bus_id = {int(r.bus_id)} AND queue_id = {int(r.queue_id)} "
                f'AND "offset" >= {lo} AND "offset" < {hi}'
            )
            lo = hi
    return predicates


EVENT_COLUMNS = 'bus_id, queue_id, "offset", message_id, ctime, body::text AS body'


def read_events(
    spark,
    db: JdbcDatabase,
    ranges: list[QueueRange],
    since: datetime | None = None,
    until: datetime | None = None,
    slice_size: int = DEFAULT_SLICE,
):
    """Events of the given queue ranges, with ``since <= ctime < until`` pushed down."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F

    predicates = offset_predicates(ranges, slice_size)
    if not predicates:
        schema = (
            "bus_id INT, queue_id INT, offset BIGINT, message_id STRING, "
            "ctime TIMESTAMP, body STRING"
        )
        return spark.createDataFrame([], schema)
    df = read_query(spark, db, f"SELECT {EVENT_COLUMNS} FROM bus_event", predicates)
    if since is not None:
        df = df.where(F.col("ctime") >= F.lit(since))
    if until is not None:
        df = df.where(F.col("ctime") < F.lit(until))
    return df


def read_by_runner(
    spark, db: JdbcDatabase, table: str, columns: str, runner_ids: list[int], parts: int = 4
):
    """Rows of a per-runner table (delivery log, failures), split by runner id so the
    position index serves every slice."""
    if table not in ("event_push_delivery", "event_push_failure"):
        raise ValueError(f"not a per-runner table: {table}")
    ids = sorted({int(r) for r in runner_ids})
    if not ids:
        return read_query(spark, db, f"SELECT {columns} FROM {table} WHERE false")
    groups = [ids[i::parts] for i in range(min(parts, len(ids)))]
    predicates = [f"runner_id IN ({','.join(str(i) for i in g)})" for g in groups]
    return read_query(spark, db, f"SELECT {columns} FROM {table}", predicates)


def write_append(df, db: JdbcDatabase, table: str, batch_size: int = 10_000) -> None:
    """Bulk-append a DataFrame to ``table`` in batched, rewritten inserts."""
    props = {**db.properties, "batchsize": str(batch_size), "reWriteBatchedInserts": "true"}
    df.write.jdbc(db.url, table, mode="append", properties=props)
