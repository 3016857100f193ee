"""Time partitions of the books, made ahead and dropped behind.

``bus_event`` is partitioned by bus (``bus_event_ID``), and each bus's partition by day of
``ctime`` (``bus_event_ID_pYYYYMMDD``, UTC days). ``event_push_delivery`` is partitioned by
day of ``ctime`` (``event_push_delivery_pYYYYMMDD``). Each partitioned table also has a
``_default`` partition, which catches rows of a day not made yet (maintenance stopped for
longer than its lead) and is emptied into the day's partition when maintenance makes it, and
possibly a ``_before`` partition (MINVALUE up to the day migration 0010 ran): the rows that
existed before partitioning, kept whole until all of them are past retention.

A day's partition is appended to all day long and never changed after: while its day lasts
(and for the days made ahead) autovacuum leaves it alone (``autovacuum_enabled = false``).
Under a steady ingest its insert-driven VACUUM read and rewrote every page appended so far,
and its ANALYZE sampled 30,000 pages again after every tenth more rows (2-6 s of a core each
on a day of a million events), both beside the ingest, whose commits waited behind them
(docs/BENCHMARKS.md, issue 31). Once the day is over, maintenance gives it back to autovacuum,
which then vacuums and analyzes it once, cold. The vacuum that guards against transaction ID
wraparound runs whatever the setting; the readers' queries go by the position index, which
the planner takes with or without statistics.

Retention drops whole partitions, never rows: a bus's day goes once its end is older than
the bus's retention (so events live between their retention and a day more), a delivery day
once its end is older than the longest retention of any bus. Failure rows (the dead-letter
store, rare by nature and not partitioned) are deleted by row after their own, longer
retention. Maintenance is :func:`maintain`, run by ``eventpush retention run`` and the
``eventpush_retention`` DAG.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from psycopg2 import errors, sql

from eventpush import config, rollups
from eventpush.db import Connection, transaction

DAY = timedelta(days=1)
DELIVERY = "event_push_delivery"
# The strong locks maintenance takes on a table that is written (a drop's ACCESS EXCLUSIVE
# on the partitioned parent, a missed day's SHARE ROW EXCLUSIVE) wait behind a long reader
# (an audit's scan, a replay), and every publisher of the table queues behind the waiting
# lock: under the single 5 s wait of before, each publisher then stalled for up to 5 s. So a
# try waits this long at most (a commit's worth, not a stall), and is tried again after a
# pause that lets the queued publishers through.
LOCK_TRY_TIMEOUT = "150ms"
# The pause after a try that gave up, doubling from the first to the longest: a short reader
# is outwaited by the first tries, a long one is not hammered.
LOCK_RETRY_FIRST_S = 0.05
LOCK_RETRY_MAX_S = 1.0
# A table's tries, all its steps together, go on this long; then it is left to the next run
# (``postponed``), as a reader longer than this (a backup, a long audit) is not outwaited.
LOCK_PATIENCE_S = 5.0
# REINDEX CONCURRENTLY (compaction) waits for every older snapshot, then gives up until the
# next run. No writer queues behind that wait (it locks SHARE UPDATE EXCLUSIVE only).
LOCK_TIMEOUT = "5s"
_BOUND = re.compile(r"FROM \((?P<lo>[^)]*)\) TO \((?P<hi>[^)]*)\)")


# The storage parameter a day still written (today's, or one made ahead) is created with off,
# and gets back once the day is over (see the module's docstring); as pg_class lists it.
_AUTOVACUUM = "autovacuum_enabled"
_AUTOVACUUM_OFF = f"{_AUTOVACUUM}=false"


@dataclass
class Partition:
    name: str
    lo: datetime | None  # None: MINVALUE
    hi: datetime | None  # None: the default partition
    hot: bool = False  # autovacuum leaves it alone (a day still written)


@dataclass
class BusHorizon:
    """One bus's horizon in a maintenance report: the oldest time whose events are still all
    kept (``deleted``: the bus is deleted, its events kept to their retention)."""

    bus: str
    horizon: str
    deleted: bool = False


@dataclass
class MaintenanceReport:
    """What one maintenance run did: partitions made and dropped, failure rows deleted, and
    the horizon per bus, by bus id: a deleted bus and a live one of the same name are two
    buses with two retentions (by name, the later overwrote the other)."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    failures_deleted: int = 0
    compacted: list[str] = field(default_factory=list)
    vacuum_settled: list[str] = field(default_factory=list)  # autovacuum turned off or on
    # Days made for rows that waited in a default partition: how many rows moved into each.
    moved: dict[str, int] = field(default_factory=dict)
    horizons: dict[int, BusHorizon] = field(default_factory=dict)
    # Tables left for the next run: a reader held their locks through every try (within
    # LOCK_PATIENCE_S), or a compaction's wait for older snapshots passed LOCK_TIMEOUT.
    postponed: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        # JSON's keys are strings: said so here, not left to each encoder (Airflow's XCom).
        doc = asdict(self)
        doc["horizons"] = {str(bus_id): h for bus_id, h in doc["horizons"].items()}
        return doc


