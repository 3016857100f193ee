"""The batch DAGs (audit, replay, rebalance) with ``dag.test()``: real Airflow, real
PostgreSQL, and each job run by SparkSubmitOperator as a real ``spark-submit`` in local mode.
Airflow's own setup is shared with the push DAG tests (tests/airflow_fixtures.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from batch_support import events, make_runner, publish_lines, simulate_push
from receiver_support import receiver

from eventpush import catalog
from tests.airflow_fixtures import REPO, airflow_conn_env, airflow_db

__all__ = ["airflow_conn_env", "airflow_db", "receiver"]

DAG_IDS = ("eventpush_audit", "eventpush_replay", "eventpush_rebalance", "eventpush_replay_gaps")


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
    # The loop: the audit updates the gaps asset, the gap replay is scheduled on it.
    gaps_uri = "eventpush://audit/gaps"
    publish = bag.dags["eventpush_audit"].get_task("publish_gaps")
    assert [a.uri for a in publish.outlets] == [gaps_uri]
    assert [a.uri for a in bag.dags["eventpush_replay_gaps"].timetable.asset_condition.objects] == [
        gaps_uri
    ]


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


@pytest.fixture
def in_process_conn(monkeypatch, airflow_conn_env):
    conn = {"conn_type": "spark", "host": "local[2]", "extra": {"in_process": True}}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn))
    return airflow_conn_env


def test_in_process_connection_runs_every_job_on_one_session(
    bag, conn, in_process_conn, receiver, monkeypatch
):
    """The connection's ``in_process`` extra: the real DAGs' jobs run in this process, on
    one local session that the first starts and the next reuses (no spark-submit)."""
    from pyspark.sql import SparkSession

    from eventpush.airflow.spark_submit import EventpushSparkSubmitOperator

    submitted = []
    monkeypatch.setattr(
        EventpushSparkSubmitOperator, "prepare_submit", lambda self, *a: submitted.append(a)
    )
    runner = make_runner(
        conn, "orders", "all", "crm", {"source": ["app.orders"]}, url=f"{receiver.url}/ok"
    )
    catalog.create_worker(conn, "w1")
    publish_lines(conn, "orders", events(5))
    simulate_push(conn, runner, fail={0, 1})
    run = bag.dags["eventpush_replay"].test(run_conf={"what": "failed", "bus": "orders"})
    assert str(run.state) == "success", states(run)
    session = SparkSession.getActiveSession()
    assert session is not None  # started here and kept
    app = session.sparkContext.applicationId
    run = bag.dags["eventpush_rebalance"].test()
    assert str(run.state) == "success", states(run)
    assert SparkSession.getActiveSession().sparkContext.applicationId == app
    assert session.range(3).count() == 3  # the jobs did not stop it
    assert submitted == []  # nothing went through spark-submit
    with conn.cursor() as cur:
        cur.execute("SELECT status, selected, delivered, failed FROM event_replay_run")
        assert cur.fetchall() == [("succeeded", 2, 2, 0)]
        cur.execute("SELECT success FROM event_check_result WHERE suite = 'rebalance'")
        assert cur.fetchall() == [(True,)]


@pytest.mark.parametrize(
    "conn_doc, message",
    [
        (
            {"conn_type": "spark", "host": "spark://127.0.0.2:7077", "extra": {"in_process": True}},
            "local masters only",
        ),
        (
            {"conn_type": "spark", "host": "local[2]", "extra": {"in_process": "yes"}},
            "true or false",
        ),
    ],
)
def test_in_process_is_refused_unless_local_and_boolean(
    monkeypatch, airflow_conn_env, conn_doc, message
):
    from eventpush.airflow.spark_submit import in_process
    from eventpush.sparkjobs.session import SparkSetupError, require_airflow_master

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn_doc))
    with pytest.raises(SparkSetupError, match=message):
        in_process("spark_default", require_airflow_master())


def gap_events() -> list:
    """The events of the gaps asset in Airflow's metadata database, oldest first."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(
            select(AssetEvent)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetModel.uri == "eventpush://audit/gaps")
            .order_by(AssetEvent.id)
        ).all()
        return [(e.extra, e.source_dag_id) for e in rows]


def queued_gap_runs() -> list[str]:
    """DAGs the scheduler would run for a new gaps event (its asset queue)."""
    from airflow.models.asset import AssetDagRunQueue, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return list(
            session.scalars(
                select(AssetDagRunQueue.target_dag_id)
                .join(AssetModel, AssetModel.id == AssetDagRunQueue.asset_id)
                .where(AssetModel.uri == "eventpush://audit/gaps")
            )
        )


