"""Rebalancing: even placement, stickiness, a disabled worker's runners, the GX check, CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from batch_support import make_runner, spark  # noqa: F401
from click.testing import CliRunner

from eventpush import catalog
from eventpush.quality.batch import CheckFailed
from eventpush.sparkjobs import rebalance as rb


def setup_runners(conn, n, workers=("w1", "w2", "w3")):
    for w in workers:
        catalog.create_worker(conn, w, 100)
    return [make_runner(conn, "orders", "all", f"t{i}", {"source": ["app"]}) for i in range(n)]


def assignment(conn):
    with conn.cursor() as cur:
        cur.execute(
            "SELECT r.name, w.name, r.generation FROM event_target_runner r "
            "LEFT JOIN event_push_worker w ON w.id = r.worker_id ORDER BY r.name"
        )
        rows = cur.fetchall()
    conn.rollback()
    return {r: w for r, w, _ in rows}, {r: g for r, _, g in rows}


def test_even_by_count_from_scratch_and_sticky(db_url, conn, spark):  # noqa: F811
    setup_runners(conn, 12)
    result = rb.run_rebalance(spark, db_url)
    placed, generations = assignment(conn)
    assert Counter(placed.values()) == {"w1": 4, "w2": 4, "w3": 4}
    assert result.proposal.moves == 12 and result.generation > 0
    assert set(generations.values()) == {result.generation}
    # Balanced already: a second run moves nothing and spends no generation.
    again = rb.run_rebalance(spark, db_url)
    assert again.proposal.moves == 0 and again.generation == 0
    assert assignment(conn)[0] == placed


def test_relative_to_capacity(db_url, conn, spark):  # noqa: F811
    catalog.create_worker(conn, "small", 100)
    catalog.create_worker(conn, "big", 300)
    for i in range(8):
        make_runner(conn, "orders", "all", f"t{i}", {"source": ["app"]})
    rb.run_rebalance(spark, db_url)
    assert Counter(assignment(conn)[0].values()) == {"small": 2, "big": 6}


def test_disabled_worker_runners_move_and_nothing_else(db_url, conn, spark):  # noqa: F811
    setup_runners(conn, 9)
    rb.run_rebalance(spark, db_url)
    before, _ = assignment(conn)
    with conn.cursor() as cur:  # disabled behind the catalog's back: rebalance must fix it
        cur.execute("UPDATE event_push_worker SET enabled = false WHERE name = 'w3'")
    conn.commit()
    result = rb.run_rebalance(spark, db_url)
    after, generations = assignment(conn)
    moved = {r for r in before if before[r] != after[r]}
    assert moved == {r for r, w in before.items() if w == "w3"}
    assert result.proposal.moves == 3
    assert "w3" not in after.values()
    assert sorted(Counter(after.values()).values()) == [4, 5]
    assert {generations[r] for r in moved} == {result.generation}


def test_load_from_delivery_log_balances_load(db_url, conn, spark):  # noqa: F811
    runners = setup_runners(conn, 6, workers=("w1", "w2"))
    with conn.cursor() as cur:
        # Older than the load window with nothing delivered: known to be idle, not new.
        cur.execute("UPDATE event_target_runner SET ctime = now() - interval '1 hour'")
        # One hot runner (many slow deliveries), five idle ones.
        cur.execute(
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms, ctime) '
            "SELECT r.id, r.name, 'orders', 0, g, 'm' || g, 1, 200, 500, now() "
            "FROM event_target_runner r, generate_series(1, 900) g WHERE r.name = %s",
            (runners[0],),
        )
    conn.commit()
    inputs = rb.load_inputs(spark, db_url)
    hot = next(r.id for r in inputs.runners if r.name == runners[0])
    assert inputs.load[hot] == pytest.approx(900 / 900 * 0.5)
    rb.run_rebalance(spark, db_url)
    placed, _ = assignment(conn)
    hot_worker = placed[runners[0]]
    # The hot runner's worker takes nothing else: it carries as much as the five idle ones.
    assert [r for r, w in placed.items() if w == hot_worker] == [runners[0]]


def test_load_counts_live_deliveries_only_and_sums_them_exactly(db_url, conn, spark):  # noqa: F811
    live, replayed = setup_runners(conn, 2, workers=("w1",))
    with conn.cursor() as cur:
        # 0.1 ms is no exact float: summed as floats, 900 of them are not 90 ms.
        cur.execute(
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms, ctime, origin) '
            "SELECT r.id, r.name, 'orders', 0, g, 'm' || g, 1, 200, "
            "CASE WHEN r.name = %s THEN 0.1 ELSE 500 END, now(), "
            "CASE WHEN r.name = %s THEN 'live' ELSE 'replay' END "
            "FROM event_target_runner r, generate_series(1, 900) g",
            (live, live),
        )
    conn.commit()
    inputs = rb.load_inputs(spark, db_url)
    ids = {r.name: r.id for r in inputs.runners}
    assert inputs.load == {ids[live]: 90.0 / 1000.0 / rb.DEFAULT_WINDOW.total_seconds()}
    assert ids[replayed] not in inputs.load


def test_bad_proposal_is_refused_by_the_check(db_url, conn, spark):  # noqa: F811
    setup_runners(conn, 6)
    rb.run_rebalance(spark, db_url)
    before = assignment(conn)

    def everything_on_one(inputs):
        good = rb.propose(inputs)
        first = inputs.workers[0].id
        return rb.Proposal({r: first for r in good.assignment}, 4, 3.0, 3.0, good.loads)

    with pytest.raises(CheckFailed, match="spread"):
        rb.run_rebalance(spark, db_url, propose_fn=everything_on_one)

    def drops_a_runner(inputs):
        good = rb.propose(inputs)
        good.assignment.pop(next(iter(good.assignment)))
        return good

    with pytest.raises(CheckFailed):
        rb.run_rebalance(spark, db_url, propose_fn=drops_a_runner)
    assert assignment(conn) == before
    with conn.cursor() as cur:
        cur.execute(
            "SELECT success, failures FROM event_check_result WHERE suite = 'rebalance' ORDER BY id"
        )
        results = cur.fetchall()
    assert [s for s, _ in results] == [True, False, False]
    assert any("spread" in json.dumps(f) for f in results[1][1])


def test_stale_proposal_is_not_applied(db_url, conn, spark):  # noqa: F811
    setup_runners(conn, 3)
    inputs = rb.load_inputs(spark, db_url)
    proposal = rb.propose(inputs)
    catalog.assign(conn)  # someone else assigns in between
    with pytest.raises(rb.StaleProposalError):
        rb.apply(db_url, inputs, proposal)


def test_propose_scales_and_stays_balanced():
    workers = [rb.Worker(i, f"w{i}", 100 if i % 2 else 200) for i in range(50)]
    runners = [rb.Runner(i, f"r{i}", None) for i in range(5000)]
    load = {i: float(1 + i % 7) for i in range(5000)}
    inputs = rb.Inputs(workers, runners, load, {w.id: w.name for w in workers})
    p = rb.propose(inputs)
    assert len(p.assignment) == 5000 and p.spread < 1.05
    # Sticky: re-proposing from the result moves nothing.
    runners2 = [rb.Runner(r, f"r{r}", w) for r, w in p.assignment.items()]
    p2 = rb.propose(rb.Inputs(workers, runners2, load, inputs.worker_names))
    assert p2.moves == 0


def test_rebalance_cli_json(db_url, conn, spark):  # noqa: F811
    from eventpush.cli.batch import rebalance

    names = setup_runners(conn, 4, workers=("w1", "w2"))
    result = CliRunner().invoke(rebalance, ["--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc["assignment"]) == set(names) and doc["moves"] == 4
    assert Counter(doc["assignment"].values()) == {"w1": 2, "w2": 2}
    assert sorted(m["runner"] for m in doc["moved"]) == sorted(names)
    assert {(m["from"], m["why"]) for m in doc["moved"]} == {(None, "unassigned")}
    human = CliRunner().invoke(rebalance, [])
    assert human.exit_code == 0 and "moves" in human.output


# --- the planner on its own (no Spark): priors, fixed cost, headroom, count caps, reasons ---


def plan(workers, runners, load):
    inputs = rb.Inputs(workers, runners, load, {w.id: w.name for w in workers})
    return inputs, rb.propose(inputs)


def counts(proposal, workers):
    held = Counter(proposal.assignment.values())
    return {w.name: held[w.id] for w in workers}


@pytest.mark.parametrize("start", ["unassigned", "on the old workers"])
def test_new_runners_without_history_spread_with_a_prior(start):
    """Five busy runners and fifteen new ones without traffic yet, four workers of which two
    are new: no worker takes the new runners alone (count spread within 2), load in bound."""
    workers = [rb.Worker(i, f"w{i}", 100) for i in (1, 2, 3, 4)]
    busy = [rb.Runner(i, f"busy{i}", 1 + i % 2, bus_id=7) for i in range(5)]
    new_worker = {"unassigned": lambda i: None, "on the old workers": lambda i: 1 + i % 2}[start]
    fresh = [rb.Runner(10 + i, f"new{i}", new_worker(i), bus_id=7, new=True) for i in range(15)]
    load = {r.id: 2.0 + r.id for r in busy}
    inputs, p = plan(workers, busy + fresh, load)
    held = counts(p, workers)
    assert max(held.values()) - min(held.values()) <= 2, held
    max_spread, max_count_spread, _ = rb.bounds(inputs)
    assert p.spread <= max_spread and p.count_spread <= max_count_spread


def test_a_new_runner_weighs_its_bus_mean_and_an_old_idle_one_only_its_fixed_cost():
    workers = [rb.Worker(1, "w1", 100)]
    runners = [
        rb.Runner(1, "a", 1, bus_id=1),
        rb.Runner(2, "b", 1, bus_id=1),
        rb.Runner(3, "c", 1, bus_id=2),
        rb.Runner(4, "new-on-1", 1, bus_id=1, new=True),
        rb.Runner(5, "new-on-3", 1, bus_id=3, new=True),
        rb.Runner(6, "old-idle", 1, bus_id=1),
    ]
    load = {1: 1.0, 2: 3.0, 3: 8.0}
    w = rb.weights(rb.Inputs(workers, runners, load, {1: "w1"}))
    fixed = rb.FIXED_COST * (1.0 + 3.0 + 8.0) / 3
    assert w[4] == pytest.approx(fixed + 2.0)  # bus 1's mean
    assert w[5] == pytest.approx(fixed + 4.0)  # no history on bus 3: the mean of all
    assert w[6] == pytest.approx(fixed)
    assert w[1] == pytest.approx(fixed + 1.0)


def test_a_busy_worker_by_its_heartbeat_gets_less():
    calm = rb.Worker(1, "calm", 100, {"cpu_percent": 35.0})
    hot = rb.Worker(2, "hot", 100, {"cpu_percent": 100.0, "loop_lag_ms": 50.0})
    lagging = rb.Worker(3, "lagging", 100, {"cpu_percent": 10.0, "loop_lag_ms": 400.0})
    assert rb.headroom(calm.metrics) == 1.0
    assert rb.headroom(hot.metrics) == pytest.approx(0.5)
    assert rb.headroom(lagging.metrics) == pytest.approx(0.5)
    assert rb.headroom({"cpu_percent": float("nan"), "loop_lag_ms": "junk"}) == 1.0
    workers = [calm, hot]
    _, p = plan(workers, [rb.Runner(i, f"r{i}", None) for i in range(12)], {})
    assert counts(p, workers) == {"calm": 8, "hot": 4}


def test_count_caps_bound_a_worker_with_light_runners():
    """One runner carries almost all the load; the light ones still spread within the cap."""
    workers = [rb.Worker(i, f"w{i}", 100) for i in (1, 2, 3)]
    runners = [rb.Runner(i, f"r{i}", None) for i in range(30)]
    load = {0: 1000.0, **{i: 0.001 for i in range(1, 30)}}
    inputs, p = plan(workers, runners, load)
    caps = rb.count_caps(30, rb.capacities(inputs))
    held = counts(p, workers)
    assert all(held[w.name] <= caps[w.id] for w in workers), (held, caps)
    _, max_count_spread, _ = rb.bounds(inputs)
    assert p.count_spread <= max_count_spread
    # Balanced by load but not by count: the crowded worker sheds down to its cap, saying why.
    two = workers[:2]
    crowded = [rb.Runner(0, "heavy", 2)] + [rb.Runner(i, f"r{i}", 1) for i in range(1, 21)]
    inputs2, p2 = plan(two, crowded, {0: 20.0, **{i: 1.0 for i in range(1, 21)}})
    cap = rb.count_caps(21, rb.capacities(inputs2))[1]
    assert counts(p2, two) == {"w1": cap, "w2": 21 - cap}
    moved = [r for r, w in p2.assignment.items() if w != (2 if r == 0 else 1)]
    assert len(moved) == 20 - cap
    assert all(p2.reasons[r] == f"worker w1 held 20 runners, over its cap of {cap}" for r in moved)


def test_every_move_says_why():
    workers = [rb.Worker(1, "w1", 100), rb.Worker(2, "w2", 100)]
    names = {1: "w1", 2: "w2", 3: "gone"}
    runners = [rb.Runner(1, "a", 3), rb.Runner(2, "b", None), rb.Runner(3, "c", 1)]
    inputs = rb.Inputs(workers, runners, {}, names)
    doc = rb.propose(inputs).to_json(inputs)
    why = {m["runner"]: (m["from"], m["why"]) for m in doc["moved"]}
    assert why == {"a": ("gone", "worker gone is disabled or gone"), "b": (None, "unassigned")}
    assert doc["moves"] == len(doc["moved"]) == 2


def test_a_worker_joining_two_busy_ones_may_take_one_runner_from_each():
    """The demo's case: four runners on two workers, each worker holding one heavy and one
    lighter runner, a third worker joins. Each busy worker sheds its lighter runner to the
    newcomer: two moves of four, within the check's bound (one per worker over its share)."""
    workers = [rb.Worker(i, f"w{i}", 100) for i in (1, 2, 3)]
    runners = [
        rb.Runner(1, "warehouse", 1),
        rb.Runner(2, "crm", 1),
        rb.Runner(3, "invoices", 2),
        rb.Runner(4, "risk", 2),
    ]
    load = {1: 15.0, 2: 4.0, 3: 15.0, 4: 4.0}
    inputs, p = plan(workers, runners, load)
    assert p.moves == 2
    assert {p.assignment[2], p.assignment[4]} == {3}  # the lighter one of each goes to w3
    max_spread, max_count_spread, max_moves = rb.bounds(inputs)
    assert p.moves <= max_moves == 2
    assert p.spread <= max_spread and p.count_spread <= max_count_spread
    # Nobody over its share: the bound stays a quarter of the runners.
    _, _, calm_moves = rb.bounds(rb.Inputs(workers[:2], runners, load, inputs.worker_names))
    assert calm_moves == 1
