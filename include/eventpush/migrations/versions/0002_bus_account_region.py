"""Bus account and region: what the input transformer's ``<aws.events.event>`` and
``<aws.events.rule-arn>`` report for events that carry none of their own.

Existing buses get the documented defaults (eventpush.rules.transforms.DEFAULT_ACCOUNT and
DEFAULT_REGION); ``eventpush bus create --account --region`` sets them per bus.

Revision ID: 0002_bus_account_region
Revises: 0001
"""

from alembic import op

revision = "0002_bus_account_region"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE event_bus
    ADD COLUMN account text NOT NULL DEFAULT '000000000000'
        CHECK (account ~ '^[0-9]{12}$'),
    ADD COLUMN region text NOT NULL DEFAULT 'us-east-1'
        CHECK (region ~ '^[a-z]{2}(-[a-z]+)+-[0-9]{1,2}$');
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute("ALTER TABLE event_bus DROP COLUMN region, DROP COLUMN account")
