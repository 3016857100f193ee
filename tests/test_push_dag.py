"""The push DAG end to end with ``dag.test()``: real PostgreSQL, a receiver on loopback, the
real engine, trigger and GX check."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from tests.airflow_fixtures import REPO, StandaloneWorker, order_events, seed, wait_for

pytest_plugins = ["tests.airflow_fixtures"]

CONF = {"slice_seconds": 30, "wait_timeout_s": 5}


@pytest.fixture(scope="module")
def push_dag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "eventpush_push.py"))
    assert not bag.import_errors
    return bag.dags["eventpush_push"]


def _states(run) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for ti in run.get_task_instances():
        states.setdefault(ti.task_id, []).append(str(ti.state))
    return states


def _check_results(conn) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute("SELECT run_label, success, failures FROM event_check_result ORDER BY id")
        rows = cur.fetchall()
    conn.rollback()
    return rows


def test_dag_run_delivers_published_events_and_checks_pass(push_dag, conn, airflow_conn_env):
    with Receiver() as rx:
        runners = seed(conn, f"{rx.url}/ok")
        publish(conn, "orders", order_events(12) + order_events(3, source="app.other"))
        run = push_dag.test(run_conf=CONF)
        states = _states(run)
        assert str(run.state) == "success", states
        assert states["worker.push"] == ["success", "success"]
        assert states["worker.check"] == ["success", "success"]
        # every matching event reached the receiver, once per runner (two runners)
        delivered = rx.state.delivered("/ok")
        assert len(delivered) == 24
        ns = sorted(json.loads(r.body)["detail"]["n"] for r in delivered)
        assert ns == sorted(list(range(12)) * 2)
    results = _check_results(conn)
    assert sorted(label.rsplit("/", 1)[1] for label, _, _ in results) == sorted(runners)
    assert all(ok for _, ok, _ in results)


def test_dag_run_fails_when_a_delivery_row_points_at_another_workers_runner(
    push_dag, conn, airflow_conn_env
):
    with Receiver() as rx:
        runners = seed(conn, f"{rx.url}/ok")
        with conn.cursor() as cur:
            cur.execute("SELECT name, id FROM event_target_runner")
            ids = dict(cur.fetchall())
            # a bug stand-in: w1's first delivery row gets logged against w2's runner
            cur.execute(
                f"""
                CREATE FUNCTION misfile() RETURNS trigger AS $$
                BEGIN
                  IF NEW.runner_id = {ids[runners["w1"]]} AND NEW."offset" = 0
                     AND NEW.queue_id = 0 THEN
                    NEW.runner_id := {ids[runners["w2"]]};
                  END IF;
                  RETURN NEW;
                END $$ LANGUAGE plpgsql;
                CREATE TRIGGER misfile BEFORE INSERT ON event_push_delivery
                  FOR EACH ROW EXECUTE FUNCTION misfile();
                """
            )
        conn.commit()
        publish(conn, "orders", order_events(6))
        run = push_dag.test(run_conf=CONF)
    states = _states(run)
    assert str(run.state) == "failed", states
    assert states["worker.check"].count("failed") >= 1, states
    results = {label.rsplit("/", 1)[1]: (ok, fails) for label, ok, fails in _check_results(conn)}
    ok, failures = results["w1"]
    assert ok is False
    broken = {(f["frame"], f["column"]) for f in failures}
    assert ("deliveries", "runner_id") in broken
    assert ("deliveries", "names_its_runner") in broken


def test_the_lease_holder_pushes_and_the_dag_skips_that_worker(push_dag, conn, airflow_conn_env):
    with Receiver() as rx:
        # slow targets: w1's events stay in flight in the standalone worker during the DAG run
        seed(conn, f"{rx.url}/slow?ms=4000")
        publish(conn, "orders", order_events(5))
        with StandaloneWorker("w1", airflow_conn_env) as standalone:

            def leased() -> bool:
                with conn.cursor() as cur:
                    cur.execute("SELECT pid IS NOT NULL FROM event_push_worker WHERE name='w1'")
                    held = cur.fetchone()[0]
                conn.rollback()
                return held

            wait_for(leased, what="the standalone worker's lease")
            run = push_dag.test(run_conf=CONF)
            states = _states(run)
            wait_for(lambda: len(rx.state.delivered("/slow")) == 10, what="all deliveries")
        assert str(run.state) == "success", states
        # both sensors saw work; w1's push skipped (the lease is held elsewhere), w2's pushed
        assert states["worker.wait_for_work"] == ["success", "success"], states
        assert sorted(states["worker.push"]) == ["skipped", "success"], states
        assert standalone.report.delivered == 5


def test_check_names_an_offset_that_moved_backwards(conn, db_url):
    from eventpush.push import run_worker
    from eventpush.quality.push_slice import CheckFailed, check_push_slice, snapshot

    with Receiver() as rx:
        seed(conn, f"{rx.url}/ok", workers=("w1",))
        publish(conn, "orders", order_events(8))
        run_worker("w1", until_idle=True, max_seconds=30)
    before = snapshot(conn, "w1")
    with conn.cursor() as cur:
        cur.execute('UPDATE event_push_offset SET "offset" = start_offset WHERE queue_id = 0')
    conn.commit()
    after = snapshot(conn, "w1")
    report = {"read": 0, "delivered": 0, "failed": 0, "filtered": 0}
    with pytest.raises(CheckFailed) as err:
        check_push_slice(db_url, before, after, report, "manual/w1")
    text = str(err.value)
    assert "worker 'w1'" in text and "offsets" in text and "after vs before" in text
    assert "orders/orders-rule/t0 q0" in text


def test_trigger_wakes_on_publish_and_ends_quietly_without_work(conn, airflow_conn_env):
    from eventpush.airflow.triggers import WorkerWorkSensor, WorkerWorkTrigger

    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    classpath, kwargs = WorkerWorkTrigger("w1", timeout=1, poll_interval=30).serialize()
    assert classpath == "eventpush.airflow.triggers.WorkerWorkTrigger"

    async def first_event(trigger):
        async for event in trigger.run():
            return event.payload

    started = time.monotonic()
    quiet = asyncio.run(first_event(WorkerWorkTrigger(**kwargs)))
    assert quiet["status"] == "timeout" and time.monotonic() - started < 5

    async def publish_later():
        await asyncio.sleep(0.5)
        await asyncio.to_thread(publish, conn, "orders", order_events(1))

    async def wait_and_publish():
        trigger = WorkerWorkTrigger("w1", timeout=20, poll_interval=30)
        event, _ = await asyncio.gather(first_event(trigger), publish_later())
        return event

    started = time.monotonic()
    woke = asyncio.run(wait_and_publish())
    # the notification wakes it long before the 30 s poll interval
    assert woke["status"] == "work" and time.monotonic() - started < 5

    sensor = WorkerWorkSensor(task_id="s", worker="w1", wait_timeout=1)
    from airflow.sdk.exceptions import AirflowSkipException

    with pytest.raises(AirflowSkipException):
        sensor.execute_complete({}, {"status": "timeout", "worker": "w1"})
    assert sensor.execute({}) == {"status": "work", "worker": "w1", "waited_s": 0.0}


def test_without_work_the_sensors_defer_and_the_run_ends_quietly(push_dag, conn, airflow_conn_env):
    seed(conn, "http://127.0.0.1:9/ok")
    started = time.monotonic()
    run = push_dag.test(run_conf={"slice_seconds": 30, "wait_timeout_s": 2})
    states = _states(run)
    assert str(run.state) == "success", states
    assert states["worker.wait_for_work"] == ["skipped", "skipped"], states
    assert states["worker.push"] == ["skipped", "skipped"], states
    assert time.monotonic() - started < 30
