"""The ``eventpush`` command. The commands and their meaning are a contract (DESIGN.md).

Exit codes are in ``cli_common``: 0 success, 1 missing deliveries, 2 refused input, 3 the
database or configuration is unusable.
"""

from __future__ import annotations

import json

import click
from rich.table import Table

from eventpush import catalog
from eventpush.cli_common import EXIT_STORE, fail, handles_errors, out, print_json
from eventpush.db import connection


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """eventpush: push events from buses to HTTP targets, matched by EventBridge patterns."""


# --- db -------------------------------------------------------------------------------------


@main.group()
def db() -> None:
    """The database schema."""


@db.command("migrate")
@handles_errors
def db_migrate() -> None:
    """Create or upgrade the schema (idempotent)."""
    from eventpush.schema import migrate

    before, after = migrate()
    if before == after:
        out.print(f"schema is up to date (revision {after})")
    else:
        out.print(f"schema migrated from {before or 'empty'} to revision {after}")


# --- bus, rule, target ------------------------------------------------------------------------


@main.group()
def bus() -> None:
    """Event buses."""


@bus.command("create")
@click.argument("name")
@click.option("--queues", type=int, default=4, show_default=True, help="Number of queues.")
@click.option("--description", default="")
@handles_errors
def bus_create(name: str, queues: int, description: str) -> None:
    """Create bus NAME with --queues queues."""
    with connection() as conn:
        catalog.create_bus(conn, name, queues, description)
    out.print(f"bus {name} created with {queues} queues")


@main.group()
def rule() -> None:
    """Rules: EventBridge event patterns on a bus."""


@rule.command("create")
@click.option("--bus", "bus_name", required=True)
@click.option("--name", required=True)
@click.option("--pattern", required=True, help="The event pattern, as JSON.")
@click.option("--description", default="")
@handles_errors
def rule_create(bus_name: str, name: str, pattern: str, description: str) -> None:
    """Create a rule; an invalid pattern is refused."""
    with connection() as conn:
        catalog.create_rule(conn, bus_name, name, pattern, description)
    out.print(f"rule {bus_name}/{name} created")


@main.group()
def target() -> None:
    """Targets: where a rule's matches are pushed."""


@target.command("create")
@click.option("--bus", "bus_name", required=True)
@click.option("--rule", "rule_name", required=True)
@click.option("--name", required=True)
@click.option("--url", required=True, help="http or https endpoint.")
@click.option("--secret", default=None, help="Standard Webhooks secret, whsec_<base64>.")
@click.option("--max-attempts", type=int, default=5, show_default=True)
@click.option("--backoff-ms", type=int, default=200, show_default=True)
@click.option("--max-age-s", type=int, default=3600, show_default=True)
@click.option("--timeout-ms", type=int, default=5000, show_default=True)
@click.option("--batch-size", type=int, default=1, show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True)
@click.option("--ordered", is_flag=True, help="Deliver in order per queue.")
@click.option(
    "--transform",
    type=click.Choice(catalog.TRANSFORM_KINDS, case_sensitive=False),
    default="ORIGINAL",
    show_default=True,
)
@click.option("--transform-spec", default=None, help="The transform's spec, as JSON.")
@handles_errors
def target_create(
    bus_name: str,
    rule_name: str,
    name: str,
    url: str,
    secret: str | None,
    max_attempts: int,
    backoff_ms: int,
    max_age_s: int,
    timeout_ms: int,
    batch_size: int,
    concurrency: int,
    ordered: bool,
    transform: str,
    transform_spec: str | None,
) -> None:
    """Create a target on a rule, and its runner."""
    spec_value = None
    if transform_spec is not None:
        try:
            spec_value = json.loads(transform_spec)
        except json.JSONDecodeError as exc:
            fail(f"--transform-spec is not valid JSON: {exc}")
    spec = catalog.TargetSpec(
        name=name,
        url=url,
        secret=secret,
        transform_kind=transform.upper(),
        transform_spec=spec_value,
        max_attempts=max_attempts,
        backoff_ms=backoff_ms,
        max_age_s=max_age_s,
        timeout_ms=timeout_ms,
        batch_size=batch_size,
        concurrency=concurrency,
        ordered=ordered,
    )
    with connection() as conn:
        runner = catalog.create_target(conn, bus_name, rule_name, spec)
    out.print(f"target created; runner {runner}")


