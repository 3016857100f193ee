"""Reading targets' destinations back: which records the books call delivered a destination
does not hold (``eventpush audit --verify-sinks``, and the absent records a ``missing`` replay
re-pushes).

The books say a record was delivered; a sink kind that can read its destination
(``read_back``, see :mod:`eventpush.sinks`) lists the record keys the destination holds for a
target, and each record the books call delivered whose key is not among them is:

- ``expired`` when the destination's own limits removed it: the books delivered it before
  its ``kept_from`` (a stream's ``max_age``, its oldest message), or the destination drops
  its oldest records (``trimmed``: a stream's first sequence has moved on) and the record is
  older than every record of its runner the destination still holds: before them in its
  queue's order, or delivered (its delivery row committed) no later than the first of them.
  That is the order records are stored in, not a proof: a retry can store one after its
  successors, and a record removed from the middle of a destination that also trims, in the
  same commit as the oldest record it holds, counts as expired;
- ``absent`` otherwise: delivered in the books, not at the destination. A loss.

One read per target URL serves every runner writing there (their keys differ), and the
comparison holds only the keys still unseen: one dict entry per record of the window for
that URL (about 200 bytes each), emptied as the destination's keys come in.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta

from eventpush.config import redact
from eventpush.errors import first_line
from eventpush.sinks.contract import record_key

ABSENT = "absent"
EXPIRED = "expired"
CHECKED = "checked"  # a marker row: the runner's destination was read (``where`` says what)
ERROR = "error"  # a marker row: it could not be read (``error`` says why)
# The read starts this long before the oldest event of the window: a destination stamps
# messages with its own clock (a server's clock behind ours must not hide a message).
CLOCK_SKEW = timedelta(minutes=5)
# Rows out: runner_id, queue_id, offset, state, where, error.
SCHEMA = "runner_id INT, queue_id INT, offset BIGINT, state STRING, where STRING, error STRING"


def check_url(
    url: str, delivered: Iterable[tuple[int, int, int, float, float]], policy
) -> Iterator[tuple]:
    """Rows of ``SCHEMA`` for one target URL: a marker per runner (``checked`` or ``error``)
    and one row per delivered record its destination does not hold. ``delivered``:
    (runner_id, queue_id, offset, event ctime, delivered at; times in epoch seconds) for
    every record the books call delivered to that URL in the window."""
    expected: dict[str, tuple[int, int, int, float]] = {}
    since: float | None = None
    runners: set[int] = set()
    for runner_id, queue_id, offset, ctime, delivered_at in delivered:
        expected[record_key(runner_id, queue_id, offset)] = (
            runner_id,
            queue_id,
            offset,
            delivered_at,
        )
        runners.add(runner_id)
        if ctime is not None and (since is None or ctime < since):
            since = ctime
    if not runners:
        return
    start = None if since is None else datetime.fromtimestamp(since, UTC) - CLOCK_SKEW
    oldest: dict[tuple[int, int], int] = {}  # (runner, queue) -> its oldest offset held
    first: dict[int, float] = {}  # runner -> the earliest delivery of a record held

    def found(key: str) -> None:
        # Each key the destination holds leaves ``expected``: what stays was not found.
        held = expected.pop(key, None)
        if held is not None:
            where = (held[0], held[1])
            if held[2] < oldest.get(where, held[2] + 1):
                oldest[where] = held[2]
            if held[3] is not None and held[3] < first.get(held[0], held[3] + 1):
                first[held[0]] = held[3]

    try:
        retention = asyncio.run(_read(url, start, found, policy))
    except Exception as exc:  # a broker gone, no stream for the subject: said, not raised
        error = redact(first_line(exc) or type(exc).__name__, url)
        for runner_id in sorted(runners):
            yield (runner_id, None, None, ERROR, None, error)
        return
    for runner_id in sorted(runners):
        yield (runner_id, None, None, CHECKED, retention.where, None)
    kept_from = None if retention.kept_from is None else retention.kept_from.timestamp()
    for runner_id, queue_id, offset, delivered_at in expected.values():
        expired = kept_from is not None and delivered_at is not None and delivered_at < kept_from
        if retention.trimmed and not expired:
            expired = offset < oldest.get((runner_id, queue_id), -1) or (
                delivered_at is not None and delivered_at <= first.get(runner_id, -1.0)
            )
        yield (runner_id, queue_id, offset, EXPIRED if expired else ABSENT, retention.where, None)


async def _read(url: str, since: datetime | None, found, policy):
    from eventpush.sinks import Sinks

    async with Sinks(policy) as sinks:
        return await sinks.sink_for(url).read_back(url, since, found)


def check_partition(policy):
    """The function each Spark partition runs over its rows (url, runner_id, queue_id,
    offset, ctime, delivered_at: times in epoch seconds), sorted by url: ``check_url`` per
    URL. ``policy`` is the driver's address policy (executors enforce it, not their own
    environment)."""

    def run(rows):
        for url, group in itertools.groupby(rows, key=lambda row: row["url"]):
            yield from check_url(
                url,
                (
                    (r["runner_id"], r["queue_id"], r["offset"], r["ctime"], r["delivered_at"])
                    for r in group
                ),
                policy,
            )

    return run
