"""``eventpush status``: progress and lag, per worker and runner."""

from __future__ import annotations

import click
from rich.table import Table

from eventpush.cli.common import handles_errors, out, print_json
from eventpush.db import connection
from eventpush.status import read_status


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handles_errors
def status_cmd(as_json: bool) -> None:
    """Progress and lag, per worker and runner."""

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
    # delivered: live and by replay; failed: stands failed now (eventpush.status)
    runners = Table(title="runners", caption="delivered: live and by replay (replayed)")
    columns = ("lag", "in_flight", "waiting", "delivered", "replayed", "failed")
    for col in ("runner", "worker", "state", *(c.replace("_", " ") for c in columns)):
        runners.add_column(col, justify="left" if col in ("runner", "worker", "state") else "right")
    for r in doc["runners"]:
        runners.add_row(r["runner"], r["worker"] or "-", r["state"], *(str(r[k]) for k in columns))
    out.print(workers)
    out.print(runners)
