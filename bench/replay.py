"""Replay benchmark: re-pushes per second, paired with the live engine on the same target.

    .venv/bin/python bench/replay.py [--records 20000] [--rounds 2] [--batch-size 1]
        [--rate-limit R]
    .venv/bin/python bench/replay.py --push-only [--other-tree DIR] [--records 10000]

One loopback receiver (``python -m eventpush.demo.receiver``, a process of its own) serves
both sides; each round runs them one after the other, in alternating order, on the same
target policy (``/ok``, ``--batch-size``, the default concurrency of 16):

- **live**: ``--records`` events published to a bus of 4 queues with one rule and one target,
  pushed by one worker (``run_worker(until_idle=True)``): deliveries over the drain time.
- **replay**: the same events, each with an open failure row for the same target; one
  ``failed`` replay re-pushes them all from the executors (the engine's delivery code):
  records delivered over the wall time of the whole replay (selection, GX checks, pushes,
  bookkeeping); and the same over the time left after the fixed cost, which a replay of one
  record in the same round measures. ``--split`` adds a replay pushing from one partition per
  core whatever its size (the job uses one per 50,000 records).

CPU: of the bench's own processes (this one with the live engine and Spark's driver, Spark's
JVM and Python workers, the receiver), over each side's timed part; PostgreSQL's is not
counted.

``--push-only`` leaves Spark out: the replay's push code (``_push``, what each partition runs)
in this process on all the failure rows, beside the live engine, and, with ``--other-tree``,
beside the same function of another checkout (``DIR/include/eventpush/sparkjobs/replay.py``),
so a change to the push path is measured against its predecessor in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database, tree_cpu  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.catalog import TargetSpec  # noqa: E402
from eventpush.demo.receiver import ReceiverProcess  # noqa: E402


def seed(url: str, target_url: str, records: int, failures: bool, **spec) -> None:
    """A bus with ``records`` events for one rule and target; with ``failures`` each event
    also has an open failure row (what a replay re-pushes), else a worker owns the runner
    from the bus's start (what the live engine pushes)."""
    conn = psycopg2.connect(url)
    bus_id = catalog.create_bus(conn, "bench", 4)
    catalog.create_rule(conn, "bench", "all", {"source": ["app"]})
    catalog.create_target(conn, "bench", "all", TargetSpec(name="t", url=target_url, **spec))
    with conn.cursor() as cur:
        cur.execute(
            'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, '
            "detail_type, event_time, size_bytes, body) SELECT %(bus)s, i %% 4, i / 4, 'm' || i, "
            "'app', 'created', now(), 120, json_build_object('source', 'app', 'detail-type', "
            "'created', 'id', 'm' || i, 'detail', json_build_object('n', i)) "
            "FROM generate_series(0, %(n)s - 1) i",
            {"bus": bus_id, "n": records},
        )
        cur.execute(
            "UPDATE event_bus_queue q SET next_offset = (SELECT count(*) FROM bus_event e "
            "WHERE e.bus_id = q.bus_id AND e.queue_id = q.queue_id) WHERE bus_id = %s",
            (bus_id,),
        )
        if failures:
            cur.execute(
                "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, "
                'queue_id, "offset", message_id, attempts, http_status, last_error) '
                "SELECT r.id, r.name, 'bench', e.queue_id, e.\"offset\", e.message_id, 5, 503, "
                "'HTTP 503' FROM event_target_runner r, bus_event e"
            )
    conn.commit()
    if not failures:
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
    conn.close()


def live(rx: ReceiverProcess, records: int, **spec) -> dict:
    from eventpush.push import run_worker

    with scratch_database("eventpush_bench_replay") as url:
        seed(url, rx.url + "/ok", records, failures=False, **spec)
        cpu, started = tree_cpu(), time.perf_counter()
        report = run_worker("w1", until_idle=True, max_seconds=600, url=url)
        elapsed, cpu = time.perf_counter() - started, tree_cpu() - cpu
    return {"delivered": report.delivered, "seconds": elapsed, "cpu_seconds": cpu}


def replay(
    spark, rx: ReceiverProcess, records: int, rate_limit: float | None, split=False, **spec
) -> dict:
    from eventpush.sparkjobs import replay_push as job
    from eventpush.sparkjobs.replay import ReplayRequest, run_replay

    default = job.RECORDS_PER_PUSH_PARTITION
    job.RECORDS_PER_PUSH_PARTITION = 1 if split else default

    with scratch_database("eventpush_bench_replay") as url:
        seed(url, rx.url + "/ok", records, failures=True, **spec)
        cpu, started = tree_cpu(), time.perf_counter()
        try:
            result = run_replay(spark, url, ReplayRequest(what="failed", rate_limit=rate_limit))
        finally:
            job.RECORDS_PER_PUSH_PARTITION = default
        elapsed, cpu = time.perf_counter() - started, tree_cpu() - cpu
    return {"delivered": result.delivered, "seconds": elapsed, "cpu_seconds": cpu}