def day_start(when: datetime) -> datetime:
    when = when.astimezone(UTC)
    return datetime(when.year, when.month, when.day, tzinfo=UTC)


def bus_table(bus_id: int) -> str:
    return f"bus_event_{bus_id}"


def _time(text: str) -> datetime | None:
    text = text.strip().strip("'")
    return None if text == "MINVALUE" else datetime.fromisoformat(text).astimezone(UTC)


def partitions(cur, parent: str) -> list[Partition]:
    """The partitions of ``parent`` with their bounds, oldest first, the default last."""
    cur.execute("SET LOCAL TimeZone = 'UTC'")
    cur.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), "
        "coalesce(%s = ANY (c.reloptions), false) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
        (_AUTOVACUUM_OFF, parent),
    )
    found = []
    for name, bound, hot in cur.fetchall():
        match = _BOUND.search(bound)
        if match is None:  # DEFAULT
            found.append(Partition(name, None, None, hot))
        else:
            found.append(Partition(name, _time(match["lo"]), _time(match["hi"]), hot))
    epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(found, key=lambda p: (p.hi is None, p.lo or epoch))


# A day that begins this long after the database's clock gets no row while it is made (rows
# take ctime = now(), and a try's lock waits are each bounded by LOCK_TRY_TIMEOUT): unless
# rows of it already wait in the default partition, writers are not held back while it is
# attached. Likewise a day that ended this long before the clock gets no row any more.
AHEAD_MARGIN = timedelta(hours=1)


def _ahead_or_over(cur, day: datetime) -> tuple[bool, bool]:
    """Whether ``day`` begins AHEAD_MARGIN or more after the database's clock, and whether
    it ended that long before it (no row of it can come any more)."""
    cur.execute("SELECT clock_timestamp()")
    clock = cur.fetchone()[0]
    return clock + AHEAD_MARGIN <= day, day + DAY + AHEAD_MARGIN <= clock


def _default_of(existing: list[Partition]) -> str | None:
    """The default partition's name among ``existing`` (``partitions``), if there is one."""
    return next((p.name for p in existing if p.hi is None), None)