def test_audit_gaps_become_an_asset_event_and_the_switch_replays_them(
    bag, conn, in_process_conn, receiver, tmp_path, monkeypatch
):
    # The jobs run in-process (the connection's extra): what this test checks is the DAGs'
    # asset event, switch and alert; the spark-submit path has tests of its own above and below.
    # The job's results and the check's alert land in a node-exporter textfile directory.
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    monkeypatch.delenv("AIRFLOW_VAR_EVENTPUSH_REPLAY_GAPS", raising=False)
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
    before = len(gap_events())
    run = bag.dags["eventpush_audit"].test(run_conf={"since": since, "until": until})
    got = states(run)
    assert str(run.state) == "failed", got
    assert got["audit_job"] == "success" and got["check"] == "failed", got
    assert got["publish_gaps"] == "success", got
    with conn.cursor() as cur:
        cur.execute("SELECT id, missing FROM event_audit_report ORDER BY id DESC LIMIT 1")
        report_id, missing = cur.fetchone()
        cur.execute("SELECT id FROM event_target_runner WHERE name = %s", (runner,))
        (runner_id,) = cur.fetchone()
        cur.execute("SELECT success FROM event_check_result WHERE suite = 'audit'")
        assert cur.fetchall() == [(False,)]
    conn.rollback()
    assert missing == 2
    # One asset event, with the counts; the scheduler has queued the gap replay for it.
    emitted = gap_events()[before:]
    assert emitted == [
        (
            {
                "report_id": report_id,
                "bus": None,
                "since": since,
                "until": until,
                "missing": 2,
                "runners": [{"runner_id": runner_id, "runner": runner, "missing": 2}],
                "replay_requested": False,
            },
            "eventpush_audit",
        )
    ]
    assert "eventpush_replay_gaps" in queued_gap_runs()
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
    labels = (("runner", runner), ("runner_id", str(runner_id)))
    assert audit[("eventpush_audit_missing_records", labels)] == 2

    def replay_runs() -> int:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM event_replay_run")
            count = cur.fetchone()[0]
        conn.rollback()
        return count

    def received() -> int:
        return receiver.state.count["/ok"] - received_before

    # Switched off (the default): the gap replay does nothing.
    received_before = receiver.state.count["/ok"]
    gaps = bag.dags["eventpush_replay_gaps"]
    off = gaps.test()
    got = states(off)
    assert got["gap_request"] == "skipped" and got["replay_job"] == "skipped", got
    assert replay_runs() == 0 and received() == 0

    # Switched on: the gaps are re-pushed, and the next audit finds nothing missing.
    monkeypatch.setenv("AIRFLOW_VAR_EVENTPUSH_REPLAY_GAPS", "true")
    on = gaps.test()
    assert str(on.state) == "success", states(on)
    with conn.cursor() as cur:
        cur.execute("SELECT what, status, selected, delivered, failed FROM event_replay_run")
        assert cur.fetchall() == [("missing", "succeeded", 2, 2, 0)]
    conn.rollback()
    assert received() == 2
    again = bag.dags["eventpush_audit"].test(run_conf={"since": since, "until": until})
    got = states(again)
    assert str(again.state) == "success", got
    assert got["publish_gaps"] == "skipped", got
    with conn.cursor() as cur:
        cur.execute("SELECT missing FROM event_audit_report ORDER BY id DESC LIMIT 1")
        assert cur.fetchone()[0] == 0
    conn.rollback()
    assert len(gap_events()) == before + 1  # no event without a gap


def test_gap_replay_switch_and_window():
    from eventpush.airflow.gaps import replay_form, switch_on

    assert [switch_on(v) for v in (None, "", "false", "0", "True", " on ", True)] == [
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="eventpush_replay_gaps must be true or false"):
        switch_on("maybe")
    a = {
        "missing": 2,
        "bus": "orders",
        "since": "2026-01-01T01:00:00+00:00",
        "until": "2026-01-01T02:00:00+00:00",
        "replay_requested": False,
    }
    b = {
        **a,
        "since": "2026-01-01T00:00:00+00:00",
        "until": "2026-01-01T01:00:00+00:00",
        "replay_requested": True,
    }
    c = {**a, "bus": "billing"}
    assert replay_form([a], switch=False) is None  # off, and not asked for
    assert replay_form([a, b], switch=False) == {
        "what": "missing",
        "bus": "orders",
        "since": b["since"],
        "until": b["until"],
    }
    assert replay_form([a, b], switch=True) == {
        "what": "missing",
        "bus": "orders",
        "since": b["since"],
        "until": a["until"],
    }
    assert replay_form([a, c], switch=True)["bus"] is None  # two buses: every bus
    assert replay_form([{**a, "missing": 0}], switch=True) is None


def test_a_gap_event_made_by_hand_without_a_window_is_refused_in_one_line():
    """An asset event on the gaps asset can be made in the UI or the REST API with any extra:
    no window is a one-line ValueError (the DAG fails the task with it), not a KeyError; a
    naive time is UTC beside an aware one, not a TypeError."""
    from eventpush.airflow.gaps import replay_form

    by_hand = {"missing": 3, "replay_requested": True, "report_id": 7}
    with pytest.raises(ValueError, match=r"^gap event of audit report 7: since None is not an"):
        replay_form([by_hand], switch=False)
    with pytest.raises(ValueError, match="until 'soon' is not an ISO 8601 time"):
        replay_form([{**by_hand, "since": "2026-01-01T00:00:00", "until": "soon"}], switch=True)
    a = {"missing": 1, "since": "2026-01-01T00:00:00", "until": "2026-01-01T01:00:00+00:00"}
    b = {"missing": 1, "since": "2026-01-01T00:30:00+00:00", "until": "2026-01-01T02:00:00"}
    form = replay_form([a, b], switch=True)
    assert (form["since"], form["until"]) == (a["since"], b["until"])


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
