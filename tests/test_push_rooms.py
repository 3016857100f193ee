"""The engine's rooms one at a time: the breaker's epochs, finite delays, the bounded window
cache, outcome rows, cursors, fencing and runner claims in the real database, and the target
policy defaults defined once."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import psycopg2
import pytest
import uvloop

from eventpush import catalog, db
from eventpush.backoff import finite
from eventpush.errors import CatalogError
from eventpush.policy import DEFAULTS, LIMITS, SCHEME_DEFAULTS
from eventpush.push import store
from eventpush.push.committing import outcome_rows
from eventpush.push.cursor import UNCOMMITTED_SPANS, QueueCursor
from eventpush.push.engine import WorkerReport
from eventpush.push.lanes import MAX_RETRY_DELAY_S, Lanes, Runner, retry_delay, wait_for_event
from eventpush.push.limits import CircuitBreaker, Limiter
from eventpush.push.reading import WINDOW, WindowCache
from eventpush.sinks import contract
from eventpush.sinks.contract import Outcome, Record, Target
from eventpush.sources import Chunk

TARGET = Target(1, "orders/r/t", "orders", 1, "r", "{}", "t", "http://127.0.0.1:9/x")


def opened(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.recent.maxlen):
        breaker.record(breaker.admit(), reached=True, failed=True)
    assert breaker.is_open


def test_outcomes_of_requests_sent_before_the_breaker_opened_do_not_count():
    breaker = CircuitBreaker(cooldown=0.0)
    early = [breaker.admit() for _ in range(5)]  # sent while closed, answered late
    opened(breaker)
    cooldown = breaker.cooldown
    for granted in early:
        breaker.record(granted, reached=True, failed=False)
    assert breaker.is_open, "a late success from before the opening must not close it"
    for granted in early:
        breaker.record(granted, reached=True, failed=True)
    assert breaker.cooldown == cooldown, "nor may late failures stretch the cool-down"
    probe = breaker.admit()
    assert probe is not None and probe.probe
    assert breaker.admit() is None, "one probe at a time"
    breaker.record(probe, reached=True, failed=False)
    assert not breaker.is_open


def test_outcomes_that_never_reached_the_target_count_for_nothing():
    breaker = CircuitBreaker(cooldown=0.0)
    opened(breaker)
    probe = breaker.admit()
    breaker.record(probe, reached=False, failed=False)  # transform failed, address refused
    assert breaker.is_open, "a request that never left is no sign of health"
    assert breaker.admit() is not None, "but the probe's turn is handed back"
    closed = CircuitBreaker()
    for _ in range(100):
        closed.record(closed.admit(), reached=False, failed=False)
    assert len(closed.recent) == 0


def test_while_a_probe_is_out_the_breaker_names_no_wait():
    breaker = CircuitBreaker(cooldown=0.0)
    opened(breaker)
    assert breaker.wait_s() == 0.0
    breaker.admit()
    assert breaker.wait_s() is None, "a waiter must sleep until the probe's outcome"


def test_a_batch_the_breaker_refuses_holds_no_slot():
    lanes = Lanes(WorkerReport("w"), None, None, None, None, None)
    target = dataclasses.replace(TARGET, pattern='{"source": ["a"]}')
    runner = Runner(target, {0: 0}, ("ACTIVE", 1, {}))
    runner.fresh.append(Record(0, 0, "m0", {}, "{}"))
    opened(runner.breaker)  # cooling down: no probe yet
    assert lanes._take(runner) is None
    assert (runner.limiter.in_use, lanes.pool.in_use, len(runner.fresh)) == (0, 0, 1)
    runner.breaker = CircuitBreaker()
    assert lanes._take(runner) is not None
    assert (runner.limiter.in_use, lanes.pool.in_use, len(runner.fresh)) == (1, 1, 0)


def test_a_released_slot_wakes_a_waiter_and_says_whether_the_limiter_was_full():
    async def main() -> None:
        limiter = Limiter(2)
        assert limiter.try_acquire() and limiter.try_acquire() and not limiter.try_acquire()
        waiter = asyncio.create_task(limiter.changed(10.0))
        await asyncio.sleep(0)  # the task now waits
        assert limiter.release() is True, "it was full: others may be waiting for the slot"
        done, _ = await asyncio.wait([waiter], timeout=1.0)
        assert done, "a waiter is woken by a release, not by its timeout"
        assert limiter.release() is False

    uvloop.run(main())


@pytest.mark.parametrize("after", [math.nan, math.inf, -math.inf, -5.0, 1e300])
def test_retry_delays_are_always_finite_and_bounded(after):
    delay = retry_delay(TARGET, 1, after)
    assert math.isfinite(delay) and 0.0 <= delay <= MAX_RETRY_DELAY_S
    assert finite(math.nan, 0.5) == 0.5 and finite(math.inf, 0.5) == 0.5
    assert finite(-1.0, 0.5) == 0.0 and finite(1e9, 0.5, high=10.0) == 10.0


def test_one_function_builds_delivery_and_failure_rows():
    batch = [Record(0, 7, "m7", {}, "{}", attempts=2), Record(1, 9, "m9", {}, "{}", attempts=2)]
    [d, _] = outcome_rows(TARGET, batch, Outcome(contract.DELIVERED, 200, None, 12.5))
    assert d == store.DeliveryRow(1, "orders/r/t", "orders", 0, 7, "m7", 2, 200, 12.5)
    [_, f] = outcome_rows(TARGET, batch, Outcome(contract.FINAL, 410, "HTTP 410", 1.0))
    assert f == store.FailureRow(1, "orders/r/t", "orders", 1, 9, "m9", 2, 410, "HTTP 410")


def test_pulled_never_goes_backwards_and_uncommitted_work_stops_pulling():
    cursor = QueueCursor(0, 100)
    cursor.advance(150)
    cursor.advance(120)
    assert cursor.pulled == 150
    span = 20
    cursor.advance(100 + UNCOMMITTED_SPANS * span - 1)
    assert not cursor.over(1000, 1 << 30, span)
    cursor.advance(100 + UNCOMMITTED_SPANS * span)
    assert cursor.over(1000, 1 << 30, span), "nothing in flight, but nothing committed either"
    cursor.committed_db = cursor.pulled
    assert not cursor.over(1000, 1 << 30, span)


def test_the_window_cache_stays_within_its_byte_budget():
    body = "x" * 1000

    async def read(bus_id, queue_id, start, stop):
        return Chunk([(o, f"m{o}", f'"{body}"') for o in range(start, stop)], stop)

    class Index:
        def matching(self, event):
            return []

    async def walk() -> WindowCache:
        cache = WindowCache(read, lambda bus_id: Index(), max_bytes=3 * WINDOW * 1002)
        for queue in range(4):
            for pos in range(0, 20 * WINDOW, WINDOW):
                events = await cache.events_from(1, queue, pos)
                assert events[0].offset == pos and len(events) == WINDOW
                assert cache.bytes <= cache.max_bytes
        return cache

    cache = asyncio.run(walk())
    assert cache.bytes == sum(w.size for w in cache.windows.values())
    assert len(cache.windows) <= 3


def test_policy_defaults_are_the_ones_everywhere(conn):
    """Defined once in push/policy.py; the migration's column defaults and CHECK bounds are
    held to the same values here."""
    fields = ("max_attempts", "backoff_ms", "max_age_s", "timeout_ms", "batch_size", "concurrency")
    spec = catalog.TargetSpec(name="t", url="http://127.0.0.1/").resolved()
    for name in fields:
        assert getattr(spec, name) == getattr(DEFAULTS, name)
    # A target made with every default, as the engine loads it back from the database: the
    # defaults went through the catalog, the table and load_targets unchanged.
    rid, _, _ = _runner(conn)
    (loaded,) = store.read_targets(conn, [rid])
    for name in fields:
        assert getattr(loaded, name) == getattr(DEFAULTS, name), name
    with conn.cursor() as cur:
        cur.execute(
            "SELECT column_name, column_default FROM information_schema.columns "
            "WHERE table_name = 'event_target' AND column_name = ANY(%s)",
            (list(fields),),
        )
        columns = dict(cur.fetchall())
        for name in fields:
            assert int(columns[name]) == getattr(DEFAULTS, name), name
            low, high = LIMITS[name]
            cur.execute(
                "SELECT count(*) FROM pg_constraint WHERE conrelid = 'event_target'::regclass "
                "AND pg_get_constraintdef(oid) LIKE %s",
                (f"%({name} >= {low}) AND ({name} <= {high})%",),
            )
            assert cur.fetchone()[0] == 1, f"CHECK bounds of {name}"
    from eventpush.cli.catalog import target_create

    options = {p.name: p.default for p in target_create.params}
    assert options["batch_size"] is None  # left to the URL's kind (TargetSpec.resolved)
    for name in fields:
        if name != "batch_size":
            assert options[name] == getattr(DEFAULTS, name), f"--{name}"
    # A kind with defaults of its own: a JetStream target's batch.
    nats_spec = catalog.TargetSpec(name="t", url="nats://127.0.0.1:4222/out.orders").resolved()
    assert nats_spec.batch_size == SCHEME_DEFAULTS["nats"].batch_size != DEFAULTS.batch_size
    assert catalog.TargetSpec(name="t", url="http://x/", batch_size=3).resolved().batch_size == 3
    # The catalog refuses a value just past each bound (and takes the bound itself).
    made = 0
    for name, (low, high) in LIMITS.items():
        option = "--" + name.replace("_", "-")
        for value, ok in ((low - 1, False), (low, True), (high, True), (high + 1, False)):
            made += 1
            base = catalog.TargetSpec(name=f"bound{made}", url="http://127.0.0.1/")
            spec = dataclasses.replace(base, **{name: value})
            if ok:
                catalog.create_target(conn, "orders", "r", spec)
            else:
                with pytest.raises(CatalogError, match=f"{option} must be between"):
                    catalog.create_target(conn, "orders", "r", spec)


def _runner(conn) -> tuple[int, int, int]:
    catalog.create_bus(conn, "orders", 1)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_target(
        conn, "orders", "r", catalog.TargetSpec(name="t", url="http://127.0.0.1/")
    )
    catalog.create_worker(conn, "w1")
    catalog.create_worker(conn, "w2")
    catalog.assign(conn)
    with conn.cursor() as cur:
        cur.execute("SELECT r.id, r.worker_id, r.generation FROM event_target_runner r")
        return cur.fetchone()


def test_a_commit_for_a_runner_that_moved_is_refused_whole(conn, db_url):
    rid, wid, gen = _runner(conn)
    lease = psycopg2.connect(db_url)
    try:
        store.take_lease(lease, "w", wid)
        assert store.claim_runners(lease, wid, {rid: gen}) == {rid}
        row = store.DeliveryRow(rid, "orders/r/t", "orders", 0, 0, "m0", 1, 200, 1.0)
        store.commit(lease, wid, store.CommitBatch([row], [], [], {rid: gen}))
        with conn.cursor() as cur:  # a rebalance moves the runner to the other worker
            cur.execute(
                "UPDATE event_target_runner SET worker_id = "
                "(SELECT id FROM event_push_worker WHERE id <> %s), generation = generation + 1",
                (wid,),
            )
        conn.commit()
        batch = store.CommitBatch([row], [], [], {rid: gen})
        with pytest.raises(store.FencedError) as refused:
            store.commit(lease, wid, batch)
        assert refused.value.runner_ids == {rid}
        assert store.commit_status(lease, batch.xid) == "aborted"
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*), max(delivered_total) FROM event_push_delivery, "
                "event_target_runner"
            )
            assert cur.fetchone() == (1, 1)
    finally:
        lease.close()


def test_commits_and_assignment_changes_run_together_without_a_deadlock(conn, db_url):
    """A worker's commit (its runners' rows FOR SHARE, then their counters updated) against
    the catalog moving that very runner (``set_worker_enabled``: the runner table locked,
    then the row updated), both in a loop at once. The commit takes the table's ROW
    EXCLUSIVE lock first, so neither waits for the other while holding what the other
    wants: PostgreSQL never has to abort one as a deadlock."""
    import threading
    import time

    rid, _, _ = _runner(conn)
    wids = dict(rows_of(conn, "SELECT name, id FROM event_push_worker"))
    lease, reader = psycopg2.connect(db_url), psycopg2.connect(db_url)
    errors: list[BaseException] = []
    counts = {"commits": 0, "fenced": 0, "moves": 0}
    stop = threading.Event()

    def commits() -> None:
        offset = 0
        try:
            while not stop.is_set():
                with reader, reader.cursor() as cur:
                    cur.execute(
                        "SELECT worker_id, generation FROM event_target_runner WHERE id = %s",
                        (rid,),
                    )
                    wid, gen = cur.fetchone()
                row = store.DeliveryRow(rid, "orders/r/t", "orders", 0, offset, "m", 1, 200, 1.0)
                offset += 1
                try:
                    store.commit(lease, wid, store.CommitBatch([row], [], [], {rid: gen}))
                    counts["commits"] += 1
                except store.FencedError:
                    counts["fenced"] += 1  # moved between the read and the commit
        except BaseException as exc:
            errors.append(exc)

    def moves() -> None:
        mover = psycopg2.connect(db_url)
        try:
            while not stop.is_set():
                with mover.cursor() as cur:
                    cur.execute(
                        "SELECT w.name FROM event_target_runner r "
                        "JOIN event_push_worker w ON w.id = r.worker_id WHERE r.id = %s",
                        (rid,),
                    )
                    holder = cur.fetchone()[0]
                mover.rollback()
                other = "w2" if holder == "w1" else "w1"
                catalog.set_worker_enabled(mover, other, True)
                assert catalog.set_worker_enabled(mover, holder, False) == 1
                counts["moves"] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            mover.close()

    try:
        for name, wid in wids.items():  # one session holds both workers' leases
            store.take_lease(lease, name, wid)
        threads = [threading.Thread(target=f) for f in (commits, moves)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        lease.close()
        reader.close()
    assert not errors, errors[0]
    assert counts["commits"] > 100 and counts["moves"] > 100, counts
    [(delivered,)] = rows_of(
        conn, "SELECT delivered_total FROM event_target_runner WHERE id = %s", (rid,)
    )
    assert delivered == counts["commits"]


def rows_of(conn, sql: str, params: tuple = ()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        found = cur.fetchall()
    conn.rollback()
    return found


def test_a_runner_is_claimed_by_one_worker_until_let_go(conn, db_url):
    rid, wid, gen = _runner(conn)
    old, new = psycopg2.connect(db_url), psycopg2.connect(db_url)
    try:
        assert store.claim_runners(old, wid, {rid: gen}) == {rid}
        assert store.claim_runners(new, wid, {rid: gen}) == set(), "still held"
        assert store.claim_runners(new, wid, {rid: gen + 1}) == set(), "not at that generation"
        store.release_runners(old, [rid])
        assert store.claim_runners(new, wid, {rid: gen}) == {rid}
    finally:
        old.close()
        new.close()


def test_transient_errors_are_told_by_class(conn):
    """Real errors from the server, raised with each SQLSTATE."""

    with conn.cursor() as cur:
        cur.execute(
            "CREATE FUNCTION pg_temp.fault(code text) RETURNS void LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'fault' USING ERRCODE = code; END $$"
        )
    conn.commit()

    def raised(code: str) -> Exception:
        with conn.cursor() as cur:
            try:
                cur.execute("SELECT pg_temp.fault(%s)", (code,))
            except psycopg2.Error as exc:
                conn.rollback()
                return exc
        raise AssertionError(f"{code} not raised")

    for code in ("25006", "40001", "40P01", "57P01", "08006", "53300"):
        assert db.is_transient(raised(code)), code
    for code in ("23505", "42P01", "22P02"):
        assert not db.is_transient(raised(code)), code
    assert not db.is_transient(ValueError("x"))


def test_the_lease_connection_keeps_alive_and_a_runner_starts_once(conn, db_url):
    """A running engine's lease connection asks for TCP keepalives (a worker cut off from
    the database loses its lease promptly), and each assigned runner has one Runner."""
    import threading
    import time

    from eventpush.push import Engine

    _runner(conn)
    with conn.cursor() as cur:  # both runners' worker: w1 has the one runner
        cur.execute(
            "UPDATE event_target_runner SET worker_id = (SELECT min(id) FROM event_push_worker)"
        )
    conn.commit()
    engine = Engine("w1", db_url, max_seconds=3)
    thread = threading.Thread(target=lambda: asyncio.run(engine.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not getattr(engine, "runners", None) and time.monotonic() < deadline:
        time.sleep(0.05)
    params = engine.lease.conn.get_dsn_parameters()
    assert params["keepalives"] == "1" and int(params["keepalives_idle"]) > 0
    assert len(engine.runners) == 1
    thread.join(15)


async def _stopped_while_woken(wait, wake) -> bool:
    """A task looping on ``wait()`` is cancelled just after ``wake()`` completed its wait,
    before it ran again: whether the cancel stops it."""

    async def loop() -> None:
        while True:
            await wait()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the task now waits
    wake()
    await asyncio.sleep(0)  # the wait inside completes...
    task.cancel()  # ...and the cancel lands before the task wakes to see it
    done, _ = await asyncio.wait([task], timeout=1.0)
    if not done:  # a swallowed cancel: stop it for good before the loop closes
        task.cancel()
        await asyncio.wait([task], timeout=1.0)
    return bool(done) and task.cancelled()


def _event_waiter():
    event = asyncio.Event()

    async def wait() -> None:
        event.clear()  # as the feeders and senders do before they wait
        await wait_for_event(event, 10.0)

    return wait, event.set


def _limiter_waiter():
    limiter = Limiter(1)
    return lambda: limiter.changed(10.0), lambda: limiter.resize(2)


@pytest.mark.parametrize("waiter", [_event_waiter, _limiter_waiter], ids=["event", "limiter"])
def test_a_cancel_that_meets_a_wake_still_stops_the_task(waiter):
    """A hand-off cancels a runner's feeders and senders and waits for them before letting
    go of the runner's claim. Python 3.11's ``asyncio.wait_for`` returns normally when a
    cancel arrives just after its inner wait completed, so a feeder woken by a finished send
    in the same step as the cancel looped on, and the next worker waited for it forever."""

    async def main() -> bool:
        return await _stopped_while_woken(*waiter())

    assert uvloop.run(main())  # the loop the engine runs on
