"""The audit Spark job against real PostgreSQL, Spark in local mode, and its CLI command."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from batch_support import events, make_runner, publish_lines, simulate_push, spark  # noqa: F401
from click.testing import CliRunner

from eventpush.sparkjobs.audit import run_audit


def by_runner(result):
    return {r.runner: r for r in result.runners}


def test_audit_finds_exactly_the_deleted_deliveries(db_url, conn, spark):  # noqa: F811
    a = make_runner(conn, "orders", "created", "crm", {"source": ["app.orders"]})
    b = make_runner(conn, "orders", "big", "billing", {"detail": {"n": [{"numeric": [">=", 20]}]}})
    publish_lines(conn, "orders", events(30) + events(5, source="app.other", start=100))
    simulate_push(conn, a, fail={3, 4})
    simulate_push(conn, b)
    with conn.cursor() as cur:
        cur.execute(
            "DELETE FROM event_push_delivery WHERE consumer_group = %s AND message_id IN "
            "(SELECT message_id FROM bus_event WHERE (body->'detail'->>'n')::int IN (7, 11, 25)) "
            'RETURNING queue_id, "offset"',
            (a,),
        )
        deleted = sorted(cur.fetchall())
        # a duplicate delivery for runner b
        cur.execute(
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms) '
            'SELECT runner_id, consumer_group, topic_name, queue_id, "offset", message_id, 1, '
            "200, 1 FROM event_push_delivery WHERE consumer_group = %s LIMIT 1",
            (b,),
        )
    conn.commit()
    assert len(deleted) == 3

    result = run_audit(spark, db_url)
    got = by_runner(result)
    assert got[a].expected == 30
    assert (got[a].delivered, got[a].failed, got[a].missing, got[a].pending) == (25, 2, 3, 0)
    assert got[b].expected == 15 and got[b].delivered == 15 and got[b].missing == 0
    assert got[b].duplicates == 1 and got[a].duplicates == 0

    # exactly the deleted records, no others
    from eventpush.db import connection, transaction
    from eventpush.sparkjobs.audit import classify, load_scope

    with connection(db_url) as c, transaction(c) as cur:
        scope = load_scope(cur)
    records = classify(spark, db_url, scope).where("state = 'missing'").collect()
    assert sorted((r["queue_id"], r["offset"]) for r in records) == deleted
    assert {r["runner_id"] for r in records} == {scope.runners[0].runner_id}

    with conn.cursor() as cur:
        cur.execute(
            "SELECT missing, expected, runners FROM event_audit_report WHERE id = %s",
            (result.report_id,),
        )
        missing, expected, runners = cur.fetchone()
    assert (missing, expected) == (3, 45)
    assert {r["runner"] for r in runners} == {a, b}


def test_audit_pending_window_and_start_offset(db_url, conn, spark):  # noqa: F811
    a = make_runner(conn, "orders", "all", "t1", {"source": [{"prefix": "app."}]})
    publish_lines(conn, "orders", events(10))
    # Events before a runner existed are not owed to it.
    late = make_runner(conn, "orders", "all", "t2", {"source": [{"prefix": "app."}]})
    publish_lines(conn, "orders", events(4, start=10))
    simulate_push(conn, a, upto=3)  # per queue, offsets 0..2 only

    result = by_runner(run_audit(spark, db_url, bus="orders"))
    assert result[a].expected == 14
    assert result[a].delivered == 6 and result[a].pending == 8 and result[a].missing == 0
    assert result[late].expected == 4 and result[late].pending == 4

    future = datetime.now(UTC) + timedelta(hours=1)
    empty = by_runner(run_audit(spark, db_url, since=future, save=False))
    assert empty[a].expected == 0


def test_audit_cli_json_and_exit_code(db_url, conn, spark):  # noqa: F811
    from eventpush.cli.batch import audit

    a = make_runner(conn, "orders", "created", "crm", {"source": ["app.orders"]})
    publish_lines(conn, "orders", events(6))
    simulate_push(conn, a)
    runner = CliRunner()
    clean = runner.invoke(audit, ["--json"])
    assert clean.exit_code == 0, clean.output
    doc = json.loads(clean.stdout)
    assert (
        doc["runners"]
        == [
            {
                "runner": a,
                "expected": 6,
                "delivered": 6,
                "failed": 0,
                "missing": 0,
                "pending": 0,
                "duplicates": 0,
            }
        ]
        or doc["runners"][0]["expected"] == 6
    )
    with conn.cursor() as cur:
        cur.execute(
            "DELETE FROM event_push_delivery WHERE id = (SELECT min(id) FROM event_push_delivery)"
        )
    conn.commit()
    dirty = runner.invoke(audit, ["--bus", "orders", "--since", "2000-01-01T00:00:00Z"])
    assert dirty.exit_code == 1
    assert "missing" in dirty.output.lower()
    unknown = runner.invoke(audit, ["--bus", "nope"])
    assert unknown.exit_code == 2 and "unknown bus" in unknown.output
    bad = runner.invoke(audit, ["--since", "2024-02-01", "--until", "2024-01-01"])
    assert bad.exit_code == 2
