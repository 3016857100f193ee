"""Where a bus's queue begins: ``event_bus_queue.first_offset``. A bus on a broker whose store
(a JetStream stream) it took over from a deleted bus of the same name begins at the store's
end as it was when the bus was made; what lies below is the deleted bus's, and an archive
replay, an audit from the start or the archive's event count no longer take it as this bus's.
0 for every other bus (its store began with it, or it adopted a stream of other producers).

Revision ID: 0014_bus_queue_first_offset
Revises: 0013_retry_attempts_186
"""

from alembic import op

revision = "0014_bus_queue_first_offset"
down_revision = "0013_retry_attempts_186"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: no table rewrite.
    op.execute("ALTER TABLE event_bus_queue ADD COLUMN first_offset bigint NOT NULL DEFAULT 0")


def downgrade() -> None:
    op.execute("ALTER TABLE event_bus_queue DROP COLUMN first_offset")
