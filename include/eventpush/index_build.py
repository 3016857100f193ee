"""An index built CONCURRENTLY by a migration, waiting a bounded time and saying for whom.

A concurrent build waits, more than once, for every transaction older than its snapshots to
end, so that the index misses no row such a transaction may still see. One session left idle
in a transaction (a psql nobody closed, a client stuck half-way) held ``eventpush db migrate``
for ever, printing nothing. Here each of the build's waits is bounded by
``EVENTPUSH_MIGRATE_INDEX_WAIT_S`` (PostgreSQL's ``lock_timeout``, which those waits obey);
meanwhile a thread of its own names the sessions the build waits for in the log (pid,
application, state and how long their transaction has been open; never their query, which
may hold a secret); past the bound the migration fails in one line naming them, its revision
not recorded, and the next run drops the invalid index the build left behind and builds it
again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import psycopg2.errors
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from eventpush.config import setting
from eventpush.db import StoreError

log = logging.getLogger("eventpush.index_build")

WAIT_ENV = "EVENTPUSH_MIGRATE_INDEX_WAIT_S"
DEFAULT_WAIT_S = 600  # an audit's long scan is outwaited; a forgotten session is not
POLL_S = 1.0  # how often the watch asks what the build waits for
LOG_EVERY_S = 30.0  # an unchanged wait is logged again this often
STOP_WAIT_S = 5.0
# The watch's session, apart from the migration's own ("eventpush db migrate"): whoever looks
# for a waiting migration in pg_stat_activity does not find the watch instead.
WATCH_APPLICATION = "eventpush db migrate (index watch)"

_BLOCKERS = text(
    "SELECT a.pid, coalesce(nullif(a.application_name, ''), 'no application name'), "
    "coalesce(a.state, 'unknown state'), "
    "coalesce(extract(epoch FROM now() - a.xact_start)::bigint, 0) "
    "FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids(:pid)) "
    "ORDER BY a.xact_start NULLS LAST, a.pid"
)


def build_concurrently(bind, index: str, create: str) -> None:
    """Run ``create`` (a ``CREATE INDEX CONCURRENTLY IF NOT EXISTS`` of ``index``, fixed SQL
    of a migration) on ``bind``, a SQLAlchemy connection inside Alembic's autocommit block,
    first dropping an invalid ``index`` that an interrupted build left (IF NOT EXISTS would
    keep it, never used). Raises :class:`StoreError` when a wait passes the bound."""
    wait_s = int(setting(WAIT_ENV, DEFAULT_WAIT_S))
    bind.execute(text("SELECT set_config('lock_timeout', :t, false)"), {"t": f"{wait_s}s"})
    pid = bind.execute(text("SELECT pg_backend_pid()")).scalar()
    watch = _Watch(bind.engine, pid, index, wait_s)
    watch.start()
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
        waited_for = watch.last_seen() or "sessions that ended as it gave up"
        raise StoreError(
            f"index {index} was not built: it waited {wait_s} s for older transactions to "
            f"end ({waited_for}); end them or raise {WAIT_ENV}, then run "
            "'eventpush db migrate' again"
        ) from None
    finally:
        watch.stop()
        # A session the database dropped cannot be reset; its error, not this one, is news.
        with contextlib.suppress(sa_exc.DBAPIError):
            bind.execute(text("RESET lock_timeout"))


def _describe(rows) -> str:
    return "; ".join(
        f"pid {pid}: {application}, {state}, its transaction open {age} s"
        for pid, application, state, age in rows
    )


class _Watch:
    """Asks every :data:`POLL_S` which sessions the build's session waits for and logs them
    when they change, or every :data:`LOG_EVERY_S` while they do not. Advice only: a watch
    that cannot connect or ask leaves the build alone."""

    def __init__(self, engine, pid: int, index: str, wait_s: int) -> None:
        self.engine, self.pid, self.index, self.wait_s = engine, pid, index, wait_s
        self._stopped = threading.Event()
        self._seen = ""
        # A daemon, joined a moment at most: a watch stuck on a database that stopped
        # answering never holds the migration's process.
        self._thread = threading.Thread(target=self._run, name="eventpush-index-watch", daemon=True)

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
                            "index %s waits for older transactions to end (%s); it gives "
                            "up after %d s",
                            self.index,
                            self._seen,
                            self.wait_s,
                        )
                        logged, logged_at = pids, now
        except Exception as exc:  # noqa: BLE001 - advice only, see the docstring
            log.debug("the index build's watch stopped: %s", type(exc).__name__)
