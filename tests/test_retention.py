"""Retention and time partitions (issue 35): a bus's retention, set, shown and applied by
dropping whole day partitions of its events (and of the delivery log) and nothing else; the
migration that splits existing tables keeps their rows; audits and replays know the horizon;
the maintenance DAG in ``dag.test()``. Real PostgreSQL throughout, one Spark audit."""

from __future__ import annotations

import functools
import json
import time
from datetime import UTC, datetime, timedelta

import psycopg2
import pytest
from batch_support import make_runner, spark

from eventpush import catalog
from eventpush.partitions import (
    DAY,
    MaintenanceReport,
    PastRetentionError,
    _fence_default,
    day_start,
    layout,
    maintain,
    partitions,
)
from tests.airflow_fixtures import REPO, airflow_conn_env, airflow_db

__all__ = ["airflow_conn_env", "airflow_db", "spark"]

NOW = D0 = AGES = TIMES = None  # set by `clock` as each test starts


@pytest.fixture(autouse=True)
def clock():
    """Sets this module's clock (``NOW``, ``D0``, ``AGES``, ``TIMES``) as each test starts:
    ``create_bus`` makes its days from the real clock when it is called, so a clock read at
    import would name yesterday for tests run after a midnight (UTC) the suite crossed."""
    global NOW, D0, AGES, TIMES
    NOW = datetime.now(UTC)
    D0 = day_start(NOW)
    # Five days of events, one an hour after each midnight, and one now: offsets 0..5.
    AGES = [D0 - 4 * DAY, D0 - 3 * DAY, D0 - 2 * DAY, D0 - DAY, D0]
    TIMES = [t + timedelta(hours=1) for t in AGES[:-1]] + [NOW]


BODY = json.dumps({"source": "app", "detail-type": "order", "detail": {}})
PATTERN = '{"source": ["app"]}'


def runner_id(conn, bus: str) -> int:
    name = make_runner(conn, bus, "r", "t", PATTERN)  # nothing is pushed to it
    with conn, conn.cursor() as cur:
        cur.execute("SELECT id FROM event_target_runner WHERE name = %s", (name,))
        return cur.fetchone()[0]


def add_event(cur, bus_id: int, queue_id: int, offset: int, ctime: datetime) -> None:
    cur.execute(
        'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, detail_type, '
        "event_time, ctime, size_bytes, body) VALUES (%s, %s, %s, %s, 'app', 'order', %s, %s, "
        "2, %s)",
        (bus_id, queue_id, offset, f"m-{bus_id}-{queue_id}-{offset}", ctime, ctime, BODY),
    )


def add_delivery(cur, runner_id: int, offset: int, ctime: datetime, bus: str = "orders"):
    cur.execute(
        "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
        '"offset", message_id, ctime, attempts, http_status, latency_ms) '
        "VALUES (%s, 'g', %s, 0, %s, 'm', %s, 1, 200, 1)",
        (runner_id, bus, offset, ctime),
    )


def add_failure(cur, runner_id: int, ctime: datetime, bus: str = "orders") -> None:
    cur.execute(
        "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
        '"offset", message_id, attempts, last_error, ctime) '
        "VALUES (%s, 'g', %s, 0, 0, 'm', 1, 'boom', %s)",
        (runner_id, bus, ctime),
    )


def bus_id(cur, name: str) -> int:
    cur.execute("SELECT id FROM event_bus WHERE name = %s", (name,))
    return cur.fetchone()[0]


def offsets(cur, bid: int) -> list[int]:
    cur.execute('SELECT "offset" FROM bus_event WHERE bus_id = %s ORDER BY "offset"', (bid,))
    return [row[0] for row in cur.fetchall()]


@pytest.fixture
def two_buses(conn):
    """``short`` keeps 2 days, ``long`` the default 7; both hold the same five days, the
    older ones first made in place as maintenance would have made them back then."""
    catalog.create_bus(conn, "short", 1, retention="2d")
    catalog.create_bus(conn, "long", 1)
    maintain(conn, now=D0 - 4 * DAY)  # the partitions of four days ago onwards
    with conn, conn.cursor() as cur:
        ids = bus_id(cur, "short"), bus_id(cur, "long")
        for bid in ids:
            for offset, ctime in enumerate(TIMES):
                add_event(cur, bid, 0, offset, ctime)
            cur.execute(
                "UPDATE event_bus_queue SET next_offset = %s WHERE bus_id = %s", (len(TIMES), bid)
            )
        for offset, ctime in enumerate(TIMES):
            add_delivery(cur, 1, offset, ctime)
        cur.execute(
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, last_error, ctime) '
            "SELECT r.id, 'g', 'short', 0, 0, 'm', 1, 'boom', %s FROM event_target_runner r "
            "LIMIT 1",
            (NOW - 40 * DAY,),
        )
    return ids


def test_retention_drops_whole_days_of_its_bus_and_nothing_else(conn, two_buses):
    short, long = two_buses
    with conn, conn.cursor() as cur:
        before = {p.name for p in partitions(cur, f"bus_event_{long}")}
    report = maintain(conn, now=NOW)

    with conn, conn.cursor() as cur:
        # 2 days: the days ending at or before now - 2d go (four and three days ago); the
        # day that began two days ago spans the boundary (part of it is younger than 2d)
        # and is kept whole, as is everything after it.
        assert offsets(cur, short) == [2, 3, 4]
        assert offsets(cur, long) == [0, 1, 2, 3, 4]
        assert sorted(report.dropped) == [
            f"bus_event_{short}_p{D0 - 4 * DAY:%Y%m%d}",
            f"bus_event_{short}_p{D0 - 3 * DAY:%Y%m%d}",
        ]
        assert {p.name for p in partitions(cur, f"bus_event_{long}")} == before
        cur.execute("SELECT events_kept_since FROM event_bus WHERE id IN %s", ((short, long),))
        assert sorted(cur.fetchall(), key=str) == sorted([(D0 - 2 * DAY,), (None,)], key=str)
        # The delivery log keeps the longest retention (7d): all five days stay.
        cur.execute("SELECT count(*) FROM event_push_delivery")
        assert cur.fetchone()[0] == 5
        cur.execute("SELECT count(*) FROM event_push_failure")  # 40 days > 30
        assert cur.fetchone()[0] == 0
    # Run again: nothing more to drop, nothing more to make.
    again = maintain(conn, now=NOW)
    assert again.dropped == [] and again.created == []
    assert all(row["ahead"] >= 3 and row["behind"] == 0 for row in layout(conn, NOW))


def test_an_archive_counts_the_events_kept_not_those_retention_dropped(conn, two_buses):
    """DescribeArchive's EventCount summed the queues' heads: it went on counting the days
    retention had dropped. It counts from each queue's first kept offset to its head (no
    count(*) of the bus's events), and the plan reads by the position index."""
    from eventpush.api.archives import _archive_figures
    from eventpush.sources import postgres

    short, long = two_buses
    maintain(conn, now=NOW)
    assert _archive_figures(conn, "short")[0] == 3  # offsets 2, 3 and 4 kept
    assert _archive_figures(conn, "long")[0] == 5
    with conn, conn.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")  # a plan that could only scan says so
        cur.execute("EXPLAIN " + postgres._KEPT_COUNT, {"bus": short})
        plan = "\n".join(row[0] for row in cur.fetchall())
    assert "Seq Scan on bus_event" not in plan and "Aggregate" in plan, plan


