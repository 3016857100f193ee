"""Fault injection against the push engine: real PostgreSQL, real loopback receivers, real
worker processes killed for real.

Database faults are made for real: a statement trigger on ``event_push_delivery`` raises a
chosen SQLSTATE (or sleeps) while a row in ``fault`` says so; a read-only failover is the
database set ``default_transaction_read_only`` with every worker backend terminated. After
each fault the audit is the same: every matching event delivered or in
``event_push_failure``, duplicates within what was in flight, peak RSS under 300 MiB.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from ports import free_port

from eventpush import catalog
from eventpush.demo.receiver import Receiver, ReceiverProcess
from eventpush.publish import publish
from eventpush.push import controls, run_worker
from eventpush.push.cursor import UNCOMMITTED_SPANS
from eventpush.sinks.contract import record_key

EXE = str(Path(sys.executable).with_name("eventpush"))
RSS_CEILING = 300 * 2**20
SPAN = 100  # the workers' buffer_span here: it bounds what a fault can leave in flight

FAULT_SQL = """
CREATE TABLE fault (code text, sleep_s float);
CREATE FUNCTION fault_inject() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    f record;
BEGIN
    FOR f IN SELECT code, sleep_s FROM fault LOOP
        IF f.sleep_s IS NOT NULL THEN
            PERFORM pg_sleep(f.sleep_s);
        END IF;
        IF f.code IS NOT NULL THEN
            RAISE EXCEPTION 'injected fault %', f.code USING ERRCODE = f.code;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
CREATE TRIGGER fault_inject BEFORE INSERT ON event_push_delivery
    FOR EACH STATEMENT EXECUTE FUNCTION fault_inject();
