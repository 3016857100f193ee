"""Committing: outcomes become delivery and failure rows, written with the offsets they allow
and the runner counters in one transaction on the lease connection.

Like a Kafka Connect sink task's offset commits, this runs beside the sending and never
inside it. Its rules:

- **Consistent.** Outcome buffers are swapped and offsets computed in one synchronous step of
  the event loop, so an offset never runs ahead of the rows that justify it.
- **Never blindly repeated.** A commit whose reply is lost (connection dropped at COMMIT,
  committer cancelled while its thread runs) stays *pending* with its transaction id; before it
  is written again, ``txid_status`` says whether it already committed.
- **Fenced.** Every commit names each runner's assignment generation; runners that moved
  make the database refuse it (``store.FencedError``): their sends are cancelled, their rows
  dropped, and the rest is committed again.
- **Backpressure.** While commits fail, the batch waits and new outcomes pile up only as far
  as feeders let them: a feeder stops pulling once its queue's pulled offset runs
  ``buffer_span`` past what is committed (see ``lanes``), so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from eventpush import tracing
from eventpush.backoff import Backoff
from eventpush.db import is_transient
from eventpush.dbslot import DbSlot
from eventpush.errors import first_line
from eventpush.push import store
from eventpush.sinks import contract
from eventpush.sinks.contract import Outcome, Record, Target

log = logging.getLogger("eventpush.push")

STATUS_POLL_S = 0.2


def outcome_rows(
    target: Target, batch: list[Record], outcome: Outcome, into: list | None = None
) -> list[store.DeliveryRow] | list[store.FailureRow]:
    """The rows one outcome leaves: a delivery row per record, or a failure row per record;
    appended to ``into`` when given (the committer's buffer: no list per send), else to a
    new list."""
    if outcome.kind == contract.DELIVERED:
        extra, row = (outcome.http_status, outcome.latency_ms), store.DeliveryRow
    else:
        extra, row = (outcome.http_status, outcome.error or "failed"), store.FailureRow
    rid, runner, bus = target.runner_id, target.runner, target.bus
    status, last = extra
    rows = [] if into is None else into
    # tuple.__new__ straight away: a NamedTuple's own __new__ is a Python function, and this
    # runs once per record finished, on the event loop; a loop, not a comprehension (its own
    # frame, for the one record of most sends).
    make, append = tuple.__new__, rows.append
    for r in batch:
        values = (rid, runner, bus, r.queue_id, r.offset, r.message_id, r.attempts, status, last)
        append(make(row, values))
    return rows


class Committer:
    """Buffers outcomes and commits them, under the lease, fenced by generation."""

    def __init__(
        self,
        lease: DbSlot,
        aux: DbSlot,
        wid: int,
        owned: Callable[[], Iterable],
        on_fenced: Callable[[frozenset[int]], Awaitable[None]],
        on_committed: Callable[[], None],
        metrics=None,
    ) -> None:
        self.lease = lease
        self.aux = aux  # for commit status look-ups: they must not need the lease
        self.wid = wid
        self.owned = owned  # runners whose outcomes and offsets this worker may commit
        self.on_fenced = on_fenced
        self.on_committed = on_committed
        self.deliveries: list[store.DeliveryRow] = []
        self.failures: list[store.FailureRow] = []
        self.versions: list[store.VersionRow] = []  # written with the next commit
        self.pending: tuple[store.CommitBatch, list] | None = None
        self.lock = asyncio.Lock()
        self.failing = False
        self.metrics = metrics  # eventpush.metrics.WorkerMetrics, or None

    def add(self, target: Target, batch: list[Record], outcome: Outcome) -> None:
        into = self.deliveries if outcome.kind == contract.DELIVERED else self.failures
        outcome_rows(target, batch, outcome, into)

    def drop(self, runner_id: int) -> None:
        """Forget a runner's uncommitted rows: it moved away, the next owner redelivers."""
        self.deliveries = [d for d in self.deliveries if d.runner_id != runner_id]
        self.failures = [f for f in self.failures if f.runner_id != runner_id]
        self.versions = [v for v in self.versions if v.runner_id != runner_id]

    def has_work(self) -> bool:
        return bool(self.deliveries or self.failures or self.versions or self.pending)

    def _gather(self) -> tuple[store.CommitBatch, list]:
        # One synchronous step: swap the outcome buffers and compute the offsets they allow.
        deliveries, failures, versions = self.deliveries, self.failures, self.versions
        self.deliveries, self.failures, self.versions = [], [], []
        offsets, written, generations, brokers = [], [], {}, {}
        for runner in self.owned():
            generations[runner.id] = runner.generation
            brokers[runner.id] = runner.target.broker
            for c in runner.cursors.values():
                committable = c.committable()
                if committable != c.committed_db or c.pulled != c.pulled_db:
                    offsets.append(
                        store.OffsetRow(
                            runner.id, c.queue_id, committable, c.pulled, c.last_message_id
                        )
                    )
                    written.append((runner.id, c, committable, c.pulled))
        if any(d.runner_id not in generations for d in deliveries) or any(
            f.runner_id not in generations for f in failures
        ):  # rows of a runner no longer ours: never written
            deliveries = [d for d in deliveries if d.runner_id in generations]
            failures = [f for f in failures if f.runner_id in generations]
        versions = [v for v in versions if v.runner_id in generations]
        batch = store.CommitBatch(deliveries, failures, offsets, generations, brokers)
        batch.versions = versions
        return batch, written

    async def commit(self, give_up_s: float | None = None) -> None:
        """Commit what an interrupted commit left pending, then what has gathered; transient
        errors are retried with backoff (until ``give_up_s``), anything else is raised."""
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        async with self.lock:
            for _ in range(2):
                if self.pending is None:
                    batch, written = self._gather()
                    if batch.empty():
                        return
                    self.pending = (batch, written)
                started = time.perf_counter()
                with tracing.commit_span(self.metrics.worker if self.metrics else str(self.wid)):
                    await self._write(deadline)
                batch, written = self.pending
                self.pending = None
                if self.metrics is not None:
                    self.metrics.commit_seconds.observe(time.perf_counter() - started)
                    self.metrics.committed(batch.deliveries, batch.failures)
                for _, cursor, committable, pulled in written:
                    cursor.committed_db = max(cursor.committed_db, committable)
                    cursor.pulled_db = pulled
                if self.failing:
                    self.failing = False
                    log.warning("commits succeed again")
                self.on_committed()

    async def _write(self, deadline: float | None) -> None:
        backoff = Backoff()
        while True:
            # A cancelled commit's thread may still be writing this very batch: let it end
            # first, so its transaction id (if it got one) tells the whole story.
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            await self.lease.settle(remaining)
            batch, written = self.pending
            if batch.xid is not None and await self._committed(batch.xid, deadline):
                return
            batch.xid = None
            if batch.empty():
                return
            try:
                await self.lease.call(store.commit, self.wid, batch, retry=False)
                return
            except store.FencedError as exc:
                log.warning("commit refused: %s; their sends stop", exc)
                self.pending = (
                    batch.without(exc.runner_ids),
                    [w for w in written if w[0] not in exc.runner_ids],
                )
                await self.on_fenced(exc.runner_ids)
                continue
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if deadline is not None and time.monotonic() > deadline:
                    raise
                if not self.failing:
                    self.failing = True
                log.warning("commit failed (%s); retrying in %.1fs", first_line(exc), backoff.delay)
                await backoff.wait()

    async def _committed(self, xid: int, deadline: float | None) -> bool:
        """Did the transaction of an interrupted commit commit? Waits while it is still in
        progress (its backend has not noticed the lost client yet)."""
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            status = await self.aux.call(store.commit_status, xid, give_up_s=remaining)
            if status == "committed":
                log.warning("a commit whose reply was lost had committed; not repeated")
                return True
            if status != "in progress":
                return False
            if deadline is not None and time.monotonic() > deadline:
                raise store.StoreError("a lost commit is still in progress; giving up")
            await asyncio.sleep(STATUS_POLL_S)
