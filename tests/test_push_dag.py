"""The push DAG and its checks DAG end to end with ``dag.test()``: real PostgreSQL, a receiver
on loopback, the real engine, trigger, asset events and GX check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import psycopg2
import psycopg2.errors
import pytest

from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from tests.airflow_fixtures import REPO, StandaloneWorker, order_events, seed, wait_for

pytest_plugins = ["tests.airflow_fixtures"]

# A slice pushes for its whole budget: short here, and the events are published before it.
# No successor comes in a test's one run: a slice stops at its window, not hand_over_s after.
CONF = {"slice_seconds": 3, "hand_over_s": 0}


def _load(name: str):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / f"{name}.py"))
    assert not bag.import_errors
    return bag.dags[name]


@pytest.fixture(scope="module")
def push_dag(airflow_db):
    return _load("eventpush_push")


@pytest.fixture(scope="module")
def checks_dag(airflow_db):
    return _load("eventpush_push_checks")


def run_checks(checks_dag, push_run, monkeypatch):
    """Run the checks DAG as the scheduler would after ``push_run``: on the asset events its
    slices recorded. ``dag.test()`` makes a manual run, so those events (real rows written by
    the push run) are attached to it as the run's triggering events before its tasks start."""
    from airflow.models import dagrun
    from airflow.models.asset import AssetEvent, AssetModel
    from sqlalchemy import select

    make_run = dagrun.get_or_create_dagrun

    def run_on_the_push_runs_events(**kwargs):
        run = make_run(**kwargs)
        session = kwargs["session"]
        events = session.scalars(
            select(AssetEvent)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetModel.name == "eventpush_push_slices")
            .where(AssetEvent.source_run_id == push_run.run_id)
        ).all()
        run.consumed_asset_events.extend(events)
        session.commit()
        return run

    monkeypatch.setattr(dagrun, "get_or_create_dagrun", run_on_the_push_runs_events)
    return checks_dag.test()


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


def test_dag_run_delivers_published_events_and_checks_pass(
    push_dag, checks_dag, conn, airflow_conn_env, monkeypatch
):
    with Receiver() as rx:
        runners = seed(conn, f"{rx.url}/ok")
        publish(conn, "orders", order_events(12) + order_events(3, source="app.other"))
        run = push_dag.test(run_conf=CONF)
        states = _states(run)
        assert str(run.state) == "success", states
        assert states["push"] == ["success", "success"]
        # every matching event reached the receiver, once per runner (two runners)
        delivered = rx.state.delivered("/ok")
        assert len(delivered) == 24
        ns = sorted(json.loads(r.body)["detail"]["n"] for r in delivered)
        assert ns == sorted(list(range(12)) * 2)
    assert _check_results(conn) == []  # the check is not part of the push run
    checked = run_checks(checks_dag, run, monkeypatch)
    states = _states(checked)
    assert str(checked.state) == "success", states
    assert states["check"] == ["success", "success"], states
    results = _check_results(conn)
    assert sorted(label for label, _, _ in results) == sorted(
        f"{run.run_id}/{worker}" for worker in runners
    )
    assert all(ok for _, ok, _ in results)


def test_a_broken_slice_fails_the_checks_run_and_raises_the_alert(
    push_dag, checks_dag, conn, airflow_conn_env, monkeypatch, tmp_path
):
    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
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
    # pushing is done and the next push run may start: the check fails in its own DAG
    assert str(run.state) == "success", _states(run)
    checked = run_checks(checks_dag, run, monkeypatch)
    states = _states(checked)
    assert str(checked.state) == "failed", states
    assert states["check"].count("failed") >= 1, states
    results = {label.rsplit("/", 1)[1]: (ok, fails) for label, ok, fails in _check_results(conn)}
    ok, failures = results["w1"]
    assert ok is False
    broken = {(f["frame"], f["column"]) for f in failures}
    assert ("deliveries", "runner_id") in broken
    assert ("deliveries", "names_its_runner") in broken
    # loud, as when the check ran in the push run: the push_check alert gauge is raised
    alert = (tmp_path / "eventpush_alert_push_check.prom").read_text()
    assert 'eventpush_alert{alert="push_check"} 1.0' in alert


def test_a_checks_run_without_slices_checks_nothing_and_an_event_without_one_fails():
    from eventpush.airflow.push_slice import slices_to_check

    assert slices_to_check([]) == []
    stranger = SimpleNamespace(
        extra={"note": "posted by hand"},
        source_dag_id=None,
        source_run_id=None,
        timestamp="2026-01-01T00:00:00+00:00",
    )
    with pytest.raises(ValueError, match="no slice to check"):
        slices_to_check([stranger])


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
            run = push_dag.test(run_conf={**CONF, "slice_seconds": 10})
            states = _states(run)
            wait_for(lambda: len(rx.state.delivered("/slow")) == 10, what="all deliveries")
        assert str(run.state) == "success", states
        # both saw work; w1's push skipped (the lease is held elsewhere), w2's pushed
        assert sorted(states["push"]) == ["skipped", "success"], states
        assert standalone.report.delivered == 5


