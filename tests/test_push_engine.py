"""The push engine against real PostgreSQL and real HTTP receivers on loopback."""

from __future__ import annotations

import gc
import json
import os
import threading
import time

import psycopg2
import pytest
from standardwebhooks import Webhook
from support import RunningWorker, wait_until

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import WorkerBusyError, controls, engine, run_worker
from eventpush.sinks.contract import record_key

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def rx():
    with Receiver() as receiver:
        yield receiver


def events(n: int, start: int = 0, **detail) -> list[str]:
    return [
        json.dumps({"source": "shop", "detail-type": "Order", "detail": {"n": i, **detail}})
        for i in range(start, start + n)
    ]


def setup_runner(conn, rx, path: str, *, pattern=None, queues: int = 2, **spec) -> str:
    catalog.create_bus(conn, "orders", queues)
    catalog.create_rule(conn, "orders", "r", pattern or {"source": ["shop"]})
    catalog.create_target(
        conn, "orders", "r", catalog.TargetSpec(name="t", url=rx.url + path, **spec)
    )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    return "orders/r/t"


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def committed_everything(conn) -> bool:
    [(lag,)] = rows(
        conn,
        'SELECT coalesce(sum(q.next_offset - o."offset"), 0) FROM event_push_offset o '
        "JOIN event_bus_queue q ON q.queue_id = o.queue_id",
    )
    return lag == 0


def test_the_collector_is_tuned_while_workers_run_and_put_back_after_the_last():
    before = gc.get_threshold()
    with engine.collector_tuned():
        assert gc.get_threshold() == (engine.GC_GEN0_THRESHOLD, *before[1:])
        with engine.collector_tuned():  # a second worker in the same process
            engine._freeze_startup_objects()
            frozen = gc.get_freeze_count()
            assert frozen > 0
            young = [[] for _ in range(1000)]
            engine._freeze_startup_objects()  # once: the collector never frees frozen cycles
            assert gc.get_freeze_count() <= frozen < frozen + len(young)
        # The first worker still runs: its collector stays as it was.
        assert gc.get_threshold()[0] == engine.GC_GEN0_THRESHOLD
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_worker_runs_as_a_batch_workload_and_puts_its_thread_back(conn, rx):
    setup_runner(conn, rx, "/ok")
    publish(conn, "orders", events(5))
    policies = []  # the loop thread's policy, as progress is reported from it
    report = run_worker(
        "w1",
        until_idle=True,
        max_seconds=60,
        progress=lambda _: policies.append(os.sched_getscheduler(0)),
    )
    assert report.delivered == 5
    assert policies and set(policies) == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_batch_scheduling_reaches_new_threads_and_leaves_a_chosen_policy_alone():
    started = []

    def child() -> None:
        started.append(os.sched_getscheduler(0))

    with engine.batch_scheduled():
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()
    assert started == [os.SCHED_BATCH]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # as `chrt --idle` would
    try:
        with engine.batch_scheduled():
            assert os.sched_getscheduler(0) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def test_500_then_200_is_retried_and_delivered(conn, rx):
    setup_runner(conn, rx, "/flaky?fail=1", backoff_ms=5)
    publish(conn, "orders", events(10))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (10, 0)
    assert rows(
        conn, "SELECT attempts, http_status, count(*) FROM event_push_delivery GROUP BY 1, 2"
    ) == [(2, 200, 10)]
    assert committed_everything(conn)


def test_a_runner_deleted_while_its_worker_was_down_is_let_go_at_its_start(conn, rx):
    """A deleted runner keeps its worker until that worker has committed what it delivered;
    a worker that was not running then lets go of it when it starts, and sends nothing."""
    setup_runner(conn, rx, "/ok")
    publish(conn, "orders", events(4))
    catalog.delete_target(conn, "orders", "r", "t")
    conn.commit()
    assert rows(conn, "SELECT worker_id IS NOT NULL FROM event_target_runner") == [(True,)]
    conn.commit()
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.read, report.delivered) == (0, 0) and rx.state.delivered("/ok") == []
    assert rows(conn, "SELECT worker_id FROM event_target_runner") == [(None,)]


