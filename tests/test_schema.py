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
