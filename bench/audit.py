"""Audit benchmark: the Spark audit job (local mode) beside the same audit as one SQL query.

    .venv/bin/python bench/audit.py [--sizes 100000,1000000,10000000] [--runners 10]
        [--master local[*] | local[2] | spark://127.0.0.1:7077] [--no-warmup]
        [--keep] [--reuse eventpush_bench_audit_XXXXXXXX]

For each size: a scratch database with one bus (8 queues), ``--runners`` runners each
matching one source in ten, every matched event delivered except one in ten thousand
(missing), all offsets committed. Then the audit two ways, each timed once after a warm-up
of the same shape: Spark with the rules through the Python engine (as the job runs), and
PostgreSQL with the rules hand-written as SQL. Rows/s counts bus events scanned. Both ways
must report the same counts (expected, delivered, failed, missing, pending, duplicates per
runner), or the bench stops.
``--master`` runs the Spark side on a cluster (e.g. ``./dev cluster up``'s standalone master),
with the executors' Python environment shipped as for any job.

Each Spark run also reports the CPU seconds and the peak resident memory of the processes it
ran on (this process and its children: the local JVM and Python workers; on a cluster also
the application's executors and their Python workers), and the CPU seconds of the PostgreSQL
backends serving the scratch database, sampled with psutil (a process that ends between two
samples loses at most its last interval). CPU per event bends less with a shared machine's
load than the wall time does.

A large data set is seeded once for several masters with ``--keep`` (the scratch database is
left and named) and then ``--reuse NAME`` (audits that database without seeding, one size,
and drops it afterwards unless ``--keep`` again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import psycopg2  # noqa: E402
from common import ADMIN_URL, machine  # noqa: E402
from psycopg2 import sql  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.catalog import TargetSpec  # noqa: E402

QUEUES = 8
SOURCES = 10
PREFIX = "eventpush_bench_audit"
COUNTS = ("expected", "delivered", "failed", "missing", "pending", "duplicates")


@contextlib.contextmanager
def audit_database(reuse: str | None, keep: bool) -> Iterator[str]:
    """A migrated scratch database: a new one, or the one ``reuse`` names (left by an earlier
    ``--keep`` run, so already seeded); dropped afterwards unless ``keep``."""
    from eventpush.schema import migrate

    if reuse is not None and not reuse.startswith(PREFIX + "_"):
        raise SystemExit(f"--reuse takes a database a --keep run left ({PREFIX}_...): {reuse!r}")
    name = reuse or f"{PREFIX}_{uuid.uuid4().hex[:8]}"
    url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    admin = psycopg2.connect(ADMIN_URL)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            if reuse is None:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            else:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    raise SystemExit(f"--reuse: no database {name!r}")
        os.environ["EVENTPUSH_DATABASE_URL"] = url
        if reuse is None:
            migrate(url)
        yield url
    finally:
        if keep:
            print(f"database kept: {name} (--reuse {name})")
        else:
            with admin.cursor() as cur:
                cur.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
        admin.close()


def seeded_size(url: str) -> int:
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT coalesce(sum(next_offset), 0) FROM event_bus_queue")
        size = int(cur.fetchone()[0])
    conn.close()
    if not size:
        raise SystemExit("--reuse: the database holds no seeded bus")
    return size


class Usage:
    """CPU seconds and peak memory of the processes one step runs on, sampled in a thread.

    ``spark``: this process and its descendants, plus, on a cluster, the executors of
    ``app_id`` and their descendants (the sampler's own CPU is taken out). ``postgres``: the
    backends of database ``db`` and their parallel workers. A process alive at the start
    counts from its CPU then, a later one from its birth; one that ends loses at most its
    last ``interval``, and one that lives less than the second between two searches for
    processes may be missed (none at the sizes this is for: JDBC slices last minutes)."""

    def __init__(self, db: str, app_id: str | None = None, interval: float = 0.25) -> None:
        self.db, self.app_id, self.interval = db, app_id, interval
        self.base: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], tuple[str, float]] = {}
        self.peak_rss = 0
        self.loads: list[float] = []
        self.sampler_cpu = 0.0
        self._known: list[tuple[str, psutil.Process]] = []
        self._found_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _processes(self) -> list[tuple[str, psutil.Process]]:
        me = psutil.Process()
        out = [("spark", p) for p in (me, *me.children(recursive=True))]
        backends: set[int] = set()
        workers: list[tuple[int, psutil.Process]] = []
        for p in psutil.process_iter(["cmdline"]):
            line = " ".join(p.info["cmdline"] or ())
            if self.app_id and "CoarseGrainedExecutorBackend" in line and self.app_id in line:
                with contextlib.suppress(psutil.Error):
                    out += [("spark", q) for q in (p, *p.children(recursive=True))]
            elif line.startswith("postgres: ") and f" {self.db} " in line:  # user db host
                backends.add(p.pid)
                out.append(("postgres", p))
            elif line.startswith("postgres: ") and " parallel worker for PID " in line:
                # "postgres: [cluster: ]parallel worker for PID N": no database in the title
                workers.append((int(line.split(" for PID ")[1].split()[0]), p))
        out += [("postgres", p) for leader, p in workers if leader in backends]
        return out

    def _sample(self, first: bool = False) -> None:
        # Finding the processes reads every command line: once a second is enough (a newcomer
        # counts from its birth); their CPU is read every interval.
        now = time.monotonic()
        if first or now - self._found_at >= 1.0:
            self._known, self._found_at = self._processes(), now
        rss = 0
        for group, p in self._known:
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    if group == "spark":
                        rss += p.memory_info().rss
            except psutil.Error:
                continue
            if first:
                self.base[key] = cpu
            self.base.setdefault(key, 0.0)
            self.last[key] = (group, cpu)
        self.peak_rss = max(self.peak_rss, rss)
        self.loads.append(os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()
        self.sampler_cpu = time.thread_time()

    def __enter__(self) -> Usage:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def cpu(self, group: str) -> float:
        total = sum(c - self.base[k] for k, (g, c) in self.last.items() if g == group)
        return total - (self.sampler_cpu if group == "spark" else 0.0)

    def summary(self) -> dict:
        return {
            "spark_cpu_s": round(self.cpu("spark"), 1),
            "postgres_cpu_s": round(self.cpu("postgres"), 1),
            "spark_peak_rss_gib": round(self.peak_rss / 2**30, 2),
            "load_1m": [round(min(self.loads), 1), round(max(self.loads), 1)],
        }


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
       count(*) FILTER (WHERE d.n IS NULL AND (f.status IS NULL OR f.status = 'replayed')
                        AND x."offset" >= x.committed) AS pending,
       coalesce(sum(greatest(d.n - 1, 0)), 0) AS duplicates
FROM expected x
LEFT JOIN delivered d USING (runner_id, queue_id, "offset")
LEFT JOIN event_push_failure f USING (runner_id, queue_id, "offset")
GROUP BY x.runner_id ORDER BY x.runner_id
"""


def sql_audit(url: str) -> tuple[float, dict, float]:
    """Seconds, counts per runner, and CPU seconds of the backend and its parallel workers."""
    conn = psycopg2.connect(url)
    with Usage(url.rsplit("/", 1)[1]) as usage, conn.cursor() as cur:
        started = time.perf_counter()
        cur.execute(SQL_AUDIT)
        rows = cur.fetchall()
        elapsed = time.perf_counter() - started
    conn.close()
    return elapsed, {r[0]: tuple(int(n) for n in r[1:]) for r in rows}, usage.cpu("postgres")


def spark_audit(spark, url: str) -> tuple[float, dict, dict]:
    from datetime import UTC, datetime, timedelta

    from eventpush.sparkjobs import audit

    since = datetime.now(UTC) - timedelta(days=1)
    sc = spark.sparkContext
    app_id = None if sc.master.startswith("local") else sc.applicationId
    with Usage(url.rsplit("/", 1)[1], app_id) as usage:
        started = time.perf_counter()
        result = audit.run_audit(spark, url, since=since, save=False, slice_size=500_000)
        elapsed = time.perf_counter() - started
    names = {}
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT name, id FROM event_target_runner")
        names = dict(cur.fetchall())
    conn.close()
    counts = {names[r.runner]: tuple(getattr(r, k) for k in COUNTS) for r in result.runners}
    return elapsed, counts, usage.summary()


def report(label: str, size: int, seconds: float, usage: dict) -> None:
    cpu = usage["spark_cpu_s"]
    print(
        f"{label}: {seconds:.1f} s = {size / seconds:,.0f} rows/s; "
        f"spark CPU {cpu:.0f} s = {size / max(cpu, 0.01):,.0f} rows per CPU-second; "
        f"postgres backends CPU {usage['postgres_cpu_s']:.0f} s; "
        f"spark peak RSS {usage['spark_peak_rss_gib']:.1f} GiB; "
        f"load (1 min) {usage['load_1m'][0]}-{usage['load_1m'][1]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--runners", type=int, default=10)
    parser.add_argument("--master", default="local[*]", help="the Spark master to audit on")
    parser.add_argument(
        "--no-warmup", action="store_true", help="time the first Spark run (no warm-up run)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the (last) scratch database, for --reuse"
    )
    parser.add_argument(
        "--reuse", metavar="NAME", help="audit a database a --keep run left (no seeding)"
    )
    args = parser.parse_args()
    if args.reuse is not None and not args.reuse.startswith(PREFIX + "_"):
        parser.error(f"--reuse takes a database a --keep run left ({PREFIX}_...)")

    from eventpush.sparkjobs.session import get_spark

    spark = get_spark(args.master, app_name="bench-audit", shuffle_partitions=8)
    conf = spark.sparkContext.getConf()
    memory = {k: conf.get(f"spark.{k}.memory", "1g (default)") for k in ("driver", "executor")}
    print(
        f"machine: {machine()}; Spark {args.master}; {args.runners} runners, {QUEUES} queues; "
        f"driver memory {memory['driver']}, executor memory {memory['executor']}"
    )
    sizes = [None] if args.reuse else [int(s) for s in args.sizes.split(",")]
    results = []
    for i, size in enumerate(sizes):
        keep = args.keep and i == len(sizes) - 1
        with audit_database(args.reuse, keep) as url:
            if size is None:
                size = seeded_size(url)
                print(f"\n{size:,} events, seeded earlier")
            else:
                t0 = time.perf_counter()
                seed(url, size, args.runners)
                print(f"\n{size:,} events seeded in {time.perf_counter() - t0:.0f} s")
            row = {"events": size, "master": args.master}
            if not args.no_warmup:  # JIT, JDBC, Python workers
                warm_s, _, warm = spark_audit(spark, url)
                report("spark warm-up run", size, warm_s, warm)
                row.update(warmup_s=warm_s, warmup=warm)
            udf_s, udf, usage = spark_audit(spark, url)
            report("spark (rules by the Python engine)", size, udf_s, usage)
            pg_s, pg, pg_cpu = sql_audit(url)
            if udf != pg:
                raise SystemExit(f"audits disagree ({', '.join(COUNTS)}): spark {udf} sql {pg}")
            row.update(spark_udf_s=udf_s, postgres_s=pg_s, postgres_query_cpu_s=pg_cpu, **usage)
            missing = sum(v[COUNTS.index("missing")] for v in pg.values())
            print(
                f"postgres one query: {pg_s:.1f} s = {size / pg_s:,.0f} rows/s; "
                f"CPU {pg_cpu:.0f} s = {size / max(pg_cpu, 0.01):,.0f} rows per CPU-second; "
                f"spark/postgres time {udf_s / pg_s:.1f}x; missing found {missing}; "
                f"load now {os.getloadavg()[0]:.1f}"
            )
            results.append(row)
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