def test_a_bus_held_by_a_reader_waits_alone_for_the_next_run(conn, db_url, two_buses):
    """A long reader of one bus holds its partitions: that bus's drop gives up after its lock
    tries and waits for the next run, while the buses after it, the delivery log and the
    failure rows are maintained. The timeout used to abort the whole run."""
    from eventpush import partitions as parts

    short, long = two_buses
    catalog.create_bus(conn, "other", 1, retention="2d")
    rid = runner_id(conn, "long")
    with conn, conn.cursor() as cur:
        other = bus_id(cur, "other")
        parts.make_ahead(cur, f"bus_event_{other}", D0 - 4 * DAY)
        add_event(cur, other, 0, 0, TIMES[0])
        add_failure(cur, rid, NOW - 40 * DAY, "long")
    reader = psycopg2.connect(db_url)
    try:
        with reader.cursor() as cur:  # a transaction left open on the short bus's events
            cur.execute("SELECT count(*) FROM bus_event WHERE bus_id = %s", (short,))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parts, "LOCK_PATIENCE_S", 1.0)
            report = maintain(conn, now=NOW)
    finally:
        reader.close()
    assert report.postponed == [f"bus_event_{short}"]
    assert sorted(report.dropped) == [
        f"bus_event_{other}_p{D0 - 4 * DAY:%Y%m%d}",
        f"bus_event_{other}_p{D0 - 3 * DAY:%Y%m%d}",
    ]
    assert report.failures_deleted == 1  # and the steps after the buses ran
    with conn, conn.cursor() as cur:
        assert offsets(cur, short) == [0, 1, 2, 3, 4]  # the next run drops them
    again = maintain(conn, now=NOW)
    assert again.postponed == [] and len(again.dropped) == 2


def test_a_publisher_gets_in_while_a_drop_waits_for_a_long_reader(conn, db_url, two_buses):
    """Dropping a day locks the bus's table ACCESS EXCLUSIVE, and every publisher of the bus
    queues behind that lock while it waits for a long reader (an audit's scan): under one 5 s
    lock timeout, each publisher stalled up to 5 s. Each try now waits a moment, and is tried
    again after a pause that lets the publishers through; once the reader ends, the day is
    dropped whole and the days kept lose no event."""

    short, long = two_buses
    table = f"bus_event_{short}"
    expired = [f"{table}_p{D0 - 4 * DAY:%Y%m%d}", f"{table}_p{D0 - 3 * DAY:%Y%m%d}"]

    def read(cur) -> None:  # a long reader: its transaction is left open until rolled back
        cur.execute("SELECT count(*) FROM bus_event WHERE bus_id = %s", (short,))

    # The event is routed to today's partition.
    took, report = _publish_while_maintenance_waits(
        conn, db_url, table, "AccessExclusiveLock", "short", read, lambda c: c.rollback()
    )
    assert took < 2, f"the publisher waited {took:.1f} s behind the drop"
    assert isinstance(report, MaintenanceReport), report
    if table in report.postponed:  # the reader outlasted this run's tries: the next drops
        report = maintain(conn, now=NOW)
    assert report.postponed == [] and sorted(report.dropped) == expired, report
    with conn, conn.cursor() as cur:
        assert offsets(cur, short) == [2, 3, 4, 5]  # the days kept, and the one published
        assert offsets(cur, long) == [0, 1, 2, 3, 4]
        cur.execute(  # every table of the bus's days is one of its partitions: none half gone
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND starts_with(relname, %s)",
            (f"{table}_",),
        )
        tables = {row[0] for row in cur.fetchall()}
        assert tables == {p.name for p in partitions(cur, table)}
        assert not tables & set(expired)


def _publish_while_maintenance_waits(conn, db_url, table, mode, bus, hold, let_go):
    """A maintenance run (a thread) started while ``hold(cur)`` keeps a transaction open;
    once the run waits for ``mode`` on ``table``, one event published to ``bus``; then
    ``let_go(connection)`` ends the holder's transaction. Returns the seconds the publish
    took and the run's report (or its exception)."""
    import threading
    import time

    from eventpush.publish import publish

    holder, publisher = psycopg2.connect(db_url), psycopg2.connect(db_url)
    results: list = []
    thread = threading.Thread(target=_maintain_into, args=(results, db_url, NOW))
    try:
        with holder.cursor() as cur:
            hold(cur)
        thread.start()
        deadline = time.monotonic() + 15
        while not _lock_waits(conn, table, mode):
            assert time.monotonic() < deadline and thread.is_alive(), results
            time.sleep(0.005)
        began = time.monotonic()
        publish(publisher, bus, [BODY])
        took = time.monotonic() - began
    finally:
        let_go(holder)
        thread.join()
        holder.close()
        publisher.close()
    [report] = results
    return took, report


def _lock_waits(conn, table: str, mode: str) -> bool:
    """Some session waits for ``mode`` on ``table`` (by name: it may be gone meanwhile)."""
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE c.relname = %s AND l.mode = %s AND NOT l.granted)",
            (table, mode),
        )
        return cur.fetchone()[0]


def test_a_publisher_gets_in_while_a_missed_day_waits_for_a_long_writer(conn, db_url):
    """A day whose rows wait in the default partition is made under SHARE ROW EXCLUSIVE on
    the bus's table, which waits for every open writer of the bus (a big batch still being
    written), and every publisher queues behind it: up to 5 s under one lock timeout. It
    waits in short tries too, and the day is made once the writer commits."""

    catalog.create_bus(conn, "late", 1, retention="30d")  # nothing to drop
    far = D0 + 10 * DAY
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "late")
        add_event(cur, bid, 0, 0, far + timedelta(hours=2))  # lands in the default partition
        cur.execute("UPDATE event_bus_queue SET next_offset = 10 WHERE bus_id = %s", (bid,))
    table = f"bus_event_{bid}"

    def write(cur) -> None:  # a long writer: its transaction is left open until committed
        add_event(cur, bid, 0, 1, NOW)

    took, report = _publish_while_maintenance_waits(
        conn, db_url, table, "ShareRowExclusiveLock", "late", write, lambda c: c.commit()
    )
    assert took < 2, f"the publisher waited {took:.1f} s behind the missed day"
    assert isinstance(report, MaintenanceReport), report
    if table in report.postponed:  # the writer outlasted this run's tries: the next makes it
        report = maintain(conn, now=NOW)
    assert report.postponed == [] and f"{table}_p{far:%Y%m%d}" in report.created, report
    with conn, conn.cursor() as cur:
        assert offsets(cur, bid) == [0, 1, 10]
        cur.execute(f'SELECT "offset" FROM "{table}_p{far:%Y%m%d}"')
        assert cur.fetchall() == [(0,)]
        cur.execute(f'SELECT count(*) FROM "{table}_default"')
        assert cur.fetchone()[0] == 0


def test_a_bus_deleted_longer_ago_than_its_retention_leaves_no_table(conn):
    """A deleted bus's events follow its retention; once it was deleted more than its
    retention (and a day) ago, its partition goes whole. It used to stay, with days made
    ahead for it every day, a few tables per bus ever deleted."""
    catalog.create_bus(conn, "gone", 1, retention="1d")
    catalog.create_bus(conn, "recent", 1, retention="1d")
    with conn, conn.cursor() as cur:
        gone, recent = bus_id(cur, "gone"), bus_id(cur, "recent")
        add_event(cur, gone, 0, 0, NOW)
    catalog.delete_bus(conn, "gone")
    catalog.delete_bus(conn, "recent")
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE event_bus SET deleted_at = %s WHERE id = %s", (NOW - 3 * DAY, gone))
    report = maintain(conn, now=NOW)
    assert f"bus_event_{gone}" in report.dropped
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT relname FROM pg_class WHERE relname = %s OR starts_with(relname, %s)",
            (f"bus_event_{gone}", f"bus_event_{gone}_"),
        )
        assert cur.fetchall() == []
        assert offsets(cur, gone) == []
        cur.execute(
            "SELECT count(*) FROM pg_class WHERE starts_with(relname, %s)",
            (f"bus_event_{recent}_p",),
        )
        assert cur.fetchone()[0] >= 4  # deleted just now: its events are kept
    again = maintain(conn, now=NOW)
    assert again.dropped == []
    assert not any(name.startswith(f"bus_event_{gone}_") for name in again.created)
    assert {row["table"] for row in layout(conn, NOW)} >= {f"bus_event_{recent}"}


