"""Day two: changing and deleting what exists, live, with history kept.

- Rules and targets carry a ``version`` (checked on update: a stale one is a conflict) and an
  ``updated_at``.
- Deletes are markers (``deleted_at``): a deleted target's runner, its delivery and failure
  rows stay (the audit of a past window still reads them); the unique names hold among live
  rows only, so a name can be reused and the new target gets a new runner id (rows are keyed
  by runner id, never by name).
- ``event_target.secret`` holds a sealed token (``eventpush.sealed``, Fernet); ``secret_old``
  and ``secret_old_until`` keep the previous secret signing beside the new one until then
  (Standard Webhooks rotation).
- ``event_runner_version``: per runner and queue, the offset from which each version of its
  rule and target took effect (the engine records it; the audit and replay read it).

Existing plain-text secrets are sealed here, once, with the key of
``EVENTPUSH_SECRET_KEY_FILE``.

Revision ID: 0005_day_two
Revises: 0004_delivery_status_any_sink
"""

from alembic import op

revision = "0005_day_two"
down_revision = "0004_delivery_status_any_sink"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE event_bus ADD COLUMN deleted_at timestamptz;
ALTER TABLE event_bus DROP CONSTRAINT event_bus_name_key;
CREATE UNIQUE INDEX event_bus_live_name ON event_bus (name) WHERE deleted_at IS NULL;

ALTER TABLE event_rule
    ADD COLUMN version    int NOT NULL DEFAULT 1 CHECK (version >= 1),
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN deleted_at timestamptz;
ALTER TABLE event_rule DROP CONSTRAINT event_rule_bus_id_name_key;
CREATE UNIQUE INDEX event_rule_live_name ON event_rule (bus_id, name) WHERE deleted_at IS NULL;

ALTER TABLE event_target
    ADD COLUMN version          int NOT NULL DEFAULT 1 CHECK (version >= 1),
    ADD COLUMN updated_at       timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN deleted_at       timestamptz,
    ADD COLUMN secret_old       text,
    ADD COLUMN secret_old_until timestamptz,
    ADD CHECK ((secret_old IS NULL) = (secret_old_until IS NULL));
ALTER TABLE event_target DROP CONSTRAINT event_target_rule_id_name_key;
CREATE UNIQUE INDEX event_target_live_name ON event_target (rule_id, name)
    WHERE deleted_at IS NULL;

ALTER TABLE event_target_runner ADD COLUMN deleted_at timestamptz;
ALTER TABLE event_target_runner DROP CONSTRAINT event_target_runner_name_key;
CREATE UNIQUE INDEX event_target_runner_live_name ON event_target_runner (name)
    WHERE deleted_at IS NULL;

-- From from_offset on (on queue_id), the runner's events are judged by this version of its
-- rule (pattern, state) and pushed by this version of its target.
CREATE TABLE event_runner_version (
    runner_id      int NOT NULL REFERENCES event_target_runner (id) ON DELETE CASCADE,
    queue_id       int NOT NULL,
    from_offset    bigint NOT NULL CHECK (from_offset >= 0),
    rule_version   int NOT NULL,
    target_version int NOT NULL,
    state          text NOT NULL CHECK (state IN ('ENABLED', 'DISABLED')),
    pattern        json NOT NULL,
    ctime          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (runner_id, queue_id, rule_version, target_version)
);

-- Every existing runner: its first version from where it started.
INSERT INTO event_runner_version (runner_id, queue_id, from_offset, rule_version,
                                  target_version, state, pattern)
SELECT r.id, o.queue_id, o.start_offset, 1, 1, ru.state, ru.pattern
FROM event_target_runner r
JOIN event_push_offset o ON o.runner_id = r.id
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id;
"""


def _seal_plain_secrets() -> None:
    """Plain-text secrets (``whsec_...``) become sealed tokens, once."""
    from eventpush import sealed

    bind = op.get_bind()
    rows = bind.exec_driver_sql(
        "SELECT id, secret FROM event_target WHERE left(secret, 6) = 'whsec_'"
    ).fetchall()
    for target_id, secret in rows:
        bind.exec_driver_sql(
            "UPDATE event_target SET secret = %(sealed)s WHERE id = %(id)s",
            {"sealed": sealed.seal(secret), "id": target_id},
        )


def upgrade() -> None:
    op.execute(UPGRADE)
    _seal_plain_secrets()


def downgrade() -> None:
    raise NotImplementedError(
        "0005_day_two has no downgrade: it would put secrets back in clear and merge the "
        "books of deleted targets with live ones"
    )