def _make_day(cur, parent: str, day: datetime, fence: str | None = None) -> tuple[str, int] | None:
    """The partition of ``parent`` for ``day`` unless a partition covers it already, and how
    many rows of that day waiting in the default partition moved into it (same transaction).

    Made as a plain table and attached: CREATE TABLE ... PARTITION OF locks the parent ACCESS
    EXCLUSIVE, so every publisher (and, for the delivery log, every engine commit) queued
    behind a maintenance run that waited for a long reader (an audit's scan). ATTACH locks
    the parent SHARE UPDATE EXCLUSIVE, which writers and readers pass; it still locks the
    default partition ACCESS EXCLUSIVE (its bound changes), so a reader that scans the
    default partition waits behind it (at most LOCK_TRY_TIMEOUT, a try). The table gets a
    CHECK matching the bound first, so the attach takes it as proof instead of scanning the
    table.

    A missed day's rows (maintenance lapsed longer than its lead) are moved before any lock
    that holds writers back: publishers and readers go on while the bulk of them moves, into
    a table that already has the parent's indexes (so the attach builds none). Only then, if
    the day may still be written, the parent is locked against writers and what they added
    meanwhile follows: the writers wait for that remainder and the attach, not for the day.
    A lock try that gives up after the bulk moved is tried again from a savepoint, the rows
    kept moved (``_tried_again``); before it, the whole step is (``_locked_step``).

    ``fence``, a missed day's CHECK on the default partition (:func:`_fence_default`), is
    validated once the day's rows have left it and dropped after the attach, which took it
    as proof that the default partition holds none of the day."""
    hi = day + DAY
    existing = partitions(cur, parent)
    for p in existing:
        if p.hi is not None and (p.lo is None or p.lo < hi) and day < p.hi:
            return None
    name = f"{parent}_p{day:%Y%m%d}"
    default = _default_of(existing)
    ahead, over = _ahead_or_over(cur, day)
    waiting = default is not None and _holds(cur, default, day, hi)
    cur.execute(
        sql.SQL(
            "CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS{}) WITH ({} = false)"
        ).format(
            sql.Identifier(name),
            sql.Identifier(parent),
            sql.SQL(" INCLUDING INDEXES" if waiting else ""),
            sql.Identifier(_AUTOVACUUM),
        )
    )
    moved = _move_rows(cur, default, name, day, hi) if waiting else 0

    def finish() -> int:
        more = 0
        if fence is not None:  # a scan under SHARE UPDATE EXCLUSIVE: writers and readers go on
            cur.execute(
                sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(
                    sql.Identifier(default), sql.Identifier(fence)
                )
            )
        if default is not None and not over and (waiting or not ahead):
            # A day begun (or about to be) that maintenance lapsed on, or one whose rows came
            # early: writers of ``parent`` wait to the commit (and are then routed to the new
            # day): a row of the day routed to the default partition meanwhile failed the
            # attach with a CheckViolation, so such a day was never made while it was being
            # written. Readers are not held (SHARE ROW EXCLUSIVE).
            cur.execute(
                sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(sql.Identifier(parent))
            )
            if _holds(cur, default, day, hi):  # written while the bulk moved, or since
                more = _move_rows(cur, default, name, day, hi)
        _attach(cur, parent, name, "ctime >= %s AND ctime < %s", "FROM (%s) TO (%s)", (day, hi))
        if fence is not None:
            cur.execute(
                sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                    sql.Identifier(default), sql.Identifier(fence)
                )
            )
        return more

    # After a bulk move, a lock try that gives up is tried again from here, not from the
    # start: the moved rows stay moved (in this transaction) between the tries.
    moved += _tried_again(cur, finish) if moved else finish()
    return name, moved


def _fence_default(cur, parent: str, day: datetime) -> str:
    """For a missed day that is over (rows of it wait in the default partition, and no more
    can come: rows take ``ctime = now()``), a CHECK on the default partition that keeps the
    day out of it, added NOT VALID (no scan; ACCESS EXCLUSIVE for a moment) in a transaction
    of its own; its name, or "" when the day needs none.

    Attaching a day scans the default partition under ACCESS EXCLUSIVE to check that none
    of the day is left there, unless a valid CHECK of the default partition proves it; after
    a lapse that partition holds the later missed days too, so each missed day's attach held
    every reader of the bus (their plans lock every partition) and the writers of the days
    not made yet for a scan of all of them. With the fence, the day's step validates it once
    its rows have moved (a scan under SHARE UPDATE EXCLUSIVE, which readers and writers
    pass) and the attach takes it as proof. A fence left by a day whose step gave up stays
    harmless (no row of the day can come) until the next run makes the day and drops it."""
    default = _default_of(partitions(cur, parent))
    hi = day + DAY
    if default is None or not _ahead_or_over(cur, day)[1] or not _holds(cur, default, day, hi):
        return ""
    fence = f"{default}_not_p{day:%Y%m%d}"
    cur.execute(
        sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}").format(
            sql.Identifier(default), sql.Identifier(fence)
        )
    )
    cur.execute(
        sql.SQL(
            "ALTER TABLE {} ADD CONSTRAINT {} "
            "CHECK (NOT (ctime IS NOT NULL AND ctime >= %s AND ctime < %s)) NOT VALID"
        ).format(sql.Identifier(default), sql.Identifier(fence)),
        (day, hi),
    )
    return fence


