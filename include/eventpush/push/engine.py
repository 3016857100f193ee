"""The push engine's supervisor: one worker's runners, from bus queues to their targets.

The engine is built in rooms (docs/ARCHITECTURE.md, "Delivery semantics"):

- ``reading``: shared, cached windows of each bus queue, parsed and matched once;
- ``lanes``: each runner's lanes, feeders, dispatcher, senders and circuit breaker;
- ``eventpush.sinks``: one attempt through the target's kind (HTTP over ``delivery``, NATS
  JetStream, plug-ins), within the address policy of ``targets``;
- ``committing``: outcomes and offsets written in one fenced transaction under the lease.

This module holds them together. It takes the worker's lease, claims the runners the
assignment gives it (waiting until their previous worker has let go), hands runners off when
the assignment moves them, and supervises every task it starts: a transient database error
is waited out where it happens (reconnect and retry with backoff); any other error stops
the worker at once with a one-line reason (:class:`WorkerFailedError`), never a task
silently dead while its records stay in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import statistics
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass

from eventpush import metrics as metrics_mod
from eventpush import sealed, sinks, sources
from eventpush.config import database_url
from eventpush.db import KEEPALIVES, is_transient
from eventpush.dbslot import DbSlot
from eventpush.errors import first_line
from eventpush.metrics import WorkerMetrics, metrics_host
from eventpush.push import rates, store
from eventpush.push.committing import Committer
from eventpush.push.controls import WorkerSettings, worker_settings
from eventpush.push.lanes import Lanes, Runner, wait_for_event
from eventpush.push.reading import BusSignals, WindowCache
from eventpush.push.tuning import (  # process tuning; engine.GC_GEN0_THRESHOLD kept for readers
    GC_GEN0_THRESHOLD,  # noqa: F401
    _freeze_startup_objects,
    batch_scheduled,
    collector_tuned,
)
from eventpush.push.versions import History, version
from eventpush.rules.patterns import RuleIndex
from eventpush.sources import Bus, Reader

log = logging.getLogger("eventpush.push")

COMMIT_INTERVAL_S = 0.2
HAND_OVER_LOOK_S = 0.05  # how often the supervisor looks; a successor waits at most this long
CONTROL_INTERVAL_S = 2.0
HEARTBEAT_INTERVAL_S = 5.0
STOP_GRACE_S = 10.0
STARTUP_GIVE_UP_S = 60.0  # a database slow to answer at start-up is waited for this long
FINAL_COMMIT_GIVE_UP_S = 30.0
COMMITTER_STOP_S = 5.0
# A moved runner's tasks end within a step of their cancel; any still running after this long
# would hold the runner's claim for good, so the worker stops instead (its claims go with it).
HAND_OFF_GIVE_UP_S = 10.0
LOOP_SAMPLE_S = 0.25
LOOP_SAMPLES_KEPT = 240  # a minute of samples, should heartbeats stall
CACHE_SHARE = 8  # the window cache may hold 1/CACHE_SHARE of a worker's buffer_bytes


def read_histories(conn, runner_ids: list[int]) -> dict[int, History]:
    """The recorded versions of runners, as histories (runners without any: empty)."""
    per_runner: dict[int, dict[int, list]] = {rid: {} for rid in runner_ids}
    for row in store.read_versions(conn, runner_ids):
        v = version(row.from_offset, row.rule_version, row.target_version, row.state, row.pattern)
        per_runner[row.runner_id].setdefault(row.queue_id, []).append(v)
    return {rid: History(queues) for rid, queues in per_runner.items()}


class WorkerFailedError(RuntimeError):
    """The worker stopped on an error it cannot wait out (said in one line)."""


@dataclass(frozen=True)
class HandOver:
    """How a run of the worker takes the lease from, and gives it to, another process: make
    before break, so the worker is never idle between two runs (the push DAG's slices).

    ``lease_wait_s``: wait this long in PostgreSQL's lock queue for the holder to let go
    (granted the moment it does) instead of failing at once. ``yield_after_s``: after this
    long, stop as soon as another process waits for the lease (``max_seconds`` still ends
    the run when none comes). ``on_lease``: called (in a thread) once the lease is taken,
    before anything is pushed. ``application_name``: the lease session's, which tells who
    holds the lease (``store.SLICE_APP`` for the DAG's slices)."""

    lease_wait_s: float = 0.0
    yield_after_s: float | None = None
    on_lease: Callable[[], None] | None = None
    application_name: str = "eventpush"


@dataclass
class WorkerReport:
    """What one run of a worker did."""

    worker: str
    read: int = 0
    delivered: int = 0
    failed: int = 0
    filtered: int = 0
    retried: int = 0
    # First sends the destination already held under their key (Lanes.held_on_first_send).
    already_held: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class Engine:
    def __init__(
        self,
        worker: str,
        url: str,
        *,
        until_idle: bool = False,
        max_seconds: float | None = None,
        progress: Callable[[dict], None] | None = None,
        metrics_port: int | None = None,
        metrics_required: bool = True,
        hand_over: HandOver | None = None,
    ) -> None:
        self.worker = worker
        self.url = url
        self.until_idle = until_idle
        self.max_seconds = max_seconds
        self.hand_over = hand_over or HandOver()
        self.progress = progress
        self.report = WorkerReport(worker)
        self.runners: dict[int, Runner] = {}
        self.waiting: set[int] = set()  # assigned here, still claimed by their previous worker
        self.retiring: dict[int, asyncio.Task] = {}  # deleted runners being finished: _retire
        self.indexes: dict[int, object] = {}  # bus id -> RuleIndex of this worker's runners
        self.refresh_lock = asyncio.Lock()
        self.stopping = asyncio.Event()
        self.catalog_changed = asyncio.Event()  # a catalog notification came in
        self.fatal: BaseException | None = None
        self.wid = 0
        self.buses: dict[int, Bus] = {}  # the buses of this worker's runners
        self.sources: dict[str, Reader] = {}  # scheme -> the source's reader, opened once
        self.metrics = WorkerMetrics(worker)
        self.metrics_port = metrics_port
        self.metrics_required = metrics_required
        self.loop_lags: list[float] = []  # samples since the last heartbeat, seconds
        self.loop_lag_ms: float | None = None

    @property
    def settings(self) -> WorkerSettings:
        """The worker settings in force (defaults until the first assignment read)."""
        lanes = getattr(self, "lanes", None)
        return lanes.settings if lanes is not None else WorkerSettings()

    # --- supervision ----------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()

    def _spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._watch)
        return task

    def _watch(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, store.LeaseLostError | store.WorkerBusyError):
            self._die(store.LeaseLostError(f"lease lost to another process: {first_line(exc)}"))
            return
        log.error("%s failed", task.get_name(), exc_info=exc)
        self._die(WorkerFailedError(f"{task.get_name()} failed: {first_line(exc)}"))

    def _die(self, exc: BaseException) -> None:
        if self.fatal is None:
            log.error("worker %s stops: %s", self.worker, exc)
            self.fatal = exc
        self.stopping.set()

    # --- lifecycle ------------------------------------------------------------------------

    async def run(self) -> WorkerReport:
        started = time.monotonic()
        self._serve_metrics()
        try:
            return await self._run(started)
        finally:
            self.metrics.close()

    def _serve_metrics(self) -> None:
        if self.metrics_port is None:
            return
        host = metrics_host()
        try:
            port = self.metrics.serve(self.metrics_port, host)
        except OSError as exc:
            why = f"metrics cannot be served on {host}:{self.metrics_port}: {exc.strerror or exc}"
            if self.metrics_required:
                raise WorkerFailedError(why) from None
            log.warning("%s; the worker runs without them", why)
            return
        log.info("worker %s serves metrics on http://%s:%d/metrics", self.worker, host, port)

    async def _run(self, started: float) -> WorkerReport:
        boot = DbSlot(self.url)
        try:
            self.wid = await boot.call(store.worker_id, self.worker, give_up_s=STARTUP_GIVE_UP_S)
            # A missing or wrong key stops the worker here, in one line.
            await boot.call(sealed.check_stored, give_up_s=STARTUP_GIVE_UP_S)
        finally:
            boot.close()
        hand_over = self.hand_over
        # Connected before the lease: a successor waiting for it starts pushing sooner.
        self.aux = DbSlot(self.url)
        await self.aux.call(lambda c: None, give_up_s=STARTUP_GIVE_UP_S)
        first = [True]  # only the first take waits and calls on_lease; a retake never does

        def take(conn) -> None:
            if not first[0]:
                store.take_lease(conn, self.worker, self.wid)
                return
            store.take_lease(conn, self.worker, self.wid, hand_over.lease_wait_s)
            first[0] = False
            if hand_over.on_lease is not None:
                hand_over.on_lease()

        # Keepalives: a worker cut off from the database notices and loses its lease (and
        # runner claims) promptly.
        self.lease = DbSlot(
            self.url, take, application_name=hand_over.application_name, **KEEPALIVES
        )
        self.sinks = sinks.Sinks()
        settings = WorkerSettings()
        self.cache = WindowCache(
            self._read,
            self._rules,
            settings.buffer_bytes // CACHE_SHARE,
            self._window,
            self._read_offsets,
        )
        self.signals = BusSignals()
        self.committer = Committer(
            self.lease,
            self.aux,
            self.wid,
            lambda: self.runners.values(),
            self._hand_off,
            self._committed,
            metrics=self.metrics,
        )
        # Destinations' rate limits: tokens leased from their buckets on a connection of
        # their own, so a lease never queues behind a commit or a heartbeat.
        self.rate_slot = DbSlot(self.url)
        self.rates = rates.RateGates(self._lease_tokens, self._spawn)
        self.lanes = Lanes(
            self.report,
            self.sinks,
            self.cache,
            self.signals,
            self.committer,
            self._spawn,
            metrics=self.metrics,
            rates=self.rates,
        )
        self.lanes.runners = self.runners
        self.background = background = []
        # Everything that needs no lease is ready before it is taken (the source's reader
        # listening, the rule engine imported), so a successor that waited for the lease
        # pushes at once: its LISTEN also hears eventpush publish elsewhere.
        self._open_source(sources.POSTGRES)
        import eventpush.rules.patterns  # noqa: F401  (first used once runners are known)

        try:
            # Take the lease now or fail (waiting out a database that is slow to answer).
            await self.lease.call(lambda c: None, give_up_s=STARTUP_GIVE_UP_S)
        except BaseException:
            await self._close_early(background)
            raise
        self.committing = self._spawn(self._committing(), "committer")
        background += [
            self.committing,
            self._spawn(self._heartbeat(), "heartbeat"),
            self._spawn(self._sampler(), "metrics sampler"),
        ]
        try:
            try:
                await self._refresh()
            except Exception as exc:
                if isinstance(exc, store.WorkerBusyError | store.LeaseLostError):
                    raise
                log.error("assignment refresh failed", exc_info=exc)
                raise WorkerFailedError(f"assignment refresh failed: {first_line(exc)}") from None
            # Only now: a controller refresh racing the first one would start runners twice.
            background.append(self._spawn(self._controller(), "controller"))
            background.append(self._spawn(self._catalog_watch(), "catalog watcher"))
            _freeze_startup_objects()
            await self._supervise(started)
        finally:
            await self._shutdown(background)
            self.report.seconds = round(time.monotonic() - started, 3)
        if self.fatal is not None:
            raise self.fatal
        return self.report

    async def _close_early(self, background: list[asyncio.Task]) -> None:
        """Undo what was set up before the lease, which could not be taken."""
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for reader in self.sources.values():
            with contextlib.suppress(Exception):
                await reader.close()
        for slot in (self.lease, self.aux, self.rate_slot):
            await slot.settle(timeout=FINAL_COMMIT_GIVE_UP_S)
            slot.close()

    async def _supervise(self, started: float) -> None:
        last_progress = 0.0
        yield_after = self.hand_over.yield_after_s
        while not self.stopping.is_set():
            await wait_for_event(self.stopping, HAND_OVER_LOOK_S)
            now = time.monotonic()
            if self.max_seconds is not None and now - started >= self.max_seconds:
                break
            if self.until_idle and self._idle():
                break
            if (
                yield_after is not None
                and now - started >= yield_after
                and await self.aux.call(store.lease_wanted, self.wid)
            ):
                log.info("worker %s hands over to the process waiting for it", self.worker)
                break
            if self.progress and now - last_progress >= 1.0:
                last_progress = now
                self.progress(self.report.as_dict())

    def _idle(self) -> bool:
        if self.committer.has_work() or self.retiring:
            return False
        if self.lanes.paused:
            return True  # nothing will move until the worker is resumed
        if self.waiting:
            return False  # work assigned here that the previous worker still holds
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
        # Deleted runners still being finished: stopped like the rest, their outcomes in the
        # final commit; the next start lets go of them.
        retiring = set(self.retiring.values())
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        runners = list(self.runners.values())
        for runner in runners:
            self.lanes.stop_taking(runner)
        await _let_sends_end(runners)
        await self.rates.close()
        committer = self.committing
        for task in background:
            if task is not committer:
                task.cancel()
        # A commit under way is let finish; if it will not, it is cancelled and stays
        # pending with its transaction id, and the final commit looks it up first.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(COMMITTER_STOP_S):
                await asyncio.shield(self._quiet(committer))
        committer.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self.fatal is None:
            try:
                await self.committer.commit(give_up_s=FINAL_COMMIT_GIVE_UP_S)
            except Exception as exc:  # the rows are lost from memory, never the events
                log.error(
                    "final commit failed (%s): uncommitted records will be redelivered",
                    first_line(exc),
                )
        # The lease goes first, before the clients and readers close: a successor waiting
        # for it starts pushing while this process tidies up.
        await self.lease.settle(timeout=FINAL_COMMIT_GIVE_UP_S)
        if self.lease.conn is not None and not self.lease.conn.closed and self.fatal is None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(store.release_lease, self.lease.conn, self.wid)
        self.lease.close()
        await self.sinks.close()
        for reader in self.sources.values():
            try:
                await reader.close()
            except Exception as exc:
                log.warning("source reader not closed cleanly: %s", first_line(exc))
        for slot in (self.aux, self.rate_slot):
            await slot.settle(timeout=FINAL_COMMIT_GIVE_UP_S)
            slot.close()

    async def _lease_tokens(self, destination: str, rate: float, want: int) -> tuple[int, float]:
        return await self.rate_slot.call(rates.lease, destination, rate, want)

    async def _quiet(self, committer: asyncio.Task) -> None:
        """Wait until no commit is under way (the committer's next one never starts: the
        final commit takes the lock after it is cancelled)."""
        while not committer.done() and self.committer.lock.locked():
            await asyncio.sleep(0.01)

    # --- assignment and controls ----------------------------------------------------------

    async def _controller(self) -> None:
        """Re-read the assignment, controls and catalog versions every CONTROL_INTERVAL_S,
        and at once when the catalog says something changed (a notification lost with its
        connection is covered by the periodic read)."""
        while True:
            await wait_for_event(self.catalog_changed, CONTROL_INTERVAL_S)
            self.catalog_changed.clear()
            await self._refresh()

    async def _catalog_watch(self) -> None:
        from eventpush.sources.postgres import CATALOG_CHANNEL, watch_channel

        await watch_channel(self.url, CATALOG_CHANNEL, lambda _bus_id: self.catalog_changed.set())

    async def _refresh(self) -> None:
        async with self.refresh_lock:
            await self._refresh_locked()

    async def _refresh_locked(self) -> None:
        assignment = await self.aux.call(store.read_assignment, self.wid, self.worker)
        assigned, controls, versions = assignment.runners, assignment.controls, assignment.versions
        newly_deleted = assignment.deleted - self.retiring.keys()
        if newly_deleted and not self.stopping.is_set():
            self._start_retiring(newly_deleted)
        paused = bool(controls.get("paused", False))
        settings = worker_settings(controls)
        if paused != self.lanes.paused or settings != self.lanes.settings:
            self.lanes.paused = paused
            self.lanes.settings = settings
            self.lanes.pool.resize(settings.pool_max)
            self.cache.max_bytes = settings.buffer_bytes // CACHE_SHARE
            for runner in self.runners.values():  # an adaptive limit's ceiling is the pool
                self.lanes.attach(runner)
            self.lanes.wake_all()  # a resume or wider limits are acted on now
        moved = [
            rid
            for rid, runner in self.runners.items()
            if rid not in assignment.deleted
            and (rid not in assigned or assigned[rid][1] != runner.generation)
        ]
        if moved:
            for rid in moved:
                name = self.runners[rid].target.runner
                log.info("runner %s moved away from worker %s", name, self.worker)
            await self._hand_off(frozenset(moved))
        new = {rid: row[1] for rid, row in assigned.items() if rid not in self.runners}
        if new and not self.stopping.is_set():
            claimed = await self.lease.call(store.claim_runners, self.wid, new)
            for rid in set(new) - claimed - self.waiting:
                log.info("runner %s waits for its previous worker to let go", rid)
            self.waiting = set(new) - claimed
            if claimed:
                targets = await self.aux.call(store.read_targets, sorted(claimed))
                await self._know_buses({t.bus_id for t in targets})
                offsets = await self.aux.call(store.read_offsets, sorted(claimed))
                histories = await self.aux.call(read_histories, sorted(claimed))
                for target in targets:
                    rid = target.runner_id
                    runner = Runner(target, offsets.get(rid, {}), assigned[rid], histories[rid])
                    self.committer.versions.extend(runner.take_effect())
                    self.runners[rid] = runner
                    self._forget_bus(target.bus_id)
                    runner.epoch = self.cache.epoch
                    self.lanes.start(runner)
        else:
            self.waiting = set()
        await self._retarget(versions)
        self._forget_unheld()
        for rid, row in assigned.items():
            if rid in self.runners:
                runner = self.runners[rid]
                runner.apply(row)
                for qid, cursor in runner.cursors.items():  # history no event can need now
                    runner.history.forget_before(qid, cursor.committed_db)

    def _forget_unheld(self) -> None:
        """What only runners no longer here used: at every refresh and after a retirement,
        not only after a retarget. The gates of destinations whose runners were handed off
        (deleted, moved) stayed until some runner here took a new version, and with them
        their figures in the heartbeat and on /metrics; buses no runner here reads any more
        stayed for the worker's life, watched by its source's reader and their heads read at
        every heartbeat (one read again is loaded again at its claim)."""
        self.rates.keep({r.gate.name for r in self.runners.values() if r.gate is not None})
        live = {r.target.bus_id for r in self.runners.values()}
        for bus_id in [b for b in self.buses if b not in live]:
            del self.buses[bus_id]
            self.signals.forget(bus_id)

    async def _retarget(self, versions: dict[int, tuple[int, int]]) -> None:
        """Runners whose rule or target changed in the catalog take the new version live.
        An ordered target that becomes unordered (or back) is restarted instead: its lanes
        differ (handed off here, claimed again at the next refresh)."""
        changed = [
            rid
            for rid, runner in self.runners.items()
            if rid in versions
            and versions[rid] != (runner.target.rule_version, runner.target.target_version)
        ]
        if not changed:
            return
        restart = []
        for target in await self.aux.call(store.read_targets, changed):
            runner = self.runners.get(target.runner_id)
            if runner is None:
                continue
            if (target.ordered, target.concurrency_auto) != (
                runner.target.ordered,
                runner.target.concurrency_auto,
            ):
                restart.append(runner.id)
                continue
            self.committer.versions.extend(runner.retarget(target))
            self.lanes.attach(runner)  # its destination or rate limit may have changed
            self._forget_bus(target.bus_id)
            runner.epoch = self.cache.epoch
            log.info(
                "runner %s now at rule version %d, target version %d",
                target.runner,
                target.rule_version,
                target.target_version,
            )
        if restart:
            await self._hand_off(frozenset(restart))

    def _start_retiring(self, runner_ids: frozenset[int]) -> None:
        """Runners deleted in the catalog take no more work from now on, and are finished
        off in a task of their own (``_retire``): a target that hangs holds up no other
        change this worker is to take."""
        for rid in sorted(runner_ids):
            if rid in self.runners:
                runner = self.runners[rid]
                log.info("runner %s deleted: its sends under way finish", runner.target.runner)
                self.lanes.stop_taking(runner)
        task = self._spawn(self._retire(runner_ids), f"retiring runners {sorted(runner_ids)}")
        self.retiring.update(dict.fromkeys(runner_ids, task))

    async def _retire(self, runner_ids: frozenset[int]) -> None:
        """The sends under way of deleted runners end (within their target's timeout, as
        at a stop), what they delivered is committed, and only then are the runners let go:
        handed off at once instead, the deliveries of a target deleted a moment after them
        were missing from its books. A commit that fails leaves them to the next refresh."""
        try:
            runners = [self.runners[rid] for rid in sorted(runner_ids) if rid in self.runners]
            await _let_sends_end(runners)
            if runners:
                try:
                    await self.committer.commit(give_up_s=FINAL_COMMIT_GIVE_UP_S)
                except Exception as exc:  # kept, stopped: the next refresh tries again
                    log.warning("deleted runners' last outcomes not committed: %s", first_line(exc))
                    return
            # Under the refresh's lock: a refresh between loading a new runner's bus and
            # starting the runner must not see that bus as nobody's.
            async with self.refresh_lock:
                if runners:
                    await self._hand_off(frozenset(r.id for r in runners))
                await self.lease.call(store.let_go_deleted, self.wid, sorted(runner_ids))
                self._forget_unheld()
        finally:
            for rid in runner_ids:
                self.retiring.pop(rid, None)

    async def _hand_off(self, runner_ids: frozenset[int]) -> None:
        """Runners that are no longer ours: stop every send, forget their uncommitted rows,
        and only then let go of their claims so the next worker may start."""
        runners = [self.runners.pop(rid) for rid in runner_ids if rid in self.runners]
        tasks = []
        for runner in runners:
            tasks.extend(self.lanes.fence(runner))
            self.committer.drop(runner.id)
            self._forget_bus(runner.target.bus_id)
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=HAND_OFF_GIVE_UP_S)
            if running:
                names = ", ".join(sorted(task.get_name() for task in running))
                raise WorkerFailedError(
                    f"hand-off stuck: {names} still running {HAND_OFF_GIVE_UP_S:g} s after "
                    "being cancelled"
                )
        if runners:
            await self.lease.call(store.release_runners, [r.id for r in runners])

    def _committed(self) -> None:
        for runner in self.runners.values():
            runner.room.set()

    def _forget_bus(self, bus_id: int) -> None:
        """The bus's runners changed: cached matches are stale."""
        self.cache.forget_bus(bus_id)
        self.indexes.pop(bus_id, None)

    # --- reading --------------------------------------------------------------------------

    def _rules(self, bus_id: int):
        index = self.indexes.get(bus_id)
        if index is None:
            index = self.indexes[bus_id] = RuleIndex(
                (r.id, r.pattern)
                for r in self.runners.values()
                if r.target.bus_id == bus_id and r.matching
            )
        return index

    async def _know_buses(self, bus_ids: set[int]) -> None:
        """Load the buses of new runners, and open the reader of each new kind of source."""
        new = bus_ids - set(self.buses)
        if new:
            self.buses.update(await self.aux.call(sources.read_buses, sorted(new)))
            for bus_id in new:
                self._open_source(self.buses[bus_id].scheme)

    def _open_source(self, scheme: str) -> None:
        if scheme in self.sources:
            return
        kind = sources.kind_named(scheme)
        reader = self.sources[scheme] = kind.open_reader(self.url)
        task = self._spawn(
            reader.watch(lambda: list(self.buses.values()), self.signals.wake),
            f"{scheme} watcher",
        )
        self.background.append(task)

    async def _read(self, bus_id: int, queue_id: int, start: int, stop: int) -> sources.Chunk:
        bus = self.buses[bus_id]
        return await self.sources[bus.scheme].read(bus, queue_id, start, stop)

    async def _read_offsets(self, bus_id: int, queue_id: int, offsets: list[int]) -> list | None:
        bus = self.buses[bus_id]
        return await self.sources[bus.scheme].read_offsets(bus, queue_id, offsets)

    def _window(self, bus_id: int) -> int:
        bus = self.buses[bus_id]
        return self.sources[bus.scheme].window_for(bus)

    async def _record_heads(self) -> None:
        """Heads of buses on a broker, recorded for status and lag (the database holds a
        PostgreSQL bus's own)."""
        for bus in list(self.buses.values()):
            reader = self.sources.get(bus.scheme)
            if bus.source_url is None or reader is None:
                continue
            try:
                async with asyncio.timeout(HEARTBEAT_INTERVAL_S):
                    heads = await reader.heads(bus)
                if heads:
                    await self.aux.call(sources.record_heads, bus.id, heads, give_up_s=5)
            except Exception as exc:  # a stale lag figure never stops the pushing
                log.warning("heads of bus %s not read: %s", bus.name, first_line(exc))

    # --- committing -----------------------------------------------------------------------

    async def _committing(self) -> None:
        while True:
            await asyncio.sleep(COMMIT_INTERVAL_S)
            await self.committer.commit()

    # --- metrics --------------------------------------------------------------------------

    async def _sampler(self) -> None:
        """Event-loop lag (how late a short timer fires) and the runners' live gauges."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_SAMPLE_S
            await asyncio.sleep(LOOP_SAMPLE_S)
            lag = max(loop.time() - due, 0.0)
            self.loop_lags.append(lag)
            del self.loop_lags[:-LOOP_SAMPLES_KEPT]
            self.metrics.loop_lag.labels(self.worker).set(lag)
            self.metrics.runner_state(
                {
                    r.target.runner: (r.inflight, r.breaker.is_open, r.limiter.limit)
                    for r in list(self.runners.values())
                }
            )
            self.metrics.destinations(self.rates.figures())

    def _loop_lag_ms(self) -> float | None:
        """The mean loop lag since the last heartbeat, for the rebalancer's headroom (the
        previous figure when no sample came in between; None before the first)."""
        lags, self.loop_lags = self.loop_lags, []
        if lags:
            self.loop_lag_ms = round(sum(lags) / len(lags) * 1000, 2)
        return self.loop_lag_ms

    async def _refresh_lag(self) -> None:
        names = {r.id: r.target.runner for r in list(self.runners.values())}
        try:
            lag = await self.aux.call(metrics_mod.read_lag, sorted(names), give_up_s=5)
        except Exception as exc:  # a gauge left stale never stops the pushing
            log.warning("lag for metrics not read: %s", first_line(exc))
            return
        for rid, (events, waiting, seconds) in lag.items():
            if rid in names:
                self.metrics.lag(names[rid], events, waiting, seconds)

    # --- heartbeat ------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        # Deferred: psutil is loaded only by the heartbeat that samples the process.
        import psutil

        proc = psutil.Process()
        proc.cpu_percent(None)
        while True:
            await self._beat(proc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _beat(self, proc) -> None:
        runner_stats, lanes, all_latencies = [], {}, []
        for runner in list(self.runners.values()):
            p50, p99 = runner.percentiles()
            runner_stats.append((runner.id, p50, p99))
            all_latencies.extend(runner.latencies)
            lanes[runner.target.runner] = {
                "fresh": len(runner.fresh) + sum(map(len, runner.ordered_lines.values())),
                "retry": sum(map(len, runner.retry)) + sum(len(d[2]) for d in runner.delayed),
                "in_flight": runner.inflight,
                "concurrency": runner.limiter.limit,
                "concurrency_auto": runner.adaptive is not None,
                "destination": runner.target.destination,
                "active": runner.limiter.in_use,
                "breaker_open": runner.breaker.is_open,
                "paused": runner.paused,
                "buffered_bytes": sum(c.inflight_bytes for c in runner.cursors.values()),
            }
        quantiles = statistics.quantiles(all_latencies, n=100) if len(all_latencies) > 1 else None
        settings = self.lanes.settings
        metrics = {
            "cpu_percent": proc.cpu_percent(None),
            "rss_mib": round(proc.memory_info().rss / 2**20, 1),
            "pool": {
                "core": settings.pool_core,
                "max": settings.pool_max,
                "active": self.lanes.pool.in_use,
                "free": self.lanes.pool.free(),
            },
            "paused": self.lanes.paused,
            "latency_p50_ms": quantiles[49] if quantiles else None,
            "latency_p99_ms": quantiles[98] if quantiles else None,
            "window_cache_bytes": self.cache.bytes,
            "window_verdict_bytes": self.cache.verdict_bytes,
            "loop_lag_ms": self._loop_lag_ms(),
            "report": self.report.as_dict(),
            "lanes": lanes,
            # Per destination with a rate limit: its limit, sends let through by this worker
            # (and per second since the last heartbeat), seconds sends waited for it
            # (growing while it holds them back), waiting now.
            "destinations": self.rates.heartbeat_figures(),
        }
        try:
            await self._record_heads()
            await self.aux.call(store.heartbeat, self.wid, metrics, runner_stats, give_up_s=5)
            await self._refresh_lag()
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("heartbeat failed: %s", first_line(exc))


async def _let_sends_end(runners: list[Runner]) -> None:
    """The sends under way of runners that take no more work: let end within the longest of
    their targets' timeouts (at most STOP_GRACE_S), then cancelled."""
    sends = set().union(*(r.sends for r in runners))
    if sends:
        longest_s = max(r.target.timeout_ms for r in runners) / 1000
        _, pending = await asyncio.wait(sends, timeout=min(STOP_GRACE_S, longest_s) + 0.5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def run_worker(
    worker: str,
    *,
    until_idle: bool = False,
    max_seconds: float | None = None,
    url: str | None = None,
    progress: Callable[[dict], None] | None = None,
    handle_signals: bool = False,
    metrics_port: int | None = None,
    metrics_required: bool = True,
    hand_over: HandOver | None = None,
) -> WorkerReport:
    """Run one worker's push loop until idle, a time budget, or SIGTERM/SIGINT (graceful:
    in-flight sends finish or are handed back, outcomes are committed, the lease released).
    With ``metrics_port`` (0: any free port) it serves Prometheus ``/metrics`` meanwhile; a
    port it cannot bind stops it at once unless ``metrics_required`` is False. ``hand_over``:
    how it takes the lease from and gives it to another run (:class:`HandOver`)."""
    url = url or database_url()
    engine = Engine(
        worker,
        url,
        until_idle=until_idle,
        max_seconds=max_seconds,
        progress=progress,
        metrics_port=metrics_port,
        metrics_required=metrics_required,
        hand_over=hand_over,
    )

    async def main() -> WorkerReport:
        if handle_signals and threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, engine.stop)
        return await engine.run()

    # uvloop roughly halves the event loop's own cost per request on the hot path.
    import uvloop

    with collector_tuned(), batch_scheduled():
        return uvloop.run(main())
