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
    human = CliRunner().invoke(rebalance, [])
    assert human.exit_code == 0 and "moves" in human.output
