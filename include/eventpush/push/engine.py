"""The push engine: one worker's runners, from bus queues to HTTP targets.

Shape (docs/ARCHITECTURE.md, "Delivery semantics"):

- **Shared reads.** Events are read per bus queue in aligned windows of ``WINDOW`` offsets,
  parsed once and matched once against every rule of the worker on that bus; each runner
  walks those windows with its own cursor. Windows are cached a few per queue, so runners at
  the same position share one read, and a stalled runner holds no memory but its own lane.
- **Lanes.** Each runner has a bounded lane: a high-priority deque of fresh records and a
  low-priority deque of retry batches (timeouts included), drained ``FRESH_PER_RETRY`` to
  one, so retries never starve fresh events. Sends take a slot of the runner's concurrency
  limit and of the worker's shared pool; a circuit breaker per target stops hammering a
  dead one. Ordered targets get one sequential sender per queue instead.
- **Backpressure.** A runner stops pulling a queue while its in-flight records on it pass a
  count, a byte size or an offset span.
- **Commits.** Every ``COMMIT_INTERVAL_S`` the outcomes gathered so far and the offsets they
  allow are written in one transaction on the lease connection. Outcome buffers are swapped
  and offsets computed in one synchronous step of the event loop, so an offset never runs
  ahead of the rows that justify it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import json
import logging
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psycopg2

from eventpush.config import database_url
from eventpush.db import StoreError, connect
from eventpush.push import delivery, store
from eventpush.push.controls import WorkerSettings, worker_settings
from eventpush.push.cursor import QueueCursor
from eventpush.push.delivery import Outcome, Record, Target
from eventpush.push.limits import CircuitBreaker, Limiter

log = logging.getLogger("eventpush.push")

WINDOW = 256
CACHE_WINDOWS_PER_QUEUE = 8
COMMIT_INTERVAL_S = 0.2
CONTROL_INTERVAL_S = 2.0
HEARTBEAT_INTERVAL_S = 5.0
POLL_INTERVAL_S = 1.0
FRESH_PER_RETRY = 4
READER_CONNECTIONS = 2
STOP_GRACE_S = 10.0


@dataclass
class WorkerReport:
    """What one run of a worker did."""

    worker: str
    read: int = 0
    delivered: int = 0
    failed: int = 0
    filtered: int = 0
    retried: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class BusEvent:
    """An event read from a queue, with the ids of the worker's runners whose rule matches."""

    offset: int
    message_id: str
    raw: str
    event: dict
    size: int
    matches: frozenset


@dataclass
class Window:
    start: int
    stop: int
    end: int  # next offset not yet read into this window
    events: list[BusEvent] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Runner:
    """One rule-target pair being pushed by this worker."""

    def __init__(self, target: Target, offsets: dict[int, int], settings: tuple) -> None:
        from eventpush.rules.patterns import compile_pattern
        from eventpush.rules.transforms import compile_transform

        self.target = target
        self.id = target.runner_id
        self.pattern = compile_pattern(target.pattern)
        self.transform = compile_transform(target.transform_kind, target.transform_spec)
        self.cursors = {qid: QueueCursor(qid, off) for qid, off in sorted(offsets.items())}
        self.fresh: deque[Record] = deque()
        self.retry: deque[list[Record]] = deque()
        self.delayed: list[tuple[float, int, list[Record]]] = []
        self.ordered_lines: dict[int, deque[Record]] = {qid: deque() for qid in self.cursors}
        self.inflight = 0
        self.limiter = Limiter(target.concurrency)
        self.breaker = CircuitBreaker()
        self.wake = asyncio.Event()  # lane or limits changed: the dispatcher looks again
        self.room = asyncio.Event()  # records finished: feeders may pull again
        self.latencies: deque[float] = deque(maxlen=2000)
        self.tasks: list[asyncio.Task] = []
        self.paused = False
        self.lane_limit = 10_000
        self.last_outcome: Outcome | None = None
        self.apply(settings)

    def apply(self, settings: tuple) -> None:
        """Apply (state, generation, controls) as read from the assignment."""
        state, _generation, controls = settings
        self.paused = state == "PAUSED" or bool(controls.get("paused", False))
        self.lane_limit = int(controls.get("lane_limit", 10_000))
        self.limiter.resize(min(int(controls.get("concurrency", self.target.concurrency)), 1024))
        self.wake.set()
        self.room.set()

    def percentiles(self) -> tuple[float | None, float | None]:
        if len(self.latencies) < 2:
            return (self.latencies[0], self.latencies[0]) if self.latencies else (None, None)
        cuts = statistics.quantiles(self.latencies, n=100)
        return cuts[49], cuts[98]

    def idle(self) -> bool:
        return self.paused or (self.inflight == 0 and all(c.at_end for c in self.cursors.values()))


