"""A target may make up to 186 attempts: EventBridge's ``MaximumRetryAttempts`` goes up to 185
retries, one attempt and 185 more, and the API maps N retries onto N + 1 attempts; the old bound
(185 attempts) refused AWS's own documented maximum.

Revision ID: 0013_retry_attempts_186
Revises: 0012_bus_event_without_fk
"""

from alembic import op

revision = "0013_retry_attempts_186"
down_revision = "0012_bus_event_without_fk"
branch_labels = None
depends_on = None


def _bound(high: int) -> None:
    op.execute(
        "ALTER TABLE event_target DROP CONSTRAINT event_target_max_attempts_check, "
        "ADD CONSTRAINT event_target_max_attempts_check "
        f"CHECK (max_attempts BETWEEN 1 AND {high})"
    )


def upgrade() -> None:
    _bound(186)


def downgrade() -> None:
    op.execute("UPDATE event_target SET max_attempts = 185 WHERE max_attempts > 185")
    _bound(185)
