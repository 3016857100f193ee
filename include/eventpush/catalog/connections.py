"""Connections: how requests to an API destination authenticate (issue 32).

A connection is one of three kinds: ``api-key`` (a header carrying the key), ``basic`` (HTTP
Basic) or ``oauth-client-credentials`` (RFC 6749 4.4: a bearer token fetched from the token
URL with the client id and secret). Each kind has one secret (the key's value, the password,
the client secret), stored sealed (``eventpush.sealed``) and never read back: reads say only
that it is set. Every kind may add invocation headers and query parameters to each request.

A change moves the connection's ``version`` on, and the version of every live target sending
through it (via its destinations), so running workers take it live as they take a target
change (push/versions.py); a delete is refused while a live destination uses it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import psycopg2
import psycopg2.errors

from eventpush import sealed
from eventpush.addresses import InvalidTargetUrlError
from eventpush.catalog.common import (
    CatalogError,
    ConflictError,
    check_changes,
    check_description,
    check_name,
    check_version,
    iso,
    named_row,
    notify,
    refuse_if_used,
)
from eventpush.db import Connection, transaction
from eventpush.sinks import validate_url
from eventpush.sinks.contract import API_KEY, AUTH_KINDS, BASIC, OAUTH
from eventpush.sinks.headers import VALUE_RE, HeaderError, check_header, check_headers, check_query

# The fields each kind takes besides its secret (the command line's options, with dashes).
KIND_FIELDS = {
    API_KEY: ("key_name",),
    BASIC: ("username",),
    OAUTH: ("token_url", "client_id", "scopes", "oauth_params"),
}
PARAMETER_FIELDS = ("key_name", "username", "token_url", "client_id", "scopes", "oauth_params")
# The options that give each kind's secret (a file or stdin: never argv, where `ps` shows it).
SECRET_NAMES = {
    API_KEY: "--key-value-file",
    BASIC: "--password-file",
    OAUTH: "--client-secret-file",
}
# Token request fields eventpush sets itself (RFC 6749 4.4.2 and 2.3.1).
RESERVED_OAUTH_PARAMS = frozenset(
    {"grant_type", "scope", "client_id", "client_secret", "client_assertion"}
)
# RFC 6749 3.3: scope-token = 1*( %x21 / %x23-5B / %x5D-7E )
SCOPE_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {'"', "\\"}
MAX_SECRET = 4096


def _option(field: str) -> str:
    return {"oauth_params": "--oauth-param", "scopes": "--scope"}.get(
        field, "--" + field.replace("_", "-")
    )


def check_connection(name: str, auth: str, secret: str | None, params: dict) -> dict:
    """The stored ``parameters`` of a connection of kind ``auth``, checked; ``secret`` is
    checked when given (None: kept as stored). Errors never carry the secret."""
    check_name("connection", name)
    where = f"connection {name!r}"
    if auth not in AUTH_KINDS:
        raise CatalogError(f"{where}: --auth must be one of {', '.join(AUTH_KINDS)}, got {auth!r}")
    wanted = KIND_FIELDS[auth]
    for field in PARAMETER_FIELDS:
        if field not in wanted and params.get(field) not in (None, (), []):
            raise CatalogError(f"{where}: {_option(field)} does not apply to --auth {auth}")
    for field in wanted:
        if field not in ("scopes", "oauth_params") and not params.get(field):
            raise CatalogError(f"{where}: --auth {auth} needs {_option(field)}")
    if secret is not None:
        _check_secret(where, auth, secret)
    out: dict = {}
    if auth == API_KEY:
        key_name, _ = _header_error(
            lambda: check_header(params["key_name"], "", where, credential=True)
        )
        out["key_name"] = params["key_name"]
        if secret is not None:
            _header_error(lambda: check_header(key_name, secret, where, credential=True))
    elif auth == BASIC:
        username = params["username"]
        if not isinstance(username, str) or ":" in username or not VALUE_RE.fullmatch(username):
            raise CatalogError(
                f"{where}: --username must be printable ASCII without ':', up to 4096 characters"
            )
        out["username"] = username
    else:
        out.update(_check_oauth(where, params))
    return out


def _check_secret(where: str, auth: str, secret: str) -> None:
    option = SECRET_NAMES[auth]
    if not isinstance(secret, str) or not secret:
        raise CatalogError(f"{where}: {option} is empty")
    if len(secret) > MAX_SECRET or any(ord(c) < 0x20 or ord(c) == 0x7F for c in secret):
        raise CatalogError(
            f"{where}: {option} must be at most {MAX_SECRET} characters without control "
            "characters (CR, LF...)"
        )


def _header_error(check):
    try:
        return check()
    except HeaderError as exc:
        raise CatalogError(str(exc)) from None


def _check_oauth(where: str, params: dict) -> dict:
    token_url = params["token_url"]
    try:
        validate_url(token_url)
    except InvalidTargetUrlError as exc:
        raise CatalogError(f"{where}: --token-url: {exc}") from None
    if not token_url.strip().lower().startswith(("http://", "https://")):
        raise CatalogError(f"{where}: --token-url must be an http or https URL")
    client_id = params["client_id"]
    if not isinstance(client_id, str) or not VALUE_RE.fullmatch(client_id):
        raise CatalogError(f"{where}: --client-id must be printable ASCII")
    scopes = list(params.get("scopes") or ())
    for scope in scopes:
        if not isinstance(scope, str) or not scope or not set(scope) <= SCOPE_CHARS:
            raise CatalogError(
                f"{where}: --scope {scope!r} is invalid: one scope per option, printable "
                "ASCII without spaces, quotes or backslashes"
            )
    extra = _header_error(lambda: check_query(params.get("oauth_params") or (), where))
    for key, _ in extra:
        if key in RESERVED_OAUTH_PARAMS:
            raise CatalogError(f"{where}: --oauth-param {key} is set by eventpush itself")
    return {
        "token_url": token_url.strip(),
        "client_id": client_id,
        "scopes": scopes,
        "oauth_params": [list(p) for p in extra],
    }


def _invocation(name: str, headers, query) -> tuple[list, list]:
    where = f"connection {name!r}"
    headers = _header_error(lambda: check_headers(headers or (), where))
    query = _header_error(lambda: check_query(query or (), where))
    return [list(h) for h in headers], [list(q) for q in query]


def create_connection(
    conn: Connection,
    name: str,
    auth: str,
    secret: str,
    *,
    headers=(),
    query=(),
    description: str = "",
    **params,
) -> ConnectionInfo:
    """A connection of kind ``auth`` with its one ``secret`` (sealed) and its parameters:
    ``key_name`` (api-key), ``username`` (basic), ``token_url``, ``client_id``, ``scopes``,
    ``oauth_params`` (oauth-client-credentials)."""
    unknown = sorted(set(params) - set(PARAMETER_FIELDS))
    if unknown:
        raise CatalogError(f"connection {name!r}: no such field {unknown[0]!r}")
    check_description(f"connection {name!r}", description)
    if secret is None:
        raise CatalogError(f"connection {name!r}: --auth {auth} needs {SECRET_NAMES.get(auth)}")
    stored = check_connection(name, auth, secret, params)
    headers, query = _invocation(name, headers, query)
    try:
        with transaction(conn) as cur:
            cur.execute(
                "INSERT INTO event_connection (name, auth_kind, parameters, secret, headers, "
                "query, description) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
                (
                    name,
                    auth,
                    json.dumps(stored),
                    sealed.seal(secret),
                    json.dumps(headers),
                    json.dumps(query),
                    description,
                ),
            )
            cur.execute(CONNECTION_INFO_SQL + " AND c.id = %s", (cur.fetchone()[0],))
            return _info(cur.fetchone())
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"connection {name!r} already exists") from None


@dataclass(frozen=True)
class ConnectionInfo:
    name: str
    auth: str
    key_name: str | None
    username: str | None
    token_url: str | None  # redacted
    client_id: str | None
    scopes: list[str]
    oauth_params: list[list[str]]
    headers: list[list[str]]
    query: list[list[str]]
    secret_set: bool  # always: the secret itself is never read back
    description: str
    version: int
    destinations: int  # live destinations using it
    updated_at: str | None
    created_at: str | None

    def to_json(self) -> dict:
        return asdict(self)


CONNECTION_INFO_SQL = """
SELECT c.name, c.auth_kind, c.parameters, c.headers, c.query, c.description, c.version,
       (SELECT count(*) FROM event_api_destination d
         WHERE d.connection_id = c.id AND d.deleted_at IS NULL), c.updated_at, c.ctime