# --- workers and assignment -------------------------------------------------------------------


@main.group()
def worker() -> None:
    """Push workers."""


@worker.command("create")
@click.argument("name")
@click.option("--capacity", type=int, default=100, show_default=True, help="Relative weight.")
@handles_errors
def worker_create(name: str, capacity: int) -> None:
    """Create worker NAME."""
    with connection() as conn:
        catalog.create_worker(conn, name, capacity)
    out.print(f"worker {name} created (capacity {capacity})")


@worker.command("disable")
@click.argument("name")
@handles_errors
def worker_disable(name: str) -> None:
    """Disable worker NAME; its runners go to the other enabled workers."""
    with connection() as conn:
        moved = catalog.set_worker_enabled(conn, name, False)
    out.print(f"worker {name} disabled; {moved} runners moved to other workers")


@worker.command("enable")
@click.argument("name")
@handles_errors
def worker_enable(name: str) -> None:
    """Enable worker NAME (rebalancing gives it runners)."""
    with connection() as conn:
        placed = catalog.set_worker_enabled(conn, name, True)
    out.print(f"worker {name} enabled; {placed} unassigned runners placed")


@worker.command("run")
@click.argument("name")
@click.option("--until-idle", is_flag=True, help="Return once nothing is left to deliver or retry.")
@click.option("--max-seconds", type=float, default=None, help="Stop after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's counts as JSON.")
@handles_errors
def worker_run(name: str, until_idle: bool, max_seconds: float | None, as_json: bool) -> None:
    """Run worker NAME's push loop (SIGTERM or Ctrl-C stops it gracefully)."""
    import logging

    from eventpush.push import LeaseLostError, UnknownWorkerError, WorkerBusyError, run_worker

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    live = None
    progress = None
    if out.is_terminal and not as_json:
        from rich.live import Live

        live = Live(console=out, refresh_per_second=4, transient=True)
        live.start()

        def progress(counts: dict) -> None:
            live.update(
                f"[bold]{name}[/] read {counts['read']:,}  delivered {counts['delivered']:,}  "
                f"failed {counts['failed']:,}  filtered {counts['filtered']:,}  "
                f"retried {counts['retried']:,}"
            )

    try:
        report = run_worker(
            name,
            until_idle=until_idle,
            max_seconds=max_seconds,
            progress=progress,
            handle_signals=True,
        )
    except UnknownWorkerError as exc:
        fail(str(exc))
    except (WorkerBusyError, LeaseLostError) as exc:
        fail(str(exc), EXIT_STORE)
    finally:
        if live is not None:
            live.stop()
    counts = report.as_dict()
    if as_json:
        print_json(counts)
        return
    table = Table(title=f"worker {name}")
    for key in ("read", "delivered", "failed", "filtered", "retried", "seconds"):
        table.add_column(key, justify="right")
    table.add_row(
        *(
            f"{counts[k]:,}" if k != "seconds" else f"{counts[k]:.1f}"
            for k in ("read", "delivered", "failed", "filtered", "retried", "seconds")
        )
    )
    out.print(table)


@worker.command("pause")
@click.argument("name")
@handles_errors
def worker_pause(name: str) -> None:
    """Pause worker NAME: it stops pulling and sending until resumed (no restart needed)."""
    _set_paused("worker", name, True)


@worker.command("resume")
@click.argument("name")
@handles_errors
def worker_resume(name: str) -> None:
    """Resume worker NAME."""
    _set_paused("worker", name, False)


@worker.command("adjust")
@click.argument("name")
@click.option("--pool-core", type=int, help="Request slots kept for steady load.")
@click.option("--pool-max", type=int, help="Most requests in flight at once.")
@click.option("--buffer-records", type=int, help="Backpressure: in-flight records per queue.")
@click.option("--buffer-bytes", type=int, help="Backpressure: in-flight bytes per queue.")
@click.option("--buffer-span", type=int, help="Backpressure: offset span per queue.")
@handles_errors
def worker_adjust(name: str, **settings: int | None) -> None:
    """Adjust worker NAME's pool and queue limits; a running worker picks them up."""
    _adjust("worker", name, settings)


@main.group()
def runner() -> None:
    """Runners (rule-target pairs): pause, resume, adjust."""


