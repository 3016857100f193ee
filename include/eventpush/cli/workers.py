"""Worker and runner commands: create, enable and disable workers; run a worker's push loop;
pause, resume and adjust a worker or a runner while it runs."""

from __future__ import annotations

import logging
import math

import click
from rich.table import Table

from eventpush import catalog
from eventpush.cli.common import EXIT_STORE, fail, handles_errors, out, print_json
from eventpush.db import connection
from eventpush.metrics import metrics_port as resolve_metrics_port
from eventpush.push.controls import adjust, set_paused


def _pause_and_resume(group: click.Group, scope: str, pause_note: str) -> None:
    """Add ``pause NAME`` and ``resume NAME`` to ``group``: one shape for workers and runners."""

    def make(paused: bool) -> click.Command:
        verb = "pause" if paused else "resume"

        @group.command(
            verb, help=f"{verb.capitalize()} {scope} NAME" + (f": {pause_note}." if paused else ".")
        )
        @click.argument("name")
        @handles_errors
        def command(name: str) -> None:
            with connection() as conn:
                set_paused(conn, scope, name, paused)
            out.print(f"{scope} {name} {'paused' if paused else 'resumed'}")

        return command

    make(True)
    make(False)


def _enable_and_disable(group: click.Group) -> None:
    """Add ``enable NAME`` and ``disable NAME`` to ``group``: one shape, told apart by what
    the assignment does with the worker's runners."""

    def make(enabled: bool, summary: str, result: str) -> None:
        verb = "enable" if enabled else "disable"

        @group.command(verb, help=summary)
        @click.argument("name")
        @handles_errors
        def command(name: str) -> None:
            with connection() as conn:
                count = catalog.set_worker_enabled(conn, name, enabled)
            out.print(f"worker {name} {verb}d; {count} {result}")

    make(
        False,
        "Disable worker NAME; its runners go to the other enabled workers.",
        "runners moved to other workers",
    )
    make(True, "Enable worker NAME (rebalancing gives it runners).", "unassigned runners placed")


@click.group()
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


_enable_and_disable(worker)


@worker.command("run")
@click.argument("name")
@click.option("--until-idle", is_flag=True, help="Return once nothing is left to deliver or retry.")
@click.option("--max-seconds", type=float, default=None, help="Stop after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's counts as JSON.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus /metrics on this port (default: EVENTPUSH_METRICS_PORT; "
    "host 127.0.0.1 unless EVENTPUSH_METRICS_HOST).",
)
@handles_errors
def worker_run(
    name: str,
    until_idle: bool,
    max_seconds: float | None,
    as_json: bool,
    metrics_port: int | None,
) -> None:
    """Run worker NAME's push loop (SIGTERM or Ctrl-C stops it gracefully)."""

    # Deferred: the push runtime (pycurl, uvloop, the engine) loads only when a worker runs.
    from eventpush.push import (
        LeaseLostError,
        UnknownWorkerError,
        WorkerBusyError,
        WorkerFailedError,
        run_worker,
    )

    # NaN compares false with everything: the loop's "elapsed >= max_seconds" never held and
    # the worker ran forever; a negative or zero budget ran nothing and said success.
    if max_seconds is not None and not 0 < max_seconds < math.inf:
        fail(f"--max-seconds must be a finite number of seconds more than 0, got {max_seconds}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        port = resolve_metrics_port(metrics_port)
    except ValueError as exc:
        fail(str(exc))
    live = None
    progress = None
    if out.is_terminal and not as_json:
        # Deferred: rich's live display is loaded only by the interactive command.
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
            metrics_port=port,
        )
    except UnknownWorkerError as exc:
        fail(str(exc))
    except (WorkerBusyError, LeaseLostError, WorkerFailedError) as exc:
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


_pause_and_resume(
    worker, "worker", "it stops pulling and sending until resumed (no restart needed)"
)


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


@click.group()
def runner() -> None:
    """Runners (rule-target pairs): pause, resume, adjust."""


_pause_and_resume(runner, "runner", "NAME is BUS/RULE/TARGET")


@runner.command("adjust")
@click.argument("name")
@click.option("--lane-limit", type=int, help="Most records in the runner's lane.")
@click.option("--concurrency", type=int, help="Most requests in flight to its target.")
@handles_errors
def runner_adjust(name: str, **settings: int | None) -> None:
    """Adjust runner NAME's lane limit and concurrency; a running worker picks them up."""
    _adjust("runner", name, settings)


def _adjust(scope: str, name: str, settings: dict) -> None:
    changes = {k: v for k, v in settings.items() if v is not None}
    with connection() as conn:
        in_force = adjust(conn, scope, name, changes)
    out.print(f"{scope} {name}: " + ", ".join(f"{k}={v}" for k, v in sorted(in_force.items())))
