"""Rebalance benchmark: 100,000 runners on 1,000 workers.

    .venv/bin/python bench/rebalance.py [--runners 100000] [--workers 1000] [--full]

Placement alone (``propose``) on synthetic inputs: from scratch with a skewed load
(log-normal, some runners 100x the median) on mixed capacities, then again after disabling
one worker in ten (what moves), then with no load data (even by count). Balance is max over
mean of load relative to capacity (1.0 is perfect). ``--full`` also runs the whole job on a
scratch database (runners and a delivery log made in SQL): Spark load from the log, proposal,
GX check and the atomic apply, each timed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, scratch_database  # noqa: E402

from eventpush.sparkjobs import rebalance as rb  # noqa: E402


def synthetic(runners: int, workers: int, seed: int = 7) -> rb.Inputs:
    rnd = random.Random(seed)
    ws = [rb.Worker(i, f"w{i}", rnd.choice((50, 100, 100, 200))) for i in range(workers)]
    rs = [rb.Runner(i, f"r{i}", None) for i in range(runners)]
    load = {i: rnd.lognormvariate(0, 1.2) for i in range(runners)}
    return rb.Inputs(ws, rs, load, {w.id: w.name for w in ws})


def timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def placement(runners: int, workers: int) -> None:
    inputs = synthetic(runners, workers)
    s, p = timed(rb.propose, inputs)
    print(
        f"from scratch, skewed load: {s:.2f} s, balance (max/mean relative load) "
        f"{p.spread:.4f}, moves {p.moves:,}"
    )
    placed = [rb.Runner(r, f"r{r}", w) for r, w in p.assignment.items()]
    off = {w.id for w in inputs.workers[::10]}
    after = rb.Inputs(
        [w for w in inputs.workers if w.id not in off], placed, inputs.load, inputs.worker_names
    )
    s, q = timed(rb.propose, after)
    must = sum(1 for r in placed if r.worker_id in off)
    print(
        f"after disabling {len(off)} workers: {s:.2f} s, balance {q.spread:.4f}, "
        f"moves {q.moves:,} (runners on disabled workers: {must:,})"
    )
    again = rb.Inputs(
        after.workers,
        [rb.Runner(r, f"r{r}", w) for r, w in q.assignment.items()],
        inputs.load,
        inputs.worker_names,
    )
    s, z = timed(rb.propose, again)
    print(f"re-run on its own result: {s:.2f} s, moves {z.moves}")
    flat = rb.Inputs(inputs.workers, inputs.runners, {}, inputs.worker_names)
    s, c = timed(rb.propose, flat)
    print(f"no load data (even by count): {s:.2f} s, balance {c.spread:.4f}")


def full(runners: int, workers: int) -> None:
    import psycopg2

    from eventpush.quality import batch as quality
    from eventpush.sparkjobs.session import get_spark

    spark = get_spark("local[*]", app_name="bench-rebalance")
    with scratch_database("eventpush_bench_rebalance") as url:
        conn = psycopg2.connect(url)
        with conn.cursor() as cur:
            cur.execute("INSERT INTO event_bus (name, queues) VALUES ('b', 1) RETURNING id")
            bus = cur.fetchone()[0]
            cur.execute(
                "INSERT INTO event_rule (bus_id, name, pattern) VALUES (%s, 'r', "
                '\'{"source": ["s"]}\') RETURNING id',
                (bus,),
            )
            rule = cur.fetchone()[0]
            cur.execute(
                "INSERT INTO event_target (rule_id, name, url) SELECT %s, 't' || i, "
                "'http://127.0.0.1:9/' FROM generate_series(1, %s) i",
                (rule, runners),
            )
            cur.execute(
                "INSERT INTO event_target_runner (target_id, name) "
                "SELECT id, 'b/r/' || name FROM event_target"
            )
            cur.execute(
                "INSERT INTO event_push_worker (name, capacity) "
                "SELECT 'w' || i, (ARRAY[50, 100, 200])[1 + i %% 3] FROM generate_series(1, %s) i",
                (workers,),
            )
            # A delivery log: ten rows per runner on average, skewed.
            cur.execute(
                "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, "
                'queue_id, "offset", message_id, attempts, http_status, latency_ms) '
                "SELECT 1 + (random() ^ 3 * %s)::int %% %s, 'x', 'b', 0, g, 'm', 1, 200, "
                "1 + random() * 50 FROM generate_series(1, %s) g",
                (runners, runners, runners * 10),
            )
        conn.commit()
        conn.close()
        s_in, inputs = timed(rb.load_inputs, spark, url)
        s_in, inputs = timed(rb.load_inputs, spark, url)  # warm
        s_p, p = timed(rb.propose, inputs)
        max_spread, max_count_spread, max_moves = rb.bounds(inputs)
        s_c, _ = timed(
            lambda: quality.check_rebalance(
                p.assignment,
                [r.id for r in inputs.runners],
                [w.id for w in inputs.workers],
                p.spread,
                p.moves,
                max_spread,
                max_moves,
                "bench",
                url,
                count_spread=p.count_spread,
                max_count_spread=max_count_spread,
            )
        )
        s_a, generation = timed(rb.apply, url, inputs, p)
        print(
            f"full job on PostgreSQL: inputs + Spark load {s_in:.1f} s, propose {s_p:.1f} s, "
            f"GX check {s_c:.1f} s, apply {s_a:.1f} s (generation {generation}, "
            f"{p.moves:,} moves, balance {p.spread:.4f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runners", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=1_000)
    parser.add_argument("--full", action="store_true")
    args = parser.parse_args()
    print(f"machine: {machine()}; {args.runners:,} runners on {args.workers:,} workers")
    placement(args.runners, args.workers)
    if args.full:
        full(args.runners, args.workers)


if __name__ == "__main__":
    main()