def test_a_deleted_target_that_hangs_holds_up_no_other_change(conn, rx, db_url):
    """A deleted runner's sends under way are waited for (up to its timeout, at most 10 s)
    before its last outcomes are committed; that wait is its own, so a target created
    meanwhile starts at once and the worker never stops reading its catalog."""
    setup_runner(conn, rx, "/hang", timeout_ms=6_000)  # a retirement of 6.5 s
    with RunningWorker("w1", db_url) as worker:
        publish(conn, "orders", events(1))
        wait_until(lambda: rx.state.count["/hang"] == 1, what="the hanging send under way")
        catalog.delete_target(conn, "orders", "r", "t")
        spec = catalog.TargetSpec(name="b", url=rx.url + "/ok")
        catalog.create_target(conn, "orders", "r", spec)
        catalog.assign(conn)

        def held() -> set[str]:
            return {r.target.runner for r in list(worker.engine.runners.values())}

        wait_until(lambda: "orders/r/b" in held(), timeout=3, what="the new target held")
        publish(conn, "orders", events(1, start=1))
        wait_until(lambda: rx.state.count["/ok"] == 1, timeout=3, what="the new target sent to")
        assert "orders/r/t" in held(), "the deleted runner's hanging send is still waited for"
        wait_until(lambda: "orders/r/t" not in held(), what="the deleted runner let go")
        # Its claim is released just after (a stop in between leaves that to the next start,
        # by design): waited for here, not raced by the stop below.
        wait_until(
            lambda: (
                rows(
                    conn, "SELECT worker_id FROM event_target_runner WHERE name = %s", "orders/r/t"
                )
                == [(None,)]
            ),
            what="the deleted runner's claim released",
        )
    assert rows(conn, "SELECT name, worker_id FROM event_target_runner ORDER BY id") == [
        ("orders/r/t", None),
        ("orders/r/b", rows(conn, "SELECT id FROM event_push_worker")[0][0]),
    ]


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_a_send_under_way_when_its_target_is_deleted_ends_and_is_booked(conn, rx, db_url, ordered):
    """Deleted mid-send, a target's send is let finish and its delivery committed before the
    runner is let go: the books hold what the receiver got. An ordered queue's sender was
    cancelled mid-send (as at a stop), so that delivery was never booked."""
    setup_runner(conn, rx, "/slow?ms=1500", ordered=ordered)
    with RunningWorker("w1", db_url) as worker:
        publish(conn, "orders", events(1))
        wait_until(lambda: rx.state.count["/slow"] == 1, what="the send under way")
        catalog.delete_target(conn, "orders", "r", "t")
        wait_until(lambda: not worker.engine.runners, what="the deleted runner let go")
    assert rx.state.count["/slow"] == 1
    assert rows(conn, "SELECT count(*) FROM event_push_delivery") == [(1,)]


def test_gone_is_final_at_once(conn, rx):
    setup_runner(conn, rx, "/gone", max_attempts=5)
    publish(conn, "orders", events(6))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (0, 6)
    assert rows(
        conn,
        "SELECT attempts, http_status, last_error, status, count(*) FROM event_push_failure "
        "GROUP BY 1, 2, 3, 4",
    ) == [(1, 410, "HTTP 410", "failed", 6)]
    assert rx.state.count["/gone"] == 6
    assert committed_everything(conn)


def test_hanging_target_times_out_then_fails(conn, rx):
    setup_runner(conn, rx, "/hang", timeout_ms=200, max_attempts=2, backoff_ms=10)
    publish(conn, "orders", events(3))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert report.failed == 3
    [(attempts, status, error)] = rows(
        conn, "SELECT DISTINCT attempts, http_status, last_error FROM event_push_failure"
    )
    assert (attempts, status, error) == (2, None, "timed out after 200 ms")


def test_connection_reset_is_retried_then_recorded(conn, rx):
    setup_runner(conn, rx, "/reset", max_attempts=3, backoff_ms=5)
    publish(conn, "orders", events(2))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert report.failed == 2
    assert rx.state.count["/reset"] == 6
    for attempts, error in rows(conn, "SELECT attempts, last_error FROM event_push_failure"):
        assert attempts == 3
        assert error


def test_429_honours_retry_after(conn, rx):
    setup_runner(conn, rx, "/ratelimit?after=1", backoff_ms=1)
    publish(conn, "orders", events(1))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert report.delivered == 1
    first, second = rx.state.requests
    assert first.headers["status"] == 429 and second.headers["status"] == 200
    assert second.at - first.at >= 0.95
    assert first.headers["webhook-id"] == second.headers["webhook-id"]


def test_only_matching_events_are_delivered_and_signed(conn, rx):
    setup_runner(
        conn, rx, "/ok", pattern={"detail": {"n": [{"numeric": [">=", 10]}]}}, secret=SECRET
    )
    publish(conn, "orders", events(25))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.filtered) == (15, 10)
    got = sorted(json.loads(r.body)["detail"]["n"] for r in rx.state.requests)
    assert got == list(range(10, 25))
    hook = Webhook(SECRET)
    with conn.cursor() as cur:  # the record key: runner, queue and offset
        cur.execute(
            'SELECT e.message_id, r.id, e.queue_id, e."offset" '
            "FROM bus_event e CROSS JOIN event_target_runner r"
        )
        keys = {mid: record_key(rid, q, o) for mid, rid, q, o in cur.fetchall()}
    conn.commit()
    for r in rx.state.requests:
        headers = {k: v for k, v in r.headers.items() if k.startswith("webhook")}
        assert hook.verify(r.body, headers)["detail"]["n"] >= 10
        assert r.headers["webhook-id"] == keys[json.loads(r.body)["id"]]
    assert committed_everything(conn)


