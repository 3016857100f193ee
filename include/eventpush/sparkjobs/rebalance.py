"""Rebalancing: which worker pushes which runner, balanced by load and count relative to
capacity, and a plan that says why each runner moves.

Inputs: the enabled workers (capacity, heartbeat metrics), the runners of enabled rules with
their bus, age and current worker, and each runner's load from its live deliveries in the
delivery log over a recent window (a replay's are not its push worker's), computed in Spark:
``load = rate x mean latency`` (Little's law: the concurrent requests it keeps busy).

A runner's **weight** is a fixed cost (its lanes, connections and memory: a tenth of the mean
runner load) plus its load. A runner created within the window has no history yet, which is not
the same as no load: it is weighed with a prior, the mean load of the runners of its bus that
have history (else of all runners). Older runners with nothing delivered are known to be idle.
Without any load data every runner weighs the same, and the result is even by count.

A worker's **capacity** is its configured capacity, lowered (to half at most) while its last
heartbeat, if recent, shows it short of headroom: CPU above 80 % or an event-loop lag above
100 ms.

The proposal is sticky. Runners on a missing or disabled worker (or on none) must move. A
worker over its share of the total weight by more than ``TOLERANCE`` sheds its heaviest
runners, never below its share; a worker over its count cap (its share of the runners by
capacity, plus ``COUNT_TOLERANCE`` and one) sheds its lightest. The displaced runners go,
heaviest first, to the worker under its count cap whose weight relative to capacity stays
lowest. Nothing else moves. Each move carries its reason.

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

from eventpush.catalog import notify
from eventpush.db import connection, transaction
from eventpush.metrics import publish_batch, rebalance_results
from eventpush.quality import batch as quality
from eventpush.sparkjobs import jdbc

DEFAULT_WINDOW = timedelta(minutes=15)
TOLERANCE = 0.10  # weight over a worker's share before it sheds runners
COUNT_TOLERANCE = 0.5  # runners over a worker's share of the count before it sheds
FIXED_COST = 0.1  # a runner's fixed cost, as a share of the mean runner load
HEARTBEAT_FRESH = timedelta(minutes=5)
BUSY_CPU_PERCENT = 80.0
BUSY_LOOP_LAG_MS = 100.0


@dataclass(frozen=True)
class Worker:
    id: int
    name: str
    capacity: int
    metrics: dict = field(default_factory=dict, compare=False)  # from a recent heartbeat only


@dataclass(frozen=True)
class Runner:
    id: int
    name: str
    worker_id: int | None
    bus_id: int | None = None
    new: bool = False  # created within the load window: no history yet


@dataclass
class Inputs:
    workers: list[Worker]  # enabled only
    runners: list[Runner]
    load: dict[int, float]  # runner id -> load, for runners with deliveries in the window
    worker_names: dict[int, str]  # every worker, enabled or not


@dataclass
class Proposal:
    assignment: dict[int, int | None]  # runner id -> worker id
    moves: int
    spread: float  # max over workers of weight/capacity over the mean of the same
    max_load_ratio: float  # the same, by weight rather than relative to capacity
    loads: dict[int, float]  # worker id -> weight held
    count_spread: float = 1.0  # max over workers of count/capacity over the mean of the same
    reasons: dict[int, str] = field(default_factory=dict)  # runner id -> why it moves

    def to_json(self, inputs: Inputs) -> dict:
        names = {r.id: r.name for r in inputs.runners}
        current = {r.id: r.worker_id for r in inputs.runners}
        worker = inputs.worker_names.get
        return {
            "assignment": {
                names[r]: worker(w) if w is not None else None
                for r, w in sorted(self.assignment.items(), key=lambda kv: names[kv[0]])
            },
            "moves": self.moves,
            "spread": round(self.spread, 4),
            "count_spread": round(self.count_spread, 4),
            "moved": [
                {
                    "runner": names[r],
                    "from": worker(current[r]) if current[r] is not None else None,
                    "to": worker(w) if w is not None else None,
                    "why": self.reasons.get(r, ""),
                }
                for r, w in sorted(self.assignment.items(), key=lambda kv: names[kv[0]])
                if current.get(r) != w
            ],
        }


def load_inputs(spark, db_url: str, window: timedelta = DEFAULT_WINDOW, now=None) -> Inputs:
    """Workers and runners from PostgreSQL; per-runner load from the delivery log in Spark."""
    now = now or datetime.now(UTC)
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "SELECT id, name, capacity, enabled, metrics, heartbeat_at >= %s "
            "FROM event_push_worker",
            (now - HEARTBEAT_FRESH,),
        )
        rows = cur.fetchall()
        cur.execute(
            "SELECT r.id, r.name, r.worker_id, ru.bus_id, r.ctime >= %s "
            "FROM event_target_runner r "
            "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
            "WHERE ru.state = 'ENABLED' AND r.deleted_at IS NULL ORDER BY r.id",
            (now - window,),
        )
        runners = [Runner(*row) for row in cur.fetchall()]
    workers = [
        Worker(wid, name, cap, (metrics or {}) if fresh else {})
        for wid, name, cap, on, metrics, fresh in rows
        if on
    ]
    names = {wid: name for wid, name, *_ in rows}
    load = runner_load(spark, db_url, [r.id for r in runners], window, now)
    return Inputs(workers=workers, runners=runners, load=load, worker_names=names)


def runner_load(spark, db_url: str, runner_ids: list[int], window: timedelta, now=None):
    """runner id -> rate (deliveries/s) x mean latency (s) over the window, from the live
    deliveries only: a replay's are sent by the Spark job, not by the runner's push worker."""
    # Deferred: PySpark is loaded only inside a Spark job.
    from pyspark.sql import functions as F

    if not runner_ids:
        return {}
    now = now or datetime.now(UTC)
    db = jdbc.jdbc_database(db_url)
    log = jdbc.read_by_runner(
        spark, db, "event_push_delivery", "runner_id, ctime, latency_ms, origin", runner_ids
    ).where((F.col("ctime") >= F.lit(now - window)) & (F.col("origin") == "live"))
    seconds = window.total_seconds()
    # rate x mean latency = total latency / window. Summed as decimals: a sum of floats
    # depends on the order of its rows, which follows the partitioning, and two runners of
    # equal load must tie exactly (then the runner id decides) on any cluster.
    rows = (
        log.groupBy("runner_id")
        .agg(F.sum(F.col("latency_ms").cast("decimal(18,3)")).alias("latency_ms"))
        .collect()
    )
    return {row["runner_id"]: float(row["latency_ms"]) / 1000.0 / seconds for row in rows}


def weights(inputs: Inputs) -> dict[int, float]:
    """Each runner's weight: a fixed cost plus its load, or plus a prior when it is new; all
    ones when there is no load data at all."""
    positive = [v for v in inputs.load.values() if v > 0]
    if not positive:
        return {r.id: 1.0 for r in inputs.runners}
    mean = sum(positive) / len(positive)
    by_bus: dict[int | None, list[float]] = {}
    for r in inputs.runners:
        if inputs.load.get(r.id, 0.0) > 0:
            by_bus.setdefault(r.bus_id, []).append(inputs.load[r.id])
    prior = {bus: sum(v) / len(v) for bus, v in by_bus.items()}

    def load(r: Runner) -> float:
        if r.id in inputs.load:
            return inputs.load[r.id]
        return prior.get(r.bus_id, mean) if r.new else 0.0

    return {r.id: FIXED_COST * mean + load(r) for r in inputs.runners}


def headroom(metrics: dict) -> float:
    """The share of its capacity a worker can take, from its last heartbeat: 1.0 with room to
    spare, down to 0.5 when its CPU is saturated or its event loop lags."""
    factor = 1.0
    cpu = metrics.get("cpu_percent")
    if isinstance(cpu, int | float) and math.isfinite(cpu) and cpu > BUSY_CPU_PERCENT:
        factor = min(factor, 1.0 - 0.5 * min(cpu - BUSY_CPU_PERCENT, 20.0) / 20.0)
    lag = metrics.get("loop_lag_ms")
    if isinstance(lag, int | float) and math.isfinite(lag) and lag > BUSY_LOOP_LAG_MS:
        factor = min(factor, max(0.5, BUSY_LOOP_LAG_MS / lag))
    return factor


def capacities(inputs: Inputs) -> dict[int, float]:
    """worker id -> effective capacity: configured capacity times heartbeat headroom."""
    return {w.id: w.capacity * headroom(w.metrics) for w in inputs.workers}


def count_caps(n_runners: int, capacity: dict[int, float]) -> dict[int, int]:
    """worker id -> the most runners it may hold: its share by capacity, with tolerance, + 1."""
    total = sum(capacity.values())
    return {
        w: math.floor(n_runners * c / total * (1 + COUNT_TOLERANCE)) + 1
        for w, c in capacity.items()
    }


def propose(inputs: Inputs, tolerance: float = TOLERANCE) -> Proposal:
    """A sticky, capacity-relative assignment; see the module docstring."""
    weight = weights(inputs)
    capacity = capacities(inputs)
    current = {r.id: r.worker_id for r in inputs.runners}
    if not capacity:
        return Proposal({r.id: None for r in inputs.runners}, 0, math.inf, math.inf, {})
    names = inputs.worker_names
    total_cap = sum(capacity.values())
    share = {w: sum(weight.values()) * c / total_cap for w, c in capacity.items()}
    cap = count_caps(len(inputs.runners), capacity)
    held: dict[int, list[int]] = {w: [] for w in capacity}
    reasons: dict[int, str] = {}
    pool = []
    for r in inputs.runners:
        if r.worker_id in held:
            held[r.worker_id].append(r.id)
        else:
            pool.append(r.id)
            reasons[r.id] = (
                "unassigned"
                if r.worker_id is None
                else f"worker {names.get(r.worker_id, r.worker_id)} is disabled or gone"
            )
    load = {w: sum(weight[r] for r in rs) for w, rs in held.items()}
    for w, rs in held.items():
        over = load[w] / share[w] if share[w] else math.inf
        # Shed the heaviest runners that keep the worker at or above its share: few moves.
        shed = set()
        for r in sorted(rs, key=lambda r: (-weight[r], r)):
            if load[w] <= share[w] * (1 + tolerance):
                break
            if load[w] - weight[r] >= share[w] - 1e-9:
                load[w] -= weight[r]
                shed.add(r)
                reasons[r] = f"worker {names[w]} carried {over:.2f}x its share of the load"
        kept = [r for r in rs if r not in shed]
        # Then the lightest, while it holds more runners than its count cap.
        for r in sorted(kept, key=lambda r: (weight[r], r))[: max(0, len(kept) - cap[w])]:
            load[w] -= weight[r]
            shed.add(r)
            reasons[r] = f"worker {names[w]} held {len(rs)} runners, over its cap of {cap[w]}"
        pool.extend(sorted(shed))
        held[w] = [r for r in rs if r not in shed]
    placement = {r: w for w, rs in held.items() for r in rs}
    count = {w: len(rs) for w, rs in held.items()}
    # Best worker for a runner: the lowest weight relative to capacity after taking it, among
    # those under their count cap. Workers with equal capacity are kept in one heap.
    heaps: dict[float, list] = {}
    for w, c in capacity.items():
        heaps.setdefault(c, []).append((load[w], w))
    for heap in heaps.values():
        heapq.heapify(heap)
    for r in sorted(pool, key=lambda r: (-weight[r], r)):
        full = []
        while True:
            open_caps = [c for c in heaps if heaps[c]]
            c = min(open_caps, key=lambda c: ((heaps[c][0][0] + weight[r]) / c, heaps[c][0][1]))
            _, w = heapq.heappop(heaps[c])
            if count[w] < cap[w]:
                break
            full.append((c, w))
        placement[r] = w
        load[w] += weight[r]
        count[w] += 1
        heapq.heappush(heaps[c], (load[w], w))
        for c_full, w_full in full:
            heapq.heappush(heaps[c_full], (load[w_full], w_full))
    moves = sum(1 for r, w in placement.items() if current.get(r) != w)
    return Proposal(
        assignment=placement,
        moves=moves,
        spread=spread(load, capacity),
        max_load_ratio=max(load.values()) / (sum(load.values()) / len(load)) if load else 0.0,
        loads=load,
        count_spread=spread({w: float(n) for w, n in count.items()}, capacity),
        reasons={r: why for r, why in reasons.items() if current.get(r) != placement.get(r)},
    )


def spread(load: dict[int, float], capacity: dict[int, int]) -> float:
    """Max over workers of load/capacity, over the mean of the same (1.0 is perfect)."""
    total_cap = sum(capacity.values())
    mean = sum(load.values()) / total_cap if total_cap else 0.0
    if mean == 0:
        return 1.0
    return max(load[w] / capacity[w] for w in capacity) / mean


def bounds(inputs: Inputs, tolerance: float = TOLERANCE) -> tuple[float, float, int]:
    """The check's limits: the weight spread the placement can always reach (its tolerance
    plus one runner's worth of granularity), the count spread (the count cap's), and the moves
    it may make: every runner that must move and every runner over a worker's count cap, plus
    a quarter of the rest or one for each worker over its share of the weight, whichever is
    more (a worker joining four runners on two busy ones takes one from each: 2 of 4)."""
    weight = weights(inputs)
    capacity = capacities(inputs)
    if not capacity or not weight:
        return math.inf, math.inf, len(inputs.runners)
    total_load = sum(weight.values())
    total_cap = sum(capacity.values())
    granularity = max(
        max(weight.values()) / (total_load * c / total_cap) for c in capacity.values()
    )
    n = len(inputs.runners)
    count_bound = max(
        (cap + 1e-9) / (n * capacity[w] / total_cap) for w, cap in count_caps(n, capacity).items()
    )
    must_move = sum(1 for r in inputs.runners if r.worker_id not in capacity)
    held: dict[int, list[int]] = {w: [] for w in capacity}
    for r in inputs.runners:
        if r.worker_id in held:
            held[r.worker_id].append(r.id)
    caps = count_caps(n, capacity)
    over_cap = sum(max(0, len(rs) - caps[w]) for w, rs in held.items())
    over_share = sum(
        1
        for w, rs in held.items()
        if sum(weight[r] for r in rs) > total_load * capacity[w] / total_cap * (1 + tolerance)
    )
    moves = must_move + over_cap + max(math.ceil(0.25 * n), over_share)
    return 1 + tolerance + granularity, count_bound, moves


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
            "count_spread": round(proposal.count_spread, 4),
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
        notify(cur)  # the workers hand over and take up the moved runners at once
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

    inputs = load_inputs(spark, db_url, window)
    check_inputs(inputs)
    proposal = propose_fn(inputs)
    max_spread, max_count_spread, max_moves = bounds(inputs)
    check = quality.check_rebalance(
        proposal.assignment,
        runner_ids=[r.id for r in inputs.runners],
        worker_ids=[w.id for w in inputs.workers],
        spread=proposal.spread if inputs.runners else 1.0,
        count_spread=proposal.count_spread if inputs.runners else 1.0,
        moves=proposal.moves,
        max_spread=max_spread,
        max_count_spread=max_count_spread,
        max_moves=max_moves,
        run_label=run_label,
        db_url=db_url,
    )
    generation = apply(db_url, inputs, proposal) if apply_it else 0
    result = RebalanceResult(proposal, inputs, generation, check.id)

    publish_batch("rebalance", rebalance_results(result, applied=apply_it))
    return result
