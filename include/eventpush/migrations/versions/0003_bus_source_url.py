"""Bus source: where a bus's events are stored. NULL is the built-in PostgreSQL store
(``bus_event``); otherwise the URL of another source, such as ``nats://HOST:PORT`` for the
JetStream stream named like the bus (eventpush.sources). The URL names a server only: the
check refuses credentials in it (they come from a file, docs/OPERATIONS.md).

Revision ID: 0003_bus_source_url
Revises: 0002_bus_account_region
"""

from alembic import op

revision = "0003_bus_source_url"
down_revision = "0002_bus_account_region"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE event_bus
    ADD COLUMN source_url text
        CHECK (source_url ~ '^[a-z][a-z0-9+.-]*://[^@/?#\s]+(/[^@?#\s]*)?$');
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute("ALTER TABLE event_bus DROP COLUMN source_url")