class DbSlot:
    """One database connection, used by one thread at a time, reconnected on failure."""

    def __init__(self, url: str, on_connect: Callable | None = None) -> None:
        self.url = url
        self.on_connect = on_connect
        self.conn = None
        self.lock = asyncio.Lock()

    async def call(self, fn: Callable, *args, give_up_s: float | None = None):
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        delay = 0.1
        async with self.lock:
            while True:
                try:
                    if self.conn is None or self.conn.closed:
                        self.conn = await asyncio.to_thread(connect, self.url)
                        if self.on_connect:
                            await asyncio.to_thread(self.on_connect, self.conn)
                    return await asyncio.to_thread(fn, self.conn, *args)
                except (psycopg2.OperationalError, psycopg2.InterfaceError, StoreError) as exc:
                    self.close()
                    if deadline is not None and time.monotonic() > deadline:
                        raise
                    log.warning("database unavailable (%s); retrying in %.1fs", _line(exc), delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _match(rows: list, index) -> tuple[list[BusEvent], list[int]]:
    """Parse a window's rows and match each once against every rule (runs in a thread)."""
    events, offsets = [], []
    for offset, message_id, raw in rows:
        event = json.loads(raw)
        matches = frozenset(index.matching(event))
        events.append(BusEvent(offset, message_id, raw, event, len(raw), matches))
        offsets.append(offset)
    return events, offsets


class Engine:
    def __init__(
        self,
        worker: str,
        url: str,
        *,
        until_idle: bool = False,
        max_seconds: float | None = None,
        progress: Callable[[dict], None] | None = None,
    ) -> None:
        self.worker = worker
        self.url = url
        self.until_idle = until_idle
        self.max_seconds = max_seconds
        self.progress = progress
        self.report = WorkerReport(worker)
        self.settings = WorkerSettings()
        self.pool = Limiter(self.settings.pool_max)
        self.runners: dict[int, Runner] = {}
        self.retired: list[Runner] = []
        self.windows: dict[tuple[int, int], dict[int, Window]] = {}
        self.indexes: dict[int, object] = {}  # bus id -> RuleIndex of this worker's runners
        self.bus_signals: dict[int, asyncio.Event] = {}
        self.deliveries: list[store.DeliveryRow] = []
        self.failures: list[store.FailureRow] = []
        self.sends: set[asyncio.Task] = set()
        self.paused = False
        self.stopping = asyncio.Event()
        self.fatal: BaseException | None = None
        self.seq = itertools.count()
        self.wid = 0
        self.readers: asyncio.Queue[DbSlot] = asyncio.Queue()

    # --- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()

    async def run(self) -> WorkerReport:
        started = time.monotonic()
        boot = await asyncio.to_thread(connect, self.url)
        try:
            self.wid = await asyncio.to_thread(store.worker_id, boot, self.worker)
        finally:
            boot.close()
        self.lease = DbSlot(self.url, lambda c: store.take_lease(c, self.worker, self.wid))
        await self.lease.call(lambda c: None, give_up_s=0)  # take the lease now or fail
        self.aux = DbSlot(self.url)
        for _ in range(READER_CONNECTIONS):
            self.readers.put_nowait(DbSlot(self.url))
        self.session = delivery.new_session()
        background = [
            asyncio.create_task(self._committer(), name="committer"),
            asyncio.create_task(self._controller(), name="controller"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._listener(), name="listener"),
        ]
        try:
            await self._refresh()
            await self._supervise(started)
        finally:
            await self._shutdown(background)
            self.report.seconds = round(time.monotonic() - started, 3)
        if self.fatal is not None:
            raise self.fatal
        return self.report

    async def _supervise(self, started: float) -> None:
        last_progress = 0.0
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.05)
            now = time.monotonic()
            if self.max_seconds is not None and now - started >= self.max_seconds:
                break
            if self.until_idle and self._idle():
                break
            if self.progress and now - last_progress >= 1.0:
                last_progress = now
                self.progress(self.report.as_dict())

    def _idle(self) -> bool:
        if self.deliveries or self.failures:
            return False
        if self.paused:
            return True  # nothing will move until the worker is resumed
        for runner in self.runners.values():
            if not runner.idle():
                return False
            if not runner.paused and any(
                c.committable() != c.committed_db for c in runner.cursors.values()
            ):
                return False
        return True

    async def _shutdown(self, background: list[asyncio.Task]) -> None:
        self.stopping.set()
        for runner in list(self.runners.values()):
            self._retire(runner)
        if self.sends:
            longest_s = max((r.target.timeout_ms for r in self.retired), default=0) / 1000
            _, pending = await asyncio.wait(self.sends, timeout=min(STOP_GRACE_S, longest_s) + 0.5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self.fatal is None:
            try:
                await self._commit(give_up_s=30.0)
            except Exception as exc:  # the rows are lost from memory, never the events
                log.error(
                    "final commit failed (%s): uncommitted records will be redelivered", _line(exc)
                )
        await self.session.close()
        if self.lease.conn is not None and not self.lease.conn.closed and self.fatal is None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(store.release_lease, self.lease.conn, self.wid)
        for slot in [self.lease, self.aux, *self._drain_readers()]:
            slot.close()

    def _drain_readers(self) -> list[DbSlot]:
        slots = []
        while not self.readers.empty():
            slots.append(self.readers.get_nowait())
        return slots

    # --- assignment and controls ----------------------------------------------------------

    async def _controller(self) -> None:
        while True:
            await asyncio.sleep(CONTROL_INTERVAL_S)
            try:
                await self._refresh()
            except Exception as exc:
                log.exception("control refresh failed: %s", _line(exc))

    async def _refresh(self) -> None:
        assigned, controls = await self.aux.call(store.read_assignment, self.wid, self.worker)
        self.paused = bool(controls.get("paused", False))
        settings = worker_settings(controls)
        if settings != self.settings:
            self.settings = settings
            self.pool.resize(settings.pool_max)
            self._wake_all()
        for rid in [rid for rid in self.runners if rid not in assigned]:
            log.info(
                "runner %s moved away from worker %s", self.runners[rid].target.runner, self.worker
            )
            runner = self.runners.pop(rid)
            self._retire(runner)
            self._forget_bus(runner.target.bus_id)
        new = [rid for rid in assigned if rid not in self.runners]
        if new:
            targets = await self.aux.call(store.read_targets, new)
            offsets = await self.aux.call(store.read_offsets, new)
            for target in targets:
                runner = Runner(
                    target, offsets.get(target.runner_id, {}), assigned[target.runner_id]
                )
                self.runners[runner.id] = runner
                self._forget_bus(target.bus_id)
                self._start(runner)
        for rid, settings_row in assigned.items():
            if rid in self.runners:
                self.runners[rid].apply(settings_row)

    def _start(self, runner: Runner) -> None:
        for cursor in runner.cursors.values():
            runner.tasks.append(asyncio.create_task(self._feed(runner, cursor)))
            if runner.target.ordered:
                runner.tasks.append(asyncio.create_task(self._ordered(runner, cursor.queue_id)))
        if not runner.target.ordered:
            runner.tasks.append(asyncio.create_task(self._dispatch(runner)))

    def _forget_bus(self, bus_id: int) -> None:
        """The bus's runners changed: cached matches are stale."""
        self.windows = {k: v for k, v in self.windows.items() if k[0] != bus_id}
        self.indexes.pop(bus_id, None)

    def _retire(self, runner: Runner) -> None:
        """Stop pulling and sending for a runner; what is unfinished stays uncommitted."""
        for task in runner.tasks:
            task.cancel()
        runner.fresh.clear()
        runner.retry.clear()
        runner.delayed.clear()
        for line in runner.ordered_lines.values():
            line.clear()
        self.retired.append(runner)

    def _wake_all(self) -> None:
        for runner in self.runners.values():
            runner.wake.set()
            runner.room.set()

    # --- reading --------------------------------------------------------------------------

    def _rules(self, bus_id: int):
        from eventpush.rules.patterns import RuleIndex

        index = self.indexes.get(bus_id)
        if index is None:
            index = self.indexes[bus_id] = RuleIndex(
                (r.id, r.pattern) for r in self.runners.values() if r.target.bus_id == bus_id
            )
        return index

    async def _events_from(self, bus_id: int, queue_id: int, pos: int) -> list[BusEvent]:
        """Events at offsets >= pos in pos's window, reading what the cache lacks."""
        start = pos - pos % WINDOW
        cache = self.windows.setdefault((bus_id, queue_id), {})
        window = cache.get(start)
        if window is None:
            window = cache[start] = Window(start, start + WINDOW, start)
            while len(cache) > CACHE_WINDOWS_PER_QUEUE:
                del cache[min(k for k in cache if k != start)]
        async with window.lock:
            # A window always holds [start, end): read from where it ends, never from pos,
            # so a runner behind another on the same window finds every offset it needs.
            if window.end <= pos:
                rows = await self._read(bus_id, queue_id, window.end, window.stop)
                if rows:
                    events, offsets = await asyncio.to_thread(_match, rows, self._rules(bus_id))
                    window.events.extend(events)
                    window.offsets.extend(offsets)
                    window.end = offsets[-1] + 1
        i = bisect.bisect_left(window.offsets, pos)
        return window.events[i:]

    async def _read(self, bus_id: int, queue_id: int, start: int, stop: int) -> list:
        slot = await self.readers.get()
        try:
            return await slot.call(store.read_window, bus_id, queue_id, start, stop)
        finally:
            self.readers.put_nowait(slot)

    def _bus_signal(self, bus_id: int) -> asyncio.Event:
        event = self.bus_signals.get(bus_id)
        if event is None or event.is_set():
            event = self.bus_signals[bus_id] = asyncio.Event()
        return event

    async def _listener(self) -> None:
        """LISTEN for publishes so feeders at the end of a queue wake at once (polling is
        the fallback when the listener is down)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn = await asyncio.to_thread(store.listen, self.url)
            except Exception:
                await asyncio.sleep(2.0)
                continue
            broken = asyncio.Event()

            def on_readable(conn=conn, broken=broken) -> None:
                try:
                    conn.poll()
                except Exception:
                    broken.set()
                    return
                for note in conn.notifies:
                    with contextlib.suppress(ValueError):
                        event = self.bus_signals.get(int(note.payload))
                        if event is not None:
                            event.set()
                conn.notifies.clear()

            loop.add_reader(conn.fileno(), on_readable)
            try:
                await broken.wait()
            finally:
                loop.remove_reader(conn.fileno())
                with contextlib.suppress(Exception):
                    conn.close()

    async def _feed(self, runner: Runner, cursor: QueueCursor) -> None:
        """Pull one queue for one runner into its lane, within the backpressure bounds."""
        bus_id = runner.target.bus_id
        ordered_line = runner.ordered_lines[cursor.queue_id] if runner.target.ordered else None
        while True:
            s = self.settings
            if runner.paused or self.paused:
                runner.room.clear()
                await _wait(runner.room, 0.5)
                continue
            if cursor.over(s.buffer_records, s.buffer_bytes, s.buffer_span) or (
                runner.inflight >= runner.lane_limit
            ):
                runner.room.clear()
                await _wait(runner.room, 1.0)
                continue
            signal_ = self._bus_signal(bus_id)
            events = await self._events_from(bus_id, cursor.queue_id, cursor.pulled)
            if not events:
                cursor.at_end = True
                await _wait(signal_, POLL_INTERVAL_S)
                continue
            cursor.at_end = False
            taken = 0
            pulled_at = time.monotonic()  # a record's age (max_age_s) counts from here
            for ev in events:
                if cursor.over(s.buffer_records, s.buffer_bytes, s.buffer_span):
                    break
                if runner.id in ev.matches:
                    cursor.take(ev.offset, ev.size)
                    record = Record(
                        cursor.queue_id, ev.offset, ev.message_id, ev.event, ev.raw, pulled_at
                    )
                    if ordered_line is None:
                        runner.fresh.append(record)
                    else:
                        ordered_line.append(record)
                    runner.inflight += 1
                    taken += 1
                else:
                    self.report.filtered += 1
                self.report.read += 1
                cursor.pulled = ev.offset + 1
            if taken:
                runner.wake.set()

    # --- sending --------------------------------------------------------------------------

    def _promote_due(self, runner: Runner, now: float) -> None:
        while runner.delayed and runner.delayed[0][0] <= now:
            runner.retry.append(heapq.heappop(runner.delayed)[2])

    async def _dispatch(self, runner: Runner) -> None:
        """Drain the runner's lane: fresh first, one retry batch every FRESH_PER_RETRY."""
        fresh_streak = 0
        last_sweep = 0.0
        size = runner.target.batch_size
        while True:
            now = time.monotonic()
            self._promote_due(runner, now)
            ready = (runner.fresh or runner.retry) and not runner.paused and not self.paused
            if ready and runner.limiter.free() and self.pool.free() and runner.breaker.allows(now):
                # A half-open breaker's probe is the oldest work: a retry batch when there is one.
                prefer_retry = runner.breaker.is_open or fresh_streak >= FRESH_PER_RETRY
                if runner.retry and (not runner.fresh or prefer_retry):
                    batch = runner.retry.popleft()
                    fresh_streak = 0
                else:
                    batch = [runner.fresh.popleft() for _ in range(min(size, len(runner.fresh)))]
                    fresh_streak += 1
                runner.limiter.try_acquire()
                self.pool.try_acquire()
                task = asyncio.create_task(self._send(runner, batch))
                self.sends.add(task)
                task.add_done_callback(self.sends.discard)
                continue
            if runner.breaker.is_open and now - last_sweep >= 1.0:
                last_sweep = now
                self._expire(runner, now)
            timeout = 0.5
            if runner.delayed:
                timeout = min(timeout, max(runner.delayed[0][0] - now, 0.001))
            if ready and runner.breaker.is_open:
                timeout = min(timeout, max(runner.breaker.wait_s(now), 0.001))
            runner.wake.clear()
            await _wait(runner.wake, timeout)

    @staticmethod
    def _unavailable(runner: Runner) -> Outcome:
        last = runner.last_outcome
        return Outcome(
            delivery.FINAL,
            last.http_status if last else None,
            f"target unavailable (circuit open) past max age {runner.target.max_age_s} s; "
            f"last error: {last.error if last else 'none'}",
            0.0,
        )

    def _expire(self, runner: Runner, now: float) -> None:
        """While the breaker keeps a dead target closed off, records past the target's age
        limit go to the failure store without another attempt, so the lane drains."""
        max_age = runner.target.max_age_s
        outcome = self._unavailable(runner)
        kept: deque[Record] = deque()
        for record in runner.fresh:
            if now - record.first_seen > max_age:
                self._finish(runner, [record], outcome)
            else:
                kept.append(record)
        runner.fresh = kept
        for batch in list(runner.retry):
            if now - batch[0].first_seen > max_age:
                runner.retry.remove(batch)
                self._finish(runner, batch, outcome)
        expired = [d for d in runner.delayed if now - d[2][0].first_seen > max_age]
        if expired:
            runner.delayed = [d for d in runner.delayed if d not in expired]
            heapq.heapify(runner.delayed)
            for _, _, batch in expired:
                self._finish(runner, batch, outcome)

    async def _attempt(self, runner: Runner, batch: list[Record]) -> Outcome:
        if batch[0].attempts:
            self.report.retried += 1
        try:
            body, headers = delivery.build_request(runner.target, batch, runner.transform)
        except Exception as exc:  # a transform that cannot apply to this event: final
            outcome = Outcome(delivery.FINAL, None, f"transform failed: {_line(exc)}", 0.0)
        else:
            outcome = await delivery.attempt(self.session, runner.target, body, headers)
        for r in batch:
            r.attempts += 1
        runner.last_outcome = outcome
        if outcome.kind == delivery.RETRY:
            runner.breaker.failure()
        else:
            runner.breaker.success()
        return outcome

    async def _send(self, runner: Runner, batch: list[Record]) -> None:
        try:
            outcome = await self._attempt(runner, batch)
        finally:
            runner.limiter.release()
            was_full = self.pool.free() == 0
            self.pool.release()
            if was_full:
                self._wake_all()
            runner.wake.set()
        if runner.id not in self.runners:
            return  # retired meanwhile: left uncommitted, the next owner redelivers
        if outcome.kind == delivery.RETRY:
            now = time.monotonic()
            delay = delivery.backoff_s(runner.target, batch[0].attempts, outcome.retry_after_s)
            if not delivery.out_of_attempts(runner.target, batch[0], now, delay):
                heapq.heappush(runner.delayed, (now + delay, next(self.seq), batch))
                return
        self._finish(runner, batch, outcome)

    async def _ordered(self, runner: Runner, queue_id: int) -> None:
        """One sequential sender per queue for ordered targets: a batch is retried in place
        until it is delivered or failed, and nothing after it goes first."""
        line = runner.ordered_lines[queue_id]
        size = runner.target.batch_size
        while True:
            if not line or runner.paused or self.paused:
                runner.wake.clear()
                await _wait(runner.wake, 0.5)
                continue
            batch = [line.popleft() for _ in range(min(size, len(line)))]
            while True:
                outcome = None
                while not runner.breaker.allows():
                    if time.monotonic() - batch[0].first_seen > runner.target.max_age_s:
                        outcome = self._unavailable(runner)
                        break
                    await asyncio.sleep(max(runner.breaker.wait_s(), 0.05))
                if outcome is not None:
                    break
                while not runner.limiter.try_acquire():
                    await runner.limiter.changed(0.05)
                while not self.pool.try_acquire():
                    await self.pool.changed(0.05)
                try:
                    outcome = await self._attempt(runner, batch)
                finally:
                    runner.limiter.release()
                    self.pool.release()
                if outcome.kind != delivery.RETRY:
                    break
                now = time.monotonic()
                delay = delivery.backoff_s(runner.target, batch[0].attempts, outcome.retry_after_s)
                if delivery.out_of_attempts(runner.target, batch[0], now, delay):
                    break
                await asyncio.sleep(delay)
            self._finish(runner, batch, outcome)

    def _finish(self, runner: Runner, batch: list[Record], outcome: Outcome) -> None:
        t = runner.target
        for r in batch:
            runner.cursors[r.queue_id].finish(r.offset, r.message_id)
            if outcome.kind == delivery.DELIVERED:
                self.deliveries.append(
                    store.DeliveryRow(
                        t.runner_id,
                        t.runner,
                        t.bus,
                        r.queue_id,
                        r.offset,
                        r.message_id,
                        r.attempts,
                        outcome.http_status,
                        outcome.latency_ms,
                    )
                )
            else:
                self.failures.append(
                    store.FailureRow(
                        t.runner_id,
                        t.runner,
                        t.bus,
                        r.queue_id,
                        r.offset,
                        r.message_id,
                        r.attempts,
                        outcome.http_status,
                        outcome.error or "failed",
                    )
                )
        runner.inflight -= len(batch)
        if outcome.kind == delivery.DELIVERED:
            self.report.delivered += len(batch)
            runner.latencies.append(outcome.latency_ms)
        else:
            self.report.failed += len(batch)
        runner.room.set()

    # --- committing -----------------------------------------------------------------------

    async def _committer(self) -> None:
        while True:
            await asyncio.sleep(COMMIT_INTERVAL_S)
            try:
                await self._commit()
            except store.LeaseLostError as exc:
                self._die(exc)
                return
            except store.WorkerBusyError as exc:
                self._die(store.LeaseLostError(f"lease lost to another process: {exc}"))
                return

    def _die(self, exc: BaseException) -> None:
        log.error("worker %s stops: %s", self.worker, exc)
        self.fatal = exc
        self.stopping.set()

    async def _commit(self, give_up_s: float | None = None) -> None:
        # One synchronous step: swap the outcome buffers and compute the offsets they allow.
        deliveries, failures = self.deliveries, self.failures
        self.deliveries, self.failures = [], []
        retired_now = list(self.retired)
        written: list[tuple[QueueCursor, int, int]] = []
        offsets: list[store.OffsetRow] = []
        for runner in [*self.runners.values(), *retired_now]:
            for c in runner.cursors.values():
                committable = c.committable()
                if committable != c.committed_db or c.pulled != c.pulled_db:
                    offsets.append(
                        store.OffsetRow(
                            runner.id, c.queue_id, committable, c.pulled, c.last_message_id
                        )
                    )
                    written.append((c, committable, c.pulled))
        if not (deliveries or failures or offsets):
            return
        try:
            await self.lease.call(
                store.commit, self.wid, deliveries, failures, offsets, give_up_s=give_up_s
            )
        except BaseException:
            self.deliveries[:0] = deliveries
            self.failures[:0] = failures
            raise
        for cursor, committable, pulled in written:
            cursor.committed_db = committable
            cursor.pulled_db = pulled
        self.retired = [r for r in self.retired if r not in retired_now]

    # --- heartbeat ------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        import psutil

        proc = psutil.Process()
        proc.cpu_percent(None)
        while True:
            runner_stats, lanes, all_latencies = [], {}, []
            for runner in self.runners.values():
                p50, p99 = runner.percentiles()
                runner_stats.append((runner.id, p50, p99))
                all_latencies.extend(runner.latencies)
                lanes[runner.target.runner] = {
                    "fresh": len(runner.fresh) + sum(map(len, runner.ordered_lines.values())),
                    "retry": sum(map(len, runner.retry)) + sum(len(d[2]) for d in runner.delayed),
                    "in_flight": runner.inflight,
                    "concurrency": runner.limiter.limit,
                    "active": runner.limiter.in_use,
                    "breaker_open": runner.breaker.is_open,
                    "paused": runner.paused,
                    "buffered_bytes": sum(c.inflight_bytes for c in runner.cursors.values()),
                }
            quantiles = (
                statistics.quantiles(all_latencies, n=100) if len(all_latencies) > 1 else None
            )
            metrics = {
                "cpu_percent": proc.cpu_percent(None),
                "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                "pool": {
                    "core": self.settings.pool_core,
                    "max": self.settings.pool_max,
                    "active": self.pool.in_use,
                    "free": self.pool.free(),
                },
                "paused": self.paused,
                "latency_p50_ms": quantiles[49] if quantiles else None,
                "latency_p99_ms": quantiles[98] if quantiles else None,
                "report": self.report.as_dict(),
                "lanes": lanes,
            }
            try:
                await self.aux.call(store.heartbeat, self.wid, metrics, runner_stats, give_up_s=5)
            except Exception as exc:
                log.warning("heartbeat failed: %s", _line(exc))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


def run_worker(
    worker: str,
    *,
    until_idle: bool = False,
    max_seconds: float | None = None,
    url: str | None = None,
    progress: Callable[[dict], None] | None = None,
    handle_signals: bool = False,
) -> WorkerReport:
    """Run one worker's push loop until idle, a time budget, or SIGTERM/SIGINT (graceful:
    in-flight sends finish or are handed back, outcomes are committed, the lease released)."""
    url = url or database_url()
    engine = Engine(worker, url, until_idle=until_idle, max_seconds=max_seconds, progress=progress)

    async def main() -> WorkerReport:
        if handle_signals and threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, engine.stop)
        return await engine.run()

    # uvloop roughly halves the event loop's own cost per request on the hot path.
    import uvloop

    return uvloop.run(main())
