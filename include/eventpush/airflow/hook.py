"""``EventpushHook``: the eventpush database as an Airflow hook, owning the connection
``eventpush_db`` (resolved as ``eventpush.airflow.connection`` says: the Airflow connection,
else ``EVENTPUSH_DATABASE_URL``), with the reads the DAGs' tasks make of it, so that no DAG
file holds SQL or opens a connection of its own.

Imported by tasks only (it loads Airflow's Task SDK), never at DAG parse time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from airflow.sdk import BaseHook

from eventpush import db
from eventpush.airflow.connection import CONN_ID, database_url


@dataclass(frozen=True)
class AuditReport:
    """The newest audit report of one window and bus, as the audit DAG hands it on."""

    report_id: int
    expected: int
    missing: int
    absent: int
    runners: object  # the report's per-runner counts (JSON)


@dataclass(frozen=True)
class Placement:
    """What a rebalance has to place: enabled and all workers, live runners."""

    enabled_workers: int
    workers: int
    runners: int


class EventpushHook(BaseHook):
    """The eventpush database through the Airflow connection ``eventpush_conn_id``."""

    conn_name_attr = "eventpush_conn_id"
    default_conn_name = CONN_ID
    conn_type = "postgres"
    hook_name = "eventpush"

    def __init__(self, eventpush_conn_id: str = CONN_ID) -> None:
        super().__init__()
        self.eventpush_conn_id = eventpush_conn_id
        self._uri: str | None = None

    def get_uri(self) -> str:
        """The database URL, resolved once per hook (secret included: only its redacted
        form is ever logged)."""
        if self._uri is None:
            self._uri = database_url(self.eventpush_conn_id)
        return self._uri

    def get_conn(self) -> db.Connection:
        """A new connection; the caller closes it (``connection()`` does that for you)."""
        return db.connect(self.get_uri())

    @contextlib.contextmanager
    def connection(self) -> Iterator[db.Connection]:
        """A connection closed on exit."""
        with db.connection(self.get_uri()) as conn:
            yield conn

    # --- the DAGs' reads -------------------------------------------------------------------

    def bus_exists(self, name: str) -> bool:
        """Whether a bus is called ``name`` (the audit's form names one)."""
        with self.connection() as conn, db.transaction(conn) as cur:
            cur.execute("SELECT 1 FROM event_bus WHERE name = %s", (name,))
            return cur.fetchone() is not None

    def audit_report(self, since: str, until: str, bus: str | None) -> AuditReport | None:
        """The newest report the audit job wrote for this window and bus (None: none)."""
        with self.connection() as conn, db.transaction(conn) as cur:
            cur.execute(
                "SELECT id, expected, missing, coalesce(absent, 0), runners "
                "FROM event_audit_report "
                "WHERE window_start = %s AND window_end = %s AND bus IS NOT DISTINCT FROM %s "
                "ORDER BY id DESC LIMIT 1",
                (since, until, bus),
            )
            row = cur.fetchone()
        return None if row is None else AuditReport(*row)

    def placement(self) -> Placement:
        with self.connection() as conn, db.transaction(conn) as cur:
            cur.execute("SELECT count(*) FILTER (WHERE enabled), count(*) FROM event_push_worker")
            enabled, workers = cur.fetchone()
            cur.execute("SELECT count(*) FROM event_target_runner WHERE deleted_at IS NULL")
            return Placement(enabled, workers, cur.fetchone()[0])

    def rebalance_outcome(self, run_label: str) -> tuple[tuple[bool, object] | None, int | None]:
        """The newest rebalance check recorded under ``run_label`` (success, statistics) or
        None, and the assignment's current generation."""
        with self.connection() as conn, db.transaction(conn) as cur:
            cur.execute(
                "SELECT success, statistics FROM event_check_result "
                "WHERE suite = 'rebalance' AND run_label = %s ORDER BY id DESC LIMIT 1",
                (run_label,),
            )
            row = cur.fetchone()
            cur.execute("SELECT max(generation) FROM event_assignment")
            return row, cur.fetchone()[0]
