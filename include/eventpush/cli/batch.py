"""The batch commands of ``eventpush``: ``audit``, ``replay`` and ``rebalance``.

Each runs its Spark job in-process (local mode unless ``EVENTPUSH_SPARK_MASTER`` or the
``spark_default`` connection says otherwise). Registered on the main group by ``cli.py``.
Exit codes are in ``cli_common``.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta

import click
from rich.table import Table

from eventpush.cli.common import EXIT_MISSING, err, fail, handles_errors, out, print_json
from eventpush.config import database_url
from eventpush.quality.batch import CheckFailed
from eventpush.sparkjobs.forms import (
    MAX_LOAD_WINDOW_MINUTES,
    REQUEST_ARGS,
    ReplayRequest,
    flag_of,
)


class IsoTime(click.ParamType):
    """An ISO 8601 time; without an offset it is UTC."""

    name = "TIME"

    def convert(self, value, param, ctx):
        if isinstance(value, datetime):
            return value
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            self.fail(f"{value!r} is not an ISO 8601 time", param, ctx)
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


ISO_TIME = IsoTime()


def check_window(since: datetime | None, until: datetime | None) -> None:
    if since and until and until <= since:
        raise ValueError(
            f"--until ({until.isoformat()}) must be after --since ({since.isoformat()})"
        )


def _spark():
    # Deferred: the Spark jobs are loaded only by the batch commands.
    from eventpush.sparkjobs.session import get_spark

    return get_spark()


@click.command("audit")
@click.option("--bus", help="Audit only this bus's runners.")
@click.option("--since", type=ISO_TIME, help="Window start (event creation time), inclusive.")
@click.option("--until", type=ISO_TIME, help="Window end, exclusive.")
@click.option(
    "--verify-sinks",
    is_flag=True,
    help="Also read readable destinations (JetStream) back: records delivered in the books "
    "but not there are absent (counted as missing in the exit code), aged out ones expired.",
)
@click.option(
    "--roll-up",
    is_flag=True,
    help="For a closed window: each runner found clean has the window's delivery rows "
    "replaced by one summary row (later audits of the window answer the same figures).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@handles_errors
def audit(bus, since, until, verify_sinks, roll_up, as_json) -> None:
    """Per runner: expected, delivered, failed, missing, pending, duplicated. Exit 1 on missing
    (with --verify-sinks: or absent, or a readable destination that could not be read)."""
    # Deferred: the Spark jobs are loaded only by the batch commands.
    from eventpush.sparkjobs.audit import run_audit

    check_window(since, until)
    url = database_url()
    with err.status("auditing deliveries with Spark..."):
        result = run_audit(
            _spark(),
            url,
            bus=bus,
            since=since,
            until=until,
            verify_sinks=verify_sinks,
            roll_up=roll_up,
        )
    for warning in result.warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if as_json:
        print_json(result.to_json())
    else:
        table = Table(title=f"audit report {result.report_id}")
        table.add_column("runner")
        # A deleted target's runner and a live one re-created with its names share a name.
        table.add_column("id", justify="right")
        keys = ("expected", "delivered", "failed", "missing", "pending", "duplicates")
        keys += ("absent", "expired") if verify_sinks else ()
        for key in keys:
            table.add_column(key, justify="right")
        if verify_sinks:
            table.add_column("destination")
        for r in result.runners:
            style = "bold red" if r.missing or r.absent else None
            sink = (r.sink or "",) if verify_sinks else ()
            cells = (r.runner, str(r.runner_id), *(str(getattr(r, k)) for k in keys), *sink)
            table.add_row(*cells, style=style)
        out.print(table)
        totals = result.totals()
        said = [f"{totals['missing']} missing"] if totals["missing"] else []
        said += [f"{totals['absent']} absent from their destination"] if totals["absent"] else []
        out.print(", ".join(said) if said else "nothing missing")
        names = result.names()
        for rid, rows in result.rolled_up.items():
            out.print(f"{names[rid]} (id {rid}): {rows} delivery rows rolled up into one")
        for rid, records in result.absent_records.items():
            shown = ", ".join(f"{q}/{o}" for q, o, _ in records[:20])
            more = f" and {len(records) - 20} more" if len(records) > 20 else ""
            out.print(f"{names[rid]} (id {rid}): absent (queue/offset) {shown}{more}")
    if result.unaccounted():
        sys.exit(EXIT_MISSING)


@click.command("rebalance")
@click.option(
    "--window-minutes",
    type=click.IntRange(1, MAX_LOAD_WINDOW_MINUTES),
    default=15,
    show_default=True,
    help="How far back the delivery log is read for each runner's load.",
)
@click.option("--dry-run", is_flag=True, help="Propose and check, but do not apply.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@handles_errors
def rebalance(window_minutes, dry_run, as_json) -> None:
    """Balance runners over enabled workers by load and capacity; applied at once."""

    # Deferred: the Spark jobs are loaded only by the batch commands.
    from eventpush.sparkjobs.rebalance import StaleProposalError, run_rebalance

    url = database_url()
    try:
        with err.status("rebalancing runners with Spark..."):
            result = run_rebalance(
                _spark(), url, timedelta(minutes=window_minutes), apply_it=not dry_run
            )
    except (CheckFailed, StaleProposalError) as exc:
        fail(str(exc), EXIT_MISSING)
    doc = result.to_json()
    if as_json:
        print_json(doc)
        return
    table = Table(title="assignment")
    table.add_column("runner")
    table.add_column("worker")
    for runner, worker in doc["assignment"].items():
        table.add_row(runner, worker or "-")
    out.print(table)
    applied = "not applied (dry run)" if dry_run else f"generation {result.generation}"
    out.print(f"{doc['moves']} moves, spread {doc['spread']}, {applied}")


def replay_options(command):
    """The options of ``eventpush replay``: the replay request's fields
    (``eventpush.sparkjobs.forms.ReplayRequest``), each under its own name."""
    types = {"text": None, "time": ISO_TIME, "int": int, "float": float}
    for name, default, arg in reversed(REQUEST_ARGS):
        if not arg.cli:
            continue
        kw: dict = {"help": arg.help[0].upper() + arg.help[1:] + "."}
        if arg.kind == "choice":
            kw.update(type=click.Choice(arg.choices), default=default, show_default=True)
        elif arg.kind == "flag":
            kw["is_flag"] = True
        elif arg.kind == "ids":
            kw["multiple"] = True
        else:
            kw["type"] = types[arg.kind]
        command = click.option(flag_of(name, arg), name, **kw)(command)
    return command


@click.command("replay")
@replay_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@handles_errors
def replay(as_json: bool, **fields) -> None:
    """Re-push failed records, audit gaps, or every matching event of a window.

    --what all needs --since (a window of at most EVENTPUSH_REPLAY_MAX_WINDOW_HOURS) or
    --everything; a run selects at most EVENTPUSH_REPLAY_MAX_COUNT records."""
    # Deferred: the Spark jobs are loaded only by the batch commands.
    from eventpush.sparkjobs.replay import check_bounds, run_replay

    req = ReplayRequest(**fields)
    check_bounds(req)  # before Spark starts: a refused request costs nothing
    url = database_url()
    try:
        with err.status(f"replaying {req.what} records with Spark..."):
            result = run_replay(_spark(), url, req)
    except CheckFailed as exc:
        fail(str(exc), EXIT_MISSING)
    for warning in result.warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if as_json:
        print_json(result.to_json())
        return
    table = Table(title=f"replay {result.replay_id}" + (" (dry run)" if req.dry_run else ""))
    table.add_column("runner")
    table.add_column("selected", justify="right")
    for runner, n in sorted(result.runners.items()):
        table.add_row(runner, str(n))
    out.print(table)
    out.print(
        f"selected {result.selected}, delivered {result.delivered}, failed {result.failed}, "
        f"skipped {result.skipped}"
    )
