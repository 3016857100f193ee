"""Applying the versioned schema migrations (Alembic, plain SQL) to the eventpush database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine

from eventpush.config import database_url
from eventpush.db import StoreError, connect
from eventpush.errors import first_line

MIGRATIONS = Path(__file__).with_name("migrations")


def _alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    sa_url = url.replace("postgres://", "postgresql://", 1).replace(
        "postgresql://", "postgresql+psycopg2://", 1
    )
    # ConfigParser interpolation would eat a '%' in an encoded password.
    cfg.set_main_option("sqlalchemy.url", sa_url.replace("%", "%%"))
    return cfg


def current_revision(url: str | None = None) -> str | None:
    """The revision the database is at, or None before the first migration."""
    cfg = _alembic_config(url or database_url())
    engine = create_engine(cfg.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"version_table": "eventpush_alembic_version"}
            )
            return ctx.get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest revision this code ships."""
    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


def migrate(url: str | None = None) -> tuple[str | None, str]:
    """Upgrade to the newest revision; idempotent. Returns (before, after)."""
    # First through eventpush.db, so an unreachable database or a malformed URL is its one
    # redacted line (StoreError, ConfigError), not SQLAlchemy's traceback.
    connect(url).close()
    url = url or database_url()
    before = current_revision(url)
    try:
        command.upgrade(_alembic_config(url), "head")
    except CommandError as exc:
        # E.g. a revision this code does not ship (the database was migrated by a newer
        # eventpush): Alembic's own words, in one line, not its traceback.
        raise StoreError(
            f"cannot migrate the database from revision {before}: {first_line(exc)}"
        ) from None
    return before, head_revision()
