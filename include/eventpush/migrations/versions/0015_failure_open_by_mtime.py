"""The open failures by ``mtime``: the dashboard's latest failures (``FAILURES_SQL``, every poll
of every open dashboard and ``api/failures``) ordered by ``mtime DESC, id DESC`` among the rows
``status = 'failed'``, and the only index on open failures was by runner, so each poll read and
sorted every open failure to return the newest few. Scanned backwards, this index hands them
over already in order, the limit's rows and no more.

Revision ID: 0015_failure_open_by_mtime
Revises: 0014_bus_queue_first_offset
"""

from alembic import op

from eventpush.migration_waits import build_concurrently

revision = "0015_failure_open_by_mtime"
down_revision = "0014_bus_queue_first_offset"
branch_labels = None
depends_on = None

INDEX = "event_push_failure_open_mtime"


def upgrade() -> None:
    # Built CONCURRENTLY, outside the migration's transaction: a plain CREATE INDEX holds the
    # failures table SHARE while it builds, and every running worker's failure row waited
    # for it (long on a big table). IF NOT EXISTS: a build that finished before its revision
    # was recorded stands.
    with op.get_context().autocommit_block():
        build_concurrently(
            op.get_bind(),
            INDEX,
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} ON event_push_failure (mtime, id) "
            "WHERE status = 'failed'",
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")