def test_a_slice_pushes_for_its_whole_budget_and_sends_late_events_at_once(conn, db_url):
    from eventpush.airflow.push_slice import push_slice

    with Receiver() as rx:
        seed(conn, f"{rx.url}/ok", workers=("w1",))
        publish(conn, "orders", order_events(2))
        result: dict = {}
        slice_ = threading.Thread(target=lambda: result.update(push_slice("w1", db_url, 5.0)))
        started = time.monotonic()
        slice_.start()
        wait_for(lambda: len(rx.state.delivered("/ok")) == 2, what="the first events")
        # idle now: a slice that stopped at its first idle moment would have ended
        time.sleep(1.0)
        published = time.monotonic()
        publish(conn, "orders", order_events(1, start=2))
        wait_for(lambda: len(rx.state.delivered("/ok")) == 3, timeout=4, what="the late event")
        late_s = time.monotonic() - published
        slice_.join(30)
    assert late_s < 1.0  # woken by the publish notification, not by a poll or the next slice
    assert time.monotonic() - started >= 5.0
    assert result["report"]["delivered"] == 3
    assert result["before"]["worker"] == result["after"]["worker"] == "w1"


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
    from airflow.sdk.exceptions import AirflowSensorTimeout, AirflowSkipException, TaskDeferred

    from eventpush.airflow.push_slice import PushSliceSensor
    from eventpush.airflow.triggers import WorkerWorkTrigger, worker_has_work

    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    classpath, kwargs = WorkerWorkTrigger("w1", timeout=1, poll_interval=30).serialize()
    assert classpath == "eventpush.airflow.triggers.WorkerWorkTrigger"

    async def first_event(trigger):
        async for event in trigger.run():
            return event.payload

    started = time.monotonic()
    quiet = asyncio.run(first_event(WorkerWorkTrigger(**kwargs)))
    assert quiet["status"] == "timeout" and time.monotonic() - started < 5

    # without work the push sensor defers to the trigger rather than hold its slot, for no
    # longer than its timeout or what is left of the run's window
    op = PushSliceSensor(task_id="s", worker="w1", slice_seconds=60, timeout=30)
    run_started = datetime.now(UTC) - timedelta(seconds=50)
    context = {"dag_run": SimpleNamespace(start_date=run_started)}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    assert isinstance(deferred.value.trigger, WorkerWorkTrigger)
    assert deferred.value.method_name == "execute_complete"
    assert 8 < deferred.value.trigger.timeout <= 10
    # a timeout is a sensor timeout: failed, or skipped with soft_fail, as Airflow resumes it
    timed_out = {"event": {"status": "timeout", "worker": "w1"}}
    with pytest.raises(AirflowSensorTimeout):
        op.resume_execution("execute_complete", timed_out, context)
    op.soft_fail = True
    with pytest.raises(AirflowSkipException):
        op.resume_execution("execute_complete", timed_out, context)
    # a window already over: nothing to wait for in this run
    late = {"dag_run": SimpleNamespace(start_date=run_started - timedelta(seconds=60))}
    with pytest.raises(AirflowSkipException, match="window"):
        op.execute(late)

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
    assert worker_has_work(airflow_conn_env, "w1")


async def _first_event(trigger) -> dict:
    """The trigger's first event; then its run is closed, as the triggerer closes it."""
    async with contextlib.aclosing(trigger.run()) as events:
        async for event in events:
            return event.payload


async def within(seconds: float, awaitable):
    async with asyncio.timeout(seconds):
        return await awaitable


def _spy_connections(monkeypatch, triggers) -> tuple[list, list[dict]]:
    """Every connection the trigger's module opens, and the parameters it was opened with."""
    opened, params = [], []
    real = triggers.connect

    def spy(url, **libpq):
        opened.append(real(url, **libpq))
        params.append(opened[-1].get_dsn_parameters())
        return opened[-1]

    monkeypatch.setattr(triggers, "connect", spy)
    return opened, params