def _tried_again(cur, step: Callable[[], _T]) -> _T:
    """``step()`` under a savepoint, a lock try that gives up (LOCK_TRY_TIMEOUT) rolled back
    to it and tried again after a pause, doubling, for LOCK_PATIENCE_S; then the last
    LockNotAvailable is raised. What the transaction did before is kept between the tries
    (locks of a rolled-back try are let go with it)."""
    pauses = _pauses(time.monotonic() + LOCK_PATIENCE_S)
    while True:
        cur.execute("SAVEPOINT tried_again")
        try:
            done = step()
        except errors.LockNotAvailable:
            cur.execute("ROLLBACK TO SAVEPOINT tried_again")
            pause = next(pauses, None)
            if pause is None:
                raise
            time.sleep(pause)
            continue
        cur.execute("RELEASE SAVEPOINT tried_again")
        return done


def _pauses(deadline: float) -> Iterator[float]:
    """The pauses between lock tries, doubling from LOCK_RETRY_FIRST_S to LOCK_RETRY_MAX_S,
    for as long as the next one would end before ``deadline`` (monotonic clock), asked for
    when a try has given up."""
    pause = LOCK_RETRY_FIRST_S
    while time.monotonic() + pause < deadline:
        yield pause
        pause = min(2 * pause, LOCK_RETRY_MAX_S)


def _move_rows(cur, default: str, table: str, lo: datetime, hi: datetime) -> int:
    """The default partition's rows of [``lo``, ``hi``) moved into ``table``, which the
    attach checks the default partition holds none of any more; how many."""
    cur.execute(
        sql.SQL(
            "WITH moved AS (DELETE FROM {d} WHERE ctime >= %s AND ctime < %s RETURNING *) "
            "INSERT INTO {n} SELECT * FROM moved"
        ).format(d=sql.Identifier(default), n=sql.Identifier(table)),
        (lo, hi),
    )
    return cur.rowcount


def _attach(cur, parent: str, table: str, proof: str, bound: str, values: tuple) -> None:
    """``table`` attached to ``parent`` ``FOR VALUES`` ``bound``, a CHECK of ``proof`` (what
    the bound says) added first so that the attach takes it as proof instead of scanning
    ``table``, and dropped after: the bound holds from then on, and the CHECK would only cost
    every insert. ``proof`` and ``bound`` are fixed SQL from this module; ``values`` fill the
    ``%s`` of each."""
    check = sql.Identifier(f"{table}_bound")
    cur.execute(
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK (" + proof + ")").format(
            sql.Identifier(table), check
        ),
        values,
    )
    cur.execute(
        sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES " + bound).format(
            sql.Identifier(parent), sql.Identifier(table)
        ),
        values,
    )
    cur.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(sql.Identifier(table), check))


def _holds(cur, table: str, lo: datetime, hi: datetime) -> bool:
    cur.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE ctime >= %s AND ctime < %s)").format(
            sql.Identifier(table)
        ),
        (lo, hi),
    )
    return cur.fetchone()[0]


def make_ahead(cur, parent: str, now: datetime, days: int | None = None) -> list[str]:
    """Day partitions of ``parent`` from today to ``days`` ahead (configuration by default),
    and those of days whose rows landed in the default partition, in this transaction."""
    made = []
    for day in days_wanted(cur, parent, now, days):
        day_made = _make_day(cur, parent, day)
        if day_made is not None:
            made.append(day_made[0])
    return made


def days_wanted(cur, parent: str, now: datetime, days: int | None = None) -> list[datetime]:
    """The days ``parent`` should have a partition of, oldest first: today to ``days`` ahead
    (configuration by default), and the days of rows waiting in its default partition."""
    days = config.partitions_ahead_days() if days is None else days
    today = day_start(now)
    wanted = {today + n * DAY for n in range(days + 1)}
    default = _default_of(partitions(cur, parent))
    if default is not None:  # days that landed in the default partition get theirs too
        cur.execute(
            sql.SQL("SELECT DISTINCT date_trunc('day', ctime) FROM {}").format(
                sql.Identifier(default)
            )
        )
        wanted |= {row[0].astimezone(UTC) for row in cur.fetchall()}
    return sorted(wanted)