def push_only(rx: ReceiverProcess, push, records: int, **spec) -> dict:
    """``push`` (a replay module's ``_push``) on every open failure row, in this process."""
    import psycopg2.extras
    import uvloop

    from eventpush.sparkjobs.replay import ReplayRequest, start_run

    with scratch_database("eventpush_bench_replay") as url:
        seed(url, rx.url + "/ok", records, failures=True, **spec)
        conn = psycopg2.connect(url)
        with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
            cur.execute(
                'SELECT f.runner_id, ru.bus_id, f.queue_id, f."offset", f.message_id '
                "FROM event_push_failure f JOIN event_target_runner r ON r.id = f.runner_id "
                "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id"
            )
            rows = cur.fetchall()
        conn.close()
        replay_id = start_run(url, ReplayRequest())
        started = time.perf_counter()
        counts = dict(uvloop.run(push(url, replay_id, "failed", None, rows)))
        elapsed = time.perf_counter() - started
    if counts["delivered"] != records:
        raise SystemExit(f"push delivered {counts} of {records}")
    return {"delivered": counts["delivered"], "seconds": elapsed}


def other_push(tree: str):
    """``_push`` of another checkout's replay module (its own imports resolve here)."""
    import importlib.util

    path = Path(tree) / "include/eventpush/sparkjobs/replay.py"
    spec = importlib.util.spec_from_file_location("other_replay", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_replay"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module._push


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rate-limit", type=float)
    parser.add_argument(
        "--split",
        action="store_true",
        help="also a replay pushing from every core (one partition each), whatever its size",
    )
    parser.add_argument("--push-only", action="store_true", help="the push code without Spark")
    parser.add_argument("--other-tree", help="with --push-only: also this checkout's push code")
    args = parser.parse_args()
    if args.push_only:
        return main_push_only(args)

    from eventpush.sparkjobs.session import get_spark

    spec = {"batch_size": args.batch_size}
    spark = get_spark("local[*]", app_name="bench-replay")
    print(f"machine: {machine()}; Spark local[*]; receiver in its own process; {spec}")
    rows = []
    with ReceiverProcess() as rx:
        replay(spark, rx, 200, None, **spec)  # warm-up: JVM, JDBC, Python workers, GX
        live(rx, 200, **spec)
        for r in range(args.rounds):
            fixed = replay(spark, rx, 1, None, **spec)["seconds"]
            print(f"round {r + 1} replay of one record (fixed cost): {fixed:.1f} s", flush=True)
            order = ["live", "replay"] + (["replay split"] if args.split else [])
            for side in order if r % 2 == 0 else order[::-1]:
                got = (
                    live(rx, args.records, **spec)
                    if side == "live"
                    else replay(
                        spark, rx, args.records, args.rate_limit, side == "replay split", **spec
                    )
                )
                rate = got["delivered"] / got["seconds"]
                line = f"round {r + 1} {side}: {got['delivered']:,} in {got['seconds']:.1f} s"
                line += f" = {rate:,.0f}/s, CPU {got['cpu_seconds']:.1f} s"
                if side != "live" and got["seconds"] > fixed:
                    past = got["delivered"] / (got["seconds"] - fixed)
                    line += f"; past the fixed cost {past:,.0f}/s"
                print(line, flush=True)
                rows.append({"round": r + 1, "side": side, "fixed_seconds": fixed, **got})
    print(json.dumps(rows))


def main_push_only(args) -> None:
    from eventpush.sparkjobs.replay_push import _push

    spec = {"batch_size": args.batch_size}
    sides = [("replay push (this tree)", lambda rx: push_only(rx, _push, args.records, **spec))]
    if args.other_tree:
        theirs = other_push(args.other_tree)
        sides.append(
            (
                f"replay push ({args.other_tree})",
                lambda rx: push_only(rx, theirs, args.records, **spec),
            )
        )
    sides.append(("live engine", lambda rx: live(rx, args.records, **spec)))
    print(f"machine: {machine()}; push code only, one process; {spec}")
    rows = []
    with ReceiverProcess() as rx:
        for r in range(args.rounds):
            for name, run in sides if r % 2 == 0 else sides[::-1]:
                got = run(rx)
                rate = got["delivered"] / got["seconds"]
                print(
                    f"round {r + 1} {name}: {got['delivered']:,} in {got['seconds']:.1f} s "
                    f"= {rate:,.0f}/s",
                    flush=True,
                )
                rows.append({"round": r + 1, "side": name, **got})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
