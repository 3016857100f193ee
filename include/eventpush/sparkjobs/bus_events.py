"""Bus events for the batch jobs, whatever the bus's source: PostgreSQL buses over JDBC
(``jdbc.read_events``), the others through a PySpark Python data source (``eventpush_bus``,
Spark 4's ``pyspark.sql.datasource``) with one input partition per queue and position range,
so the executors read the broker in parallel and nothing passes through the driver.

Both give the same columns: ``bus_id, queue_id, offset, message_id, ctime, body``
(``ctime`` is when the source stored the event).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from datetime import datetime

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from eventpush.db import connection
from eventpush.sources import Bus, kind_for, read_buses
from eventpush.sources.contract import position_runs
from eventpush.sparkjobs import jdbc

FORMAT = "eventpush_bus"
SCHEMA = "bus_id INT, queue_id INT, offset BIGINT, message_id STRING, ctime TIMESTAMP, body STRING"


class RangePartition(InputPartition):
    """Positions ``[start, end)`` of one queue of one bus (the bus as a plain dict)."""

    def __init__(self, bus: dict, queue_id: int, start: int, end: int) -> None:
        super().__init__((bus["id"], queue_id, start, end))
        self.bus = bus
        self.queue_id = queue_id
        self.start = start
        self.end = end


class BusEventsReader(DataSourceReader):
    def __init__(self, options: dict) -> None:
        self.ranges = json.loads(options["ranges"])
        self.slice = int(options.get("slice", jdbc.DEFAULT_SLICE))

    def partitions(self) -> list[RangePartition]:
        parts = []
        for bus, queue_id, start, end in self.ranges:
            lo = start
            while lo < end:
                hi = min(lo + self.slice, end)
                parts.append(RangePartition(bus, queue_id, lo, hi))
                lo = hi
        return parts

    def read(self, partition: RangePartition) -> Iterator[tuple]:
        bus = Bus(**partition.bus)
        kind = kind_for(bus.source_url)
        for event in kind.read_range(None, bus, partition.queue_id, partition.start, partition.end):
            yield (
                bus.id,
                event.queue_id,
                event.position,
                event.message_id,
                event.ctime,
                event.body,
            )


class BusEventsSource(DataSource):
    """``spark.read.format("eventpush_bus").option("ranges", JSON)``: JSON is a list of
    ``[bus, queue_id, start, end]`` with ``bus`` = ``{"id", "name", "queues", "source_url"}``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema) -> BusEventsReader:
        return BusEventsReader(self.options)


def read_events(
    spark,
    db_url: str,
    ranges: list[jdbc.QueueRange],
    since: datetime | None = None,
    until: datetime | None = None,
    slice_size: int = jdbc.DEFAULT_SLICE,
):
    """Events of the given queue ranges, with ``since <= ctime < until``."""

    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F

    with connection(db_url) as conn:
        buses = read_buses(conn, {r.bus_id for r in ranges})
    built_in = [r for r in ranges if buses[r.bus_id].source_url is None]
    elsewhere = [r for r in ranges if buses[r.bus_id].source_url is not None]
    df = jdbc.read_events(spark, jdbc.jdbc_database(db_url), built_in, since, until, slice_size)
    if not elsewhere:
        return df
    spark.dataSource.register(BusEventsSource)
    spec = [[asdict(buses[r.bus_id]), r.queue_id, r.start, r.end] for r in elsewhere]
    others = (
        spark.read.format(FORMAT)
        .option("ranges", json.dumps(spec))
        .option("slice", str(slice_size))
        .load()
    )
    if since is not None:
        others = others.where(F.col("ctime") >= F.lit(since))
    if until is not None:
        others = others.where(F.col("ctime") < F.lit(until))
    return df.unionByName(others) if built_in else others


def source_bodies(conn, keys: list[tuple[int, int, int, int]]) -> dict[tuple, str]:
    """Bodies of events on buses that are not in PostgreSQL, for replay's executors:
    ``keys`` are (runner_id, bus_id, queue_id, position); returns {(runner_id, queue_id,
    position): body} for those found. Only the positions asked are read and kept (a queue
    was read from the first to the last asked, everything between held in memory)."""

    buses = {b.id: b for b in read_buses(conn, {k[1] for k in keys}).values() if b.source_url}
    wanted: dict[tuple[int, int], dict[int, list[int]]] = {}
    for runner_id, bus_id, queue_id, position in keys:
        if bus_id in buses:
            wanted.setdefault((bus_id, queue_id), {}).setdefault(position, []).append(runner_id)
    bodies: dict[tuple, str] = {}
    for (bus_id, queue_id), positions in wanted.items():
        for event in _read_positions(conn, buses[bus_id], queue_id, sorted(positions)):
            for runner_id in positions.get(event.position, ()):
                bodies[(runner_id, queue_id, event.position)] = event.body
    return bodies


def _read_positions(conn, bus: Bus, queue_id: int, positions: list[int]) -> Iterator:
    """The kind's own look-up, else its ranges over runs of near positions."""
    kind = kind_for(bus.source_url)
    if kind.read_positions is not None:
        yield from kind.read_positions(conn, bus, queue_id, positions)
        return
    for run in position_runs(positions):
        yield from kind.read_range(conn, bus, queue_id, run[0], run[-1] + 1)