def settle_vacuum(cur, parent: str, now: datetime) -> list[str]:
    """Days of ``parent`` still written (today's and ahead) are left alone by autovacuum, days
    over are given back to it (each converges, whatever made it); the partitions whose
    setting changed."""
    today = day_start(now)
    changed = []
    for p in partitions(cur, parent):
        if p.hi is None:  # the default partition keeps autovacuum's defaults
            continue
        hot = p.hi > today
        if hot == p.hot:
            continue
        verb = "SET ({} = false)" if hot else "RESET ({})"
        cur.execute(
            sql.SQL("ALTER TABLE {} " + verb).format(
                sql.Identifier(p.name), sql.Identifier(_AUTOVACUUM)
            )
        )
        changed.append(p.name)
    return changed


def create_bus_partition(cur, bus_id: int, now: datetime | None = None) -> None:
    """A new bus's partition of ``bus_event``, partitioned by day, with its default and the
    days ahead made (inside the caller's transaction). Made apart and attached, as a day is
    (``_make_day``): CREATE TABLE ... PARTITION OF bus_event locked ``bus_event`` ACCESS
    EXCLUSIVE, so creating a bus while any reader (an audit's scan) held it stopped every
    publisher and reader of every bus until that reader ended. ``bus_event`` has no default
    partition, so the attach locks nothing else that exists."""
    table = bus_table(bus_id)
    cur.execute(
        sql.SQL(
            "CREATE TABLE {} (LIKE bus_event INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
            "PARTITION BY RANGE (ctime)"
        ).format(sql.Identifier(table))
    )
    cur.execute(
        sql.SQL("CREATE TABLE {} PARTITION OF {} DEFAULT").format(
            sql.Identifier(f"{table}_default"), sql.Identifier(table)
        )
    )
    make_ahead(cur, table, now or datetime.now(UTC))
    _attach(cur, "bus_event", table, "bus_id = %s", "IN (%s)", (bus_id,))


def _drop_behind(cur, parent: str, horizon: datetime) -> list[str]:
    """Drop the partitions of ``parent`` that end at or before ``horizon``."""
    dropped = []
    for p in partitions(cur, parent):
        if p.hi is not None and p.hi <= horizon:
            cur.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(p.name)))
            dropped.append(p.name)
    return dropped


def horizon(retention_s: int, now: datetime) -> datetime:
    """The oldest time still kept whole under ``retention_s``: partitions are dropped by
    whole days, so a time at or after this is never gone."""
    return now - timedelta(seconds=retention_s)


def bus_retention(cur, bus_id: int) -> int:
    """The bus's retention in seconds: its own, else the configured default."""
    cur.execute("SELECT retention_s FROM event_bus WHERE id = %s", (bus_id,))
    row = cur.fetchone()
    own = row[0] if row else None
    return own if own is not None else config.default_retention_s()


def kept_since(cur, bus_id: int) -> datetime | None:
    """Where the bus's kept events begin: events before it were dropped by retention. None
    while nothing was ever dropped."""
    cur.execute("SELECT events_kept_since FROM event_bus WHERE id = %s", (bus_id,))
    row = cur.fetchone()
    return row[0] if row else None


# The session lock one maintenance run holds: two at once (the DAG and a cron'd
# `db maintain`) dropped and made the same partitions, and the later one failed.
MAINTAIN_LOCK_KEY = 0x6570_6D61_696E  # "epmain"


def maintain(
    conn: Connection,
    now: datetime | None = None,
    progress: Callable[[str], None] | None = None,
) -> MaintenanceReport:
    """Make partitions ahead and drop the ones behind retention, per bus and for the
    delivery log; delete failure rows past their retention. Each step that locks a table in
    a transaction of its own, its lock waits short tries retried (``_locked_step``), so a
    table whose reader outlasts them waits for the next run alone (``postponed``). A bus
    deleted longer ago than its retention (and a day) goes whole. One run at a time: another
    waits for it, then finds what it left.

    Delivery days are kept for the longest bus retention, and failure rows for the longer of
    their own retention and that: an audit of any window a bus still holds finds its books.
    ``progress`` is given a line for each day made whose rows moved in from a default
    partition (after a lapse, the long part of a run)."""
    with transaction(conn) as cur:
        # The wait for a run before is as long as that run (the URL's options may time out
        # statements or lock waits: those are for the work, not for this turn).
        cur.execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
        cur.execute("SELECT pg_advisory_lock(%s)", (MAINTAIN_LOCK_KEY,))
    try:
        return _maintain(conn, (now or datetime.now(UTC)).astimezone(UTC), progress or _quiet)
    finally:
        with contextlib.suppress(Exception), transaction(conn) as cur:
            cur.execute("SELECT pg_advisory_unlock(%s)", (MAINTAIN_LOCK_KEY,))


