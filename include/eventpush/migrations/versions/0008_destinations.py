"""Connections and API destinations (issue 32): what real endpoints need besides a URL.

- ``event_connection``: how requests authenticate (``api-key``, ``basic`` or
  ``oauth-client-credentials``). Its non-secret parts are ``parameters`` (key name, user
  name, token URL, client id, scopes, extra token request fields); its one secret (the API
  key's value, the password or the client secret) is ``secret``, sealed like target secrets
  (``eventpush.sealed``); ``headers`` and ``query`` are the invocation parameters every
  request through it carries (``[[name, value], ...]``).
- ``event_api_destination``: a URL, an HTTP method, an optional connection, an optional
  ``rate_limit`` (invocations per second for the destination as a whole) and optional
  mTLS files (client certificate and key, CA bundle), by path on the worker's host.
- ``event_target``: ``destination_id`` (a target sends through an API destination; its
  ``url`` is then kept equal to the destination's), its own ``headers``,
  ``concurrency_auto`` (``--concurrency auto``) and its own mTLS files.

Connections and destinations are deleted as markers (``deleted_at``), like rules and
targets: a deleted target keeps pointing at the destination it used.

Revision ID: 0008_destinations
Revises: 0007_verify_sinks
"""

from alembic import op

revision = "0008_destinations"
down_revision = "0007_verify_sinks"
branch_labels = None
depends_on = None

NAME_CHECK = r"CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$')"
TLS_COLUMNS = """
    client_cert_file text,
    client_key_file  text,
    ca_file          text,
    CHECK ((client_cert_file IS NULL) = (client_key_file IS NULL))"""

UPGRADE = f"""
CREATE TABLE event_connection (
    id          serial PRIMARY KEY,
    name        text NOT NULL {NAME_CHECK},
    auth_kind   text NOT NULL
                CHECK (auth_kind IN ('api-key', 'basic', 'oauth-client-credentials')),
    parameters  jsonb NOT NULL DEFAULT '{{}}',
    secret      text NOT NULL,
    headers     jsonb NOT NULL DEFAULT '[]',
    query       jsonb NOT NULL DEFAULT '[]',
    description text NOT NULL DEFAULT '',
    version     int NOT NULL DEFAULT 1 CHECK (version >= 1),
    ctime       timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    deleted_at  timestamptz
);
CREATE UNIQUE INDEX event_connection_live_name ON event_connection (name)
    WHERE deleted_at IS NULL;

CREATE TABLE event_api_destination (
    id            serial PRIMARY KEY,
    name          text NOT NULL {NAME_CHECK},
    url           text NOT NULL,
    method        text NOT NULL DEFAULT 'POST'
                  CHECK (method IN ('POST', 'PUT', 'PATCH', 'DELETE', 'GET')),
    connection_id int REFERENCES event_connection (id),
    rate_limit    double precision CHECK (rate_limit > 0),
    description   text NOT NULL DEFAULT '',
    version       int NOT NULL DEFAULT 1 CHECK (version >= 1),
    ctime         timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    deleted_at    timestamptz,{TLS_COLUMNS}
);
CREATE UNIQUE INDEX event_api_destination_live_name ON event_api_destination (name)
    WHERE deleted_at IS NULL;
CREATE INDEX event_api_destination_connection ON event_api_destination (connection_id);

ALTER TABLE event_target
    ADD COLUMN destination_id   int REFERENCES event_api_destination (id),
    ADD COLUMN headers          jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN concurrency_auto boolean NOT NULL DEFAULT false,
    ADD COLUMN client_cert_file text,
    ADD COLUMN client_key_file  text,
    ADD COLUMN ca_file          text,
    ADD CHECK ((client_cert_file IS NULL) = (client_key_file IS NULL));
CREATE INDEX event_target_destination ON event_target (destination_id);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(
        "ALTER TABLE event_target DROP COLUMN destination_id, DROP COLUMN headers, "
        "DROP COLUMN concurrency_auto, DROP COLUMN client_cert_file, "
        "DROP COLUMN client_key_file, DROP COLUMN ca_file; "
        "DROP TABLE event_api_destination; DROP TABLE event_connection"
    )
