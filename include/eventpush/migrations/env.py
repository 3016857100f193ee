"""Alembic environment for eventpush: plain SQL migrations, no ORM models."""

import time

from alembic import context
from sqlalchemy import create_engine, text

from eventpush.migration_waits import bounded

config = context.config
# Serialises concurrent `eventpush db migrate` runs against one database.
MIGRATE_LOCK_KEY = 0x6576_7075_7368  # "evpush"
# Its session's name in pg_stat_activity: who holds or waits for that lock, at a glance.
APPLICATION_NAME = "eventpush db migrate"
# A run that finds the lock taken asks again after this long, with no statement open between:
# blocked in pg_advisory_lock it held that statement's snapshot, and an index the run holding
# the lock builds CONCURRENTLY waits for every older snapshot (a deadlock, one run failed).
TURN_POLL_S = 0.2


def _take_turn(connection) -> None:
    """The migration lock (a session's): asked for until it is free, then the transaction
    that asked committed, so that Alembic finds none of its caller's open and gives each
    migration a transaction of its own (``transaction_per_migration``), which one that builds
    an index concurrently leaves for an autocommit block. Left open, the lock's transaction
    held every migration of the run (one transaction, and no autocommit block possible)."""
    lock = text("SELECT pg_try_advisory_lock(:k)")
    while not connection.execute(lock, {"k": MIGRATE_LOCK_KEY}).scalar():
        connection.rollback()
        time.sleep(TURN_POLL_S)
    connection.commit()


def run_migrations_online() -> None:
    engine = create_engine(
        config.get_main_option("sqlalchemy.url"),
        poolclass=None,
        connect_args={"application_name": APPLICATION_NAME},
    )
    with engine.connect() as connection:
        _take_turn(connection)
        try:
            context.configure(
                connection=connection,
                version_table="eventpush_alembic_version",
                transaction_per_migration=True,
            )
            with bounded(connection), context.begin_transaction():
                context.run_migrations()
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
            connection.commit()
    engine.dispose()


run_migrations_online()
