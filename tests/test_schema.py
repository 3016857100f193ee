"""Migrations against the real PostgreSQL."""

import psycopg2
import pytest

from eventpush.schema import current_revision, head_revision, migrate

TABLES = {
    "event_bus",
    "bus_event",
    "event_rule",
    "event_target",
    "event_target_runner",
    "event_push_worker",
    "event_push_offset",
    "event_push_failure",
    "event_push_delivery",
    "event_replay_run",
    "event_audit_report",
    "event_push_metric",
    "event_runtime_control",
    "event_assignment",
    "event_check_result",
}
SEED_COLUMNS = {
    "id",
    "consumer_group",
    "message_id",
    "topic_name",
    "broker_name",
    "queue_id",
    "offset",
    "ctime",
}


def _columns(url: str, table: str) -> set[str]:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s", (table,)
        )
        return {r[0] for r in cur.fetchall()}


def test_migrate_twice_is_idempotent(empty_db_url):
    assert current_revision(empty_db_url) is None
    before, after = migrate(empty_db_url)
    assert (before, after) == (None, head_revision())
    assert migrate(empty_db_url) == (head_revision(), head_revision())
    with psycopg2.connect(empty_db_url) as c, c.cursor() as cur:
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        present = {r[0] for r in cur.fetchall()}
    assert present >= TABLES


@pytest.mark.parametrize(
    "table", ["event_push_offset", "event_push_failure", "event_push_delivery"]
)
def test_offset_tables_carry_the_seed_columns(db_url, table):
    assert _columns(db_url, table) >= SEED_COLUMNS


def test_bus_event_is_partitioned(conn):
    with conn.cursor() as cur:
        cur.execute("SELECT relkind FROM pg_class WHERE relname = 'bus_event'")
        assert cur.fetchone()[0] == "p"


def test_constraints_refuse_impossible_rows(conn):
    with conn.cursor() as cur:
        for sql in (
            "INSERT INTO event_bus (name, queues) VALUES ('b', 0)",
            "INSERT INTO event_bus (name, queues) VALUES ('bad name', 1)",
            "INSERT INTO event_push_worker (name, capacity) VALUES ('w', 0)",
        ):
            with pytest.raises(psycopg2.errors.CheckViolation):
                cur.execute(sql)
            conn.rollback()


def test_an_event_is_stored_only_for_a_bus_that_exists(conn):
    """``bus_event`` has no foreign key (migration 0012): its partitions by bus refuse an
    event of a bus that was never made, and a made bus takes its events."""
    from eventpush import catalog

    catalog.create_bus(conn, "known", 1)
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM event_bus WHERE name = 'known'")
        (known,) = cur.fetchone()
        cur.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'bus_event'::regclass "
            "AND contype = 'f'"
        )
        assert cur.fetchone()[0] == 0
    row = (
        'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, detail_type, '
        "event_time, size_bytes, body) VALUES (%s, 0, 0, 'm', 's', 't', now(), 2, '{}')"
    )
    with conn.cursor() as cur, pytest.raises(psycopg2.errors.CheckViolation, match="no partition"):
        cur.execute(row, (known + 1000,))
    conn.rollback()
    with conn.cursor() as cur:
        cur.execute(row, (known,))
    conn.commit()


FAILURES_INDEX = "event_push_failure_open_mtime"  # migration 0015's
BEFORE_0015 = "0014_bus_queue_first_offset"
BEFORE_0014 = "0013_retry_attempts_186"


def _runner_before_0015(conn, db_url: str) -> int:
    """A runner to write failure rows for, and the database downgraded to before 0015 (its
    index gone with it: the downgrade undoes the upgrade)."""
    from alembic import command
    from batch_support import make_runner

    from eventpush.schema import _alembic_config

    name = make_runner(conn, "orders", "r", "t", '{"source": ["app"]}')
    with conn, conn.cursor() as cur:
        cur.execute("SELECT id FROM event_target_runner WHERE name = %s", (name,))
        (runner,) = cur.fetchone()
    command.downgrade(_alembic_config(db_url), BEFORE_0015)
    assert current_revision(db_url) == BEFORE_0015
    assert _index_valid(conn) is None
    return runner


def _fail(cur, runner: int, offset: int) -> None:
    """A worker's failure row of the event at ``offset``."""
    cur.execute(
        "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
        "\"offset\", message_id, attempts, last_error) VALUES (%s, 'g', 'orders', 0, %s, 'm', "
        "1, 'boom')",
        (runner, offset),
    )


def _index_valid(conn) -> bool | None:
    """Whether 0015's index is valid; None when there is none."""
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
            (FAILURES_INDEX,),
        )
        row = cur.fetchone()
    return None if row is None else row[0]