def test_a_deleted_bus_and_a_live_one_of_its_name_keep_their_own_horizons(conn):
    """Horizons were keyed by bus name: a deleted bus still maintained (its events kept to
    its retention) and the live bus of the same name collided, the later one's overwriting
    the other's. By bus id, each keeps its own, and the JSON still names the bus."""
    catalog.create_bus(conn, "orders", 1, retention="1d")
    catalog.delete_bus(conn, "orders")
    catalog.create_bus(conn, "orders", 1, retention="3d")
    with conn, conn.cursor() as cur:
        cur.execute("SELECT id, deleted_at IS NOT NULL FROM event_bus WHERE name = 'orders'")
        ids = dict(cur.fetchall())
    report = maintain(conn, now=NOW)
    found = {bus_id: (h.bus, h.horizon, h.deleted) for bus_id, h in report.horizons.items()}
    assert found == {
        bus_id: ("orders", (NOW - (1 if deleted else 3) * DAY).isoformat(), deleted)
        for bus_id, deleted in ids.items()
    }
    doc = json.loads(json.dumps(report.to_json()))
    assert sorted(doc["horizons"]) == sorted(str(bus_id) for bus_id in ids)
    assert {h["bus"] for h in doc["horizons"].values()} == {"orders"}


def test_a_compaction_held_by_an_old_snapshot_waits_and_the_run_goes_on(conn, db_url):
    """REINDEX CONCURRENTLY waits for every older snapshot (a backup, a long audit): past
    the lock timeout that partition waits for the next run, the invalid index copy it left
    is dropped, and maintenance goes on. The timeout used to raise out of ``maintain``."""
    from eventpush import partitions as parts

    catalog.create_bus(conn, "orders", 1)
    rid = runner_id(conn, "orders")
    with conn, conn.cursor() as cur:
        add_delivery(cur, rid, 0, NOW)  # in the _before partition: a past day tomorrow
        add_failure(cur, rid, NOW - 40 * DAY)
    backup = psycopg2.connect(db_url)
    backup.set_session(isolation_level="REPEATABLE READ")
    try:
        with backup.cursor() as cur:  # a snapshot held open, as pg_dump holds one
            cur.execute("SELECT count(*) FROM event_bus")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parts, "LOCK_TIMEOUT", "200ms")
            mp.setattr(parts, "BLOAT_FACTOR", 0)  # every past partition is reindexed
            mp.setattr(parts, "compact", functools.partial(parts.compact, min_bytes=0))
            report = maintain(conn, now=NOW + DAY)
    finally:
        backup.close()
    assert "event_push_delivery_before" in report.postponed
    assert report.failures_deleted == 1
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_index WHERE NOT indisvalid")  # no copy left
        assert cur.fetchone()[0] == 0


def test_an_invalid_index_copy_is_dropped_without_holding_readers(conn, db_url):
    """The copy a REINDEX CONCURRENTLY that gave up leaves is dropped CONCURRENTLY: while
    the drop waits for an open reader of the partition, other readers pass. A plain DROP
    INDEX queued its ACCESS EXCLUSIVE there, and every reader behind it."""
    import threading

    from eventpush import partitions as parts

    catalog.create_bus(conn, "orders", 1)
    rid = runner_id(conn, "orders")
    with conn, conn.cursor() as cur:
        add_delivery(cur, rid, 0, NOW)
        add_delivery(cur, rid, 0, NOW)  # the same key twice: a unique build fails
        cur.execute("SELECT tableoid::regclass::text FROM event_push_delivery LIMIT 1")
        [partition] = cur.fetchone()
    conn.autocommit = True
    with conn.cursor() as cur, pytest.raises(psycopg2.errors.UniqueViolation):
        cur.execute(
            f'CREATE UNIQUE INDEX CONCURRENTLY copy_ccnew ON {partition} (runner_id, "offset")'
        )
    conn.autocommit = False
    reader, other, dropper = (psycopg2.connect(db_url) for _ in range(3))
    try:
        with reader.cursor() as cur:  # an audit's scan, open
            cur.execute(f"SELECT count(*) FROM {partition}")
        dropper.autocommit = True
        with dropper.cursor() as cur:
            cur.execute("SET lock_timeout = '3s'")
            drop = threading.Thread(target=parts._drop_invalid_indexes, args=(cur, partition))
            drop.start()
            with other.cursor() as cur2:
                cur2.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query ILIKE 'DROP INDEX%%'"
                )
                deadline = time.monotonic() + 30
                while cur2.fetchone()[0] == 0:
                    assert time.monotonic() < deadline and drop.is_alive()
                    other.rollback()  # a transaction's reads of pg_stat_activity: one snapshot
                    cur2.execute(cur2.query)
                cur2.execute("SET lock_timeout = '500ms'")
                cur2.execute(f"SELECT count(*) FROM {partition}")  # not held by the drop
                assert cur2.fetchone()[0] == 2
            other.rollback()
            reader.rollback()  # the scan ends: the drop goes through
            drop.join(30)
    finally:
        for c in (reader, other, dropper):
            c.close()
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_index WHERE NOT indisvalid")
        assert cur.fetchone()[0] == 0


def _maintain_into(results: list, db_url: str, now: datetime, before=None, **libpq) -> None:
    """One maintenance run on a connection of its own (``libpq`` its options), its report or
    its exception appended to ``results``; ``before`` is called once it is connected."""
    c = psycopg2.connect(db_url, **libpq)
    try:
        if before is not None:
            before()
        results.append(maintain(c, now=now))
    except Exception as exc:
        results.append(exc)
    finally:
        c.close()


def test_two_maintenance_runs_at_once_take_turns(conn, db_url):
    """The DAG and a cron'd ``db maintain`` at once: one waits for the other, and the second
    finds nothing left to do. Both used to drop and make the same partitions, and the later
    failed (UndefinedTable, DuplicateTable: a traceback from ``db maintain``)."""
    import threading

    for name in ("a", "b", "c"):
        catalog.create_bus(conn, name, 1)
    far = D0 + 10 * DAY
    results: list = []
    start = threading.Barrier(2)

    def run() -> None:
        _maintain_into(results, db_url, far, before=start.wait)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(r, MaintenanceReport) for r in results), results
    made = [name for r in results for name in r.created]
    assert len(made) == len(set(made)) == 4 * 4  # three buses and the delivery log, 4 days


