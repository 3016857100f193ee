"""Rolled-up books: once an audit finds a window clean for a runner (nothing missing,
nothing pending, nothing absent), that window's delivery rows may be replaced by one summary
row (``event_delivery_rollup``): expected, delivered, failed, duplicates, and per queue the
offsets covered. Later audits of a window holding it answer its figures; a record of it is
never called missing (a replay of gaps finds none there); a window cutting through it counts
its records as failed when their failure row says so, delivered otherwise (their duplicates
are no longer known). Windows of one runner never overlap; rows of windows not audited, or
audited with gaps, stay as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from eventpush.db import Connection, int_array, transaction


@dataclass(frozen=True)
class Rollup:
    runner_id: int
    window_start: datetime
    window_end: datetime
    expected: int
    delivered: int
    failed: int
    duplicates: int


def load(cur, runner_ids: list[int]) -> list[Rollup]:
    """The roll-ups of the runners, oldest first."""
    cur.execute(
        "SELECT runner_id, window_start, window_end, expected, delivered, failed, duplicates "
        "FROM event_delivery_rollup WHERE runner_id = ANY(%s) ORDER BY runner_id, window_start",
        (list(runner_ids),),
    )
    return [Rollup(*row) for row in cur.fetchall()]


def whole_within(
    rollups: list[Rollup], since: datetime | None, until: datetime | None
) -> list[Rollup]:
    """The roll-ups lying wholly inside ``[since, until)``: an audit answers their figures."""
    return [
        r
        for r in rollups
        if (since is None or r.window_start >= since) and (until is None or r.window_end <= until)
    ]


@dataclass(frozen=True)
class RunnerWindow:
    """What one runner's clean window rolls up: its audit figures and its records' keys
    (queue_id, offset) per queue."""

    runner_id: int
    expected: int
    delivered: int
    failed: int
    duplicates: int
    offsets: dict[int, list[int]]


def roll_up(
    conn: Connection,
    since: datetime,
    until: datetime,
    windows: list[RunnerWindow],
    report_id: int | None = None,
) -> dict[int, int]:
    """One summary row per runner for ``[since, until)`` and its delivery rows deleted, in
    one transaction; a runner with a roll-up overlapping the window already is left as it
    is. Returns runner id -> delivery rows replaced."""
    replaced: dict[int, int] = {}
    with transaction(conn) as cur:
        # Roll-ups of one runner must not overlap: one writer at a time decides.
        cur.execute("LOCK TABLE event_delivery_rollup IN SHARE ROW EXCLUSIVE MODE")
        for w in windows:
            cur.execute(
                "SELECT 1 FROM event_delivery_rollup WHERE runner_id = %s "
                "AND window_start < %s AND window_end > %s",
                (w.runner_id, until, since),
            )
            if cur.fetchone() is not None:
                continue
            rows = 0
            for queue_id, offs in w.offsets.items():
                cur.execute(
                    "DELETE FROM event_push_delivery WHERE runner_id = %s AND queue_id = %s "
                    'AND "offset" = ANY(%s::bigint[])',
                    (w.runner_id, queue_id, int_array(offs)),
                )
                rows += cur.rowcount
            covered = {
                str(q): [min(offs), max(offs), len(offs)] for q, offs in w.offsets.items() if offs
            }
            cur.execute(
                "INSERT INTO event_delivery_rollup (runner_id, window_start, window_end, "
                "expected, delivered, failed, duplicates, rows_rolled, offsets, report_id) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    w.runner_id,
                    since,
                    until,
                    w.expected,
                    w.delivered,
                    w.failed,
                    w.duplicates,
                    rows,
                    json.dumps(covered),
                    report_id,
                ),
            )
            replaced[w.runner_id] = rows
    return replaced


def prune(cur, before: datetime) -> int:
    """Delete the roll-ups of windows that ended before ``before`` (retention's horizon of
    the delivery log)."""
    cur.execute("DELETE FROM event_delivery_rollup WHERE window_end <= %s", (before,))
    return cur.rowcount