def _quiet(line: str) -> None:
    pass


def _maintain(
    conn: Connection, now: datetime, progress: Callable[[str], None]
) -> MaintenanceReport:
    report = MaintenanceReport()
    default = config.default_retention_s()
    with transaction(conn) as cur:
        cur.execute(
            "SELECT b.id, b.name, coalesce(b.retention_s, %s), b.deleted_at FROM event_bus b "
            "JOIN pg_class c ON c.relname = 'bus_event_' || b.id AND c.relkind = 'p' "
            "ORDER BY b.id",
            (default,),
        )
        buses = cur.fetchall()
    longest = max([default, *(r for _, _, r, _ in buses)])
    for bus_id, name, retention_s, deleted_at in buses:
        edge = horizon(retention_s, now)
        table = bus_table(bus_id)
        patience = _Patience(report, table)
        if deleted_at is not None and deleted_at + DAY <= edge:
            # Deleted longer ago than its retention (and a day): every event it took is past
            # it, so its partition goes whole. Kept, it had days made (and dropped) for it
            # every day, for ever: a few tables per bus ever deleted. The drop locks all of
            # bus_event ACCESS EXCLUSIVE: every bus's publishers queue behind its wait.
            if _locked_step(conn, patience, _drop_whole, table):
                report.dropped.append(table)
            continue
        # The drop apart from the days made: its ACCESS EXCLUSIVE on the bus's table holds
        # every publisher of the bus until its commit, not also through the attaches (and a
        # missed day's rows moved) after it.
        dropped = _locked_step(conn, patience, _drop_bus_days, bus_id, edge)
        _make_days(conn, patience, table, now, progress)
        report.dropped += dropped or []
        report.horizons[bus_id] = BusHorizon(name, edge.isoformat(), deleted_at is not None)
    patience = _Patience(report, DELIVERY)
    edge = horizon(longest, now)
    report.dropped += _locked_step(conn, patience, _drop_delivery_days, edge) or []
    _make_days(conn, patience, DELIVERY, now, progress)
    report.compacted = compact(conn, day_start(now), postponed=report.postponed)
    with transaction(conn) as cur:
        failure_s = max(config.failure_retention_s(), longest)
        cur.execute("DELETE FROM event_push_failure WHERE ctime < %s", (horizon(failure_s, now),))
        report.failures_deleted = cur.rowcount
    return report


def _drop_whole(cur, table: str) -> bool:
    cur.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    return True


def _drop_bus_days(cur, bus_id: int, edge: datetime) -> list[str]:
    """The bus's days behind ``edge`` dropped, and where its kept events begin moved."""
    table = bus_table(bus_id)
    dropped = _drop_behind(cur, table, edge)
    if dropped:
        kept = [p.lo for p in partitions(cur, table) if p.hi is not None and p.lo]
        cur.execute(
            "UPDATE event_bus SET events_kept_since = %s WHERE id = %s",
            (min(kept, default=day_start(edge)), bus_id),
        )
    return dropped


def _drop_delivery_days(cur, edge: datetime) -> list[str]:
    """The delivery log's days behind ``edge`` dropped, and the roll-ups of their windows."""
    dropped = _drop_behind(cur, DELIVERY, edge)
    rollups.prune(cur, edge)
    return dropped


def _make_days(
    conn: Connection,
    patience: _Patience,
    parent: str,
    now: datetime,
    progress: Callable[[str], None],
) -> None:
    """The days of ``parent`` made ahead, each in a step of its own (a missed day's rows
    moved hold the table's writers for that day's remainder alone, not for every day the
    run makes), then autovacuum settled, all put in the report. A day whose tries gave up is
    left, with the rest, to the next run (the table is postponed); what was made stays made.
    A day whose rows moved in from the default partition is told to ``progress`` as it is
    made: after a lapse, that is where a run's minutes go."""
    report = patience.report
    with transaction(conn) as cur:
        days = days_wanted(cur, parent, now)
    for day in days:
        started = time.monotonic()
        fence = _locked_step(conn, patience, _fence_default, parent, day)
        if fence is None:
            return
        made = _locked_step(conn, patience, _make_day_step, parent, day, fence or None)
        if made is None:
            return
        if made:
            name, moved = made
            report.created.append(name)
            if moved:
                report.moved[name] = moved
                progress(
                    f"{name} made: {moved:,} {'row' if moved == 1 else 'rows'} moved in from "
                    "the default partition "
                    f"({time.monotonic() - started:.1f} s)"
                )
    report.vacuum_settled += _locked_step(conn, patience, settle_vacuum, parent, now) or []


