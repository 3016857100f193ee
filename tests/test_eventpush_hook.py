"""EventpushHook (issue 29): the eventpush database as an Airflow hook owning the
``eventpush_db`` connection, and the reads the DAGs' tasks make through it; no DAG file holds
SQL or opens a connection of its own. The DAGs themselves run through it in
test_dags_batch.py and test_forms.py."""

from __future__ import annotations

import json
import re

from batch_support import make_runner

from eventpush import catalog
from tests.airflow_fixtures import REPO, airflow_conn_env, airflow_db

__all__ = ["airflow_conn_env", "airflow_db"]


def test_the_hook_reads_through_the_airflow_connection(
    airflow_db, airflow_conn_env, conn, monkeypatch
):
    from eventpush.airflow.hook import EventpushHook

    # Only the Airflow connection leads to the test's database: the environment's URL does not.
    monkeypatch.setenv("EVENTPUSH_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/nothing")
    hook = EventpushHook()
    with hook.connection() as c, c.cursor() as cur:
        cur.execute("SELECT current_database()")
        assert cur.fetchone()[0] == conn.get_dsn_parameters()["dbname"]
    assert hook.conn_type == "postgres" and hook.eventpush_conn_id == "eventpush_db"

    make_runner(conn, "orders", "all", "t", {"source": ["shop"]})
    catalog.create_worker(conn, "w1")
    catalog.create_worker(conn, "w2")
    catalog.set_worker_enabled(conn, "w2", False)
    assert hook.bus_exists("orders") and not hook.bus_exists("nope")
    found = hook.placement()
    assert (found.enabled_workers, found.workers, found.runners) == (1, 2, 1)

    since, until = "2026-01-01T00:00:00+00:00", "2026-01-01T01:00:00+00:00"
    assert hook.audit_report(since, until, "orders") is None
    with conn, conn.cursor() as cur:
        for missing in (3, 5):  # the newest report of the window counts
            cur.execute(
                "INSERT INTO event_audit_report (bus, window_start, window_end, expected, "
                "delivered, failed, missing, pending, duplicates, runners) "
                "VALUES ('orders', %s, %s, 10, 5, 0, %s, 0, 0, %s)",
                (since, until, missing, json.dumps({"r": missing})),
            )
    report = hook.audit_report(since, until, "orders")
    assert (report.expected, report.missing, report.absent, report.runners) == (10, 5, 0, {"r": 5})
    assert hook.audit_report(since, until, None) is None  # the whole-installation audit's own
    catalog.assign(conn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT max(generation) FROM event_assignment")
        generation = cur.fetchone()[0]
        cur.execute(
            "INSERT INTO event_check_result (suite, run_label, success, statistics, failures) "
            "VALUES ('rebalance', 'run-1', true, '{\"moves\": 2}', '[]'), "
            "('audit', 'run-2', true, '{}', '[]')"
        )
    assert generation is not None
    assert hook.rebalance_outcome("run-1") == ((True, {"moves": 2}), generation)
    assert hook.rebalance_outcome("run-2") == (None, generation)  # not a rebalance's


def test_dag_files_hold_no_sql_and_open_no_connection():
    for path in sorted((REPO / "dags").glob("*.py")):
        text = path.read_text()
        found = re.findall(
            r"\b(?:SELECT|INSERT|UPDATE|DELETE)\b|\.execute\(|database_url|connect\(", text
        )
        assert not found, f"{path.name}: {found}"


def test_connection_extras_reach_libpq_as_written(airflow_db, airflow_conn_env, monkeypatch):
    """An extra with a space in it (libpq's ``options``, as an Airflow connection's extra
    holds it) reaches the server as written, not with a "+" for the space."""
    from urllib.parse import quote

    from eventpush.airflow.hook import EventpushHook

    options = quote("-c statement_timeout=1234 -c lock_timeout=4321", safe="")
    monkeypatch.setenv("AIRFLOW_CONN_EVENTPUSH_DB", f"{airflow_conn_env}?options={options}")
    with EventpushHook().connection() as c, c.cursor() as cur:
        cur.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
        assert cur.fetchone() == ("1234ms", "4321ms")
