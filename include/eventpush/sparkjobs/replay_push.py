"""Replay's executor side: pushing the selected records and writing what became of them.

The driver (:mod:`eventpush.sparkjobs.replay`) checks a request, selects its records and
hands them here in groups (:func:`spread`, one per pushing partition, :func:`push_partitions`
of them). Each partition (:func:`push_partition`) reads the events' bodies, pushes them with
the engine's delivery code (the sinks, signing, inline retries, the stable ``webhook-id``)
at the request's rate, and writes its delivery rows (origin ``replay``) and failure-row
updates in one transaction while the pushes go on (:func:`_write_outcomes`, the engine's own
row builder and COPY writer). A ``failed`` or ``missing`` record that gained a delivery row
since the selection is skipped, so a replay is safe to run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, deque

from eventpush.db import connect, connection, int_array, transaction
from eventpush.push.committing import outcome_rows
from eventpush.push.store import copy_deliveries, load_targets
from eventpush.rules.transforms import compile_transform
from eventpush.sinks import Sinks
from eventpush.sinks.contract import DELIVERED, FINAL, Record, by_answer

PUSH_CONCURRENCY = 16  # requests in flight per partition
WRITE_INTERVAL_S = 0.2  # how often a partition writes its finished outcomes (as the engine)
# A pushing partition is a Python process, a database connection and an HTTP pool: below this
# many records a second one cost more than it gave (docs/BENCHMARKS.md, replay).
RECORDS_PER_PUSH_PARTITION = 50_000
NOT_RESTORED = (
    "{where} still holds this record's key (a removed message whose id it remembers within "
    "its duplicate window): not restored; replay it again once the window has passed"
)


def push_partition(
    db_url: str, replay_id: int, what: str, rate_per_partition: float | None, policy=None
):
    """The function each executor partition runs: push, then record, in one transaction.
    ``policy`` is the driver's address policy: executors enforce it, not their own env."""

    def run(groups):
        rows = [row for group in groups for row in group]  # one group per partition
        if not rows:
            return iter([])
        import uvloop  # as the engine: it roughly halves the loop's own cost per request

        return iter(uvloop.run(_push(db_url, replay_id, what, rate_per_partition, rows, policy)))

    return run


