"""The end-to-end demo behind ``./dev demo``.

A realistic topology on the embedded default: one bus with four queues, rules for four teams
in the EventBridge pattern language, targets served by the package's demo receiver (one
healthy, one slow, one down until it recovers, one that refuses for good), tens of thousands
of events published through the EventBridge API (``eventpush api``, boto3's PutEvents signed
with a producer key, as any application on AWS would), then the real Airflow DAGs run one
after another with ``DAG.test()`` (what ``airflow dags test`` runs), all in one Airflow
process (``demo.dag_runs``): push (until the work is done), audit (which finds the
failures), replay once the flaky target recovers, audit again (clean), rebalance onto a new
worker. It prints what happened as tables and writes an HTML report with charts. Nothing is
left running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import psycopg2
from rich.console import Console
from rich.table import Table

from eventpush import access_keys, catalog
from eventpush.config import allow_loopback_receiver, redact_url
from eventpush.demo.dag_runs import DagRuns
from eventpush.demo.front_door import ApiProcess, put_events
from eventpush.demo.receiver import ReceiverProcess
from eventpush.demo.report import write_report

REPO = Path(__file__).resolve().parents[3]
DEMO_DB = "eventpush_demo"
SECRET = "whsec_ZGVtby1zZWNyZXQtZm9yLWV2ZW50cHVzaC1kZW1v"
console = Console(width=max(Console().width, 110))
SPARK_MASTER = "local[2]"

RULES = {
    # team: (rule name, pattern, target name, receiver path, target options)
    "billing": (
        "large-orders",
        {
            "source": ["shop.orders"],
            "detail-type": ["OrderPlaced"],
            "detail": {"total": [{"numeric": [">", 100]}]},
        },
        "invoices",
        "/ok",
        {"secret": SECRET},
    ),
    "shipping": (
        "shippable",
        {
            "detail-type": ["OrderPlaced", "OrderCancelled"],
            "detail": {"country": [{"anything-but": ["XX"]}]},
        },
        "warehouse",
        "/slow?ms=20",
        {"batch_size": 25},
    ),
    "fraud": (
        "foreign-cards",
        {
            "source": ["shop.payments"],
            "detail": {
                "card": {"country": [{"anything-but": "US"}]},
                "ip": [{"cidr": "10.0.0.0/8"}],
            },
        },
        "risk",
        "/down",
        {"max_attempts": 3, "backoff_ms": 100, "max_age_s": 8},
    ),
    "marketing": (
        "newsletter",
        {"source": [{"prefix": "shop."}], "detail": {"email": [{"suffix": "@example.com"}]}},
        "crm",
        "/gone",
        {},
    ),
}


def events(n: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.random()
        email = f"c{i % 5000}@{rng.choice(['example.com', 'mail.test'])}"
        if kind < 0.6:
            event = {
                "source": "shop.orders",
                "detail-type": "OrderPlaced",
                "detail": {
                    "order": i,
                    "total": rng.randint(5, 500),
                    "email": email,
                    "country": rng.choice(["US", "DE", "FR", "XX"]),
                },
            }
        elif kind < 0.8:
            event = {
                "source": "shop.orders",
                "detail-type": "OrderCancelled",
                "detail": {"order": i, "country": rng.choice(["US", "DE", "XX"])},
            }
        else:
            event = {
                "source": "shop.payments",
                "detail-type": "PaymentAuthorized",
                "detail": {
                    "payment": i,
                    "card": {"country": rng.choice(["US", "GB", "BR"])},
                    "ip": rng.choice(["10.1.2.3", "10.200.0.9", "192.168.1.4"]),
                },
            }
        out.append(event)
    return out


def demo_database() -> str:
    admin_url = os.environ.get("EVENTPUSH_ADMIN_URL") or os.environ["EVENTPUSH_DATABASE_URL"]
    admin = psycopg2.connect(admin_url)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{DEMO_DB}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{DEMO_DB}"')
    admin.close()
    url = f"{admin_url.rsplit('/', 1)[0]}/{DEMO_DB}"
    # Deferred: alembic is loaded only by a migration.
    from eventpush.schema import migrate

    migrate(url)
    return url


def airflow_env(url: str) -> dict[str, str]:
    home = REPO / "var" / "airflow-demo"
    home.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "AIRFLOW_CONN_EVENTPUSH_DB": url,
        # In-process mode (eventpush.airflow.spark_submit): the DAG runs share this Airflow
        # process, so their Spark jobs share one local JVM instead of a spark-submit each.
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
            {"conn_type": "spark", "host": SPARK_MASTER, "extra": {"in_process": True}}
        ),
        "EVENTPUSH_DATABASE_URL": url,
        "GX_ANALYTICS_ENABLED": "False",
        "PYTHONWARNINGS": "ignore",
    }


def dag_test(runs: DagRuns, dag_id: str, conf: dict, step: str) -> float:
    """One real DAG run, as ``airflow dags test DAG_ID -c CONF`` would make it."""
    started = time.monotonic()
    with console.status(f"[bold]{step}[/]: dags test {dag_id}"):
        runs.run(dag_id, conf)
    elapsed = time.monotonic() - started
    console.print(f"[green]✓[/] {step} ({dag_id}, {elapsed:.0f} s)")
    return elapsed


def runner_table(conn, title: str) -> list[dict]:
    """The runners as ``eventpush status`` counts them (``eventpush.status``: delivered live
    and by replay, the audit's vocabulary), printed and returned for the report."""
    from eventpush.status import read_status

    rows = [
        {
            "runner": r["runner"],
            "worker": r["worker"],
            "delivered": r["delivered"],
            "replayed": r["replayed"],
            "failed": r["failed"],
            "open": r["open_failures"],
        }
        for r in read_status(conn)["runners"]
    ]
    conn.rollback()
    table = Table(title=title, caption="delivered: live and by replay; failed: failed now")
    for col in ("runner", "worker", "delivered", "of which replayed", "failed", "open failures"):
        table.add_column(col, justify="left" if col in ("runner", "worker") else "right")
    for r in rows:
        table.add_row(
            r["runner"],
            r["worker"] or "-",
            *(f"{r[k]:,}" for k in ("delivered", "replayed", "failed", "open")),
        )
    console.print(table)
    return rows


def audit_table(conn, title: str) -> dict:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT runners, missing, failed, created_at FROM event_audit_report "
            "ORDER BY id DESC LIMIT 1"
        )
        row = cur.fetchone()
    if row is None:
        raise RuntimeError("the audit wrote no report")
    runners = row[0] if isinstance(row[0], list) else row[0].get("runners", row[0])
    table = Table(title=title)
    keys = ("expected", "delivered", "failed", "missing", "pending", "duplicates")
    table.add_column("runner")
    for k in keys:
        table.add_column(k, justify="right")
    for r in runners:
        table.add_row(r["runner"], *(f"{r[k]:,}" for k in keys))
    console.print(table)
    return {"runners": runners, "missing": row[1], "failed": row[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--port", type=int, default=8787)
    parser.add_argument("--report", default=str(REPO / "artifacts" / "demo-report.html"))
    args = parser.parse_args()
    started = time.monotonic()
    timings: dict[str, float] = {}

    console.rule("[bold]eventpush demo")
    allow_loopback_receiver()  # before Airflow's environment is copied from ours
    url = demo_database()
    console.print(f"demo database: [cyan]{DEMO_DB}[/] (migrated)")
    env = airflow_env(url)
    receiver = ReceiverProcess(args.port)
    # Airflow starts (migrates its metadata database, starts the Spark session the jobs share)
    # while the shop is set up and publishes.
    runs = DagRuns(env, Path(env["AIRFLOW_HOME"]) / "demo-dag-runs.log", spark=SPARK_MASTER)
    try:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "commerce", 4, "orders and payments of the demo shop")
        for team, (rule, pattern, target, path, options) in RULES.items():
            catalog.create_rule(conn, "commerce", rule, pattern, f"{team} team")
            catalog.create_target(
                conn,
                "commerce",
                rule,
                catalog.TargetSpec(name=target, url=receiver.url + path, **options),
            )
        for worker in ("w1", "w2"):
            catalog.create_worker(conn, worker)
        catalog.assign(conn)
        window_start = datetime.now(UTC) - timedelta(minutes=1)
        shop = access_keys.create_key(conn, "demo-shop", "producer", ["commerce"])
        t = time.monotonic()
        api = ApiProcess(args.port + 1, url)
        try:
            key = (shop.info.access_key_id, shop.secret_access_key)
            count = put_events(api.url, key, "commerce", events(args.events))
        finally:
            api.stop()
        console.print(
            f"published [bold]{count:,}[/] events to bus commerce through the EventBridge API "
            f"(boto3 PutEvents, 10 a call) in {time.monotonic() - t:.1f} s"
        )

        timings["push"] = dag_test(
            runs,
            "eventpush_push",
            # one run, ended when the work is: no window to wait out, no next run to hand to
            {"slice_seconds": 120, "hand_over_s": 0, "until_idle": True},
            "push",
        )
        runner_table(conn, "after the push")
        window = {
            "since": window_start.isoformat(),
            "until": (datetime.now(UTC) + timedelta(minutes=1)).isoformat(),
        }
        timings["audit"] = dag_test(runs, "eventpush_audit", {**window, "bus": "commerce"}, "audit")
        first_audit = audit_table(conn, "audit 1: the failures are on the books, nothing missing")

        receiver.recover("/down")
        console.print("the [bold]risk[/] target has recovered")
        timings["replay"] = dag_test(
            runs,
            "eventpush_replay",
            {
                "bus": "commerce",
                "rule": "foreign-cards",
                "target": "risk",
                "what": "failed",
                **window,
            },
            "replay of the risk target's failures",
        )
        runner_table(conn, "after the replay")
        timings["audit again"] = dag_test(
            runs, "eventpush_audit", {**window, "bus": "commerce"}, "audit again"
        )
        second_audit = audit_table(conn, "audit 2")

        catalog.create_worker(conn, "w3")
        console.print("a new worker [bold]w3[/] joins")
        timings["rebalance"] = dag_test(runs, "eventpush_rebalance", {}, "rebalance")
        final = runner_table(conn, "after the rebalance")
        stats = receiver.stats()
    finally:
        receiver.stop()
        runs.close()

    path = write_report(
        Path(args.report), final, first_audit, second_audit, timings, stats, args.events
    )
    console.rule()
    console.print(f"report: [cyan]{path}[/]")
    # The private cluster's URL carries a password: never printed (trust auth's is kept whole).
    secret = urlsplit(url).password is not None
    shown = redact_url(url) if secret else url
    console.print(f"inspect it yourself: EVENTPUSH_DATABASE_URL={shown} .venv/bin/eventpush status")
    if secret:
        console.print("(credentials masked: the same as in your EVENTPUSH_DATABASE_URL)")
    console.print(f"demo finished in {time.monotonic() - started:.0f} s; nothing left running")


if __name__ == "__main__":
    main()
