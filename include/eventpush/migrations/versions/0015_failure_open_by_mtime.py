"""The open failures by ``mtime``: the dashboard's latest failures (``FAILURES_SQL``, every poll
of every open dashboard and ``api/failures``) ordered by ``mtime DESC, id DESC`` among the rows
``status = 'failed'``, and the only index on open failures was by runner, so each poll read and
sorted every open failure to return the newest few. Scanned backwards, this index hands them
over already in order, the limit's rows and no more.

Revision ID: 0015_failure_open_by_mtime
Revises: 0014_bus_queue_first_offset
"""

from alembic import op

revision = "0015_failure_open_by_mtime"
down_revision = "0014_bus_queue_first_offset"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX event_push_failure_open_mtime ON event_push_failure (mtime, id) "
        "WHERE status = 'failed'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX event_push_failure_open_mtime")