def test_a_database_that_stops_answering_does_not_hold_the_trigger(
    conn, airflow_conn_env, monkeypatch
):
    """A check that gets no answer (here it waits behind a table lock; a half-open connection
    after a failover is the same wait, without a server to end it) ends the trigger at its
    timeout, not when the database answers; the check's statement is cancelled by the server
    soon after and its connection closed, and every connection carries TCP keepalives and a
    user timeout for a peer that went silent."""
    from eventpush.airflow import triggers

    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    monkeypatch.setattr(triggers, "QUERY_TIMEOUT_S", 2)
    opened, params = _spy_connections(monkeypatch, triggers)

    def lock_waits() -> int:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            n = cur.fetchone()[0]
        conn.rollback()
        return n

    locker = psycopg2.connect(airflow_conn_env)
    loop = asyncio.new_event_loop()
    try:
        with locker.cursor() as cur:
            cur.execute("LOCK TABLE event_push_worker IN ACCESS EXCLUSIVE MODE")
        trigger = triggers.WorkerWorkTrigger("w1", timeout=1, poll_interval=30)
        started = time.monotonic()
        event = loop.run_until_complete(within(8, _first_event(trigger)))
        assert event["status"] == "timeout" and time.monotonic() - started < 3
        assert lock_waits() == 1  # the check still waits: the trigger did not wait for it
        # the lock still held: the server ends the check's wait (statement_timeout)
        wait_for(lambda: lock_waits() == 0, timeout=6, what="the check's statement cancelled")
        wait_for(lambda: all(c.closed for c in opened), timeout=2, what="connections closed")
    finally:
        locker.rollback()
        locker.close()
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
    assert len(opened) == 2  # the listener and one check
    for p in params:
        assert (p["keepalives"], p["keepalives_idle"], p["tcp_user_timeout"]) == ("1", "5", "10000")


def test_a_listen_that_fails_leaves_no_connection_open(conn, airflow_conn_env, monkeypatch):
    """LISTEN refused: the listener's connection is closed, and the trigger waits by polling."""
    from eventpush.airflow import triggers

    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    monkeypatch.setattr(triggers, "NOTIFY_CHANNEL", "not a channel")  # LISTEN: syntax error
    opened, _ = _spy_connections(monkeypatch, triggers)
    with pytest.raises(psycopg2.errors.SyntaxError):
        triggers._listen(airflow_conn_env)
    assert len(opened) == 1 and opened[0].closed
    quiet = asyncio.run(_first_event(triggers.WorkerWorkTrigger("w1", timeout=1)))
    assert quiet["status"] == "timeout"
    assert len(opened) >= 3 and all(c.closed for c in opened)


def test_without_work_the_push_tasks_defer_and_the_run_ends_quietly(
    push_dag, conn, airflow_conn_env
):
    seed(conn, "http://127.0.0.1:9/ok")
    started = time.monotonic()
    run = push_dag.test(run_conf={"slice_seconds": 2, "hand_over_s": 0})
    states = _states(run)
    assert str(run.state) == "success", states
    assert states["push"] == ["skipped", "skipped"], states
    assert time.monotonic() - started < 30


def test_a_worker_without_work_does_not_hold_back_the_run(push_dag, conn, airflow_conn_env):
    with Receiver() as rx:
        seed(conn, f"{rx.url}/ok", workers=("w1",))
        seed(conn, f"{rx.url}/ok", workers=("w2",), bus="quiet")
        publish(conn, "orders", order_events(3))
        started = time.monotonic()
        run = push_dag.test(run_conf={"slice_seconds": 4, "hand_over_s": 0})
        took = time.monotonic() - started
    states = _states(run)
    assert str(run.state) == "success", states
    assert sorted(states["push"]) == ["skipped", "success"], states
    # w2 waits for what is left of the run's 4 s window, not for its 120 s sensor timeout
    assert took < 60


