"""Retention and time partitions: a retention per bus (NULL: the configured default), where
its kept events begin once retention dropped some, and ``bus_event`` (per bus) and
``event_push_delivery`` split by day of ``ctime`` (eventpush.partitions maintains them).

Existing rows are kept where they are: each existing table becomes the ``_before`` partition
(MINVALUE up to tomorrow) of its new partitioned table, no row copied; retention drops it
whole once all of it is past. ``bus_event``'s key (bus, queue, offset) cannot stay unique
across time partitions (PostgreSQL wants the partition key in every unique index): offsets
stay unique because publishers allocate them under the queue row's lock, and the same
columns stay indexed for reads by offset.

Self-contained: it uses no eventpush module, so re-chaining it is a one-line change.

Revision ID: 0010_retention
Revises: 0009_rate_limits
"""

from datetime import UTC, datetime, timedelta

from alembic import op
from sqlalchemy import text

revision = "0010_retention"
down_revision = "0009_rate_limits"
branch_labels = None
depends_on = None

AHEAD_DAYS = 3
DELIVERY = "event_push_delivery"


def _days(table: str, first: datetime) -> list[str]:
    statements = []
    for n in range(AHEAD_DAYS):
        lo = first + timedelta(days=n)
        hi = lo + timedelta(days=1)
        statements.append(
            f'CREATE TABLE "{table}_p{lo:%Y%m%d}" PARTITION OF "{table}" '
            f"FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')"
        )
    return statements


def upgrade() -> None:
    bind = op.get_bind()
    now = datetime.now(UTC)
    tomorrow = datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)
    op.execute(
        "ALTER TABLE event_bus ADD COLUMN retention_s bigint "
        "CHECK (retention_s BETWEEN 3600 AND 315360000), "
        "ADD COLUMN events_kept_since timestamptz"
    )

    # bus_event: per bus, the old partition becomes the new one's _before partition.
    op.execute("ALTER TABLE bus_event DROP CONSTRAINT bus_event_pkey")
    op.execute('CREATE INDEX bus_event_position ON bus_event (bus_id, queue_id, "offset")')
    bus_ids = [
        row[0]
        for row in bind.execute(
            text(
                "SELECT b.id FROM event_bus b JOIN pg_class c ON c.relname = 'bus_event_' || b.id "
                "AND c.relkind = 'r' ORDER BY b.id"
            )
        )
    ]
    for bus_id in bus_ids:
        table = f"bus_event_{bus_id}"
        for statement in [
            f'ALTER TABLE bus_event DETACH PARTITION "{table}"',
            f'ALTER TABLE "{table}" RENAME TO "{table}_before"',
            f'CREATE TABLE "{table}" (LIKE bus_event INCLUDING DEFAULTS) '
            "PARTITION BY RANGE (ctime)",
            f'ALTER TABLE "{table}" ATTACH PARTITION "{table}_before" '
            f"FOR VALUES FROM (MINVALUE) TO ('{tomorrow.isoformat()}')",
            f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT',
            *_days(table, tomorrow),
            f'ALTER TABLE bus_event ATTACH PARTITION "{table}" FOR VALUES IN ({bus_id})',
        ]:
            op.execute(statement)

    # event_push_delivery: the table becomes the _before partition; the id sequence moves to
    # the new table (it would go with the old one when retention drops it).
    for statement in [
        f"ALTER TABLE {DELIVERY} RENAME TO {DELIVERY}_before",
        f"ALTER TABLE {DELIVERY}_before DROP CONSTRAINT {DELIVERY}_pkey",
        f"CREATE TABLE {DELIVERY} (LIKE {DELIVERY}_before INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS) PARTITION BY RANGE (ctime)",
        f"ALTER SEQUENCE {DELIVERY}_id_seq OWNED BY {DELIVERY}.id",
        f"ALTER TABLE {DELIVERY} ADD PRIMARY KEY (id, ctime)",
        f"ALTER INDEX {DELIVERY}_position RENAME TO {DELIVERY}_before_position",
        f"ALTER INDEX {DELIVERY}_ctime RENAME TO {DELIVERY}_before_ctime",
        f'CREATE INDEX {DELIVERY}_position ON {DELIVERY} (runner_id, queue_id, "offset")',
        f"CREATE INDEX {DELIVERY}_ctime ON {DELIVERY} USING brin (ctime)",
        f"ALTER TABLE {DELIVERY} ATTACH PARTITION {DELIVERY}_before "
        f"FOR VALUES FROM (MINVALUE) TO ('{tomorrow.isoformat()}')",
        f"CREATE TABLE {DELIVERY}_default PARTITION OF {DELIVERY} DEFAULT",
        *_days(DELIVERY, tomorrow),
    ]:
        op.execute(statement)

    # Rolled-up books: one row per runner and audited window found clean, standing for the
    # delivery rows it replaced (eventpush.rollups).
    op.execute(ROLLUP)