def test_a_run_waits_its_turn_past_the_urls_own_timeouts(conn, db_url):
    """A database URL whose options time statements and lock waits out (as an Airflow
    connection's extras may) bounds maintenance's work, not its wait for the run before."""
    import threading

    from eventpush.partitions import MAINTAIN_LOCK_KEY

    catalog.create_bus(conn, "a", 1)
    holder = psycopg2.connect(db_url)
    holder.autocommit = True
    with holder.cursor() as cur:  # a run in progress
        cur.execute("SELECT pg_advisory_lock(%s)", (MAINTAIN_LOCK_KEY,))
    results: list = []

    def run() -> None:
        timeouts = "-c statement_timeout=1s -c lock_timeout=1s"
        _maintain_into(results, db_url, D0 + 10 * DAY, options=timeouts)

    waiting = threading.Thread(target=run)
    waiting.start()
    try:
        waiting.join(2.5)
        assert waiting.is_alive() and results == [], results
    finally:
        holder.close()  # the run before ends
    waiting.join(60)
    [report] = results
    assert isinstance(report, MaintenanceReport) and report.created, report


def test_days_still_written_are_left_alone_by_autovacuum_until_over(conn, two_buses):
    """Today's partition and the ones ahead are made with autovacuum off; maintenance gives
    each day back to autovacuum once that day is over (the delivery log's too), and turns it
    off for a day still written that has it (a partition made before this policy)."""
    short, long = two_buses
    table = f"bus_event_{long}"

    def hot_by_end(parent: str) -> dict[datetime, bool]:
        """Each partition's end (the default partition has none) -> autovacuum off for it."""
        with conn, conn.cursor() as cur:
            return {p.hi: p.hot for p in partitions(cur, parent) if p.hi is not None}

    made_then = hot_by_end(table)  # made by maintenance four days ago: all hot then
    assert len(made_then) >= 4 and all(made_then.values())
    with conn, conn.cursor() as cur:  # as a partition made before the policy would be
        cur.execute(f'ALTER TABLE "{table}_p{D0 + DAY:%Y%m%d}" RESET (autovacuum_enabled)')
        cur.execute("SELECT reloptions FROM pg_class WHERE relname = %s", (f"{table}_default",))
        assert cur.fetchone()[0] is None  # the default partition keeps autovacuum's defaults

    report = maintain(conn, now=NOW)

    for parent in (table, "event_push_delivery"):
        ends = hot_by_end(parent)
        assert ends == {end: end > D0 for end in ends}, parent
    assert f"{table}_p{D0 - DAY:%Y%m%d}" in report.vacuum_settled
    assert f"{table}_p{D0 + DAY:%Y%m%d}" in report.vacuum_settled
    assert maintain(conn, now=NOW).vacuum_settled == []  # settled: nothing changes again


def test_a_hot_day_never_analyzed_is_read_by_its_index(conn):
    """Autovacuum leaves today's partition alone, so it has no statistics all day: the
    planner still reads a window by the position index, not by scanning the day."""
    catalog.create_bus(conn, "busy", 4)
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "busy")
        cur.execute(
            'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, detail_type, '
            "event_time, size_bytes, body) SELECT %s, g %% 4, g / 4, 'm' || g, 'app', 'order', "
            "now(), 2, '{}' FROM generate_series(0, 49999) g",
            (bid,),
        )
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT reltuples, reloptions FROM pg_class WHERE relname = %s",
            (f"bus_event_{bid}_p{D0:%Y%m%d}",),
        )
        assert cur.fetchone() == (-1, ["autovacuum_enabled=false"])  # never analyzed
        cur.execute(
            'EXPLAIN SELECT "offset", message_id, body::text FROM bus_event WHERE bus_id = %s '
            'AND queue_id = 1 AND "offset" >= 9000 AND "offset" < 9500 ORDER BY "offset"',
            (bid,),
        )
        plan = "\n".join(row[0] for row in cur.fetchall())
    assert f"Index Scan using bus_event_{bid}_p{D0:%Y%m%d}" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_rows_landing_past_the_made_days_move_into_their_partition(conn):
    """A day maintenance did not make (it stopped) lands in the default partition, and gets
    its partition, rows moved, at the next run: then retention can drop it."""
    catalog.create_bus(conn, "late", 1, retention="1d")
    far = D0 + 10 * DAY
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "late")
        add_event(cur, bid, 0, 0, far + timedelta(hours=2))
    told: list[str] = []
    report = maintain(conn, now=NOW, progress=told.append)
    day = f"bus_event_{bid}_p{far:%Y%m%d}"
    assert (
        report.moved == {day: 1}
        and len(told) == 1
        and told[0].startswith(f"{day} made: 1 row moved")
    )
    with conn, conn.cursor() as cur:
        cur.execute(f'SELECT count(*) FROM "bus_event_{bid}_p{far:%Y%m%d}"')
        assert cur.fetchone()[0] == 1
        cur.execute(f'SELECT count(*) FROM "bus_event_{bid}_default"')
        assert cur.fetchone()[0] == 0
    report = maintain(conn, now=far + 3 * DAY)
    assert f"bus_event_{bid}_p{far:%Y%m%d}" in report.dropped


def test_rows_published_while_their_day_is_moved_in_land_in_it(conn, db_url):
    """Maintenance moves a day's rows out of the default partition while publishers still
    write that day: their rows wait for the move and land in the new day. A row routed to
    the default partition during the move used to fail the attach (CheckViolation), so a day
    being written never got its partition."""
    import threading
    import time

    catalog.create_bus(conn, "late", 1, retention="30d")  # no drop holds the writers off
    far = D0 + 10 * DAY
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "late")
        cur.execute(  # enough waiting rows that the move takes a while
            'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, '
            "detail_type, event_time, ctime, size_bytes, body) SELECT %s, 0, n, 'm' || n, "
            "'app', 'order', %s, %s, 2, %s FROM generate_series(0, 49999) AS n",
            (bid, far, far + timedelta(hours=1), BODY),
        )
    stop, errors, written = threading.Event(), [], []

    def publisher() -> None:
        c = psycopg2.connect(db_url)
        try:
            offset = 50_000
            while not stop.is_set():
                with c, c.cursor() as cur:
                    add_event(cur, bid, 0, offset, far + timedelta(hours=2))
                written.append(offset)
                offset += 1
        except psycopg2.Error as exc:
            errors.append(exc)
        finally:
            c.close()

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        while len(written) < 5 and thread.is_alive():
            time.sleep(0.01)
        report = maintain(conn, now=far)
    finally:
        stop.set()
        thread.join()
    assert errors == [] and f"bus_event_{bid}_p{far:%Y%m%d}" in report.created
    with conn, conn.cursor() as cur:
        cur.execute(f'SELECT count(*) FROM "bus_event_{bid}_p{far:%Y%m%d}"')
        assert cur.fetchone()[0] == 50_000 + len(written)
        cur.execute(f'SELECT count(*) FROM "bus_event_{bid}_default"')
        assert cur.fetchone()[0] == 0


def _holds_lock(conn, pid: int, table: str, mode: str) -> bool:
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.pid = %s AND c.relname = %s AND l.mode = %s AND l.granted)",
            (pid, table, mode),
        )
        return cur.fetchone()[0]


def _waits_for_a_row(conn, pid: int) -> bool:
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND locktype = 'transactionid' "
            "AND NOT granted)",
            (pid,),
        )
        return cur.fetchone()[0]


def _a_missed_day(conn) -> tuple[int, str, datetime]:
    """A bus whose three events wait in its default partition, of a day 10 days ahead (past
    the days made ahead, as after a lapse): its id, its table, the day."""
    catalog.create_bus(conn, "late", 1, retention="30d")
    far = D0 + 10 * DAY
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "late")
        for offset in range(3):
            add_event(cur, bid, 0, offset, far + timedelta(hours=1))
    return bid, f"bus_event_{bid}", far


