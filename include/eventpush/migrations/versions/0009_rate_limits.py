"""The token bucket of each API destination's rate limit (push/rates.py): one row per
destination, shared by every worker, from which each worker leases small slices of tokens.

Revision ID: 0009_rate_limits
Revises: 0008_destinations
"""

from alembic import op

revision = "0009_rate_limits"
down_revision = "0008_destinations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE event_destination_rate (
            destination text PRIMARY KEY,
            tokens double precision NOT NULL,
            refreshed_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE event_destination_rate")