def test_the_next_slice_takes_over_the_moment_the_previous_one_lets_go(conn, db_url):
    from eventpush.airflow.push_slice import push_slice
    from eventpush.airflow.triggers import HAND_OVER, slice_due

    with Receiver() as rx:
        seed(conn, f"{rx.url}/ok", workers=("w1",))
        results: list[dict] = [{}, {}]
        ended = [0.0, 0.0]

        def run(i: int, budget_s: float, hand_over_s: float) -> None:
            results[i].update(push_slice("w1", db_url, budget_s, hand_over_s=hand_over_s))
            ended[i] = time.monotonic()

        started = time.monotonic()
        first = threading.Thread(target=run, args=(0, 2.0, 30.0))
        first.start()
        wait_for(lambda: slice_due(db_url, "w1") == HAND_OVER, what="the first slice's lease")
        # the next slice starts while the first pushes, and waits for the lease
        second = threading.Thread(target=run, args=(1, 10.0, 0.0))
        second.start()
        n = 0
        # a steady stream across the hand-over, and on for a second after it
        while time.monotonic() - started < 4.5 or not ended[0] or time.monotonic() < ended[0] + 1:
            assert time.monotonic() - started < 30, "the first slice never handed over"
            event = {"source": "app.orders", "detail-type": "t", "detail": {"n": n}}
            publish(conn, "orders", [json.dumps(event)])
            n += 1
            time.sleep(0.02)
        first.join(30)
        second.join(30)
        got = [json.loads(r.body)["detail"]["n"] for r in rx.state.delivered("/ok")]
    # the first stopped once its window was over and the next one waited, not 30 s later
    assert ended[0] - started < 12
    assert sorted(got) == list(range(n))  # nothing lost, no copies
    reports = [r["report"] for r in results]
    assert reports[0]["delivered"] > 0 and reports[1]["delivered"] > 0
    assert reports[0]["delivered"] + reports[1]["delivered"] == n
    # the successor's "before" is where the first one ended: each slice's check sees its own
    # (runner, queue, committed offset): the queue's end, the fourth column, moves with the
    # stream still being published between the two pictures
    ended_at = [row[:3] for row in results[0]["after"]["offsets"]]
    assert [row[:3] for row in results[1]["before"]["offsets"]] == ended_at
    assert results[1]["before"]["runners"] == results[0]["after"]["runners"]


def test_the_push_sensor_pokes_and_times_out_like_any_sensor(conn, airflow_conn_env):
    from airflow.sdk.exceptions import AirflowSensorTimeout, AirflowSkipException

    from eventpush.airflow.push_slice import PushSliceSensor

    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    context = {"dag_run": SimpleNamespace(start_date=datetime.now(UTC))}
    poking = {"task_id": "s", "worker": "w1", "slice_seconds": 60, "deferrable": False}
    op = PushSliceSensor(**poking, mode="poke", poke_interval=0.2, timeout=1)
    with pytest.raises(AirflowSensorTimeout):
        op.execute(context)
    op = PushSliceSensor(**poking, mode="poke", poke_interval=0.2, timeout=1, soft_fail=True)
    with pytest.raises(AirflowSkipException):
        op.execute(context)


def test_a_one_off_run_until_idle_ends_when_the_work_is_done(push_dag, conn, airflow_conn_env):
    with Receiver() as rx:
        seed(conn, f"{rx.url}/ok", workers=("w1",))
        publish(conn, "orders", order_events(5))
        started = time.monotonic()
        run = push_dag.test(run_conf={"slice_seconds": 600, "until_idle": True})
        took = time.monotonic() - started
        assert len(rx.state.delivered("/ok")) == 5
    states = _states(run)
    assert str(run.state) == "success", states
    assert states["push"] == ["success"], states
    assert took < 300  # the work's few seconds, not the 600 s window (nor its hand-over)


def test_a_mistyped_field_in_the_conf_is_refused_not_ignored(push_dag, conn, airflow_conn_env):
    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    run = push_dag.test(run_conf={"slice_seconds": 2, "hand_over_s": 0, "until_idel": True})
    states = _states(run)
    assert str(run.state) == "failed" and states["list_workers"] == ["failed"], states
    assert states.get("push", ["upstream_failed"]) != ["success"], states


@pytest.mark.parametrize(
    ("field", "value"), [("hand_over_s", "nan"), ("slice_seconds", "inf"), ("hand_over_s", "-1")]
)
def test_a_slice_without_a_finite_length_is_refused_before_it_pushes(
    push_dag, conn, airflow_conn_env, monkeypatch, field, value
):
    """JSON's NaN and Infinity pass the form's minimum and maximum: a slice of either length
    would push, holding its worker's lease, for ever. Refused in one line, nothing started;
    a huge finite number is refused by the form itself."""
    from airflow.sdk.exceptions import AirflowFailException, ParamValidationError

    from eventpush.airflow import push_slice

    def never(*args, **kwargs):
        raise AssertionError(f"a slice started: {args} {kwargs}")

    monkeypatch.setattr(push_slice, "push_slice", never)
    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    publish(conn, "orders", order_events(1))  # work: the sensor's condition holds at once
    form = {"slice_seconds": "5", "hand_over_s": "0", field: value}
    op = push_slice.PushSliceSensor(task_id="s", worker="w1", **form)
    context = {"dag_run": SimpleNamespace(start_date=datetime.now(UTC))}
    message = f"^{field} must be a finite number of seconds, got '{value}'$"
    with pytest.raises(AirflowFailException, match=message):
        op.execute(context)
    for name in ("slice_seconds", "hand_over_s"):
        with pytest.raises(ParamValidationError):
            push_dag.params.get_param(name).resolve(1e308)