def _maintaining(conn, results: list):
    """A maintenance run on ``conn`` in a thread (not started), its report put in ``results``."""
    import threading

    return threading.Thread(target=lambda: results.append(maintain(conn, now=NOW)))


def test_a_missed_days_rows_move_before_its_writers_are_held_back(conn, db_url):
    """A missed day still written has its rows moved from the default partition into its
    own: the bulk of them used to move under SHARE ROW EXCLUSIVE on the bus's table, every
    publisher of the bus held for the whole move (a day of events after a maintenance lapse).
    Now the writers are held only for what they added meanwhile: while the move waits here
    (for a row another session holds), maintenance holds no lock that stops a writer."""
    bid, table, far = _a_missed_day(conn)
    holder, runner = psycopg2.connect(db_url), psycopg2.connect(db_url)
    results: list = []
    thread = _maintaining(runner, results)
    try:
        with holder.cursor() as cur:  # one of the day's rows held: the move waits for it
            cur.execute(f'SELECT 1 FROM "{table}_default" WHERE "offset" = 1 FOR UPDATE')
        pid = runner.info.backend_pid
        thread.start()
        deadline = time.monotonic() + 30
        while not _waits_for_a_row(conn, pid):
            assert time.monotonic() < deadline and thread.is_alive(), results
            time.sleep(0.005)
        assert not _holds_lock(conn, pid, table, "ShareRowExclusiveLock")
        with conn, conn.cursor() as cur:  # a publisher gets in meanwhile
            add_event(cur, bid, 0, 3, far + timedelta(hours=2))
    finally:
        holder.rollback()
        thread.join(60)
        holder.close()
        runner.close()
    [report] = results
    if table in report.postponed:  # the held row outlasted this run's tries: the next makes it
        report = maintain(conn, now=NOW)
    assert f"{table}_p{far:%Y%m%d}" in report.created, report
    with conn, conn.cursor() as cur:
        cur.execute(f'SELECT "offset" FROM "{table}_p{far:%Y%m%d}" ORDER BY "offset"')
        assert cur.fetchall() == [(0,), (1,), (2,), (3,)]
        cur.execute(f'SELECT count(*) FROM "{table}_default"')
        assert cur.fetchone()[0] == 0
        cur.execute(  # the moved day has the parent's indexes once, as a day made ahead has
            "SELECT count(*) FROM pg_indexes WHERE tablename = %s",
            (f"{table}_p{far:%Y%m%d}",),
        )
        moved_indexes = cur.fetchone()[0]
        cur.execute(
            "SELECT count(*) FROM pg_indexes WHERE tablename = %s", (f"{table}_p{D0:%Y%m%d}",)
        )
        assert moved_indexes == cur.fetchone()[0] > 0


def test_a_missed_days_move_is_kept_while_its_attach_waits_for_a_reader(conn, db_url):
    """The attach of a missed day waits (in short tries) for a reader of the default
    partition; a try that gives up used to roll the whole day back, its moved rows with it,
    and the next try moved them again (after a lapse, a day of events each time). Now the
    tries go on in the one transaction that moved them: one transaction id throughout."""
    bid, table, far = _a_missed_day(conn)
    reader, runner = psycopg2.connect(db_url), psycopg2.connect(db_url)
    results: list = []
    thread = _maintaining(runner, results)
    xids, waits, waiting = set(), 0, False
    try:
        with reader.cursor() as cur:  # a long reader of the default partition
            cur.execute(f'SELECT count(*) FROM "{table}_default"')
        pid = runner.info.backend_pid
        thread.start()
        deadline = time.monotonic() + 30
        while waits < 3:  # three tries seen waiting for the reader
            assert time.monotonic() < deadline and thread.is_alive(), results
            with conn, conn.cursor() as cur:
                cur.execute("SELECT backend_xid::text FROM pg_stat_activity WHERE pid = %s", (pid,))
                (xid,) = cur.fetchone()
            now_waiting = _lock_waits(conn, f"{table}_default", "AccessExclusiveLock")
            if now_waiting and xid is not None:
                xids.add(xid)
                waits += not waiting
            waiting = now_waiting
            time.sleep(0.005)
    finally:
        reader.rollback()
        thread.join(60)
        reader.close()
        runner.close()
    [report] = results
    assert len(xids) == 1, xids
    assert report.postponed == [] and report.moved == {f"{table}_p{far:%Y%m%d}": 3}, report


def test_a_missed_day_over_is_made_while_a_writer_of_today_is_open(conn, db_url):
    """A day that is over gets no row any more, so its partition is made (its rows moved
    from the default partition) without waiting for the bus's writers: a long writer of
    today no longer holds it off until the run gives up."""
    catalog.create_bus(conn, "late", 1, retention="30d")  # its days are made from today on
    past = D0 - 2 * DAY
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "late")
        add_event(cur, bid, 0, 0, past + timedelta(hours=1))  # lands in the default partition
    table = f"bus_event_{bid}"
    writer = psycopg2.connect(db_url)
    try:
        with writer.cursor() as cur:  # today's writer, its transaction left open
            add_event(cur, bid, 0, 1, NOW)
        report = maintain(conn, now=NOW)
    finally:
        writer.commit()
        writer.close()
    assert report.postponed == [] and f"{table}_p{past:%Y%m%d}" in report.created, report
    with conn, conn.cursor() as cur:
        assert offsets(cur, bid) == [0, 1]
        cur.execute(f'SELECT count(*) FROM "{table}_default"')
        assert cur.fetchone()[0] == 0


def test_missed_days_over_are_attached_without_scanning_the_default_partition(conn):
    """After a lapse the default partition holds every missed day; each one's attach scanned
    all of it under ACCESS EXCLUSIVE, every reader of the bus and the writers of the days not
    made yet held meanwhile. A day that is over is now fenced out of the default partition
    by a CHECK, validated once its rows have moved (under a lock readers and writers pass),
    which the attach takes as proof: PostgreSQL says so for each day, and skipped the scan.
    A fence left by a run that gave up (here: made by hand) is taken over and dropped."""
    catalog.create_bus(conn, "late", 1, retention="30d")  # its days are made from today on
    missed = [D0 - 3 * DAY, D0 - 2 * DAY]
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "late")
        for offset in range(6):
            add_event(cur, bid, 0, offset, missed[offset % 2] + timedelta(hours=offset))
    table = f"bus_event_{bid}"
    with conn, conn.cursor() as cur:
        assert _fence_default(cur, table, missed[1]) == f"{table}_default_not_p{missed[1]:%Y%m%d}"
        cur.execute("SET client_min_messages = debug1")  # the session's: maintain's too
    conn.notices = []  # all of them (psycopg2 keeps the last 50 by default)
    try:
        report = maintain(conn, now=NOW)
    finally:
        with conn, conn.cursor() as cur:
            cur.execute("RESET client_min_messages")
    assert report.moved == {f"{table}_p{day:%Y%m%d}": 3 for day in missed}, report
    proofs = [
        n
        for n in conn.notices
        if f'default partition "{table}_default" is implied by existing constraints' in n
    ]
    assert len(proofs) == 2, conn.notices
    with conn, conn.cursor() as cur:
        assert offsets(cur, bid) == list(range(6))
        cur.execute(f'SELECT count(*) FROM "{table}_default"')
        assert cur.fetchone()[0] == 0
        cur.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass",
            (f"{table}_default",),
        )
        assert cur.fetchall() == []


