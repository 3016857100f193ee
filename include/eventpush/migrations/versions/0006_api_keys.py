"""Access keys of the EventBridge-compatible API (issue 31): one row per key, its secret
sealed (eventpush.sealed), its role, and for a producer the buses it may put events on.

Revision ID: 0006_api_keys
Revises: 0005_day_two
"""

from alembic import op

revision = "0006_api_keys"
down_revision = "0005_day_two"
branch_labels = None
depends_on = None

NAME_CHECK = r"CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$')"


def upgrade() -> None:
    op.execute(
        f"""
CREATE TABLE event_api_key (
    id            serial PRIMARY KEY,
    name          text NOT NULL UNIQUE {NAME_CHECK},
    access_key_id text NOT NULL UNIQUE CHECK (access_key_id ~ '^[A-Z0-9]{{20}}$'),
    secret        text NOT NULL,
    role          text NOT NULL CHECK (role IN ('admin', 'producer')),
    buses         text[] NOT NULL DEFAULT '{{}}',
    ctime         timestamptz NOT NULL DEFAULT now(),
    CHECK ((role = 'producer') = (cardinality(buses) > 0))
)
"""
    )


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS event_api_key")
