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


def _two_runners_of_one_name(conn, missing: tuple[int, int]) -> tuple[str, int, int]:
    """orders/r/t pushed, some of its delivery rows lost (``missing[0]``), its bus deleted
    (``--force``) and made again with the same names (a new runner, same name) and pushed in
    turn, losing ``missing[1]``. Returns the name and the deleted and live runners' ids."""
    from eventpush import catalog

    ids = []
    for lost in missing:
        catalog.create_bus(conn, "orders", 2)
        catalog.create_rule(conn, "orders", "r", {"source": ["app.orders"]})
        spec = catalog.TargetSpec(name="t", url="http://127.0.0.1:9/hook")
        name = catalog.create_target(conn, "orders", "r", spec)
        publish_lines(conn, "orders", events(6))
        simulate_push(conn, name)
        with conn.cursor() as cur:
            cur.execute(
                "SELECT id FROM event_target_runner WHERE name = %s AND deleted_at IS NULL",
                (name,),
            )
            ids.append(cur.fetchone()[0])
            cur.execute(
                "DELETE FROM event_push_delivery WHERE id IN (SELECT id FROM "
                "event_push_delivery WHERE runner_id = %s ORDER BY id LIMIT %s)",
                (ids[-1], lost),
            )
        conn.commit()
        if len(ids) == 1:
            catalog.delete_bus(conn, "orders", force=True)
    return name, ids[0], ids[1]


def test_a_deleted_runner_and_the_live_one_of_its_name_keep_their_figures_apart(
    db_url,
    conn,
    spark,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Two runners named orders/r/t, one of a deleted target, one live, 2 and 3 records
    missing: the result, the saved report, the JSON, the table, the metrics, the gap event's
    extra and the alert line each keep them apart by runner id."""
    from prometheus_client.parser import text_string_to_metric_families

    from eventpush.airflow import alerts
    from eventpush.airflow.gaps import gap_extra
    from eventpush.cli.batch import audit

    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    name, old, live = _two_runners_of_one_name(conn, (2, 3))

    result = run_audit(spark, db_url)
    got = {r.runner_id: (r.runner, r.deleted, r.missing) for r in result.runners}
    assert got == {old: (name, True, 2), live: (name, False, 3)}

    with conn.cursor() as cur:
        cur.execute("SELECT runners FROM event_audit_report WHERE id = %s", (result.report_id,))
        (saved,) = cur.fetchone()
    conn.rollback()
    assert {r["runner_id"]: r["missing"] for r in saved} == {old: 2, live: 3}

    text = (tmp_path / "eventpush_audit.prom").read_text()
    series = {
        (s.labels["runner"], s.labels["runner_id"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "eventpush_audit_missing_records"
    }
    assert series == {(name, str(old)): 2, (name, str(live)): 3}

    report = {"report_id": result.report_id, "bus": None, "since": None, "until": None}
    report |= {"missing": 5, "runners": saved}
    extra = gap_extra(report, False)
    assert sorted(extra["runners"], key=lambda r: r["runner_id"]) == [
        {"runner_id": old, "runner": name, "missing": 2},
        {"runner_id": live, "runner": name, "missing": 3},
    ]
    ti = type("TI", (), {"xcom_pull": lambda self, task_ids: report})()
    lines = []
    monkeypatch.setattr(alerts, "raise_alert", lambda alert, message: lines.append(message))
    alerts.audit_failed({"ti": ti})
    assert f"{name} #{live} (3), {name} #{old} (2)" in lines[0]

    doc = json.loads(CliRunner().invoke(audit, ["--json"]).stdout)
    assert {r["runner_id"]: r["missing"] for r in doc["runners"]} == {old: 2, live: 3}
    table = CliRunner().invoke(audit, [])
    assert table.exit_code == 1, table.output
    # The name is cut to the terminal's width; the id column tells the rows apart.
    rows = {
        tuple(cell.strip() for cell in line.strip("│").split("│")[1:6])
        for line in table.stdout.splitlines()
        if line.startswith("│ orders/")
    }
    assert rows == {(str(old), "6", "4", "0", "2"), (str(live), "6", "3", "0", "3")}


def test_a_clean_deleted_runner_does_not_roll_up_the_live_one_of_its_name(
    db_url,
    conn,
    spark,  # noqa: F811
):
    """The deleted runner is clean, the live one of its name has a record missing: only the
    deleted one's window is rolled up; the live one keeps its delivery rows and its gap."""
    since = datetime.now(UTC) - timedelta(minutes=5)
    name, old, live = _two_runners_of_one_name(conn, (0, 1))
    until = datetime.now(UTC)
    result = run_audit(spark, db_url, since=since, until=until, roll_up=True)
    with conn.cursor() as cur:
        cur.execute("SELECT runner_id FROM event_delivery_rollup")
        assert cur.fetchall() == [(old,)]
        cur.execute("SELECT count(*) FROM event_push_delivery WHERE runner_id = %s", (live,))
        assert cur.fetchone()[0] == 5
    conn.rollback()
    got = {r.runner_id: (r.missing, r.pending) for r in result.runners}
    assert got == {old: (0, 0), live: (1, 0)}
    assert result.rolled_up == {old: 6}
    again = run_audit(spark, db_url, since=since, until=until)
    assert {r.runner_id: r.missing for r in again.runners} == {old: 0, live: 1}
