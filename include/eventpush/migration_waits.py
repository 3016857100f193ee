"""A migration run's lock waits: bounded, and the sessions waited for named while they last.

A migration that alters a table waits for every session holding a lock on it; one that
builds an index CONCURRENTLY waits, more than once, for every transaction older than its
snapshots. One session left idle in a transaction (a psql nobody closed, a client stuck
half-way) held ``eventpush db migrate`` for ever, printing nothing, and with it every
service's start, which runs it. Here every lock wait of a run is bounded by
``EVENTPUSH_MIGRATE_WAIT_S`` (PostgreSQL's ``lock_timeout`` on the run's session, which a
concurrent build's waits obey too); meanwhile a thread of its own names the sessions the run
waits for in the log (pid, application, state and how long their transaction has been open;
never their query, which may hold a secret); past the bound the run fails in one line naming
them, the migration's revision not recorded (each migration commits on its own). A build
given up leaves an invalid index, which the next run drops and builds again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import psycopg2.errors
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from eventpush.config import setting
from eventpush.db import StoreError

log = logging.getLogger("eventpush.migration_waits")

WAIT_ENV = "EVENTPUSH_MIGRATE_WAIT_S"
# Its name when it bounded only the concurrent index builds; still read when WAIT_ENV is not set.
FORMER_WAIT_ENV = "EVENTPUSH_MIGRATE_INDEX_WAIT_S"
DEFAULT_WAIT_S = 600  # an audit's long scan is outwaited; a forgotten session is not
POLL_S = 1.0  # how often the watch asks what the run waits for
LOG_EVERY_S = 30.0  # an unchanged wait is logged again this often
STOP_WAIT_S = 5.0
# The watch's session, apart from the run's own ("eventpush db migrate"): whoever looks for a
# waiting migration in pg_stat_activity does not find the watch instead.
WATCH_APPLICATION = "eventpush db migrate (lock watch)"
_WAITING = "the migration waits for locks other sessions hold"

_BLOCKERS = text(
    "SELECT a.pid, coalesce(nullif(a.application_name, ''), 'no application name'), "
    "coalesce(a.state, 'unknown state'), "
    "coalesce(extract(epoch FROM now() - a.xact_start)::bigint, 0) "
    "FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids(:pid)) "
    "ORDER BY a.xact_start NULLS LAST, a.pid"
)

_watch: _Watch | None = None  # the run's, while it runs (one run a process: Alembic's context)


def wait_bound() -> int:
    """Seconds a lock wait of a migration run may last."""
    former = setting(FORMER_WAIT_ENV, DEFAULT_WAIT_S)
    return int(setting(WAIT_ENV, former))


@contextlib.contextmanager
def bounded(connection) -> Iterator[None]:
    """The migrations run inside on ``connection`` (SQLAlchemy, the run's session) wait for
    a lock ``wait_bound()`` seconds at most, watched; one that gives up is raised as
    :class:`StoreError`, one line naming the sessions it waited for."""
    global _watch
    wait_s = wait_bound()
    connection.execute(text("SELECT set_config('lock_timeout', :t, false)"), {"t": f"{wait_s}s"})
    pid = connection.execute(text("SELECT pg_backend_pid()")).scalar()
    connection.commit()
    _watch = _Watch(connection.engine, pid, wait_s)
    _watch.start()
    try:
        yield
    except sa_exc.OperationalError as exc:
        if not isinstance(exc.orig, psycopg2.errors.LockNotAvailable):
            raise
        raise StoreError(
            f"db migrate gave up: it waited {wait_s} s for a lock "
            f"({_watch.last_seen() or 'its holders ended as it gave up'}); end them or "
            f"raise {WAIT_ENV}, then run 'eventpush db migrate' again"
        ) from None
    finally:
        _watch.stop()
        _watch = None
        # A session the database dropped cannot be reset; its error, not this one, is news.
        with contextlib.suppress(sa_exc.DBAPIError):
            connection.execute(text("RESET lock_timeout"))


def build_concurrently(bind, index: str, create: str) -> None:
    """Run ``create`` (a ``CREATE INDEX CONCURRENTLY IF NOT EXISTS`` of ``index``, fixed SQL
    of a migration) on ``bind``, a SQLAlchemy connection inside Alembic's autocommit block,
    first dropping an invalid ``index`` that an interrupted build left (IF NOT EXISTS would
    keep it, never used). Its waits are the run's (:func:`bounded`); one that passes the
    bound is raised as :class:`StoreError` naming what it waited for."""
    if _watch is not None:
        _watch.doing = f"index {index} waits for older transactions to end"
    try:
        invalid = bind.execute(
            text("SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:i)"),
            {"i": index},
        ).scalar()
        if invalid:
            bind.execute(text(f'DROP INDEX CONCURRENTLY "{index}"'))
        bind.execute(text(create))
    except sa_exc.OperationalError as exc:
        if not isinstance(exc.orig, psycopg2.errors.LockNotAvailable):
            raise
        waited_for = (_watch and _watch.last_seen()) or "sessions that ended as it gave up"
        raise StoreError(
            f"index {index} was not built: it waited {wait_bound()} s for older transactions "
            f"to end ({waited_for}); end them or raise {WAIT_ENV}, then run "
            "'eventpush db migrate' again"
        ) from None
    finally:
        if _watch is not None:
            _watch.doing = _WAITING


def _describe(rows) -> str:
    return "; ".join(
        f"pid {pid}: {application}, {state}, its transaction open {age} s"
        for pid, application, state, age in rows
    )


class _Watch:
    """Asks every :data:`POLL_S` which sessions the run's session waits for and logs them
    when they change, or every :data:`LOG_EVERY_S` while they do not, saying what waits
    (``doing``). Advice only: a watch that cannot connect or ask leaves the run alone."""

    def __init__(self, engine, pid: int, wait_s: int) -> None:
        self.engine, self.pid, self.wait_s = engine, pid, wait_s
        self.doing = _WAITING
        self._stopped = threading.Event()
        self._seen = ""
        # A daemon, joined a moment at most: a watch stuck on a database that stopped
        # answering never holds the migration's process.
        self._thread = threading.Thread(target=self._run, name="eventpush-lock-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(STOP_WAIT_S)

    def last_seen(self) -> str:
        return self._seen

    def _run(self) -> None:
        try:
            with self.engine.connect() as conn:
                conn.execute(
                    text("SELECT set_config('application_name', :a, false)"),
                    {"a": WATCH_APPLICATION},
                )
                conn.commit()
                logged: list[int] = []
                logged_at = 0.0
                while not self._stopped.wait(POLL_S):
                    rows = conn.execute(_BLOCKERS, {"pid": self.pid}).all()
                    conn.rollback()  # a transaction a poll: each one a fresh snapshot
                    if not rows:
                        continue
                    self._seen = _describe(rows)
                    pids, now = [row[0] for row in rows], time.monotonic()
                    if pids != logged or now - logged_at >= LOG_EVERY_S:
                        log.warning(
                            "%s (%s); it gives up after %d s", self.doing, self._seen, self.wait_s
                        )
                        logged, logged_at = pids, now
        except Exception as exc:  # noqa: BLE001 - advice only, see the docstring
            log.debug("the migration's lock watch stopped: %s", type(exc).__name__)