def test_a_day_made_ahead_lets_publishers_in_while_maintenance_waits(conn, db_url):
    """A day was made by CREATE TABLE ... PARTITION OF, which locks the parent ACCESS
    EXCLUSIVE (under SHARE ROW EXCLUSIVE besides): a maintenance run waiting behind a long
    reader of the bus held every publisher of it until the reader ended or the lock timed
    out. A day ahead is now a table attached (SHARE UPDATE EXCLUSIVE on the parent), and
    publishers go on while maintenance waits."""
    import threading
    import time

    from eventpush import partitions as parts

    catalog.create_bus(conn, "orders", 1)
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "orders")
    table, day = f"bus_event_{bid}", D0 + 10 * DAY
    reader, maintainer = psycopg2.connect(db_url), psycopg2.connect(db_url)
    writer = psycopg2.connect(db_url, options="-c lock_timeout=3s")
    made, failed = [], []

    def make_day() -> None:
        try:
            with maintainer, maintainer.cursor() as cur:
                made.extend(parts.make_ahead(cur, table, day, days=0))
        except psycopg2.Error as exc:
            failed.append(exc)

    thread = threading.Thread(target=make_day)
    try:
        with reader.cursor() as cur:  # a long reader: its transaction is left open
            cur.execute("SELECT count(*) FROM bus_event WHERE bus_id = %s", (bid,))
        pid = maintainer.get_backend_pid()
        thread.start()
        deadline = time.monotonic() + 15
        while not _waits_for_a_lock(conn, pid):
            assert time.monotonic() < deadline and thread.is_alive(), failed
            time.sleep(0.05)
        with writer, writer.cursor() as cur:  # a publisher, routed to today's partition
            add_event(cur, bid, 0, 0, NOW)
        assert thread.is_alive()  # maintenance still waits for the reader
    finally:
        reader.rollback()
        thread.join()
        for c in (reader, maintainer, writer):
            c.close()
    assert failed == [] and made == [f"{table}_p{day:%Y%m%d}"]
    with conn, conn.cursor() as cur:
        [new] = [p for p in partitions(cur, table) if p.lo == day]
        assert (new.hi, new.hot) == (day + DAY, True)
        cur.execute(  # the CHECK that spared the attach its scan is gone with it
            "SELECT count(*) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'",
            (new.name,),
        )
        assert cur.fetchone()[0] == 0
        assert offsets(cur, bid) == [0]


def test_a_bus_is_created_while_a_reader_holds_another_bus_events(conn, db_url):
    """A bus's partition was made by CREATE TABLE ... PARTITION OF bus_event, which waits for
    ACCESS EXCLUSIVE on all of ``bus_event``: behind any open reader of any bus, with every
    publisher and reader of every bus queued behind it. It is now attached (SHARE UPDATE
    EXCLUSIVE), and its events are stored and read as before."""
    from eventpush.publish import publish

    catalog.create_bus(conn, "orders", 1)
    reader = psycopg2.connect(db_url)
    creator = psycopg2.connect(db_url, options="-c lock_timeout=3s")
    try:
        with reader.cursor() as cur:  # a long reader of another bus: left open
            cur.execute(
                "SELECT count(*) FROM bus_event b JOIN event_bus e ON e.id = b.bus_id "
                "WHERE e.name = 'orders'"
            )
        catalog.create_bus(creator, "billing", 2)
    finally:
        reader.rollback()
        reader.close()
        creator.close()
    publish(conn, "billing", [BODY] * 4)
    with conn, conn.cursor() as cur:
        bid = bus_id(cur, "billing")
        assert len(offsets(cur, bid)) == 4
        assert {p.name for p in partitions(cur, f"bus_event_{bid}")} >= {
            f"bus_event_{bid}_default",
            f"bus_event_{bid}_p{D0:%Y%m%d}",
        }
        cur.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'",
            (f"bus_event_{bid}",),
        )
        assert cur.fetchone()[0] == 0


def _waits_for_a_lock(conn, pid: int) -> bool:
    with conn, conn.cursor() as cur:
        cur.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", (pid,))
        return cur.fetchone()[0]


def test_queries_by_offset_use_an_index(conn, two_buses):
    short, long = two_buses
    with conn, conn.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")  # tiny tables: ask whether one exists
        cur.execute(
            'EXPLAIN SELECT body FROM bus_event WHERE bus_id = %s AND queue_id = 0 AND "offset" '
            '>= 2 AND "offset" < 4',
            (short,),
        )
        plan = "\n".join(row[0] for row in cur.fetchall())
        assert "Index" in plan and f"bus_event_{short}_" in plan, plan
        assert f"bus_event_{long}_" not in plan  # pruned to the bus
        cur.execute(
            "EXPLAIN SELECT 1 FROM event_push_delivery "
            'WHERE runner_id = 1 AND queue_id = 0 AND "offset" = 3'
        )
        plan = "\n".join(row[0] for row in cur.fetchall())
        assert "Index" in plan, plan


def test_a_runner_behind_a_dropped_day_steps_over_it_and_delivers_what_is_kept(conn):
    """Retention drops a day a runner had not read yet (a worker stopped, a slow target):
    its offsets are gone, and the runner goes on from the first kept one. It used to wait at
    the gap forever: the window read came back empty and looked like the queue's end."""
    from eventpush.demo.receiver import Receiver
    from eventpush.push import run_worker

    old, kept = 300, 5  # more than a window (256) of events in the dropped day
    with Receiver() as rx:
        catalog.create_bus(conn, "orders", 1, retention="2d")
        catalog.create_rule(conn, "orders", "all", PATTERN)
        catalog.create_target(
            conn, "orders", "all", catalog.TargetSpec(name="t", url=rx.url + "/ok")
        )
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        maintain(conn, now=D0 - 4 * DAY)
        with conn, conn.cursor() as cur:
            bid = bus_id(cur, "orders")
            for offset in range(old + kept):
                add_event(cur, bid, 0, offset, TIMES[0] if offset < old else NOW)
            cur.execute("UPDATE event_bus_queue SET next_offset = %s", (old + kept,))
        assert len(maintain(conn, now=NOW).dropped) == 2
        with conn, conn.cursor() as cur:
            assert offsets(cur, bid) == list(range(old, old + kept))
        report = run_worker("w1", until_idle=True, max_seconds=30)
        got = [r.body for r in rx.state.delivered("/ok")]
    assert report.delivered == kept and len(got) == kept
    with conn, conn.cursor() as cur:
        cur.execute('SELECT "offset" FROM event_push_delivery ORDER BY "offset"')
        assert [row[0] for row in cur.fetchall()] == list(range(old, old + kept))