def _make_day_step(
    cur, parent: str, day: datetime, fence: str | None
) -> tuple[str, int] | tuple[()]:
    return _make_day(cur, parent, day, fence) or ()


@dataclass
class _Patience:
    """One table's tries: its steps together wait for locks until ``deadline`` (monotonic
    clock); the table is listed in the report's ``postponed`` once, whichever step gave up."""

    report: MaintenanceReport
    table: str
    deadline: float = field(default_factory=lambda: time.monotonic() + LOCK_PATIENCE_S)

    def give_up(self) -> None:
        if self.table not in self.report.postponed:
            self.report.postponed.append(self.table)


_T = TypeVar("_T")


def _locked_step(
    conn: Connection, patience: _Patience, step: Callable[..., _T], *args: object
) -> _T | None:
    """``step(cur, *args)`` in a transaction of its own whose every lock wait is one short
    try (LOCK_TRY_TIMEOUT): a wait that times out rolls the whole step back (no table is left
    half dropped, no day half made), and the step is tried again after a pause, doubling,
    until the table's patience runs out; then the table is postponed and None returned.
    Each step gets one try however little patience is left. Its value otherwise."""
    pauses = _pauses(patience.deadline)
    while True:
        try:
            with transaction(conn) as cur:
                cur.execute("SELECT set_config('lock_timeout', %s, true)", (LOCK_TRY_TIMEOUT,))
                return step(cur, *args)
        except errors.LockNotAvailable:
            pause = next(pauses, None)
            if pause is None:
                patience.give_up()
                return None
        time.sleep(pause)


# Past days' delivery partitions are compacted when their indexes hold this many times the
# bytes of their rows (and at least BLOAT_MIN_BYTES): what roll-ups leave behind.
BLOAT_FACTOR = 2
BLOAT_MIN_BYTES = 1 << 20


def compact(
    conn: Connection,
    before: datetime,
    min_bytes: int = BLOAT_MIN_BYTES,
    postponed: list[str] | None = None,
) -> list[str]:
    """The delivery log's partitions of days before ``before``, which no writer touches any
    more (live pushes and replays write today's): vacuumed (which also cuts the empty pages
    at the end of the table), and reindexed concurrently when their indexes outgrew their
    rows, as after a roll-up deleted most of them. Returns the partitions reindexed; those
    whose lock waited past LOCK_TIMEOUT are added to ``postponed`` (the next run retries)."""
    with transaction(conn) as cur:
        names = [p.name for p in partitions(cur, DELIVERY) if p.hi is not None and p.hi <= before]
    reindexed = []
    autocommit = conn.autocommit
    conn.autocommit = True  # VACUUM and REINDEX CONCURRENTLY run outside a transaction
    try:
        with conn.cursor() as cur:
            cur.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            for name in names:
                try:
                    if _compact_one(cur, name, min_bytes):
                        reindexed.append(name)
                except errors.LockNotAvailable:
                    # REINDEX CONCURRENTLY waits for every older snapshot (a backup, a long
                    # audit): past the timeout it raised out of maintain, so the failure rows
                    # were never deleted. This partition waits for the next run instead.
                    _drop_invalid_indexes(cur, name)
                    if postponed is not None:
                        postponed.append(name)
            cur.execute("RESET lock_timeout")
    finally:
        conn.autocommit = autocommit
    return reindexed


