"""Rebalancing: which worker pushes which runner, balanced by load relative to capacity.

Inputs: the enabled workers (capacity, metrics), the runners of enabled rules with their
current worker, and each runner's load from the delivery log over a recent window, computed
in Spark: ``load = rate x mean latency`` (Little's law: the concurrent requests it keeps
busy). With no delivery data every runner weighs 1, so the result is even by count.

The proposal is sticky. Runners on a missing or disabled worker (or on none) must move.
A worker over its capacity share of the total by more than ``tolerance`` sheds runners, but
never below its share; then the displaced runners go, heaviest first, to the worker whose
load relative to capacity stays lowest. Nothing else moves.

A proposal is applied in one transaction with a new generation (``event_assignment``), after
checking that the assignment it started from is still the current one; the push workers
re-read their runners and pick the change up.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from eventpush.db import connection, transaction

DEFAULT_WINDOW = timedelta(minutes=15)
TOLERANCE = 0.10


@dataclass(frozen=True)
class Worker:
    id: int
    name: str
    capacity: int
    metrics: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Runner:
    id: int
    name: str
    worker_id: int | None


@dataclass
class Inputs:
    workers: list[Worker]  # enabled only
    runners: list[Runner]
    load: dict[int, float]  # runner id -> load; empty when there is no delivery data
    worker_names: dict[int, str]  # every worker, enabled or not


@dataclass
class Proposal:
    assignment: dict[int, int | None]  # runner id -> worker id
    moves: int
    spread: float  # max over workers of relative load / mean relative load
    max_load_ratio: float  # the same, by load rather than relative to capacity
    loads: dict[int, float]  # worker id -> load

    def to_json(self, inputs: Inputs) -> dict:
        names = {r.id: r.name for r in inputs.runners}
        return {
            "assignment": {
                names[r]: inputs.worker_names.get(w) if w is not None else None
                for r, w in sorted(self.assignment.items(), key=lambda kv: names[kv[0]])
            },
            "moves": self.moves,
            "spread": round(self.spread, 4),
        }


def load_inputs(spark, db_url: str, window: timedelta = DEFAULT_WINDOW, now=None) -> Inputs:
    """Workers and runners from PostgreSQL; per-runner load from the delivery log in Spark."""
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute("SELECT id, name, capacity, enabled, metrics FROM event_push_worker")
        rows = cur.fetchall()
        cur.execute(
            "SELECT r.id, r.name, r.worker_id FROM event_target_runner r "
            "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
            "WHERE ru.state = 'ENABLED' ORDER BY r.id"
        )
        runners = [Runner(*row) for row in cur.fetchall()]
    workers = [Worker(wid, name, cap, metrics or {}) for wid, name, cap, on, metrics in rows if on]
    names = {wid: name for wid, name, *_ in rows}
    load = runner_load(spark, db_url, [r.id for r in runners], window, now)
    return Inputs(workers=workers, runners=runners, load=load, worker_names=names)


def runner_load(spark, db_url: str, runner_ids: list[int], window: timedelta, now=None):
    """runner id -> rate (deliveries/s) x mean latency (s) over the window."""
    from pyspark.sql import functions as F

    from eventpush.sparkjobs import jdbc

    if not runner_ids:
        return {}
    now = now or datetime.now(UTC)
    db = jdbc.jdbc_database(db_url)
    log = jdbc.read_by_runner(
        spark, db, "event_push_delivery", "runner_id, ctime, latency_ms", runner_ids
    ).where(F.col("ctime") >= F.lit(now - window))
    seconds = window.total_seconds()
    rows = (
        log.groupBy("runner_id")
        .agg(F.count(F.lit(1)).alias("n"), F.avg("latency_ms").alias("latency_ms"))
        .collect()
    )
    return {
        row["runner_id"]: (row["n"] / seconds) * (float(row["latency_ms"]) / 1000.0) for row in rows
    }


def weights(inputs: Inputs) -> dict[int, float]:
    """Each runner's weight: its load, with a floor so idle runners still spread by count;
    all ones when there is no load data."""
    positive = [v for v in inputs.load.values() if v > 0]
    if not positive:
        return {r.id: 1.0 for r in inputs.runners}
    floor = 0.01 * sum(positive) / len(positive)
    return {r.id: max(inputs.load.get(r.id, 0.0), floor) for r in inputs.runners}


def propose(inputs: Inputs, tolerance: float = TOLERANCE) -> Proposal:
    """A sticky, capacity-relative assignment; see the module docstring."""
    weight = weights(inputs)
    capacity = {w.id: w.capacity for w in inputs.workers}
    current = {r.id: r.worker_id for r in inputs.runners}
    if not capacity:
        return Proposal({r.id: None for r in inputs.runners}, 0, math.inf, math.inf, {})
    total_load = sum(weight.values())
    total_cap = sum(capacity.values())
    share = {w: total_load * c / total_cap for w, c in capacity.items()}
    held: dict[int, list[int]] = {w: [] for w in capacity}
    pool = []
    for r in inputs.runners:
        held.get(r.worker_id, pool).append(r.id)
    load = {w: sum(weight[r] for r in rs) for w, rs in held.items()}
    for w, rs in held.items():
        if load[w] <= share[w] * (1 + tolerance):
            continue
        # Shed the heaviest runners that keep the worker at or above its share: few moves.
        shed = set()
        for r in sorted(rs, key=lambda r: (-weight[r], r)):
            if load[w] <= share[w] * (1 + tolerance):
                break
            if load[w] - weight[r] >= share[w] - 1e-9:
                load[w] -= weight[r]
                shed.add(r)
        pool.extend(sorted(shed))
        held[w] = [r for r in rs if r not in shed]
    placement = {r: w for w, rs in held.items() for r in rs}
    # One heap per capacity: the best worker for a runner is the one whose relative load is
    # lowest *after* taking it, and within one capacity that is the least loaded one.
    heaps: dict[int, list] = {}
    for w, c in capacity.items():
        heaps.setdefault(c, []).append((load[w], w))
    for heap in heaps.values():
        heapq.heapify(heap)
    for r in sorted(pool, key=lambda r: (-weight[r], r)):
        c = min(heaps, key=lambda c: ((heaps[c][0][0] + weight[r]) / c, heaps[c][0][1]))
        _, w = heapq.heappop(heaps[c])
        placement[r] = w
        load[w] += weight[r]
        heapq.heappush(heaps[c], (load[w], w))
    moves = sum(1 for r, w in placement.items() if current.get(r) != w)
    return Proposal(
        assignment=placement,
        moves=moves,
        spread=spread(load, capacity),
        max_load_ratio=max(load.values()) / (sum(load.values()) / len(load)) if load else 0.0,
        loads=load,
    )


def spread(load: dict[int, float], capacity: dict[int, int]) -> float:
    """Max over workers of load/capacity, over the mean of the same (1.0 is perfect)."""
    total_cap = sum(capacity.values())
    mean = sum(load.values()) / total_cap if total_cap else 0.0
    if mean == 0:
        return 1.0
    return max(load[w] / capacity[w] for w in capacity) / mean


def bounds(inputs: Inputs, tolerance: float = TOLERANCE) -> tuple[float, int]:
    """The check's limits: the spread the placement can always reach (its tolerance plus one
    runner's worth of granularity), and the moves it may make (every runner that must move,
    plus a quarter of the rest)."""
    weight = weights(inputs)
    capacity = {w.id: w.capacity for w in inputs.workers}
    if not capacity or not weight:
        return math.inf, len(inputs.runners)
    total_load = sum(weight.values())
    total_cap = sum(capacity.values())
    granularity = max(
        max(weight.values()) / (total_load * c / total_cap) for c in capacity.values()
    )
    must_move = sum(1 for r in inputs.runners if r.worker_id not in capacity)
    return 1 + tolerance + granularity, must_move + math.ceil(0.25 * len(inputs.runners))


class StaleProposalError(RuntimeError):
    """The assignment changed since the proposal was computed."""


def apply(db_url: str, inputs: Inputs, proposal: Proposal, origin: str = "rebalance") -> int:
    """Write the proposal in one transaction with a new generation; returns it (0 if nothing
    moved: no generation is spent on a no-op)."""
    current = {r.id: r.worker_id for r in inputs.runners}
    moved = {r: w for r, w in proposal.assignment.items() if current.get(r) != w}
    with connection(db_url) as conn, transaction(conn) as cur:
        # The same lock as `assign` and worker enable/disable: one assignment change at a time.
        cur.execute("LOCK TABLE event_target_runner IN SHARE ROW EXCLUSIVE MODE")
        cur.execute(
            "SELECT id, worker_id FROM event_target_runner WHERE id = ANY(%s)",
            (list(current),),
        )
        now_assigned = dict(cur.fetchall())
        if any(now_assigned.get(r) != w for r, w in current.items()):
            raise StaleProposalError("the assignment changed while rebalancing: run it again")
        if not moved:
            return 0
        details = {
            "spread": round(proposal.spread, 4),
            "max_load_ratio": round(proposal.max_load_ratio, 4),
            "workers": {inputs.worker_names[w]: round(v, 4) for w, v in proposal.loads.items()},
        }
        cur.execute(
            "INSERT INTO event_assignment (origin, moves, details) VALUES (%s, %s, %s) "
            "RETURNING generation",
            (origin, len(moved), json.dumps(details)),
        )
        generation = cur.fetchone()[0]
        cur.execute(
            "UPDATE event_target_runner r SET worker_id = v.worker_id, generation = %s "
            "FROM unnest(%s::int[], %s::int[]) AS v(id, worker_id) WHERE r.id = v.id",
            (generation, list(moved), list(moved.values())),
        )
        return generation


@dataclass
class RebalanceResult:
    proposal: Proposal
    inputs: Inputs
    generation: int
    check_id: int | None

    def to_json(self) -> dict:
        return {**self.proposal.to_json(self.inputs), "generation": self.generation}


def check_inputs(inputs: Inputs) -> None:
    if inputs.runners and not inputs.workers:
        raise ValueError("no enabled worker: enable or create one before rebalancing")


def run_rebalance(
    spark,
    db_url: str,
    window: timedelta = DEFAULT_WINDOW,
    apply_it: bool = True,
    run_label: str = "cli",
    propose_fn=propose,
) -> RebalanceResult:
    """Inputs, proposal, GX check, then (unless told not to) the atomic apply."""
    from eventpush.quality import batch as quality

    inputs = load_inputs(spark, db_url, window)
    check_inputs(inputs)
    proposal = propose_fn(inputs)
    max_spread, max_moves = bounds(inputs)
    check = quality.check_rebalance(
        proposal.assignment,
        runner_ids=[r.id for r in inputs.runners],
        worker_ids=[w.id for w in inputs.workers],
        spread=proposal.spread if inputs.runners else 1.0,
        moves=proposal.moves,
        max_spread=max_spread,
        max_moves=max_moves,
        run_label=run_label,
        db_url=db_url,
    )
    generation = apply(db_url, inputs, proposal) if apply_it else 0
    return RebalanceResult(proposal, inputs, generation, check.id)
