"""``bus_event`` without its foreign key to ``event_bus``. The key's check ran once per stored
event (a lookup and a row lock on the bus, in a trigger per row): 7-10 µs of the 23-29 µs of
CPU a backend spent on an event of the API's group commit (docs/BENCHMARKS.md, issue 31). It
guarded nothing the partitions do not: ``bus_event`` is partitioned by bus with no default
partition, and a bus's partition is made in the transaction that makes the bus, so an event
can only be stored for a bus that exists. Buses are deleted by marking them (``deleted_at``),
never as rows, so the key's cascade never ran either. ``event_push_delivery`` has gone without
one from the start for the same reason.

Revision ID: 0012_bus_event_without_fk
Revises: 0011_replayed_total
"""

from alembic import op

revision = "0012_bus_event_without_fk"
down_revision = "0011_replayed_total"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE bus_event DROP CONSTRAINT IF EXISTS bus_event_bus_id_fkey")


def downgrade() -> None:
    op.execute(
        "ALTER TABLE bus_event ADD CONSTRAINT bus_event_bus_id_fkey "
        "FOREIGN KEY (bus_id) REFERENCES event_bus (id) ON DELETE CASCADE"
    )