FROM event_connection c
WHERE c.deleted_at IS NULL
"""


def _info(row) -> ConnectionInfo:
    from eventpush.config import redact_url

    name, auth, params, headers, query, description, version, used, updated, created = row
    token_url = params.get("token_url")
    return ConnectionInfo(
        name,
        auth,
        params.get("key_name"),
        params.get("username"),
        None if token_url is None else redact_url(token_url),
        params.get("client_id"),
        params.get("scopes", []),
        params.get("oauth_params", []),
        headers,
        query,
        True,
        description,
        version,
        used,
        iso(updated),
        iso(created),
    )


def connection_row(cur, name: str, lock: str = "") -> int:
    """The id of the live connection ``name`` (``lock``: "", "share" or "update")."""
    return named_row(cur, "event_connection", "connection", name, lock=lock)[0]


def get_connection(conn: Connection, name: str) -> ConnectionInfo:
    with transaction(conn) as cur:
        connection_id = connection_row(cur, name)
        cur.execute(CONNECTION_INFO_SQL + " AND c.id = %s", (connection_id,))
        return _info(cur.fetchone())


def list_connections(conn: Connection) -> list[ConnectionInfo]:
    with transaction(conn) as cur:
        cur.execute(CONNECTION_INFO_SQL + " ORDER BY c.name")
        return [_info(row) for row in cur.fetchall()]


def update_connection(
    conn: Connection,
    name: str,
    *,
    expected_version: int | None = None,
    **changes,
) -> ConnectionInfo:
    """Change a connection: ``auth`` (a new kind needs its parameters and a new secret),
    ``secret``, ``headers``, ``query``, ``description`` or a parameter of its kind. The
    targets sending through it take the change live."""
    allowed = {"auth", "secret", "headers", "query", "description", *PARAMETER_FIELDS}
    check_changes("connection", name, changes, allowed)
    if "description" in changes:
        check_description(f"connection {name!r}", changes["description"])
    with transaction(conn) as cur:
        connection_id = connection_row(cur, name, "update")
        cur.execute(
            "SELECT auth_kind, parameters, headers, query, description, version "
            "FROM event_connection WHERE id = %s",
            (connection_id,),
        )
        auth, params, headers, query, description, version = cur.fetchone()
        check_version("connection", name, version, expected_version)
        new_auth = changes.get("auth", auth)
        if new_auth != auth:
            if changes.get("secret") is None:
                raise CatalogError(
                    f"connection {name!r}: a new --auth needs its new "
                    f"{SECRET_NAMES.get(new_auth, 'secret')}"
                )
            params = {}
        params = {**params, **{k: v for k, v in changes.items() if k in PARAMETER_FIELDS}}
        stored = check_connection(name, new_auth, changes.get("secret"), params)
        headers, query = _invocation(
            name, changes.get("headers", headers), changes.get("query", query)
        )
        secret_sql, secret_args = "", ()
        if changes.get("secret") is not None:
            secret_sql, secret_args = "secret = %s, ", (sealed.seal(changes["secret"]),)
        cur.execute(
            "UPDATE event_connection SET auth_kind = %s, parameters = %s, "
            + secret_sql
            + "headers = %s, query = %s, description = %s, version = version + 1, "
            "updated_at = now() WHERE id = %s",
            (
                new_auth,
                json.dumps(stored),
                *secret_args,
                json.dumps(headers),
                json.dumps(query),
                changes.get("description", description),
                connection_id,
            ),
        )
        retarget(cur, "d.connection_id = %s", (connection_id,))
        cur.execute(CONNECTION_INFO_SQL + " AND c.id = %s", (connection_id,))
        return _info(cur.fetchone())


def retarget(cur, where: str, params: tuple, url: str | None = None) -> None:
    """Live targets sending through the destinations ``where`` (a fixed condition over alias
    d) move to a new version (and to ``url`` when given), and their buses' workers hear of
    it: they take the change live, as for a change to the target itself."""
    cur.execute(
        "UPDATE event_target t SET version = t.version + 1, updated_at = now(), "
        "url = coalesce(%s, t.url) FROM event_api_destination d "
        f"WHERE t.destination_id = d.id AND t.deleted_at IS NULL AND {where} "
        "RETURNING (SELECT ru.bus_id FROM event_rule ru WHERE ru.id = t.rule_id)",
        (url, *params),
    )
    for bus_id in sorted({row[0] for row in cur.fetchall()}):
        notify(cur, bus_id)


def delete_connection(conn: Connection, name: str) -> None:
    """Delete a connection (refused while a live destination uses it)."""
    with transaction(conn) as cur:
        connection_id = connection_row(cur, name, "update")
        cur.execute(
            "SELECT name FROM event_api_destination WHERE connection_id = %s "
            "AND deleted_at IS NULL ORDER BY name",
            (connection_id,),
        )
        users = [row[0] for row in cur.fetchall()]
        hint = "point them at another connection or delete them first"
        refuse_if_used("connection", name, users, "destination", hint)
        cur.execute(
            "UPDATE event_connection SET deleted_at = now() WHERE id = %s", (connection_id,)
        )
