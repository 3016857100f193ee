"""Lanes and dispatch: each runner's records, from the windows it pulls to the sends that
take them to its target.

- **Lanes.** Each runner has a bounded lane: a high-priority deque of fresh records and a
  low-priority deque of retry batches (timeouts included), drained ``FRESH_PER_RETRY`` to
  one, so retries never starve fresh events. Sends take a slot of the runner's concurrency
  limit and of the worker's shared pool; a circuit breaker per target stops hammering a dead
  one. Ordered targets get one sequential sender per queue instead.
- **Senders.** Long-lived coroutines per runner: a sender whose send ended takes its next
  batch from the lane itself, so a busy runner costs no hand-over, future or wake-up per
  send; idle senders are handed batches by the feeder that brought them. The dispatcher is
  the runner's clock (due retries, the breaker's cool-down, aging out, changed limits).
- **Backpressure.** A runner stops pulling a queue while its in-flight records on it pass a
  count, a byte size or an offset span, or while what it pulled runs too far past what is
  committed (``QueueCursor.over``).
- **Time.** Every delay that keys the retry heap or a sleep passes through ``finite``: a
  target's ``Retry-After: nan`` can never freeze a runner.

The sending itself is a sink's (``eventpush.sinks``: HTTP, NATS JetStream, plug-ins); what
an outcome leaves behind is ``committing``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Coroutine

from eventpush import tracing
from eventpush.backoff import finite
from eventpush.push.adaptive import AdaptiveLimiter
from eventpush.push.committing import Committer
from eventpush.push.controls import WorkerSettings
from eventpush.push.cursor import UNCOMMITTED_SPANS, QueueCursor
from eventpush.push.limits import CircuitBreaker, Limiter, Pass
from eventpush.push.rates import DestinationGate, RateGates
from eventpush.push.reading import BusSignals, WindowCache
from eventpush.push.store import VersionRow
from eventpush.push.versions import ENABLED, History, version
from eventpush.rules.patterns import compile_pattern
from eventpush.rules.transforms import compile_transform
from eventpush.sinks import contract, retry
from eventpush.sinks.contract import Outcome, Record, Target

log = logging.getLogger(__name__)

FRESH_PER_RETRY = 4
ROOM_SHARE = 16  # a blocked feeder wakes once 1/ROOM_SHARE of the runner's records finished
POLL_INTERVAL_S = 1.0
IDLE_WAIT_S = 0.5
MIN_WAIT_S = 0.001
MAX_RETRY_DELAY_S = 300.0
# The breaker's longest cool-down for --concurrency auto targets: a destination that answers
# again is probed within this long, and the adaptive limit grows back from there.
AUTO_MAX_COOLDOWN_S = 4.0


class Runner:
    """One rule-target pair being pushed by this worker, at one assignment generation."""

    def __init__(
        self,
        target: Target,
        offsets: dict[int, int],
        settings: tuple,
        history: History | None = None,
    ) -> None:
        self.target = target
        self.id = target.runner_id
        self.generation = settings[1]
        self.pattern = compile_pattern(target.pattern)
        self.transform = compile_transform(target.transform_kind, target.transform_spec)
        # Which version judges which offset (push/versions.py); ``epoch``: the window cache's
        # epoch once its newest version was in the index (older matches are judged again).
        self.history = history if history is not None else History()
        self.epoch = 0
        self.cursors = {qid: QueueCursor(qid, off) for qid, off in sorted(offsets.items())}
        self.fresh: deque[Record] = deque()
        self.retry: deque[list[Record]] = deque()
        self.delayed: list[tuple[float, int, list[Record]]] = []
        self.ordered_lines: dict[int, deque[Record]] = {qid: deque() for qid in self.cursors}
        self.inflight = 0
        # --concurrency auto: the limit follows the answers (push/adaptive.py) under a ceiling
        # (the runner's concurrency control and the worker's pool; see Lanes.attach).
        self.adaptive: AdaptiveLimiter | None = None
        if target.concurrency_auto:
            self.limiter = self.adaptive = AdaptiveLimiter(1024)
            self.breaker = CircuitBreaker(max_cooldown=AUTO_MAX_COOLDOWN_S)
        else:
            self.limiter = Limiter(target.concurrency)
            self.breaker = CircuitBreaker()
        self.gate: DestinationGate | None = None  # its destination's rate limit (Lanes.attach)
        self.wake = asyncio.Event()  # retries, breaker or limits changed: the dispatcher looks
        if self.adaptive is not None:
            self.adaptive.wake = self.wake
        self.room = asyncio.Event()  # records finished or committed: feeders may pull again
        # A blocked feeder is woken once a share of what was in flight has finished, not by
        # every record that finishes (a wake per delivery was a large part of its cost).
        self.freed = 0
        self.room_at = 1
        self.fresh_streak = 0  # fresh batches sent since the last retry batch
        self.latencies: deque[float] = deque(maxlen=2000)
        self.tasks: list[asyncio.Task] = []  # feeders and dispatcher or ordered senders
        # The runner's senders (unordered targets): long-lived coroutines, one per send in
        # flight at the busiest moment. A sender takes its next batch from the lane itself;
        # an idle one waits on a future of its own until a batch is handed to it.
        self.sends: set[asyncio.Task] = set()
        self.idle_senders: deque[asyncio.Future] = deque()
        self.stopped = False  # taking no more work: senders end after their send
        self.paused = False
        self.fenced = False  # moved away: its outcomes are never committed
        self.lane_limit = 10_000
        self.last_outcome: Outcome | None = None
        self.send_fn = None  # the target's sink's send, looked up at the first attempt
        self.apply(settings)

    def apply(self, settings: tuple) -> None:
        """Apply (state, generation, controls) as read from the assignment; a different
        generation is a different runner (the engine hands this one off)."""
        state, _generation, controls = settings
        self.paused = state == "PAUSED" or bool(controls.get("paused", False))
        self.lane_limit = self._control(controls, "lane_limit", 10_000)
        if self.adaptive is not None:  # only a control of the operator's caps it
            self.adaptive.set_ceiling(min(self._control(controls, "concurrency", 1024), 1024))
        else:
            self.limiter.resize(
                min(self._control(controls, "concurrency", self.target.concurrency), 1024)
            )
        # A resume, a wider lane or more concurrency must be acted on now, not at the next
        # wake-up of the dispatcher and the feeders.
        self.wake.set()
        self.room.set()

    @property
    def matching(self) -> bool:
        """The newest version of its rule is enabled: the index holds its pattern."""
        return self.target.rule_state == ENABLED

    def take_effect(self) -> list[VersionRow]:
        """The target's versions (as read from the catalog) take effect on each queue at the
        offset the runner has read up to; the rows to record, for queues where they are new."""
        t = self.target
        rows = []
        for qid, cursor in self.cursors.items():
            newest = self.history.newest(qid)
            if newest is not None and newest.key == (t.rule_version, t.target_version):
                continue
            start = max(cursor.pulled, self.history.newest_from(qid))
            v = version(start, t.rule_version, t.target_version, t.rule_state, t.pattern)
            self.history.add(qid, v)
            rows.append(VersionRow(self.id, qid, start, *v.key, v.state, v.pattern))
        return rows

    def retarget(self, target: Target) -> list[VersionRow]:
        """A new version of the target or its rule, live: sends from now on use it, events
        from the offsets it takes effect at are judged by it. Returns the rows to record."""
        from eventpush.rules.patterns import compile_pattern
        from eventpush.rules.transforms import compile_transform

        old, self.target = self.target, target
        self.pattern = compile_pattern(target.pattern)
        self.transform = compile_transform(target.transform_kind, target.transform_spec)
        if target.url != old.url:
            self.send_fn = None  # the new URL's kind of sink, looked up at the next attempt
        # (a new concurrency reaches the limiter with the engine's next ``apply``)
        self.wake.set()
        self.room.set()
        return self.take_effect()

    def _control(self, controls: dict, key: str, default: int) -> int:
        value = controls.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"runner {self.target.runner}: control {key} must be a positive integer, "
                f"got {value!r}"
            )
        return value

    def percentiles(self) -> tuple[float | None, float | None]:
        if len(self.latencies) < 2:
            return (self.latencies[0], self.latencies[0]) if self.latencies else (None, None)
        cuts = statistics.quantiles(self.latencies, n=100)
        return cuts[49], cuts[98]

    def idle(self) -> bool:
        return self.paused or (self.inflight == 0 and all(c.at_end for c in self.cursors.values()))


def retry_delay(target: Target, attempts: int, retry_after_s: float | None) -> float:
    """Seconds before the next attempt, always finite: the policy's backoff when what the
    target asked for is no number."""
    delay = retry.backoff_s(target, attempts, retry_after_s)
    if delay is None or not math.isfinite(delay) or delay < 0:
        delay = retry.backoff_s(target, attempts)
    return finite(delay, target.backoff_ms / 1000, 0.0, MAX_RETRY_DELAY_S)


async def wait_for_event(event: asyncio.Event, timeout: float) -> None:
    if event.is_set():
        return
    # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when a cancel
    # meets a completed wait, and a feeder that survives its hand-off holds the runner forever.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(finite(timeout, IDLE_WAIT_S, MIN_WAIT_S)):
            await event.wait()


class Lanes:
    """The worker's runners' lanes, the shared pool, and the tasks that move records."""

    def __init__(
        self,
        report,
        sinks,
        cache: WindowCache,
        signals: BusSignals,
        committer: Committer,
        spawn: Callable[[Coroutine, str], asyncio.Task],
        metrics=None,
        rates: RateGates | None = None,
    ) -> None:
        self.report = report
        self.sinks = sinks  # eventpush.sinks.Sinks: how a record reaches its target's kind
        self.cache = cache
        self.signals = signals
        self.committer = committer
        self.spawn = spawn
        self.settings = WorkerSettings()
        self.paused = False
        self.pool = Limiter(self.settings.pool_max)
        self.seq = itertools.count()
        self.runners: dict[int, Runner] = {}
        self.metrics = metrics  # eventpush.metrics.WorkerMetrics, or None
        # Its per-request counters, called straight from the hot path.
        self.attempts = metrics.attempts if metrics is not None else None
        self.warned_held: set[int] = set()  # runners warned of a destination's held keys
        self.rates = rates  # the destinations' rate limits (push/rates.py), or None

    def attach(self, runner: Runner) -> None:
        """The runner's destination's rate-limit gate and, for an adaptive limit, the pool as
        its ceiling: at its start, after a new version of its target, and after new worker
        settings."""
        t = runner.target
        runner.gate = self.rates.gate_for(t.destination, t.rate_limit) if self.rates else None
        if runner.adaptive is not None:
            runner.adaptive.set_pool(self.settings.pool_max)

    # --- life of a runner -----------------------------------------------------------------

    def start(self, runner: Runner) -> None:
        name = runner.target.runner
        self.attach(runner)
        for cursor in runner.cursors.values():
            qid = cursor.queue_id
            span = UNCOMMITTED_SPANS * self.settings.buffer_span
            cursor.resent_below = cursor.committed_db + span
            runner.tasks.append(self.spawn(self.feed(runner, cursor), f"feeder {name}#{qid}"))
            if runner.target.ordered:
                runner.tasks.append(self.spawn(self.ordered(runner, qid), f"sender {name}#{qid}"))
        if not runner.target.ordered:
            runner.tasks.append(self.spawn(self.dispatch(runner), f"dispatcher {name}"))

    def stop_taking(self, runner: Runner) -> None:
        """No more pulling or dispatching; sends under way go on (an ordered queue's sender
        in the middle of one too: it ends after it); unsent records stay uncommitted (the
        next run redelivers them)."""
        runner.stopped = True
        self.warned_held.discard(runner.id)  # a runner that comes back is warned once again
        for task in runner.tasks:
            if task not in runner.sends:
                task.cancel()
        while runner.idle_senders:  # idle senders end now, busy ones after their send
            waiting = runner.idle_senders.popleft()
            if not waiting.done():
                waiting.set_result(None)
        runner.fresh.clear()
        runner.retry.clear()
        runner.delayed.clear()
        for line in runner.ordered_lines.values():
            line.clear()

    def fence(self, runner: Runner) -> list[asyncio.Task]:
        """The runner is no longer ours: everything of it stops now, outcomes included.
        Returns the tasks to wait for before another worker may take it."""
        runner.fenced = True
        self.stop_taking(runner)
        for task in runner.sends:
            task.cancel()
        return [*runner.tasks, *runner.sends]

    def wake_all(self) -> None:
        for runner in self.runners.values():
            runner.wake.set()
            runner.room.set()

    # --- pulling --------------------------------------------------------------------------

    async def feed(self, runner: Runner, cursor: QueueCursor) -> None:
        """Pull one queue for one runner into its lane, within the backpressure bounds."""
        bus_id = runner.target.bus_id
        ordered_line = runner.ordered_lines[cursor.queue_id] if runner.target.ordered else None
        while True:
            s = self.settings
            if runner.paused or self.paused:
                runner.room.clear()
                await wait_for_event(runner.room, IDLE_WAIT_S)
                continue
            if cursor.over(s.buffer_records, s.buffer_bytes, s.buffer_span) or (
                runner.inflight >= runner.lane_limit
            ):
                runner.room.clear()
                runner.freed = 0
                runner.room_at = max(1, runner.inflight // ROOM_SHARE)
                await wait_for_event(runner.room, POLL_INTERVAL_S)
                continue
            signal_ = self.signals.signal(bus_id)
            qid = cursor.queue_id
            history = runner.history
            got = await self.cache.events_from(
                bus_id, qid, cursor.pulled, (runner.id, runner.epoch, history.newest_from(qid))
            )
            # The index's verdict holds for events it matched with the runner's newest version
            # and read from where that version took effect; others are judged by the version
            # in force at their offset (push/versions.py). Read after the wait: the runner may
            # have taken a new version meanwhile.
            epoch, exact_from = runner.epoch, history.newest_from(qid)
            if got.__class__ is list:
                events, rows = got, None
                if not events:
                    cursor.at_end = True
                    await wait_for_event(signal_, POLL_INTERVAL_S)
                    continue
            else:  # kept verdicts: the rows it must see; the window's others it passes over
                if got.epoch < epoch or got.exact_from != exact_from:
                    continue  # chosen by what the runner trusted before it changed: again
                events, rows = got.events, got.offsets
            cursor.at_end = False
            taken = 0
            pulled_at = time.monotonic()  # a record's age (max_age_s) counts from here
            # cursor.over's bounds, worked out once for this pull (nothing finishes during
            # it): records still allowed, and the offset where the span bounds stop it.
            room = s.buffer_records - len(cursor.inflight)
            stop = cursor.committed_db + UNCOMMITTED_SPANS * s.buffer_span
            oldest = next(iter(cursor.inflight)) if cursor.inflight else None
            if oldest is not None:
                stop = min(stop, oldest + s.buffer_span)
            max_bytes, rid = s.buffer_bytes, runner.id
            judge = history.judge
            lane = runner.fresh if ordered_line is None else ordered_line
            # The cursor's take and advance, inline on locals written back once (per record
            # pulled, these calls were a good part of a feeder's cost; nothing awaits here).
            inflight, held, pulled = cursor.inflight, cursor.inflight_bytes, cursor.pulled
            first = pulled
            read = 0
            try:
                for ev in events:
                    if room <= 0 or pulled >= stop or held >= max_bytes:
                        break
                    offset = ev.offset
                    if rows is not None and offset > pulled:
                        # the rows before it, none of them its rule's: passed as a full window's
                        # filtered rows are, up to the span bound
                        pulled = min(offset, stop)
                        if pulled >= stop:
                            break
                    read += 1
                    if (
                        rid in ev.matches
                        if ev.epoch >= epoch and offset >= exact_from
                        else judge(qid, offset, ev.event)
                    ):
                        if oldest is None:
                            oldest = offset
                            stop = min(stop, oldest + s.buffer_span)
                        room -= 1
                        inflight[offset] = ev.size
                        held += ev.size
                        lane.append(
                            Record(qid, offset, ev.message_id, ev.parsed, ev.raw, pulled_at)
                        )
                        taken += 1
                    if offset >= pulled:
                        pulled = offset + 1
                else:
                    if rows is not None and room > 0 and held < max_bytes and pulled < stop:
                        pulled = min(got.stop, stop)  # the rows after its last one
            finally:
                if rows is not None:  # rows passed over count as read (and filtered)
                    read = bisect.bisect_left(rows, pulled) - bisect.bisect_left(rows, first)
                cursor.inflight_bytes, cursor.pulled = held, pulled
                runner.inflight += taken
                self.report.read += read
                self.report.filtered += read - taken
            if taken:
                if ordered_line is None:
                    self.pump(runner)
                else:
                    runner.wake.set()

    # --- dispatching ----------------------------------------------------------------------

    def _promote_due(self, runner: Runner, now: float) -> None:
        while runner.delayed and runner.delayed[0][0] <= now:
            runner.retry.append(heapq.heappop(runner.delayed)[2])

    def _take(self, runner: Runner) -> tuple[list[Record], Pass] | None:
        """The runner's next batch, with a slot of its limiter and of the shared pool, when
        the lane, the limits and the breaker allow one now: fresh first, one retry batch
        every FRESH_PER_RETRY, a half-open breaker's probe the oldest work."""
        if runner.delayed:
            self._promote_due(runner, time.monotonic())
        if not (runner.fresh or runner.retry) or runner.paused or self.paused or runner.stopped:
            return None
        # The destination's rate-limit token and the slots are taken first (each take is its
        # own check) and given back when the breaker says no: the rare case pays, not every
        # send. A runner without a token is woken when its destination's next slice comes.
        gate = runner.gate
        if gate is not None and not gate.try_take(runner.wake):
            return None
        limiter, pool = runner.limiter, self.pool
        if not limiter.try_acquire():
            if gate is not None:
                gate.give_back()
            return None
        if not pool.try_acquire():
            limiter.release()
            if gate is not None:
                gate.give_back()
            return None
        granted = runner.breaker.admit()
        if granted is None:
            limiter.release()
            pool.release()
            if gate is not None:
                gate.give_back()
            return None
        fresh = runner.fresh
        if runner.retry and (not fresh or granted.probe or runner.fresh_streak >= FRESH_PER_RETRY):
            batch = runner.retry.popleft()
            runner.fresh_streak = 0
        else:
            size = runner.target.batch_size
            if size == 1:
                batch = [fresh.popleft()]
            else:
                batch = [fresh.popleft() for _ in range(min(size, len(fresh)))]
            runner.fresh_streak += 1
        return batch, granted

    def pump(self, runner: Runner) -> None:
        """Hand out every batch that may go now: to idle senders first, to new senders when
        every one is busy (so there is never a task per send). Busy senders take their next
        batch themselves when their send ends."""
        while (job := self._take(runner)) is not None:
            self._launch(runner, job)

    async def dispatch(self, runner: Runner) -> None:
        """The runner's clock: due retries, the breaker's cool-down, records aging out while
        it is open, and limits that changed. The senders take work from the lane themselves;
        this only hands out what became possible while every sender was idle."""
        last_sweep = 0.0
        breaker = runner.breaker
        while True:
            now = time.monotonic()
            self._promote_due(runner, now)
            self.pump(runner)
            if breaker.is_open and now - last_sweep >= 1.0:
                last_sweep = now
                self._expire(runner, now)
            # Sleep until a wake (limits, breaker or lane changed, an earlier retry queued),
            # the next due retry or the breaker's cool-down; never a fixed short tick.
            timeout = IDLE_WAIT_S
            if runner.delayed:
                timeout = min(timeout, max(runner.delayed[0][0] - now, MIN_WAIT_S))
            if breaker.is_open and (runner.fresh or runner.retry):
                wait = breaker.wait_s(now)  # None while a probe is out: its outcome wakes us
                if wait is not None and runner.limiter.free() and self.pool.free():
                    timeout = min(timeout, max(wait, MIN_WAIT_S))
            runner.wake.clear()
            await wait_for_event(runner.wake, timeout)

    def _launch(self, runner: Runner, job: tuple[list[Record], Pass]) -> None:
        """Hand the job to an idle sender; a new sender only when all are busy."""
        while runner.idle_senders:
            waiting = runner.idle_senders.popleft()
            if not waiting.done():  # a cancelled sender leaves its future behind
                waiting.set_result(job)
                return
        task = self.spawn(self.sender(runner, job), f"sender {runner.target.runner}")
        runner.sends.add(task)
        task.add_done_callback(runner.sends.discard)

    async def sender(self, runner: Runner, job: tuple[list[Record], Pass] | None) -> None:
        """Send batches until the runner stops taking work: the next one straight from the
        lane when there is one, else wait idle until one is handed over."""
        loop = asyncio.get_running_loop()
        while job is not None:
            batch, granted = job
            pool_was_full = True
            try:
                outcome = await self.traced_attempt(runner, batch, granted)
            finally:
                pool_was_full = self._release(runner, granted)
            if not runner.fenced:  # moved away meanwhile: left uncommitted for the next owner
                self._settle(runner, batch, outcome)
            if runner.stopped:
                return
            # A slot of a full pool goes to whichever runner's dispatcher comes first (all were
            # woken), not back to this runner at once: other runners may be waiting for it.
            job = None if pool_was_full else self._take(runner)
            if job is None:
                waiting = loop.create_future()
                runner.idle_senders.append(waiting)
                job = await waiting

    @staticmethod
    def _unavailable(runner: Runner) -> Outcome:
        last = runner.last_outcome
        return Outcome(
            contract.FINAL,
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
                self.finish(runner, [record], outcome)
            else:
                kept.append(record)
        runner.fresh = kept
        for batch in list(runner.retry):
            if now - batch[0].first_seen > max_age:
                runner.retry.remove(batch)
                self.finish(runner, batch, outcome)
        expired = [d for d in runner.delayed if now - d[2][0].first_seen > max_age]
        if expired:
            runner.delayed = [d for d in runner.delayed if d not in expired]
            heapq.heapify(runner.delayed)
            for _, _, batch in expired:
                self.finish(runner, batch, outcome)

    # --- observed attempts ----------------------------------------------------------------

    async def traced_attempt(self, runner: Runner, batch: list[Record], granted: Pass) -> Outcome:
        """One attempt through the target's sink, in a span of its own whose ``traceparent``
        the sink is handed (the request carries it), counted on the records, the breaker and
        the worker's metrics."""
        retry = batch[0].attempts > 0
        if retry:
            self.report.retried += 1
        send = runner.send_fn
        if send is None:
            send = runner.send_fn = self.sinks.sender_for(runner.target.url)
        if not tracing.enabled():  # the usual case, kept free of span machinery
            outcome = await send(
                runner.target,
                batch,
                runner.transform,
                tracing.unrecorded_traceparent(tracing.carrier(batch[0])),
            )
        else:
            outcome = await tracing.in_deliver_span(
                runner.target,
                batch,
                lambda parent: send(runner.target, batch, runner.transform, parent),
            )
        if outcome.held is not None:  # rare: the destination already held some keys
            self.held_on_first_send(runner, batch, outcome)
        for r in batch:
            r.attempts += 1
        runner.last_outcome = outcome
        # A request that never left (transform failed, address refused) says nothing about the
        # target's health.
        kind = outcome.kind
        adaptive = runner.adaptive
        if adaptive is None:
            runner.breaker.record(granted, reached=outcome.reached, failed=kind == contract.RETRY)
        else:
            adaptive.observe(outcome)
            was_open = runner.breaker.is_open
            runner.breaker.record(granted, reached=outcome.reached, failed=kind == contract.RETRY)
            if runner.breaker.is_open and not was_open:
                adaptive.breaker_opened()
        if self.attempts is not None:
            self.attempts.add(runner.target.runner, kind, outcome.latency_ms / 1000, retry)
        return outcome

    def held_on_first_send(self, runner: Runner, batch: list[Record], outcome: Outcome) -> None:
        """Records the destination already held under their key on their first send from this
        runner (attempt 1, and past what a previous owner of the runner may have sent): no
        copy of ours can be there, so another writer uses the same keys (two installations
        on one stream, a runner's keys reused). Still delivered (the destination holds that
        key); counted in ``eventpush_sink_duplicates_total`` and warned of once per target."""
        cursors = runner.cursors
        first = [
            r
            for r in (batch[i] for i in outcome.held)
            if r.attempts == 0 and r.offset >= cursors[r.queue_id].resent_below
        ]
        if not first:
            return
        self.report.already_held += len(first)
        where = outcome.held_by or "the destination"
        if self.metrics is not None:
            self.metrics.already_held(runner.target.runner, where, len(first))
        if runner.id not in self.warned_held:
            self.warned_held.add(runner.id)
            log.warning(
                "target %s: %s already held %d record(s) sent for the first time (e.g. queue "
                "%d offset %d): another writer uses this runner's record keys; see "
                "docs/OPERATIONS.md",
                runner.target.runner,
                where,
                len(first),
                first[0].queue_id,
                first[0].offset,
            )

    # --- sending --------------------------------------------------------------------------

    def _release(self, runner: Runner, granted: Pass) -> bool:
        """A send's slots back; True when the shared pool was full (every runner is woken)."""
        runner.limiter.release()
        was_full = self.pool.release()
        if was_full:  # other runners' senders may be waiting for this slot
            self.wake_all()
        # Otherwise the runner's clock is woken only when the breaker has something to say (a
        # probe's outcome, an open breaker): the sender takes its next batch itself.
        elif granted.probe or runner.breaker.is_open:
            runner.wake.set()
        return was_full

    def _settle(self, runner: Runner, batch: list[Record], outcome: Outcome) -> None:
        """A retry goes on the timer heap (unless out of attempts or age); anything else is
        finished. A batch whose records were answered one by one settles per answer."""
        if outcome.per_record is not None:
            for part, records in contract.by_answer(batch, outcome):
                self._settle(runner, records, part)
            return
        if outcome.kind == contract.RETRY:
            now = time.monotonic()
            delay = retry_delay(runner.target, batch[0].attempts, outcome.retry_after_s)
            if not retry.out_of_attempts(runner.target, batch[0], now, delay):
                entry = (now + delay, next(self.seq), batch)
                heapq.heappush(runner.delayed, entry)
                if runner.delayed[0] is entry:  # due before what the clock sleeps towards
                    runner.wake.set()
                return
        self.finish(runner, batch, outcome)

    async def ordered(self, runner: Runner, queue_id: int) -> None:
        """One sequential sender per queue for ordered targets: a batch is retried in place
        until it is delivered or failed, and nothing after it goes first."""
        line = runner.ordered_lines[queue_id]
        size = runner.target.batch_size
        breaker = runner.breaker
        me = asyncio.current_task()
        while True:
            if runner.stopped:
                return
            if not line or runner.paused or self.paused:
                runner.wake.clear()
                await wait_for_event(runner.wake, IDLE_WAIT_S)
                continue
            batch = [line.popleft() for _ in range(min(size, len(line)))]
            while True:
                outcome = None
                granted = breaker.admit()
                while granted is None:
                    if time.monotonic() - batch[0].first_seen > runner.target.max_age_s:
                        outcome = self._unavailable(runner)
                        break
                    wait = breaker.wait_s()
                    if wait is None:  # another queue's probe is out: its outcome wakes us
                        runner.wake.clear()
                        await wait_for_event(runner.wake, IDLE_WAIT_S)
                    else:
                        await asyncio.sleep(finite(wait, IDLE_WAIT_S, 0.05, IDLE_WAIT_S))
                    granted = breaker.admit()
                if outcome is not None:
                    break
                while runner.gate is not None and not runner.gate.try_take(runner.wake):
                    runner.wake.clear()  # set when the destination's next tokens come
                    await wait_for_event(runner.wake, IDLE_WAIT_S)
                while not runner.limiter.try_acquire():
                    await runner.limiter.changed(IDLE_WAIT_S)
                while not self.pool.try_acquire():
                    await self.pool.changed(IDLE_WAIT_S)
                runner.sends.add(me)  # a stop lets the send end; a fence cancels it
                try:
                    outcome = await self.traced_attempt(runner, batch, granted)
                finally:
                    runner.sends.discard(me)
                    runner.limiter.release()
                    self.pool.release()
                    runner.wake.set()
                if outcome.kind != contract.RETRY:
                    break
                now = time.monotonic()
                delay = retry_delay(runner.target, batch[0].attempts, outcome.retry_after_s)
                if retry.out_of_attempts(runner.target, batch[0], now, delay):
                    break
                if runner.stopped:  # the retry is left uncommitted, as an unordered one
                    return
                await asyncio.sleep(delay)
            if runner.fenced:
                return
            # Each record on its own answer when it has one (a retryable one among finals:
            # failed); one group otherwise.
            for part, records in contract.by_answer(batch, outcome):
                self.finish(runner, records, part)

    # --- outcomes -------------------------------------------------------------------------

    def finish(self, runner: Runner, batch: list[Record], outcome: Outcome) -> None:
        """The records are done with: off their cursors, their rows to the committer, the
        counts moved, a blocked feeder woken once enough finished. One pass per send."""
        n = len(batch)
        if n == 1:  # the usual send: no loop, no list of rows
            r = batch[0]
            runner.cursors[r.queue_id].finish(r.offset, r.message_id)
        else:
            cursors = runner.cursors
            for r in batch:
                cursors[r.queue_id].finish(r.offset, r.message_id)
        self.committer.add(runner.target, batch, outcome)
        runner.inflight -= n
        if outcome.kind == contract.DELIVERED:
            self.report.delivered += n
            runner.latencies.append(outcome.latency_ms)
        else:
            self.report.failed += n
        runner.freed += n
        if runner.freed >= runner.room_at:
            runner.room.set()