def test_batches_are_json_arrays(conn, rx):
    setup_runner(conn, rx, "/ok", batch_size=10, queues=1)
    publish(conn, "orders", events(35))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert report.delivered == 35
    sizes = sorted(len(json.loads(r.body)) for r in rx.state.requests)
    assert sum(sizes) == 35 and max(sizes) <= 10
    assert len(rx.state.requests) < 35


def test_ordered_target_keeps_queue_order_through_retries(conn, rx):
    setup_runner(conn, rx, "/flaky?fail=1", ordered=True, backoff_ms=5, queues=2)
    publish(conn, "orders", events(40))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert report.delivered == 40
    order = rows(conn, 'SELECT queue_id, "offset" FROM event_push_delivery ORDER BY id')
    for queue_id in (0, 1):
        offsets = [o for q, o in order if q == queue_id]
        assert offsets == sorted(offsets)
    delivered_bodies = [json.loads(r.body)["id"] for r in rx.state.delivered("/flaky")]
    assert len(delivered_bodies) == 40


def test_second_copy_of_a_worker_is_refused(conn, rx, db_url):
    setup_runner(conn, rx, "/ok")
    holder = psycopg2.connect(db_url)
    try:
        from eventpush.push.store import take_lease

        take_lease(holder, "w1", rows(conn, "SELECT id FROM event_push_worker")[0][0])
        with pytest.raises(WorkerBusyError, match="already running"):
            run_worker("w1", until_idle=True, max_seconds=5)
    finally:
        holder.close()
    run_worker("w1", until_idle=True, max_seconds=5)


def test_a_waiting_copy_takes_the_lease_the_moment_it_is_let_go(conn, rx, db_url):
    from eventpush.push import HandOver
    from eventpush.push.store import lease_holder, lease_wanted, release_lease, take_lease

    setup_runner(conn, rx, "/ok")
    wid = rows(conn, "SELECT id FROM event_push_worker")[0][0]
    holder = psycopg2.connect(db_url, application_name="holder")
    try:
        take_lease(holder, "w1", wid)
        assert lease_holder(conn, wid) == "holder" and not lease_wanted(conn, wid)
        # a wait shorter than the hold: refused as before, after the wait
        with pytest.raises(WorkerBusyError, match="already running"):
            run_worker("w1", until_idle=True, hand_over=HandOver(lease_wait_s=0.3))
        result = {}
        waiting = HandOver(lease_wait_s=30, on_lease=lambda: result.update(at=time.monotonic()))
        thread = threading.Thread(
            target=lambda: result.update(report=run_worker("w1", max_seconds=3, hand_over=waiting))
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not lease_wanted(conn, wid):  # the copy waits in the lock queue
            assert time.monotonic() < deadline, "the copy never waited for the lease"
            time.sleep(0.05)
        released = time.monotonic()
        release_lease(holder, wid)
        thread.join(30)
    finally:
        holder.close()
    assert result["report"].worker == "w1"
    assert result["at"] - released < 5  # granted on release, not at the end of its wait


def test_pause_reaches_a_running_worker(conn, rx, db_url):
    runner = setup_runner(conn, rx, "/ok")
    with RunningWorker("w1", db_url) as worker:
        publish(conn, "orders", events(20))
        wait_until(lambda: rx.state.count["/ok"] == 20, what="the first 20 delivered")
        controls.set_paused(conn, "runner", runner, True)
        [held] = worker.engine.runners.values()
        wait_until(lambda: held.paused, what="the runner paused")
        publish(conn, "orders", events(20, start=20))
        time.sleep(1.5)
        assert rx.state.count["/ok"] == 20, "a paused runner must not deliver"
        controls.set_paused(conn, "runner", runner, False)
        wait_until(lambda: rx.state.count["/ok"] == 40, what="the rest delivered after resume")
    assert worker.engine.report.delivered == 40


def test_assignment_and_controls_reach_a_running_worker_at_once(conn, rx, db_url, monkeypatch):
    """A new runner assigned, a runner paused, the worker disabled: each notifies the
    catalog's channel, so the running worker acts on it at once, not at its periodic read
    (made longer than the test here; it was the only way an assignment or control arrived)."""
    monkeypatch.setattr(engine, "CONTROL_INTERVAL_S", 600.0)
    setup_runner(conn, rx, "/ok")
    spec = catalog.TargetSpec(name="b", url=rx.url + "/ok/b")
    catalog.create_target(conn, "orders", "r", spec)  # not assigned yet
    with RunningWorker("w1", db_url) as worker:
        wait_until(lambda: len(worker.engine.runners) == 1, what="the first runner held")
        catalog.assign(conn)

        def runner_b():
            return next(
                (r for r in worker.engine.runners.values() if r.target.runner == "orders/r/b"),
                None,
            )

        wait_until(lambda: runner_b() is not None, what="the assigned runner held")
        controls.set_paused(conn, "runner", "orders/r/b", True)
        wait_until(lambda: runner_b().paused, what="the runner paused")
        catalog.set_worker_enabled(conn, "w1", False)
        wait_until(lambda: not worker.engine.runners, what="the disabled worker's runners let go")


def test_database_connections_killed_mid_run_lose_nothing(conn, rx, db_url):
    setup_runner(conn, rx, "/slow?ms=5", concurrency=4)
    publish(conn, "orders", events(400))
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(report=run_worker("w1", until_idle=True, max_seconds=90)),
        daemon=True,
    )
    thread.start()
    dbname = db_url.rsplit("/", 1)[1]
    killed = 0
    for _ in range(3):
        time.sleep(0.4)
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s AND application_name = 'eventpush' AND pid <> pg_backend_pid()",
                (dbname,),
            )
            killed += cur.fetchone()[0]
        conn.commit()
    thread.join(120)
    assert killed > 0
    assert "report" in result, "the worker must survive losing its connections"
    delivered = {
        (q, o) for q, o in rows(conn, 'SELECT DISTINCT queue_id, "offset" FROM event_push_delivery')
    }
    assert len(delivered) == 400
    assert committed_everything(conn)


