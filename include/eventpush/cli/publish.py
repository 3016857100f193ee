"""``eventpush publish``: JSON events, one a line, onto a bus; all or nothing."""

from __future__ import annotations

import click
from rich.table import Table

from eventpush.cli.common import handles_errors, out, print_json
from eventpush.db import connection
from eventpush.publish import publish


def _read(file):
    """FILE's lines; a file that cannot be read, or is not UTF-8, is refused as input (the
    publish, all or nothing, is rolled back) in one line naming it, not a traceback."""
    where = "stdin" if file.name == "<stdin>" else file.name
    try:
        # Not "yield from": closing this generator would close FILE too (stdin at exit).
        for line in file:  # noqa: UP028
            yield line
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text") from None


@click.command("publish")
@click.option("--bus", "bus_name", required=True)
@click.option("--partition-key", default=None, help="Dotted path of the key, e.g. detail.order")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.argument("file", type=click.File("r", encoding="utf-8"), default="-")
@handles_errors
def publish_cmd(bus_name: str, partition_key: str | None, as_json: bool, file) -> None:
    """Publish JSON events, one a line, from FILE (stdin if none). All or nothing."""

    with connection() as conn:
        result = publish(conn, bus_name, _read(file), partition_key)
    if as_json:
        print_json(
            {
                "bus": result.bus,
                "count": result.count,
                "offsets": {str(q): list(span) for q, span in result.offsets.items()},
                "counts": {str(q): n for q, n in result.counts.items()},
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
        table.add_row(str(queue_id), str(result.counts[queue_id]), f"{first}..{last}")
    out.print(table)