ROLLUP = """
CREATE TABLE event_delivery_rollup (
    runner_id    int NOT NULL,
    window_start timestamptz NOT NULL,
    window_end   timestamptz NOT NULL CHECK (window_end > window_start),
    expected     bigint NOT NULL CHECK (expected >= 0),
    delivered    bigint NOT NULL CHECK (delivered >= 0),
    failed       bigint NOT NULL CHECK (failed >= 0),
    duplicates   bigint NOT NULL CHECK (duplicates >= 0),
    rows_rolled  bigint NOT NULL CHECK (rows_rolled >= 0),
    offsets      jsonb NOT NULL,
    report_id    bigint,
    ctime        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (runner_id, window_start)
)
"""


def downgrade() -> None:
    """Back to one table per bus and one delivery table, every row copied (the partitions
    that retention dropped and the rows roll-ups replaced stay gone)."""
    op.execute("DROP TABLE event_delivery_rollup")
    bind = op.get_bind()
    bus_ids = [
        row[0]
        for row in bind.execute(
            text(
                "SELECT b.id FROM event_bus b JOIN pg_class c ON c.relname = 'bus_event_' || b.id "
                "AND c.relkind = 'p' ORDER BY b.id"
            )
        )
    ]
    for bus_id in bus_ids:
        table = f"bus_event_{bus_id}"
        for statement in [
            f'CREATE TABLE "{table}_flat" (LIKE bus_event INCLUDING DEFAULTS)',
            f'INSERT INTO "{table}_flat" SELECT * FROM "{table}"',
            f'DROP TABLE "{table}"',
            f'ALTER TABLE "{table}_flat" RENAME TO "{table}"',
            f'ALTER TABLE bus_event ATTACH PARTITION "{table}" FOR VALUES IN ({bus_id})',
        ]:
            op.execute(statement)
    op.execute("DROP INDEX bus_event_position")
    op.execute('ALTER TABLE bus_event ADD PRIMARY KEY (bus_id, queue_id, "offset")')
    for statement in [
        f"CREATE TABLE {DELIVERY}_flat (LIKE {DELIVERY} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
        f"INSERT INTO {DELIVERY}_flat SELECT * FROM {DELIVERY}",
        f"ALTER SEQUENCE {DELIVERY}_id_seq OWNED BY {DELIVERY}_flat.id",
        f"DROP TABLE {DELIVERY}",
        f"ALTER TABLE {DELIVERY}_flat RENAME TO {DELIVERY}",
        f"ALTER TABLE {DELIVERY} ADD PRIMARY KEY (id)",
        f'CREATE INDEX {DELIVERY}_position ON {DELIVERY} (runner_id, queue_id, "offset")',
        f"CREATE INDEX {DELIVERY}_ctime ON {DELIVERY} USING brin (ctime)",
        "ALTER TABLE event_bus DROP COLUMN retention_s, DROP COLUMN events_kept_since",
    ]:
        op.execute(statement)