def _compact_one(cur, name: str, min_bytes: int) -> bool:
    """Vacuum one past delivery partition, and reindex it when its indexes outgrew its rows;
    True when it was reindexed."""
    table = sql.Identifier(name)
    cur.execute(sql.SQL("VACUUM {}").format(table))
    cur.execute(
        "SELECT pg_total_relation_size(%s::regclass) - pg_indexes_size(%s::regclass),"
        " pg_indexes_size(%s::regclass)",
        (name, name, name),
    )
    rows, indexes = cur.fetchone()
    if indexes > max(min_bytes, BLOAT_FACTOR * rows):
        cur.execute(sql.SQL("REINDEX TABLE CONCURRENTLY {}").format(table))
        return True
    return False


def _drop_invalid_indexes(cur, name: str) -> None:
    """The copies a REINDEX CONCURRENTLY that gave up left behind (invalid, never used, as
    big as the index they were to replace); one still locked stays for the next run.
    Dropped CONCURRENTLY: a plain DROP INDEX locks the partition ACCESS EXCLUSIVE, and an
    audit or replay reading the delivery log queued behind its wait (up to LOCK_TIMEOUT)."""
    cur.execute(  # the table's indexes and its TOAST table's (REINDEX TABLE does both)
        "SELECT n.nspname, c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE NOT i.indisvalid AND i.indrelid "
        "IN (SELECT oid FROM pg_class WHERE oid = %s::regclass UNION ALL "
        "SELECT reltoastrelid FROM pg_class WHERE oid = %s::regclass)",
        (name, name),
    )
    for schema, index in cur.fetchall():
        with contextlib.suppress(errors.LockNotAvailable):
            cur.execute(sql.SQL("DROP INDEX CONCURRENTLY {}").format(sql.Identifier(schema, index)))


# --- the horizon: what audits and replays may still ask about ---------------------------------


class PastRetentionError(ValueError):
    """A window or a record whose events retention has dropped, said in one line."""


def kept_since_by_bus(cur, bus_ids: list[int]) -> dict[str, datetime]:
    """bus name -> where its kept events begin, for the buses (of ``bus_ids``) that retention
    has dropped events of."""
    cur.execute(
        "SELECT name, events_kept_since FROM event_bus "
        "WHERE id = ANY(%s) AND events_kept_since IS NOT NULL ORDER BY name",
        (list(bus_ids),),
    )
    return dict(cur.fetchall())


def clip_window(
    kept: dict[str, datetime], since: datetime | None, until: datetime | None, what: str
) -> list[str]:
    """Warnings, one line per bus whose kept events begin inside the window (the window is
    answered from there on: what is gone is not counted, never called missing). A window
    that ends before every bus's kept events begin is refused (PastRetentionError)."""
    if not kept:
        return []
    if until is not None and all(until <= start for start in kept.values()):
        first = min(kept, key=kept.get)
        raise PastRetentionError(
            f"{what} refused: the window ends {until.isoformat()}, before bus {first!r} keeps "
            f"events (from {kept[first].isoformat()}): they are gone by retention"
        )
    return [
        f"bus {name!r}: events before {start.isoformat()} are gone by retention; the {what} "
        f"covers {start.isoformat()} onwards"
        for name, start in kept.items()
        if since is None or since < start
    ]


def layout(conn: Connection, now: datetime | None = None) -> list[dict]:
    """Per partitioned table (each bus's, the delivery log): how many whole days ahead of
    today are made (``ahead``) and how many partitions end at or before its horizon
    (``behind``: retention owes a drop). What the retention check judges."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    default = config.default_retention_s()
    rows = []
    with transaction(conn) as cur:
        cur.execute(
            "SELECT b.id, coalesce(b.retention_s, %s) FROM event_bus b "
            "JOIN pg_class c ON c.relname = 'bus_event_' || b.id AND c.relkind = 'p' "
            "ORDER BY b.id",
            (default,),
        )
        tables = [(bus_table(bus_id), retention_s) for bus_id, retention_s in cur.fetchall()]
        longest = max([default, *(r for _, r in tables)])
        tables.append((DELIVERY, longest))
        today = day_start(now)
        for table, retention_s in tables:
            parts = [p for p in partitions(cur, table) if p.hi is not None]
            ahead = 0
            while any(
                (p.lo is None or p.lo <= today + ahead * DAY) and today + ahead * DAY < p.hi
                for p in parts
            ):
                ahead += 1
            edge = horizon(retention_s, now)
            behind = sum(1 for p in parts if p.hi <= edge)
            rows.append({"table": table, "ahead": ahead - 1, "behind": behind})
    return rows