async def _push(db_url, replay_id, what, rate, rows, policy=None) -> list[tuple[str, int]]:
    # Deferred: bus_events imports PySpark at load.
    from eventpush.sparkjobs.bus_events import source_bodies

    conn = connect(db_url, application_name="eventpush-replay")
    try:
        with transaction(conn) as cur:
            ids = sorted({r["runner_id"] for r in rows})
            targets = {t.runner_id: t for t in load_targets(cur, "r.id = ANY(%s)", (ids,))}
            keys = [(r["runner_id"], r["bus_id"], r["queue_id"], r["offset"]) for r in rows]
            events = event_bodies(cur, [k[1:] for k in keys])
            bodies = {(rid, q, o): events[b, q, o] for rid, b, q, o in keys if (b, q, o) in events}
            already = set()
            if what != "all":
                cur.execute(
                    'SELECT DISTINCT d.runner_id, d.queue_id, d."offset" '
                    "FROM unnest(%s::int[], %s::int[], %s::bigint[]) AS k(runner_id, q, off) "
                    "JOIN event_push_delivery d ON d.runner_id = k.runner_id "
                    'AND d.queue_id = k.q AND d."offset" = k.off',
                    [int_array(k[i] for k in keys) for i in (0, 2, 3)],
                )
                already = {tuple(row) for row in cur.fetchall()}
        bodies.update(source_bodies(conn, keys))  # events of buses kept outside PostgreSQL
        transforms = {
            rid: compile_transform(t.transform_kind, t.transform_spec) for rid, t in targets.items()
        }
        interval = 1.0 / rate if rate else 0.0
        start = time.monotonic()
        pending: list = []  # (target, records, outcome) not yet written
        counts = {"delivered": 0, "failed": 0}

        def record(row) -> Record:
            raw = bodies[(row["runner_id"], row["queue_id"], row["offset"])]
            return Record(row["queue_id"], row["offset"], row["message_id"], json.loads(raw), raw)

        async def send(first: int, batch: list, sinks) -> None:
            """One request of up to ``batch_size`` records, paced by its first record's index."""
            if interval:  # record i goes no earlier than i / rate
                delay = start + first * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            target = targets[batch[0]["runner_id"]]
            records = [record(row) for row in batch]
            outcome = await sinks.deliver(target, records, transforms[target.runner_id])
            if outcome.held and any(batch[i]["absent"] for i in outcome.held):
                not_restored(batch, outcome)
            pending.append((target, records, outcome))

        todo: dict[int, list] = {}
        skipped = 0
        for row in rows:
            key = (row["runner_id"], row["queue_id"], row["offset"])
            # An absent record has its delivery row: the destination lost it, not the books.
            done = key in already and not row["absent"]
            if done or key not in bodies or row["runner_id"] not in targets:
                skipped += 1
            else:
                todo.setdefault(row["runner_id"], []).append(row)
        # As live: a batch target gets batches of its size; an ordered target gets one sender
        # per queue that sends its batches in offset order, each after the one before is final.
        lines: deque[list[tuple[int, list]]] = deque()
        first = 0
        for runner_id, runner_rows in sorted(todo.items()):
            target = targets[runner_id]
            runner_rows.sort(key=lambda r: (r["queue_id"], r["offset"]))
            queues: dict[int, list] = {}
            for row in runner_rows:
                queues.setdefault(row["queue_id"] if target.ordered else -1, []).append(row)
            for queue_rows in queues.values():
                line = []
                for k in range(0, len(queue_rows), target.batch_size):
                    line.append((first, queue_rows[k : k + target.batch_size]))
                    first += len(line[-1][1])
                lines.extend([line] if target.ordered else [[b] for b in line])

        async def sender(sinks) -> None:
            # A fixed set of senders taking lines in order: the concurrency bound without a
            # task (and a semaphore waiter) per request.
            while lines:
                for first, batch in lines.popleft():
                    await send(first, batch, sinks)

        # One transaction for the partition, as before, but written while the pushes go on
        # (as the engine's committer does), not after them: the rows' foreign-key checks and
        # index updates cost about as much as the requests themselves.
        with transaction(conn) as cur:
            done = asyncio.Event()

            async def writer() -> None:
                while True:
                    finished = done.is_set()
                    chunk = pending[:]
                    pending.clear()
                    if chunk:
                        await asyncio.to_thread(_write_outcomes, cur, chunk, replay_id, counts)
                    if finished:
                        return
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(WRITE_INTERVAL_S):
                            await done.wait()

            writing = asyncio.create_task(writer())
            try:
                async with Sinks(policy) as sinks:
                    senders = min(PUSH_CONCURRENCY, len(lines))
                    await asyncio.gather(*(sender(sinks) for _ in range(senders)))
            finally:
                done.set()
                await writing
    finally:
        conn.close()
    return [("delivered", counts["delivered"]), ("failed", counts["failed"]), ("skipped", skipped)]


def not_restored(batch: list, outcome) -> None:
    """Absent records the destination answered as held on their first attempt were not
    written again: each fails with the reason (``NOT_RESTORED``), the rest keep their
    answers."""
    answers = outcome.per_record or [(outcome.kind, outcome.error)] * len(batch)
    why = NOT_RESTORED.format(where=outcome.held_by or "the destination")
    for i in outcome.held:
        if batch[i]["absent"]:
            answers[i] = (FINAL, why)
    outcome.per_record = answers
    if len(set(answers)) == 1:
        outcome.kind, outcome.error = answers[0]


def event_bodies(cur, keys: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], str]:
    """Bodies of the events at ``keys`` (bus_id, queue_id, offset), each read once: a queue
    whose wanted offsets lie close together is read as one range of its index (a replay of a
    run of failures, or of a window), the others offset by offset."""
    wanted: dict[tuple[int, int], set[int]] = {}
    for bus_id, queue_id, offset in keys:
        wanted.setdefault((bus_id, queue_id), set()).add(offset)
    ranges, scattered = [], []
    for (bus_id, queue_id), offsets in wanted.items():
        lo, hi = min(offsets), max(offsets)
        if hi - lo + 1 <= 2 * len(offsets):
            ranges.append((bus_id, queue_id, lo, hi + 1))
        else:
            scattered.extend((bus_id, queue_id, offset) for offset in offsets)
    rows = []
    if ranges:
        cur.execute(
            'SELECT e.bus_id, e.queue_id, e."offset", e.body::text '
            "FROM unnest(%s::int[], %s::int[], %s::bigint[], %s::bigint[]) "
            "AS w(bus_id, queue_id, lo, hi) JOIN bus_event e ON e.bus_id = w.bus_id "
            'AND e.queue_id = w.queue_id AND e."offset" >= w.lo AND e."offset" < w.hi',
            [int_array(r[i] for r in ranges) for i in range(4)],
        )
        rows += cur.fetchall()
    if scattered:
        cur.execute(
            'SELECT e.bus_id, e.queue_id, e."offset", e.body::text '
            "FROM unnest(%s::int[], %s::int[], %s::bigint[]) AS k(bus_id, queue_id, off) "
            "JOIN bus_event e ON e.bus_id = k.bus_id AND e.queue_id = k.queue_id "
            'AND e."offset" = k.off',
            [int_array(k[i] for k in scattered) for i in range(3)],
        )
        rows += cur.fetchall()
    return {(b, q, o): body for b, q, o, body in rows}