def _index_build_waits(conn) -> bool:
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND query ILIKE 'CREATE INDEX%%' AND wait_event_type = 'Lock')"
        )
        return cur.fetchone()[0]


def _asks_for_its_turn(conn) -> bool:
    """A migrate session asks for the migration lock again and again: its last statement
    the ask or the rollback after a refusal (a transaction each: a transaction's reads of
    pg_stat_activity are one snapshot of it)."""
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'eventpush db migrate' "
            "AND (query ILIKE 'SELECT pg%%advisory_lock(%%' OR query = 'ROLLBACK'))"
        )
        return cur.fetchone()[0]


def _migrate_into(results: list, url: str) -> None:
    """One ``migrate`` (in a thread: Alembic's context is the process's, one run at a time)."""
    try:
        results.append(migrate(url))
    except Exception as exc:
        results.append(exc)


def test_the_failures_index_is_built_while_workers_write_failures(conn, db_url):
    """Migration 0015 built its index on the failures table with a plain CREATE INDEX, which
    holds the table SHARE until built: behind a worker's open transaction, and every other
    worker's failure row queued behind it. Built CONCURRENTLY, the rows go in meanwhile."""
    import threading
    import time

    runner = _runner_before_0015(conn, db_url)
    slow, worker = psycopg2.connect(db_url), psycopg2.connect(db_url, options="-c lock_timeout=3s")
    results: list = []
    thread = threading.Thread(target=_migrate_into, args=(results, db_url))
    try:
        with slow.cursor() as cur:  # a worker's transaction that wrote a failure row, open
            _fail(cur, runner, 0)
        thread.start()
        deadline = time.monotonic() + 15
        while not _index_build_waits(conn):
            assert time.monotonic() < deadline and thread.is_alive(), results
            time.sleep(0.01)
        try:
            with worker, worker.cursor() as cur:  # another worker's failure row
                _fail(cur, runner, 1)
        except psycopg2.errors.LockNotAvailable:
            pytest.fail("a failure row waited for the index build")
    finally:
        slow.commit()
        thread.join(60)
        slow.close()
        worker.close()
    assert results == [(BEFORE_0015, head_revision())]
    assert _index_valid(conn) is True
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_push_failure")
        assert cur.fetchone()[0] == 2


def test_an_interrupted_build_of_the_failures_index_is_built_again(conn, db_url):
    """A concurrent build that fails leaves an invalid index of its name behind, unused: the
    migration run again drops it and builds the index, not keeping the invalid one."""
    runner = _runner_before_0015(conn, db_url)
    with conn, conn.cursor() as cur:
        _fail(cur, runner, 2)
        _fail(cur, runner, 3)
    conn.autocommit = True
    with conn.cursor() as cur, pytest.raises(psycopg2.errors.UniqueViolation):
        cur.execute(  # fails on its last step, as a cancelled build would: left invalid
            f"CREATE UNIQUE INDEX CONCURRENTLY {FAILURES_INDEX} ON event_push_failure "
            "(runner_id) WHERE status = 'failed'"
        )
    conn.autocommit = False
    assert _index_valid(conn) is False
    assert migrate(db_url) == (BEFORE_0015, head_revision())
    assert _index_valid(conn) is True
    with conn, conn.cursor() as cur:
        cur.execute("SELECT pg_get_indexdef(to_regclass(%s))", (FAILURES_INDEX,))
        assert "(mtime, id) WHERE (status = 'failed'::text)" in cur.fetchone()[0]