def test_dead_target_opens_the_breaker_and_ages_out_without_hammering(conn, rx):
    setup_runner(conn, rx, "/down", max_attempts=100, backoff_ms=10, max_age_s=3, queues=1)
    publish(conn, "orders", events(300))
    started = time.monotonic()
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert report.failed == 300
    assert time.monotonic() - started < 20
    # The breaker opened: far fewer requests than 300 records x 100 attempts.
    assert rx.state.count["/down"] < 600
    errors = rows(conn, "SELECT DISTINCT split_part(last_error, ';', 1) FROM event_push_failure")
    assert ("target unavailable (circuit open) past max age 3 s",) in errors
    assert committed_everything(conn)


def test_paused_worker_has_no_work_and_a_slice_ends_at_once(conn, rx):
    from eventpush.status import has_work

    setup_runner(conn, rx, "/ok")
    publish(conn, "orders", events(5))
    assert has_work(conn, "w1")
    controls.set_paused(conn, "worker", "w1", True)
    assert not has_work(conn, "w1")
    report = run_worker("w1", until_idle=True, max_seconds=30)
    assert report.delivered == 0 and report.seconds < 10
    controls.set_paused(conn, "worker", "w1", False)
    assert run_worker("w1", until_idle=True, max_seconds=30).delivered == 5


def test_sigterm_lets_in_flight_requests_finish_and_commits(conn, rx, cli):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    setup_runner(conn, rx, "/slow?ms=1500", concurrency=8, queues=1)
    publish(conn, "orders", events(8))
    exe = str(Path(sys.executable).with_name("eventpush"))
    proc = subprocess.Popen([exe, "worker", "run", "w1", "--max-seconds", "60"])
    deadline = time.monotonic() + 20
    while rx.state.count["/slow"] < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # all 8 requests are in flight, 1.5 s each
    assert proc.wait(20) == 0
    assert rows(conn, "SELECT count(*) FROM event_push_delivery") == [(8,)]
    assert committed_everything(conn)
    [(pid,)] = rows(conn, "SELECT pid FROM event_push_worker")
    assert pid is None, "the lease is released"


def test_a_running_worker_picks_up_a_new_assignment_without_restart(conn, rx, db_url):
    """The runner moved as a rebalance's SQL would, but with no notification: the worker's
    periodic read (every 2 s) finds it."""
    setup_runner(conn, rx, "/ok/a")
    catalog.create_worker(conn, "w2")
    with RunningWorker("w2", db_url) as worker:
        publish(conn, "orders", events(10))
        time.sleep(1.0)
        assert rx.state.count["/ok/a"] == 0, "w2 has no runner yet"
        with conn.cursor() as cur:  # what a rebalance applies: the runner moves to w2
            cur.execute(
                "UPDATE event_target_runner SET worker_id = "
                "(SELECT id FROM event_push_worker WHERE name = 'w2'), generation = generation + 1"
            )
        conn.commit()
        wait_until(lambda: rx.state.count["/ok/a"] == 10, timeout=6, what="the moved runner")
        wait_until(lambda: committed_everything(conn), what="its offsets committed")
    assert worker.engine.report.delivered == 10
