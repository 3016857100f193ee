"""Audit reports that read destinations back (``audit --verify-sinks``): per report, the
records delivered in the books that their destination does not hold (``absent``) or has aged
out (``expired``); NULL when the report did not verify sinks.

Revision ID: 0007_verify_sinks
Revises: 0006_api_keys
"""

from alembic import op

revision = "0007_verify_sinks"
down_revision = "0006_api_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE event_audit_report ADD COLUMN absent bigint, ADD COLUMN expired bigint")


def downgrade() -> None:
    op.execute("ALTER TABLE event_audit_report DROP COLUMN absent, DROP COLUMN expired")
