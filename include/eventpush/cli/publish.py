"""``eventpush publish``: JSON events, one a line, onto a bus; all or nothing."""

from __future__ import annotations

import io
import os
import stat

import click
from rich.table import Table

from eventpush.cli.common import err, handles_errors, out, print_json
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


def _size(file) -> int | None:
    """Bytes a regular FILE holds (None for a pipe or a terminal: no total to show)."""
    try:
        info = os.fstat(file.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _shown(lines, file):
    """FILE's lines, with a progress bar on a terminal's stderr while they are read and
    sent (a big file is minutes of COPY); the bar is gone once the publish ends."""
    if not err.is_terminal:
        yield from lines
        return
    # Deferred: the bar's code is loaded only where it is drawn.
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    total = _size(file)
    columns = [TextColumn("reading events {task.fields[events]:,}"), BarColumn()]
    if total is not None:
        columns += [DownloadColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("publish", total=total, events=0)
        done = 0
        for events, line in enumerate(lines, 1):
            yield line
            done += len(line)  # characters: as bytes for the ASCII most events are
            if events % 4096 == 0:  # the bar's own cost stays out of the loop
                progress.update(task, completed=done, events=events)


@click.command("publish")
@click.option("--bus", "bus_name", required=True)
@click.option("--partition-key", default=None, help="Dotted path of the key, e.g. detail.order")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.argument("file", type=click.File("r", encoding="utf-8"), default="-")
@handles_errors
def publish_cmd(bus_name: str, partition_key: str | None, as_json: bool, file) -> None:
    """Publish JSON events, one a line, from FILE (stdin if none). All or nothing."""

    with connection() as conn:
        result = publish(conn, bus_name, _shown(_read(file), file), partition_key)
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