@runner.command("pause")
@click.argument("name")
@handles_errors
def runner_pause(name: str) -> None:
    """Pause runner NAME (BUS/RULE/TARGET)."""
    _set_paused("runner", name, True)


@runner.command("resume")
@click.argument("name")
@handles_errors
def runner_resume(name: str) -> None:
    """Resume runner NAME."""
    _set_paused("runner", name, False)


@runner.command("adjust")
@click.argument("name")
@click.option("--lane-limit", type=int, help="Most records in the runner's lane.")
@click.option("--concurrency", type=int, help="Most requests in flight to its target.")
@handles_errors
def runner_adjust(name: str, **settings: int | None) -> None:
    """Adjust runner NAME's lane limit and concurrency; a running worker picks them up."""
    _adjust("runner", name, settings)


def _set_paused(scope: str, name: str, paused: bool) -> None:
    from eventpush.controls import set_paused

    with connection() as conn:
        set_paused(conn, scope, name, paused)
    out.print(f"{scope} {name} {'paused' if paused else 'resumed'}")


def _adjust(scope: str, name: str, settings: dict) -> None:
    from eventpush.controls import adjust

    changes = {k: v for k, v in settings.items() if v is not None}
    with connection() as conn:
        in_force = adjust(conn, scope, name, changes)
    out.print(f"{scope} {name}: " + ", ".join(f"{k}={v}" for k, v in sorted(in_force.items())))


@main.command("assign")
@handles_errors
def assign_cmd() -> None:
    """Give unassigned runners to workers, evenly, without moving assigned ones."""
    with connection() as conn:
        placed = catalog.assign(conn)
    out.print(f"{placed} runners assigned")


# --- publish ----------------------------------------------------------------------------------


@main.command("publish")
@click.option("--bus", "bus_name", required=True)
@click.option("--partition-key", default=None, help="Dotted path of the key, e.g. detail.order")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.argument("file", type=click.File("r", encoding="utf-8"), default="-")
@handles_errors
def publish_cmd(bus_name: str, partition_key: str | None, as_json: bool, file) -> None:
    """Publish JSON events, one a line, from FILE (stdin if none). All or nothing."""
    from eventpush.publish import publish

    with connection() as conn:
        result = publish(conn, bus_name, file, partition_key)
    if as_json:
        print_json(
            {
                "bus": result.bus,
                "count": result.count,
                "offsets": {str(q): list(span) for q, span in result.offsets.items()},
            }
        )
        return
    out.print(f"published {result.count} events to bus {result.bus}")
    if not result.count:
        return
    table = Table()
    table.add_column("queue", justify="right")
    table.add_column("events", justify="right")
    table.add_column("offsets")
    for queue_id, (first, last) in result.offsets.items():
        table.add_row(str(queue_id), str(last - first + 1), f"{first}..{last}")
    out.print(table)


# --- status -----------------------------------------------------------------------------------


@main.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handles_errors
def status_cmd(as_json: bool) -> None:
    """Progress and lag, per worker and runner."""
    from eventpush.status import read_status

    with connection() as conn:
        doc = read_status(conn)
    if as_json:
        print_json(doc)
        return
    workers = Table(title="workers")
    for col in ("worker", "enabled", "capacity", "runners", "alive", "heartbeat"):
        workers.add_column(col)
    for w in doc["workers"]:
        workers.add_row(
            w["worker"],
            "yes" if w["enabled"] else "no",
            str(w["capacity"]),
            str(w["runners"]),
            "yes" if w["alive"] else "no",
            w["heartbeat_at"] or "-",
        )
    runners = Table(title="runners")
    for col in ("runner", "worker", "state", "lag", "in flight", "waiting", "delivered", "failed"):
        runners.add_column(col, justify="left" if col in ("runner", "worker", "state") else "right")
    for r in doc["runners"]:
        runners.add_row(
            r["runner"],
            r["worker"] or "-",
            r["state"],
            *(str(r[k]) for k in ("lag", "in_flight", "waiting", "delivered", "failed")),
        )
    out.print(workers)
    out.print(runners)


def _register_batch_commands() -> None:
    from eventpush.cli_batch import audit, rebalance, replay

    for command in (audit, replay, rebalance):
        main.add_command(command)


_register_batch_commands()

if __name__ == "__main__":
    main()
