"""Alembic environment for eventpush: plain SQL migrations, no ORM models."""

from alembic import context
from sqlalchemy import create_engine, text

config = context.config
# Serialises concurrent `eventpush db migrate` runs against one database.
MIGRATE_LOCK_KEY = 0x6576_7075_7368  # "evpush"


def run_migrations_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=None)
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
        try:
            context.configure(
                connection=connection,
                version_table="eventpush_alembic_version",
                transaction_per_migration=True,
            )
            with context.begin_transaction():
                context.run_migrations()
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
            connection.commit()
    engine.dispose()


run_migrations_online()
