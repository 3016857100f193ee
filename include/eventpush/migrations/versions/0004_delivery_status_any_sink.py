"""Delivery rows of sinks that have no HTTP status: ``event_push_delivery.http_status`` may
be NULL (a NATS JetStream target is delivered on the stream's acknowledgement). An HTTP
delivery still records its 2xx; the column's CHECK keeps any status given within 200-299.

Revision ID: 0004_delivery_status_any_sink
Revises: 0003_bus_source_url
"""

from alembic import op

revision = "0004_delivery_status_any_sink"
down_revision = "0003_bus_source_url"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE event_push_delivery ALTER COLUMN http_status DROP NOT NULL")


def downgrade() -> None:
    # Refused while NATS delivery rows exist: they have no status to put back.
    op.execute("ALTER TABLE event_push_delivery ALTER COLUMN http_status SET NOT NULL")