def test_horizon_refuses_and_clips(conn, two_buses, db_url):
    """The window checks of audits and replays, without Spark: refused in one line when
    the window is past retention, clipped with a warning when it reaches past it; a replay
    of failures whose events are gone says so in one line."""
    from eventpush.partitions import clip_window, kept_since_by_bus
    from eventpush.sparkjobs.replay import (
        ReplayRequest,
        ReplayRequestError,
        check_request,
        gone_failures,
    )

    short, _ = two_buses
    runner = runner_id(conn, "short")
    maintain(conn, now=NOW)
    with conn, conn.cursor() as cur:
        kept = kept_since_by_bus(cur, [short])
        assert kept == {"short": D0 - 2 * DAY}
        with pytest.raises(PastRetentionError) as refused:
            clip_window(kept, D0 - 4 * DAY, D0 - 3 * DAY, "audit")
        assert "\n" not in str(refused.value) and "gone by retention" in str(refused.value)
        (warning,) = clip_window(kept, D0 - 4 * DAY, NOW, "audit")
        assert "'short'" in warning and (D0 - 2 * DAY).isoformat() in warning
        assert clip_window(kept, D0 - DAY, NOW, "audit") == []

        for req in (
            ReplayRequest(what="all", bus="short", since=D0 - 4 * DAY, until=D0 - 3 * DAY),
            ReplayRequest(what="missing", bus="short", since=D0 - 3 * DAY, until=NOW),
        ):
            with pytest.raises(ReplayRequestError) as refused:
                check_request(req, cur)
            assert "\n" not in str(refused.value) and "replay refused" in str(refused.value)
        # A failure of offset 0, whose day is gone: a replay of it is refused in one line.
        cur.execute(
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
            "\"offset\", message_id, attempts, last_error) VALUES (%s, 'g', 'short', 0, 0, "
            "'m-gone', 3, 'HTTP 500')",
            (runner,),
        )
        with pytest.raises(ReplayRequestError, match="gone by retention") as refused:
            check_request(ReplayRequest(what="failed", bus="short"), cur)
        assert "\n" not in str(refused.value)
        # With one whose event is still kept, the replay goes ahead (the gone one is skipped).
        cur.execute(
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
            "\"offset\", message_id, attempts, last_error) VALUES (%s, 'g', 'short', 0, 3, "
            "'m-kept', 3, 'HTTP 500')",
            (runner,),
        )
        assert check_request(ReplayRequest(what="failed", bus="short"), cur) == [runner]
        # ... and run_replay warns, in one line, of the one it skips.
        assert gone_failures(ReplayRequest(what="failed", bus="short"), cur, [runner]) == (
            2,
            1,
            "short",
            D0 - 2 * DAY,
        )


def test_audit_of_a_window_spanning_the_horizon_is_clipped_not_missing(
    conn, db_url, two_buses, spark
):
    """The one Spark job of this file: a runner committed past everything, delivered all of
    it; after retention dropped two days, an audit from before them counts what is kept,
    warns, and calls nothing missing. A window wholly past retention is refused."""
    from eventpush.sparkjobs.audit import run_audit

    short, _ = two_buses
    runner = runner_id(conn, "short")
    with conn, conn.cursor() as cur:
        cur.execute(
            'UPDATE event_push_offset SET "offset" = 5, start_offset = 0 WHERE runner_id = %s',
            (runner,),
        )
        cur.execute("DELETE FROM event_push_delivery")
        for offset, ctime in enumerate(TIMES):
            add_delivery(cur, runner, offset, ctime, "short")
    maintain(conn, now=NOW)
    with pytest.raises(PastRetentionError):
        run_audit(None, db_url, bus="short", since=D0 - 4 * DAY, until=D0 - 3 * DAY)
    result = run_audit(spark, db_url, bus="short", since=D0 - 4 * DAY, until=NOW + DAY)
    (r,) = result.runners
    assert (r.expected, r.delivered, r.missing, r.pending) == (3, 3, 0, 0)
    assert len(result.warnings) == 1 and "gone by retention" in result.warnings[0]
    assert result.to_json()["warnings"] == result.warnings


def test_bus_retention_through_the_cli(db_url, cli):
    made = cli("bus", "create", "orders", "--queues", "2", "--retention", "3d")
    assert made.returncode == 0, made.stderr
    shown = json.loads(cli("bus", "show", "orders", "--json").stdout)
    assert (shown["retention"], shown["retention_default"]) == ("3d", False)
    changed = cli("bus", "update", "orders", "--retention", "default", "--json")
    assert json.loads(changed.stdout)["retention"] == "7d", changed.stderr
    bad = cli("bus", "update", "orders", "--retention", "3 days")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--retention" in bad.stderr
    far = D0 + 10 * DAY  # a row past the days made ahead: the run makes its day, and says so
    with psycopg2.connect(db_url) as conn, conn.cursor() as cur:
        bid = bus_id(cur, "orders")
        add_event(cur, bid, 0, 0, far + timedelta(hours=1))
    conn.close()
    ran = cli("db", "maintain", "--json")
    assert ran.returncode == 0, ran.stderr
    done = json.loads(ran.stdout)
    assert set(done) == set(MaintenanceReport().to_json())
    day = f"bus_event_{bid}_p{far:%Y%m%d}"
    assert done["moved"] == {day: 1}
    assert ran.stderr.startswith(f"{day} made: 1 row moved in from the default partition ("), (
        ran.stderr
    )


def test_bus_retention_refused_and_defaulted(conn, monkeypatch):
    with pytest.raises(catalog.CatalogError, match="--retention"):
        catalog.create_bus(conn, "b", 1, retention="30m")
    monkeypatch.setenv("EVENTPUSH_RETENTION", "2w")
    catalog.create_bus(conn, "b", 1)
    info = catalog.get_bus(conn, "b")
    assert (info.retention, info.retention_default) == ("14d", True)
    assert catalog.update_bus_retention(conn, "b", "36h").retention == "36h"


@pytest.mark.parametrize(
    "text", ["\u0667d", "\uff17d", "9" * 5000 + "d", "0d", "-1h", "1e9w", "7 d", "99999999999w"]
)
def test_retention_spellings_outside_the_grammar_are_refused(text):
    """Only ASCII digits and a unit, within an hour and ten years, refused in our words: an
    Arabic-Indic or a full-width seven used to be taken as 7, and 5,000 digits failed with
    int()'s own message."""
    from eventpush.config import retention_seconds

    with pytest.raises(ValueError, match="--retention must be a number and a unit"):
        retention_seconds(text, "--retention")
    assert retention_seconds(" 7d ", "--retention") == 7 * 86400


def test_days_made_ahead_are_bounded(monkeypatch):
    """A huge EVENTPUSH_PARTITIONS_AHEAD_DAYS is refused in one line; it used to be taken,
    making a table per day per bus (or, past year 9999, an OverflowError traceback)."""
    from eventpush.config import ConfigError, partitions_ahead_days

    monkeypatch.setenv("EVENTPUSH_PARTITIONS_AHEAD_DAYS", "100000")
    with pytest.raises(ConfigError, match="EVENTPUSH_PARTITIONS_AHEAD_DAYS must be at most 366"):
        partitions_ahead_days()
    monkeypatch.setenv("EVENTPUSH_PARTITIONS_AHEAD_DAYS", " 366 ")
    assert partitions_ahead_days() == 366


def test_migration_splits_existing_tables_and_keeps_their_rows(empty_db_url):
    """A database at 0007 with a bus, events and deliveries: after 0010 every row is still
    there, in the ``_before`` partitions, and new rows land in day partitions."""
    from alembic import command

    from eventpush.schema import _alembic_config, migrate

    command.upgrade(_alembic_config(empty_db_url), "0007_verify_sinks")
    c = psycopg2.connect(empty_db_url)
    try:
        with c, c.cursor() as cur:
            cur.execute("INSERT INTO event_bus (name, queues) VALUES ('old', 1) RETURNING id")
            bid = cur.fetchone()[0]
            cur.execute(
                f"CREATE TABLE bus_event_{bid} PARTITION OF bus_event FOR VALUES IN ({bid})"
            )
            for offset in range(3):
                add_event(cur, bid, 0, offset, NOW - 20 * DAY + offset * DAY)
                add_delivery(cur, 7, offset, NOW - 20 * DAY + offset * DAY, "old")
        migrate(empty_db_url)
        with c, c.cursor() as cur:
            assert offsets(cur, bid) == [0, 1, 2]
            cur.execute(f"SELECT count(*) FROM bus_event_{bid}_before")
            assert cur.fetchone()[0] == 3
            cur.execute("SELECT count(*) FROM event_push_delivery_before")
            assert cur.fetchone()[0] == 3
            add_event(cur, bid, 0, 3, D0 + DAY + timedelta(hours=1))
            add_delivery(cur, 7, 3, D0 + DAY + timedelta(hours=1), "old")
            cur.execute(f'SELECT count(*) FROM "bus_event_{bid}_p{D0 + DAY:%Y%m%d}"')
            assert cur.fetchone()[0] == 1
            cur.execute("SELECT max(id) FROM event_push_delivery")
            assert cur.fetchone()[0] == 4  # the id sequence carried on
        # Past the default 7 days, the whole _before partition goes at once.
        report = maintain(c, now=NOW + 8 * DAY)
        assert f"bus_event_{bid}_before" in report.dropped
        assert "event_push_delivery_before" in report.dropped
        with c, c.cursor() as cur:
            assert offsets(cur, bid) == [3]
            cur.execute("SELECT nextval('event_push_delivery_id_seq')")  # still owned
            assert cur.fetchone()[0] == 5
    finally:
        c.close()