def _write_outcomes(cur, outcomes: list, replay_id: int, counts: dict) -> None:
    """Delivery rows (origin ``replay``), and failure rows marked ``replayed`` or ``dead``, for
    finished requests, built by the engine's own row builder and written by its COPY writer,
    so live and replay rows cannot drift apart."""
    # Deferred: psycopg2's extras are loaded only by the executors that write rows.
    import psycopg2.extras

    delivered, failed = [], []  # delivery rows; (failure row, the runner's broker_name)
    brokers = {}  # runner -> its delivery rows' broker_name
    for target, sent, answer in outcomes:
        for outcome, records in by_answer(sent, answer):
            rows = outcome_rows(target, records, outcome)
            if outcome.kind == DELIVERED:
                delivered.extend(rows)
                brokers[target.runner_id] = target.broker
            else:
                failed.extend((row, target.broker) for row in rows)
    if delivered:
        # The runners' counters first: a worker's commit holds its runner rows FOR SHARE
        # while it writes failure rows, so taking them before the failure rows below keeps
        # the two in one lock order.
        per_runner = Counter(d.runner_id for d in delivered)
        cur.execute(
            "UPDATE event_target_runner r SET replayed_total = r.replayed_total + k.n "
            "FROM unnest(%s::int[], %s::bigint[]) AS k(id, n) WHERE r.id = k.id",
            (list(per_runner), list(per_runner.values())),
        )
        copy_deliveries(cur, delivered, brokers, replay=True, replay_id=replay_id)
        cur.execute(
            "UPDATE event_push_failure f SET status = 'replayed', replay_id = %s, "
            "mtime = now() FROM unnest(%s::int[], %s::int[], %s::bigint[]) "
            "AS k(runner_id, q, off) WHERE f.runner_id = k.runner_id "
            'AND f.queue_id = k.q AND f."offset" = k.off',
            (
                replay_id,
                int_array(d.runner_id for d in delivered),
                int_array(d.queue_id for d in delivered),
                int_array(d.offset for d in delivered),
            ),
        )
    if failed:
        psycopg2.extras.execute_values(
            cur,
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, "
            'queue_id, "offset", message_id, attempts, http_status, last_error, broker_name, '
            'status, replay_id) VALUES %s ON CONFLICT (runner_id, queue_id, "offset") DO UPDATE '
            "SET status = 'dead', attempts = event_push_failure.attempts + "
            "EXCLUDED.attempts, http_status = EXCLUDED.http_status, "
            "last_error = EXCLUDED.last_error, replay_id = EXCLUDED.replay_id, mtime = now()",
            [(*f, broker, "dead", replay_id) for f, broker in failed],
            page_size=1000,
        )
    counts["delivered"] += len(delivered)
    counts["failed"] += len(failed)


def push_partitions(selected: int, parallelism: int) -> int:
    """How many partitions push: one per ``RECORDS_PER_PUSH_PARTITION`` records, at most one
    per executor core."""
    wanted = -(-selected // RECORDS_PER_PUSH_PARTITION)
    return max(1, min(wanted, parallelism))


def ordered_runners(db_url: str, runner_ids: list[int]) -> set[int]:
    """The runners among ``runner_ids`` whose target is ordered."""
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "SELECT r.id FROM event_target_runner r JOIN event_target t ON t.id = r.target_id "
            "WHERE r.id = ANY(%s) AND t.ordered",
            (runner_ids,),
        )
        return {row[0] for row in cur.fetchall()}


def spread(rows: list[dict], parts: int, ordered: set[int]) -> list[list[dict]]:
    """The selected rows in ``parts`` groups, one per pushing partition: an ordered target's
    queue stays in one group (one sender per queue, in offset order), whole queues going to
    the smallest group; an unordered target's records are dealt round, so a runner with few
    queues still keeps every partition busy."""
    if parts <= 1:
        return [rows]
    groups: list[list[dict]] = [[] for _ in range(parts)]
    queues: dict[tuple[int, int], list[dict]] = {}
    dealt = 0
    for row in rows:
        if row["runner_id"] in ordered:
            queues.setdefault((row["runner_id"], row["queue_id"]), []).append(row)
        else:
            groups[dealt % parts].append(row)
            dealt += 1
    for queue in sorted(queues.values(), key=len, reverse=True):
        min(groups, key=len).extend(queue)
    return groups
