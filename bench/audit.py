"""Audit benchmark: the Spark audit job (local mode) beside the same audit as one SQL query.

    .venv/bin/python bench/audit.py [--sizes 100000,1000000,10000000] [--runners 10]
        [--master local[*] | local[2] | spark://127.0.0.1:7077]

For each size: a scratch database with one bus (8 queues), ``--runners`` runners each
matching one source in ten, every matched event delivered except one in ten thousand
(missing), all offsets committed. Then the audit two ways, each timed once after a warm-up
of the same shape: Spark with the rules through the Python engine (as the job runs), and
PostgreSQL with the rules hand-written as SQL. Rows/s counts bus events scanned. Both ways
must report the same counts, or the bench stops.
``--master`` runs the Spark side on a cluster (e.g. ``./dev cluster up``'s standalone master),
with the executors' Python environment shipped as for any job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.catalog import TargetSpec  # noqa: E402

QUEUES = 8
SOURCES = 10


def seed(url: str, events: int, runners: int) -> list[int]:
    conn = psycopg2.connect(url)
    bus_id = catalog.create_bus(conn, "bench", QUEUES)
    ids = []
    for r in range(runners):
        source = f"app.src{r % SOURCES}"
        catalog.create_rule(conn, "bench", f"r{r}", {"source": [source]})
        catalog.create_target(
            conn, "bench", f"r{r}", TargetSpec(name="t", url="http://127.0.0.1:9/")
        )
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM event_target_runner ORDER BY id")
        ids = [row[0] for row in cur.fetchall()]
        # Events straight into the bus partition: offsets per queue, one source in ten each.
        cur.execute(
            'INSERT INTO bus_event (bus_id, queue_id, "offset", message_id, source, '
            "detail_type, event_time, ctime, size_bytes, body) "
            "SELECT %(bus)s, i %% %(q)s, i / %(q)s, 'm' || i, 'app.src' || (i %% 10), 'created', "
            "now(), now() - interval '30 minutes', 150, json_build_object('version', '0', "
            "'id', 'm' || i, 'source', 'app.src' || (i %% 10), 'detail-type', 'created', "
            "'time', '2026-01-01T00:00:00Z', 'resources', json_build_array(), "
            "'detail', json_build_object('n', i, 'tag', 'x'))"
            "FROM generate_series(0, %(n)s - 1) AS i",
            {"bus": bus_id, "q": QUEUES, "n": events},
        )
        cur.execute(
            "UPDATE event_bus_queue q SET next_offset = (SELECT count(*) FROM bus_event e "
            "WHERE e.bus_id = q.bus_id AND e.queue_id = q.queue_id) WHERE bus_id = %s",
            (bus_id,),
        )
        cur.execute(
            'UPDATE event_push_offset o SET "offset" = q.next_offset, pulled = q.next_offset, '
            "start_offset = 0 FROM event_bus_queue q WHERE q.bus_id = %s "
            "AND q.queue_id = o.queue_id",
            (bus_id,),
        )
        # Deliveries for every match but one in ten thousand.
        cur.execute(
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms) '
            "SELECT r.id, r.name, 'bench', e.queue_id, e.\"offset\", e.message_id, 1, 200, 5 "
            "FROM event_target_runner r JOIN event_target t ON t.id = r.target_id "
            "JOIN event_rule ru ON ru.id = t.rule_id "
            "JOIN bus_event e ON e.bus_id = %s AND e.source = ru.pattern->'source'->>0 "
            'WHERE (e."offset" * 8 + e.queue_id) %% 10000 <> 7',
            (bus_id,),
        )
    conn.commit()
    with conn.cursor() as cur:
        conn.autocommit = True
        cur.execute("VACUUM ANALYZE")
    conn.close()
    return ids


SQL_AUDIT = """
WITH rules AS (
    SELECT r.id AS runner_id, ru.pattern->'source'->>0 AS source
    FROM event_target_runner r JOIN event_target t ON t.id = r.target_id
    JOIN event_rule ru ON ru.id = t.rule_id
),
expected AS (
    SELECT ru.runner_id, e.queue_id, e."offset", o."offset" AS committed
    FROM bus_event e
    JOIN rules ru ON e.body->>'source' = ru.source
    JOIN event_push_offset o ON o.runner_id = ru.runner_id AND o.queue_id = e.queue_id
    WHERE e."offset" >= o.start_offset AND e.ctime >= now() - interval '1 day'
),
delivered AS (
    SELECT runner_id, queue_id, "offset", count(*) AS n
    FROM event_push_delivery GROUP BY 1, 2, 3
)
SELECT x.runner_id, count(*) AS expected,
       count(*) FILTER (WHERE d.n > 0) AS delivered,
       count(*) FILTER (WHERE d.n IS NULL AND f.status IN ('failed', 'dead')) AS failed,
       count(*) FILTER (WHERE d.n IS NULL AND (f.status IS NULL OR f.status = 'replayed')
                        AND x."offset" < x.committed) AS missing,
       coalesce(sum(greatest(d.n - 1, 0)), 0) AS duplicates
FROM expected x
LEFT JOIN delivered d USING (runner_id, queue_id, "offset")
LEFT JOIN event_push_failure f USING (runner_id, queue_id, "offset")
GROUP BY x.runner_id ORDER BY x.runner_id
"""


def sql_audit(url: str) -> tuple[float, dict]:
    conn = psycopg2.connect(url)
    started = time.perf_counter()
    with conn.cursor() as cur:
        cur.execute(SQL_AUDIT)
        rows = cur.fetchall()
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed, {r[0]: (r[1], r[2], r[4]) for r in rows}


def spark_audit(spark, url: str) -> tuple[float, dict]:
    from datetime import UTC, datetime, timedelta

    from eventpush.sparkjobs import audit

    since = datetime.now(UTC) - timedelta(days=1)
    started = time.perf_counter()
    result = audit.run_audit(spark, url, since=since, save=False, slice_size=500_000)
    elapsed = time.perf_counter() - started
    names = {}
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT name, id FROM event_target_runner")
        names = dict(cur.fetchall())
    conn.close()
    return elapsed, {names[r.runner]: (r.expected, r.delivered, r.missing) for r in result.runners}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--runners", type=int, default=10)
    parser.add_argument("--master", default="local[*]", help="the Spark master to audit on")
    args = parser.parse_args()

    from eventpush.sparkjobs.session import get_spark

    spark = get_spark(args.master, app_name="bench-audit", shuffle_partitions=8)
    print(f"machine: {machine()}; Spark {args.master}; {args.runners} runners, {QUEUES} queues")
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        with scratch_database("eventpush_bench_audit") as url:
            t0 = time.perf_counter()
            seed(url, size, args.runners)
            print(f"\n{size:,} events seeded in {time.perf_counter() - t0:.0f} s")
            spark_audit(spark, url)  # warm-up: JIT, JDBC, Python workers
            udf_s, udf = spark_audit(spark, url)
            pg_s, pg = sql_audit(url)
            if udf != pg:
                raise SystemExit(f"audits disagree: spark {udf} sql {pg}")
            row = {"events": size, "master": args.master, "spark_udf_s": udf_s, "postgres_s": pg_s}
            missing = sum(v[2] for v in pg.values())
            print(
                f"spark (rules by the Python engine): {udf_s:.1f} s = "
                f"{size / udf_s:,.0f} rows/s; postgres one query: {pg_s:.1f} s = "
                f"{size / pg_s:,.0f} rows/s; spark/postgres time {udf_s / pg_s:.1f}x; "
                f"missing found {missing}"
            )
            results.append(row)
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
