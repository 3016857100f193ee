"""A runner's count of deliveries made by replays, kept beside ``delivered_total``: status read
it by counting the runner's delivery rows of origin ``replay`` on every call, a scan that grew
with the books and came out wrong once a window's rows were rolled up (issue 35). Replays add
to it in the transaction that writes their delivery rows.

Revision ID: 0011_replayed_total
Revises: 0010_retention
"""

from alembic import op

revision = "0011_replayed_total"
down_revision = "0010_retention"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE event_target_runner ADD COLUMN replayed_total bigint NOT NULL DEFAULT 0"
    )
    op.execute(
        "UPDATE event_target_runner r SET replayed_total = d.n FROM "
        "(SELECT runner_id, count(*) AS n FROM event_push_delivery WHERE origin = 'replay' "
        "GROUP BY runner_id) d WHERE d.runner_id = r.id"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE event_target_runner DROP COLUMN replayed_total")