def test_a_migration_waiting_its_turn_lets_a_concurrent_index_build_finish(conn, db_url):
    """Every service runs ``db migrate`` on start. One waiting for the run before in
    pg_advisory_lock held that statement's snapshot, which the run's concurrent index build
    waits for, while it waited for the build's run: a deadlock, and one of the two failed.
    A waiting run now asks again and again with no statement open; both succeed."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    runner = _runner_before_0015(conn, db_url)
    exe = [str(Path(sys.executable).with_name("eventpush")), "db", "migrate"]
    slow = psycopg2.connect(db_url)
    runs = []
    try:
        with slow.cursor() as cur:  # holds the first run's build in its first wait
            _fail(cur, runner, 4)
        runs.append(subprocess.Popen(exe, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 30
        while not _index_build_waits(conn):
            assert time.monotonic() < deadline and runs[0].poll() is None
            time.sleep(0.01)
        runs.append(subprocess.Popen(exe, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 30  # a process's start on a loaded machine: seconds
        while not _asks_for_its_turn(conn):  # the second run
            assert time.monotonic() < deadline and runs[1].poll() is None
            time.sleep(0.01)
    finally:
        slow.commit()
        slow.close()
        outcomes = [(run.wait(60), run.communicate()) for run in runs]
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    assert current_revision(db_url) == head_revision()
    assert _index_valid(conn) is True


def _forgotten_session(db_url: str, *, wrote: bool, runner: int):
    """A session left open in a transaction, as a psql nobody closed: holding a snapshot
    (``wrote``: a failure row written too, so the table's lock as well)."""
    session = psycopg2.connect(db_url, application_name="forgotten psql")
    with session.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        if wrote:
            _fail(cur, runner, 5)
        else:
            cur.execute("SELECT count(*) FROM event_bus")
    with session.cursor() as cur:  # its pid, read in its own open transaction
        cur.execute("SELECT pg_backend_pid()")
        return session, cur.fetchone()[0]


def _refused_while_open(db_url: str, session) -> str:
    """``migrate`` refused (StoreError) while ``session`` holds its transaction open: the
    refusal's message. The session is ended either way."""
    from eventpush.db import StoreError

    try:
        with pytest.raises(StoreError) as failed:
            migrate(db_url)
    finally:
        session.rollback()
        session.close()
    return str(failed.value)


def test_an_index_build_behind_a_forgotten_transaction_gives_up_naming_it(
    conn, db_url, monkeypatch
):
    """A concurrent build waits for every older transaction: one session left idle in a
    transaction held ``db migrate`` for ever, silently. Now each wait is bounded
    (EVENTPUSH_MIGRATE_WAIT_S), the migration fails naming the session (pid,
    application, state; never its query), nothing is recorded, and once the session ends the
    next run builds the index."""

    runner = _runner_before_0015(conn, db_url)
    monkeypatch.setenv("EVENTPUSH_MIGRATE_WAIT_S", "2")
    session, pid = _forgotten_session(db_url, wrote=True, runner=runner)
    message = _refused_while_open(db_url, session)
    assert message.startswith(f"index {FAILURES_INDEX} was not built: it waited 2 s"), message
    assert f"pid {pid}: forgotten psql, idle in transaction, its transaction open" in message
    assert "INSERT" not in message and "\n" not in message
    assert current_revision(db_url) == BEFORE_0015
    assert _index_valid(conn) is not True
    assert migrate(db_url) == (BEFORE_0015, head_revision())
    assert _index_valid(conn) is True


def test_db_migrate_says_whom_an_index_build_waits_for_and_exits_in_one_line(conn, db_url):
    """The CLI: while the build waits, a line on stderr names the session it waits for; when
    it gives up, one error line and the database's exit code, the revision unchanged. (The
    bound by its former name, which is still read.)"""
    from conftest import run_cli

    runner = _runner_before_0015(conn, db_url)
    session, pid = _forgotten_session(db_url, wrote=False, runner=runner)
    try:
        run = run_cli("db", "migrate", env={"EVENTPUSH_MIGRATE_INDEX_WAIT_S": "3"})
    finally:
        session.rollback()
        session.close()
    assert run.returncode == 3, run
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith(f"index {FAILURES_INDEX} waits for older transactions to end (")
    assert f"pid {pid}: forgotten psql, idle in transaction" in lines[0]
    assert lines[-1].startswith(f"error: index {FAILURES_INDEX} was not built"), lines
    assert f"pid {pid}: forgotten psql" in lines[-1]
    assert current_revision(db_url) == BEFORE_0015


def test_a_migration_behind_a_forgotten_reader_gives_up_naming_it(conn, db_url, monkeypatch):
    """Not only a concurrent index build: every lock wait of a migration run is bounded
    (EVENTPUSH_MIGRATE_WAIT_S). 0014 adds a column to event_bus_queue, which waits for every
    session holding that table: a forgotten reader of it held ``db migrate`` (and every
    service's start) for ever, silently. Now the run fails in one line naming the session,
    the revision unchanged, and once the session ends the next run applies it."""
    from alembic import command

    from eventpush.schema import _alembic_config

    command.downgrade(_alembic_config(db_url), BEFORE_0014)
    monkeypatch.setenv("EVENTPUSH_MIGRATE_WAIT_S", "2")
    session = psycopg2.connect(db_url, application_name="forgotten psql")
    with session.cursor() as cur:  # its transaction left open, holding the table
        cur.execute("SELECT count(*) FROM event_bus_queue")
        cur.execute("SELECT pg_backend_pid()")
        (pid,) = cur.fetchone()
    message = _refused_while_open(db_url, session)
    assert message.startswith("db migrate gave up: it waited 2 s for a lock ("), message
    assert f"pid {pid}: forgotten psql, idle in transaction, its transaction open" in message
    assert "count(" not in message and "\n" not in message
    assert current_revision(db_url) == BEFORE_0014
    assert migrate(db_url) == (BEFORE_0014, head_revision())