"""


def events(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps({"source": "shop", "detail-type": "Order", "detail": {"n": i}})
        for i in range(start, start + n)
    ]


def sql(conn, statement: str, *params):
    with conn.cursor() as cur:
        cur.execute(statement, params or None)
        out = cur.fetchall() if cur.description else None
    conn.commit()
    return out


def set_fault(conn, code: str | None = None, sleep_s: float | None = None) -> None:
    sql(conn, "DELETE FROM fault")
    if code or sleep_s:
        sql(conn, "INSERT INTO fault VALUES (%s, %s)", code, sleep_s)


def setup(conn, rx, path: str, *, queues: int = 2, workers=("w1",), **spec) -> None:
    catalog.create_bus(conn, "orders", queues)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_target(
        conn, "orders", "r", catalog.TargetSpec(name="t", url=rx.url + path, **spec)
    )
    for name in workers:
        catalog.create_worker(conn, name)
        controls.adjust(conn, "worker", name, {"buffer_span": SPAN})
    catalog.assign(conn)
    sql(conn, FAULT_SQL)


class Worker:
    """``eventpush worker run`` in a process of its own, its peak RSS watched."""

    def __init__(self, name: str = "w1", *args: str) -> None:
        self.proc = subprocess.Popen(
            [EXE, "worker", "run", name, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.peak = 0
        self.watch = threading.Thread(target=self._watch, daemon=True)
        self.watch.start()
        # Read both pipes as the worker writes: a full pipe would block its logging, and so
        # the worker, which a test would then take for an engine stall.
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._drain, args=(pipe, sink), daemon=True)
            for pipe, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _drain(pipe, sink: list[str]) -> None:
        for line in pipe:
            sink.append(line)

    def _collected(self, timeout: float) -> tuple[str, str]:
        self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(5)
        return "".join(self.out), "".join(self.err)

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited {self.proc.returncode}"
        return f"{self.proc.args[3]} {state}; stderr tail: {''.join(self.err[-5:])!r}"

    def _watch(self) -> None:
        try:
            proc = psutil.Process(self.proc.pid)
            while self.proc.poll() is None:
                self.peak = max(self.peak, proc.memory_info().rss)
                time.sleep(0.05)
        except psutil.NoSuchProcess:
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self._collected(timeout)
        return self.proc.returncode, err

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        out, err = self._collected(timeout)
        self.watch.join(1)
        return self.proc.returncode, out, err


def wait_until(predicate, timeout: float, what: str, workers=()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            states = "; ".join(w.describe() for w in workers)
            raise AssertionError(
                f"timed out waiting for {what}" + (f" ({states})" if states else "")
            )
        time.sleep(0.05)


def audit(conn) -> tuple[int, int]:
    """(missing, duplicates) over every event and the one runner, which matches them all."""
    [(missing, duplicates)] = sql(
        conn,
        "SELECT count(*) FILTER (WHERE d = 0 AND NOT f), coalesce(sum(greatest(d - 1, 0)), 0) "
        'FROM (SELECT e.queue_id, e."offset", '
        "  (SELECT count(*) FROM event_push_delivery x WHERE x.queue_id = e.queue_id "
        '     AND x."offset" = e."offset") AS d, '
        "  EXISTS (SELECT 1 FROM event_push_failure x WHERE x.queue_id = e.queue_id "
        '     AND x."offset" = e."offset") AS f '
        "  FROM bus_event e) s",
    )
    return missing, duplicates


def lag(conn) -> int:
    [(value,)] = sql(
        conn,
        'SELECT coalesce(sum(q.next_offset - o."offset"), 0) FROM event_push_offset o '
        "JOIN event_bus_queue q ON q.queue_id = o.queue_id",
    )
    return value


def delivered_rows(conn) -> int:
    return sql(conn, "SELECT count(*) FROM event_push_delivery")[0][0]


def test_commits_failing_with_several_sqlstates_then_sigkill_lose_nothing(conn):
    """Inserts into the delivery log fail for 3.2 s (read-only, serialization, admin
    shutdown, deadlock): the worker waits them out, stops taking new work, and a SIGKILL
    soon after the database heals duplicates no more than what was in flight."""
    n = 5000
    with Receiver(keep_bodies=False) as rx:
        setup(conn, rx, "/slow?ms=4", concurrency=8)
        publish(conn, "orders", events(n))
        worker = Worker("w1", "--max-seconds", "60")
        wait_until(lambda: delivered_rows(conn) >= 200, 30, "first commits")
        sent_before = rx.state.count["/slow"]
        for code in ("25006", "40001", "57P01", "40P01"):
            set_fault(conn, code)
            time.sleep(0.8)
        sent_during = rx.state.count["/slow"] - sent_before
        assert worker.alive(), worker.describe()
        rows_before = delivered_rows(conn)
        set_fault(conn)
        wait_until(lambda: delivered_rows(conn) > rows_before, 15, "commits to resume")
        time.sleep(0.3)
        worker.kill()
        assert worker.peak < RSS_CEILING
        final = Worker("w1", "--until-idle", "--max-seconds", "90", "--json")
        code, out, err = final.finish(120)
        assert code == 0, err
        assert final.peak < RSS_CEILING
    in_flight_bound = 2 * UNCOMMITTED_SPANS * SPAN  # two queues
    # Backpressure on what is committed: while nothing could commit, the worker sent at most
    # what its uncommitted window allows (plus the sends already under way).
    assert sent_during <= in_flight_bound + 8, sent_during
    missing, duplicates = audit(conn)
    assert missing == 0
    assert duplicates <= in_flight_bound
    assert lag(conn) == 0


def test_read_only_failover_is_waited_out_without_a_duplicate(conn, db_url):
    """The database turns read-only for 2.5 s and every worker connection is cut (as a
    failover to a standby does): every commit fails with 25006 until it is writable again.
    No kill, so not a single duplicate: no lost commit is ever repeated."""
    n = 3000
    dbname = db_url.rsplit("/", 1)[1]
    with Receiver(keep_bodies=False) as rx:
        setup(conn, rx, "/slow?ms=3", concurrency=8)
        publish(conn, "orders", events(n))
        worker = Worker("w1", "--max-seconds", "60")
        wait_until(lambda: delivered_rows(conn) >= 200, 30, "first commits")
        try:
            sql(conn, f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
            sql(
                conn,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s AND application_name = 'eventpush'",
                dbname,
            )
            time.sleep(2.5)
            assert worker.alive()
        finally:
            sql(conn, f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        wait_until(lambda: lag(conn) == 0, 60, "everything committed")
        code, err = worker.stop()
        assert code == 0, err
        assert worker.peak < RSS_CEILING
    assert audit(conn) == (0, 0)
    [(total,)] = sql(conn, "SELECT delivered_total FROM event_target_runner")
    assert total == n


def test_shutdown_during_a_slow_commit_commits_once(conn):
    """SIGTERM while a commit hangs in the database for longer than shutdown waits for it:
    the committer is cancelled with its thread still committing, and the final commit looks
    that transaction up instead of writing the same rows again."""
    n = 60
    with Receiver(keep_bodies=False) as rx:
        setup(conn, rx, "/ok", concurrency=4)
        set_fault(conn, sleep_s=6.5)
        publish(conn, "orders", events(n))
        worker = Worker("w1", "--max-seconds", "60")
        wait_until(lambda: rx.state.count["/ok"] >= n, 30, "every event sent")
        time.sleep(0.5)  # a commit is now asleep in the trigger
        set_fault(conn)
        code, err = worker.stop(timeout=60)
        assert code == 0, err
    assert "a commit whose reply was lost had committed; not repeated" in err
    assert delivered_rows(conn) == n
    assert audit(conn) == (0, 0)
    [(total,)] = sql(conn, "SELECT delivered_total FROM event_target_runner")
    assert total == n, "counters are not doubled either"
    assert lag(conn) == 0


def test_a_runner_moved_between_running_workers_has_one_sender_per_queue(conn):
    """Under load, an ordered target's runner moves w1 -> w2 -> w1 while both run: the
    target sees one in-order sequence per queue (a restart at each hand-off, never two
    senders interleaving), and nothing is missing."""
    n = 3000
    with Receiver() as rx:
        setup(conn, rx, "/slow?ms=2", ordered=True, workers=("w1", "w2"))
        publish(conn, "orders", events(n))
        ids = dict(sql(conn, "SELECT name, id FROM event_push_worker"))
        sql(conn, "UPDATE event_target_runner SET worker_id = %s", ids["w1"])
        workers = [Worker(name, "--max-seconds", "60") for name in ("w1", "w2")]
        for to, at in (("w2", 150), ("w1", 600)):
            wait_until(lambda at=at: rx.state.count["/slow"] >= at, 30, f"{at} sends", workers)
            sql(
                conn,
                "UPDATE event_target_runner SET worker_id = %s, generation = generation + 1",
                ids[to],
            )
        wait_until(lambda: lag(conn) == 0, 60, "everything committed", workers)
        for w in workers:
            assert w.alive()
            code, err = w.stop()
            assert code == 0, err
            assert w.peak < RSS_CEILING
        arrivals = [r.headers["webhook-id"] for r in sorted(rx.state.requests, key=lambda r: r.at)]
    where = {
        record_key(rid, q, o): (q, o)
        for rid, q, o in sql(
            conn, 'SELECT r.id, queue_id, "offset" FROM bus_event CROSS JOIN event_target_runner r'
        )
    }
    for queue in (0, 1):
        offsets = [where[h][1] for h in arrivals if where[h][0] == queue]
        restarts = sum(1 for a, b in zip(offsets, offsets[1:], strict=False) if b <= a)
        assert restarts <= 2, f"queue {queue}: {restarts} steps back: two senders interleaved"
        assert set(offsets) == {o for q, o in where.values() if q == queue}
    missing, duplicates = audit(conn)
    assert missing == 0
    assert duplicates <= 2 * 2 * UNCOMMITTED_SPANS * SPAN  # two hand-offs, two queues


def test_a_hand_off_whose_tasks_will_not_stop_stops_the_worker_loudly(conn, monkeypatch):
    """A moved runner's task that outlives its cancel (as one did through Python 3.11's
    ``wait_for``) would hold the runner's claim for good, the next worker waiting silently:
    the worker stops instead, naming the task, and its claims go with its connection."""
    import asyncio
    import contextlib

    from eventpush.push import engine, lanes, store

    async def swallows_one_cancel() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # the fault, on purpose
            await asyncio.sleep(3600)
        await asyncio.sleep(3600)  # the loop's own cancel at exit ends it

    start = lanes.Lanes.start

    def start_with_a_stubborn_task(self, runner) -> None:
        start(self, runner)
        runner.tasks.append(self.spawn(swallows_one_cancel(), "stubborn task"))

    monkeypatch.setattr(lanes.Lanes, "start", start_with_a_stubborn_task)
    monkeypatch.setattr(engine, "HAND_OFF_GIVE_UP_S", 1.0)
    with Receiver() as rx:
        setup(conn, rx, "/ok", workers=("w1", "w2"))
        publish(conn, "orders", events(20))
        sql(
            conn,
            "UPDATE event_target_runner SET worker_id = (SELECT min(id) FROM event_push_worker)",
        )
        move = threading.Timer(
            1.0, sql, (conn, "UPDATE event_target_runner SET generation = generation + 1")
        )
        move.start()
        began = time.monotonic()
        try:
            with pytest.raises(engine.WorkerFailedError) as failed:
                run_worker("w1", max_seconds=30)
        finally:
            move.join()
    assert "hand-off stuck: stubborn task still running 1 s after being cancelled" in str(
        failed.value
    )
    assert time.monotonic() - began < 15, "stopped at once, not at the end of its budget"

    def claims() -> int:
        [(n,)] = sql(
            conn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            store.RUNNER_NAMESPACE,
        )
        return n

    # The worker closed its connections as it stopped; the server ends their backends (and
    # lets go of their locks) a moment later, longer on a loaded machine: a claim the worker
    # kept would stay past the wait.
    wait_until(lambda: claims() == 0, 5.0, "the runner's claim to go with the stopped worker")


def test_start_up_with_a_slow_database_starts_each_runner_once(conn, db_url):
    """The assignment read is held up longer than the control interval at start-up: the
    controller must not race the first refresh into a second copy of the runner."""
    import psycopg2

    n = 300
    with Receiver() as rx:
        setup(conn, rx, "/ok", queues=2)
        publish(conn, "orders", events(n))
        blocker = psycopg2.connect(db_url)
        with blocker.cursor() as cur:
            cur.execute("LOCK TABLE event_target_runner IN ACCESS EXCLUSIVE MODE")
        timer = threading.Timer(3.0, blocker.rollback)
        timer.start()
        try:
            report = run_worker("w1", until_idle=True, max_seconds=60)
        finally:
            timer.join()
            blocker.close()
        ids = [r.headers["webhook-id"] for r in rx.state.requests]
    assert report.delivered == n
    assert len(ids) == len(set(ids)) == n, "every event pushed exactly once"
    assert audit(conn) == (0, 0)


@pytest.mark.parametrize("after", ["nan", "-inf", "-5", "soon"])
@pytest.mark.parametrize("ordered", [False, True])
def test_a_retry_after_that_is_no_number_never_freezes_a_runner(conn, after, ordered):
    """429 with a Retry-After of NaN, infinity, a negative or garbage: the engine's retry
    heap and sleeps only ever see finite delays, so every event is delivered."""
    n = 40
    with Receiver() as rx:
        setup(conn, rx, f"/ratelimit?after={after}", backoff_ms=20, ordered=ordered)
        publish(conn, "orders", events(n))
        report = run_worker("w1", until_idle=True, max_seconds=30)
    assert (report.delivered, report.failed) == (n, 0)
    assert audit(conn) == (0, 0)


def test_an_error_no_retry_can_mend_stops_the_worker_loudly(conn):
    """A control row written by hand that the engine cannot read stops the worker with a
    one-line reason and a non-zero exit, instead of a task dying silently."""
    with Receiver() as rx:
        setup(conn, rx, "/ok")
        sql(
            conn,
            "INSERT INTO event_runtime_control (scope, name, key, value) "
            "VALUES ('runner', 'orders/r/t', 'lane_limit', '\"lots\"')",
        )
        worker = Worker("w1", "--max-seconds", "30")
        code, out, err = worker.finish(60)
    assert code == 3
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "orders/r/t: control lane_limit must be a positive integer, got 'lots'" in lines[0]


def test_a_dispatcher_sleeps_while_its_half_open_probe_hangs(conn):
    """A dead target opens the breaker; its probe then hangs for seconds. The dispatcher must
    sleep until the probe's outcome, not wake every millisecond: the worker's CPU time over
    that stretch stays near nothing (0.01 s here; a 1 ms wake loop spent 0.19 s)."""
    # The receiver runs in a process of its own: dozens of hanging handlers torn down in this
    # process's interpreter trip a CPython 3.11.7 bug (AST recursion depth mismatch).
    with ReceiverProcess(free_port()) as rx:
        setup(conn, rx, "/hang", timeout_ms=3000, concurrency=20, max_attempts=100, queues=1)
        publish(conn, "orders", events(60))
        worker = Worker("w1", "--max-seconds", "12")

        def count(rx) -> int:
            return rx.stats()["count"].get("/hang", 0)

        wait_until(lambda: count(rx) >= 20, 15, "the first attempts")
        # They time out after 3 s and open the breaker; 1 s later one probe goes out and
        # hangs another 3 s.
        time.sleep(3.0 + 1.0 + 0.4)
        proc = psutil.Process(worker.proc.pid)

        def cpu() -> float:
            times = proc.cpu_times()
            return times.user + times.system

        sent, before = count(rx), cpu()
        time.sleep(2.0)
        spent, sent = cpu() - before, count(rx) - sent
        code, _, err = worker.finish(60)
    assert code == 0, err
    assert sent <= 1, "while the breaker is open, one probe at a time"
    assert spent < 0.08, f"the worker spent {spent:.2f} s of CPU while its probe hung"


def test_a_receiver_process_stops_when_what_started_it_is_killed():
    """A test or benchmark killed (SIGKILL, a CI timeout) runs no clean-up: its receiver
    process must not keep running, and its port, for good."""
    code = (
        "import time\n"
        "from eventpush.demo.receiver import ReceiverProcess\n"
        "rx = ReceiverProcess()\n"
        "print(rx.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    receiver = psutil.Process(int(parent.stdout.readline()))
    assert receiver.is_running()
    parent.kill()
    parent.wait()
    receiver.wait(timeout=10)  # psutil.TimeoutExpired while it still runs