def test_retention_dag_in_dag_test(airflow_db, airflow_conn_env, conn):
    from airflow.dag_processing.dagbag import DagBag

    catalog.create_bus(conn, "orders", 1, retention="1d")
    bag = DagBag(dag_folder=str(REPO / "dags" / "eventpush_retention.py"))
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["eventpush_retention"]
    assert dag.doc_md.strip().startswith("### eventpush_retention")
    assert dag.default_args["owner"] == "eventpush" and "eventpush" in dag.tags
    run = dag.test()
    assert {ti.task_id: str(ti.state) for ti in run.get_task_instances()} == {
        "maintain": "success",
        "check": "success",
    }
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT success FROM event_check_result WHERE suite = 'retention' ORDER BY id DESC"
        )
        assert cur.fetchone() == (True,)


def test_a_rolled_up_window_audits_to_the_same_figures(conn, db_url, spark):
    """Two runners on one bus audited over a closed window with roll-up: the clean one (one
    failure, one duplicate) gets one summary row instead of its delivery rows, the one with
    a gap keeps its rows. Later audits of that window, and of a wider one, answer the same
    figures; a replay of gaps selects nothing of the rolled-up runner."""
    from batch_support import events, publish_lines, simulate_push

    from eventpush.sparkjobs.audit import run_audit
    from eventpush.sparkjobs.replay import ReplayRequest, select

    pattern = '{"source": ["app.orders"]}'
    clean = make_runner(conn, "books", "r1", "clean", pattern)
    gappy = make_runner(conn, "books", "r2", "gappy", pattern)
    since = datetime.now(UTC) - timedelta(minutes=5)
    publish_lines(conn, "books", events(12))
    until = datetime.now(UTC)
    simulate_push(conn, clean, fail={3})
    simulate_push(conn, gappy)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT id, name FROM event_target_runner")
        ids = {name: rid for rid, name in cur.fetchall()}
        cur.execute(  # a duplicate of the clean runner's first delivery
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms) SELECT runner_id, '
            'consumer_group, topic_name, queue_id, "offset", message_id, 1, 200, 1 '
            "FROM event_push_delivery WHERE runner_id = %s ORDER BY id LIMIT 1",
            (ids[clean],),
        )
        cur.execute(  # a lost record of the other runner
            "DELETE FROM event_push_delivery WHERE id = (SELECT min(id) FROM "
            "event_push_delivery WHERE runner_id = %s)",
            (ids[gappy],),
        )

    def figures(result) -> dict:
        return {
            r.runner: (r.expected, r.delivered, r.failed, r.missing, r.duplicates)
            for r in result.runners
        }

    first = run_audit(spark, db_url, bus="books", since=since, until=until, roll_up=True)
    assert figures(first) == {clean: (12, 11, 1, 0, 1), gappy: (12, 11, 0, 1, 0)}
    assert first.rolled_up == {ids[clean]: 12}  # 11 deliveries and the duplicate
    with conn, conn.cursor() as cur:
        cur.execute("SELECT runner_id, count(*) FROM event_push_delivery GROUP BY runner_id")
        assert dict(cur.fetchall()) == {ids[gappy]: 11}
        cur.execute(
            "SELECT expected, delivered, failed, duplicates, rows_rolled, offsets "
            "FROM event_delivery_rollup"
        )
        ((expected, delivered, failed, dups, rows, covered),) = cur.fetchall()
        assert (expected, delivered, failed, dups, rows) == (12, 11, 1, 1, 12)
        assert sum(n for _, _, n in covered.values()) == 12

    again = run_audit(spark, db_url, bus="books", since=since, until=until)
    assert figures(again) == figures(first)
    wider = run_audit(spark, db_url, bus="books", since=since - DAY, until=until + DAY)
    assert figures(wider) == figures(first)
    # A second roll-up of the same window leaves the first alone.
    third = run_audit(spark, db_url, bus="books", since=since, until=until, roll_up=True)
    assert third.rolled_up == {} and figures(third) == figures(first)

    # Tomorrow's maintenance compacts a day that roll-ups emptied: its indexes rebuilt, the
    # rows kept. (Twelve rolled rows leave too little behind to tell: 20,000 more, gone.)
    from eventpush.partitions import compact

    with conn, conn.cursor() as cur:
        cur.execute(
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms) '
            "SELECT 999, 'g', 'books', 0, g, 'm', 1, 200, 1 FROM generate_series(1, 20000) g"
        )
        cur.execute("DELETE FROM event_push_delivery WHERE runner_id = 999")
    assert compact(conn, D0 + DAY, min_bytes=0) == ["event_push_delivery_before"]
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_push_delivery")
        assert cur.fetchone()[0] == 11
    assert compact(conn, D0) == []  # today's partition is still written: never touched
    req = ReplayRequest(what="missing", bus="books", since=since, until=until)
    picked = select(spark, db_url, req, [ids[clean], ids[gappy]]).collect()
    assert [(row["runner_id"]) for row in picked] == [ids[gappy]]


def test_a_missed_delivery_day_is_made_with_the_logs_indexes_once(conn):
    """The delivery log's missed day too: its rows move into a table made with the log's
    indexes (its primary key among them), which the attach takes as the partition's own
    instead of building a second set."""
    far = D0 + 10 * DAY
    with conn, conn.cursor() as cur:
        for offset in range(3):
            add_delivery(cur, 1, offset, far + timedelta(hours=1))
    report = maintain(conn, now=NOW)
    ahead = D0 + 2 * DAY  # a day made ahead, as usual (today's may lie in `_before`)
    day, usual = f"event_push_delivery_p{far:%Y%m%d}", f"event_push_delivery_p{ahead:%Y%m%d}"
    assert day in report.created, report
    with conn, conn.cursor() as cur:
        cur.execute(f'SELECT count(*) FROM "{day}"')
        assert cur.fetchone()[0] == 3
        cur.execute('SELECT count(*) FROM "event_push_delivery_default"')
        assert cur.fetchone()[0] == 0
        shapes = {}
        for table in (day, usual):
            cur.execute(
                "SELECT i.indisprimary, pg_get_indexdef(i.indexrelid, 0, true) FROM pg_index i "
                "WHERE i.indrelid = %s::regclass AND i.indisvalid",
                (table,),
            )
            # the definition without the index's and the table's own names
            shapes[table] = sorted(
                (primary, definition.split(" USING ", 1)[1])
                for primary, definition in cur.fetchall()
            )
        assert shapes[day] == shapes[usual] and any(p for p, _ in shapes[day]), shapes
