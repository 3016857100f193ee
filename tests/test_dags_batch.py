"""The batch DAGs (audit, replay, rebalance) with ``dag.test()``: real Airflow, real
PostgreSQL, and each job run by SparkSubmitOperator as a real ``spark-submit`` in local mode.
Airflow's own setup is shared with the push DAG tests (tests/airflow_fixtures.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from batch_support import events, make_runner, publish_lines, simulate_push

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from tests.airflow_fixtures import REPO, airflow_conn_env, airflow_db

__all__ = ["airflow_conn_env", "airflow_db"]

DAG_IDS = ("eventpush_audit", "eventpush_replay", "eventpush_rebalance")


@pytest.fixture(scope="module")
def bag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert not bag.import_errors, bag.import_errors
    return bag


@pytest.fixture
def spark_conn(monkeypatch, airflow_conn_env):
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"})
    )
    return airflow_conn_env


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


def states(run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


def test_dags_load_with_their_contract(bag):
    for dag_id in DAG_IDS:
        dag = bag.dags[dag_id]
        assert dag.doc_md and dag.doc_md.strip().startswith(f"### {dag_id}")
        assert "eventpush" in dag.tags
        assert dag.default_args["owner"] == "eventpush"
        assert dag.is_paused_upon_creation is False  # active from the first start
        for t in dag.tasks:
            assert t.doc_md or t.doc or t.task_type.endswith("Operator"), t.task_id
    assert bag.dags["eventpush_rebalance"].timetable.delta == timedelta(minutes=10)
    hourly = bag.dags["eventpush_audit"].timetable
    assert type(hourly).__name__ == "CronDataIntervalTimetable"
    assert hourly.expression == "0 * * * *"
    replay_params = bag.dags["eventpush_replay"].params
    for name in (
        "what",
        "bus",
        "rule",
        "target",
        "since",
        "until",
        "message_ids",
        "max_count",
        "rate_limit",
        "dry_run",
    ):
        param = replay_params.get_param(name)
        assert param.schema.get("title") and param.description, name
    assert "replay_missing" in bag.dags["eventpush_audit"].params


def test_missing_spark_connection_is_an_error_not_yarn(monkeypatch):
    from eventpush.sparkjobs.session import SparkSetupError, require_airflow_master, resolve_master

    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)
    monkeypatch.delenv("EVENTPUSH_SPARK_MASTER", raising=False)
    with pytest.raises(SparkSetupError, match="spark_default"):
        require_airflow_master()
    assert resolve_master() == "local[*]"  # the CLI's local default
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://spark-master:7077")
    assert require_airflow_master() == "spark://spark-master:7077"


def test_rebalance_dag_applies_an_even_assignment(bag, conn, spark_conn):
    for w in ("w1", "w2"):
        catalog.create_worker(conn, w)
    for i in range(6):
        make_runner(conn, "orders", "all", f"t{i}", {"source": ["app.orders"]})
    run = bag.dags["eventpush_rebalance"].test()
    assert str(run.state) == "success", states(run)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT w.name, count(*), max(r.generation) FROM event_target_runner r "
            "JOIN event_push_worker w ON w.id = r.worker_id GROUP BY w.name"
        )
        rows = cur.fetchall()
        cur.execute("SELECT success FROM event_check_result WHERE suite = 'rebalance'")
        assert cur.fetchall() == [(True,)]
    assert {name: n for name, n, _ in rows} == {"w1": 3, "w2": 3}
    assert all(g > 0 for *_, g in rows)


def test_audit_dag_fails_on_missing_and_triggers_the_replay(
    bag, conn, spark_conn, receiver, tmp_path, monkeypatch
):
    # The job's results and the check's alert land in a node-exporter textfile directory.
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    runner = make_runner(
        conn, "orders", "all", "crm", {"source": ["app.orders"]}, url=f"{receiver.url}/ok"
    )
    publish_lines(conn, "orders", events(8))
    simulate_push(conn, runner)
    with conn.cursor() as cur:
        cur.execute(
            "DELETE FROM event_push_delivery WHERE id IN "
            "(SELECT id FROM event_push_delivery ORDER BY id LIMIT 2)"
        )
    conn.commit()
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    until = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    run = bag.dags["eventpush_audit"].test(
        run_conf={"since": since, "until": until, "replay_missing": True}
    )
    got = states(run)
    assert str(run.state) == "failed", got
    assert got["audit_job"] == "success" and got["check"] == "failed"
    assert got["trigger_replay"] == "success"
    with conn.cursor() as cur:
        cur.execute("SELECT missing FROM event_audit_report ORDER BY id DESC LIMIT 1")
        assert cur.fetchone()[0] == 2
        cur.execute("SELECT success FROM event_check_result WHERE suite = 'audit'")
        assert cur.fetchall() == [(False,)]
    conn.rollback()
    # The failure callback raised the alert; the job itself reported the gap per runner.
    from prometheus_client.parser import text_string_to_metric_families

    def samples(name: str) -> dict:
        text = (tmp_path / name).read_text()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    alert = samples("eventpush_alert_audit_missing.prom")
    assert alert[("eventpush_alert", (("alert", "audit_missing"),))] == 1
    audit = samples("eventpush_audit.prom")
    assert audit[("eventpush_audit_missing_records", (("runner", runner),))] == 2

    from airflow.models import DagRun

    triggered = DagRun.find(dag_id="eventpush_replay")
    confs = [
        r.conf
        for r in triggered
        if (r.conf or {}).get("what") == "missing" and r.conf.get("since") == since
    ]
    assert confs, [r.conf for r in triggered]


def test_replay_dag_repushes_failed_records(bag, conn, spark_conn, receiver):
    runner = make_runner(
        conn, "orders", "all", "crm", {"source": ["app.orders"]}, url=f"{receiver.url}/ok"
    )
    publish_lines(conn, "orders", events(5))
    simulate_push(conn, runner, fail={0, 1})
    run = bag.dags["eventpush_replay"].test(run_conf={"what": "failed", "bus": "orders"})
    assert str(run.state) == "success", states(run)
    with conn.cursor() as cur:
        cur.execute("SELECT status, selected, delivered, failed FROM event_replay_run")
        assert cur.fetchall() == [("succeeded", 2, 2, 0)]
        cur.execute("SELECT status, count(*) FROM event_push_failure GROUP BY status")
        assert cur.fetchall() == [("replayed", 2)]


@pytest.mark.parametrize(
    "conf",
    [
        {"since": "2024-02-01T00:00:00+00:00", "until": "2024-01-01T00:00:00+00:00"},
        {"bus": "no-such-bus"},
    ],
)
def test_replay_dag_refuses_impossible_forms(bag, conn, spark_conn, conf):
    run = bag.dags["eventpush_replay"].test(run_conf=conf)
    got = states(run)
    assert str(run.state) == "failed" and got["check_request"] == "failed", got
    assert got["replay_job"] != "success"


@pytest.mark.parametrize(
    "conf, field",
    [
        ({"max_count": 0}, "max_count"),
        ({"what": "everything"}, "what"),
        ({"rate_limit": -1}, "rate_limit"),
    ],
)
def test_replay_form_validation(bag, conf, field):
    import copy

    params = copy.deepcopy(bag.dags["eventpush_replay"].params)
    with pytest.raises(Exception, match=field):  # what the UI form and the API refuse
        params.update(conf)  # validates each value against its Param's schema
        params.validate()
