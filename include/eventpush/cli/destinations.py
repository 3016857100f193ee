"""``connection`` and ``destination`` commands (issue 32): how requests to an endpoint
authenticate, and the endpoints targets send through. Secrets come from a file or stdin
(``-``), never from the command line; ``show`` and ``list`` never print them."""

from __future__ import annotations

import sys

import click

from eventpush import catalog
from eventpush.cli.changes import as_json_option, said, show, show_list
from eventpush.cli.common import (
    TLS_FIELDS,
    fail,
    handles_errors,
    not_both,
    pairs,
    read_text_file,
    tls_options,
)
from eventpush.db import connection as db_connection
from eventpush.sinks.contract import AUTH_KINDS

SECRET_FILES = {
    "key_value_file": ("api-key", "--key-value-file"),
    "password_file": ("basic", "--password-file"),
    "client_secret_file": ("oauth-client-credentials", "--client-secret-file"),
}


def read_secret_file(path: str, option: str) -> str:
    """A secret from a file, or from stdin for ``-``; its line ending dropped."""
    text = sys.stdin.read() if path == "-" else read_text_file(path, option)
    text = text.rstrip("\r\n")
    if not text:
        fail(f"the secret read from {option} {'stdin' if path == '-' else path} is empty")
    return text


def invocation_options(func):
    """--header and --query, on connections."""
    func = click.option(
        "--query", "query", multiple=True, metavar="K=V", help="Query parameter, repeatable."
    )(func)
    return click.option(
        "--header", "headers", multiple=True, metavar="K:V", help="Header, repeatable."
    )(func)


def connection_options(func):
    for name, (kind, option) in reversed(SECRET_FILES.items()):
        func = click.option(
            option,
            name,
            default=None,
            metavar="FILE",
            help=f"{kind}: the secret, read from FILE ('-': stdin).",
        )(func)
    func = click.option(
        "--oauth-param", "oauth_params", multiple=True, metavar="K=V", help="Token request field."
    )(func)
    func = click.option("--scope", "scopes", multiple=True, help="OAuth2 scope, repeatable.")(func)
    func = click.option("--client-id", default=None)(func)
    func = click.option("--token-url", default=None, help="OAuth2 token endpoint.")(func)
    func = click.option("--username", default=None)(func)
    func = click.option("--key-name", default=None, help="The API key's header, e.g. X-Api-Key.")(
        func
    )
    return func


def _secret(auth: str | None, files: dict) -> str | None:
    given = [(name, path) for name, path in files.items() if path is not None]
    if len(given) > 1:
        fail("give one secret file: " + ", ".join(SECRET_FILES[n][1] for n, _ in given))
    if not given:
        return None
    name, path = given[0]
    kind, option = SECRET_FILES[name]
    if auth is not None and auth != kind:
        fail(f"{option} applies to --auth {kind}, not {auth}")
    return read_secret_file(path, option)


@click.group()
def connection() -> None:
    """Connections: how requests to API destinations authenticate."""


@connection.command("create")
@click.argument("name")
@click.option("--auth", required=True, type=click.Choice(AUTH_KINDS))
@connection_options
@invocation_options
@click.option("--description", default="")
@as_json_option
@handles_errors
def connection_create(name: str, auth: str, headers, query, description: str, as_json: bool, **kw):
    """Create connection NAME."""
    secret = _secret(auth, {k: kw.pop(k) for k in SECRET_FILES})
    if secret is None:
        fail(f"--auth {auth} needs its secret: {_secret_option(auth)} FILE (or - for stdin)")
    kw["scopes"] = list(kw["scopes"])
    kw["oauth_params"] = pairs(kw["oauth_params"], "=", "--oauth-param")
    with db_connection() as conn:
        info = catalog.create_connection(
            conn,
            name,
            auth,
            secret,
            headers=pairs(headers, ":", "--header"),
            query=pairs(query, "=", "--query"),
            description=description,
            **{k: v for k, v in kw.items() if v not in (None, [])},
        )
    said(f"connection {name} created ({auth})", as_json, info.to_json())


def _secret_option(auth: str) -> str:
    return next(option for kind, option in SECRET_FILES.values() if kind == auth)


@connection.command("list")
@as_json_option
@handles_errors
def connection_list(as_json: bool) -> None:
    """List connections (never their secrets)."""
    with db_connection() as conn:
        items = catalog.list_connections(conn)
    show_list(items, as_json, "connections", ("name", "auth", "version", "destinations"))


@connection.command("show")
@click.argument("name")
@as_json_option
@handles_errors
def connection_show(name: str, as_json: bool) -> None:
    """Show connection NAME (its secret only as set)."""
    with db_connection() as conn:
        show(catalog.get_connection(conn, name), as_json, f"connection {name}")


@connection.command("update")
@click.argument("name")
@click.option("--auth", default=None, type=click.Choice(AUTH_KINDS))
@connection_options
@invocation_options
@click.option("--no-header", is_flag=True, help="Drop every header.")
@click.option("--no-query", is_flag=True, help="Drop every query parameter.")
@click.option("--description", default=None)
@click.option("--expected-version", type=int, default=None)
@as_json_option
@handles_errors
def connection_update(
    name: str,
    auth: str | None,
    headers,
    query,
    no_header: bool,
    no_query: bool,
    description: str | None,
    expected_version: int | None,
    as_json: bool,
    **kw,
):
    """Change a connection (--header or --query replace all of theirs); the targets sending
    through it take the change live."""
    not_both({"--header": headers}, "--no-header", no_header)
    not_both({"--query": query}, "--no-query", no_query)
    changes: dict = {}
    secret = _secret(auth, {k: kw.pop(k) for k in SECRET_FILES})
    if secret is not None:
        changes["secret"] = secret
    if auth is not None:
        changes["auth"] = auth
    scopes = kw.pop("scopes")
    if scopes:
        changes["scopes"] = list(scopes)
    raw_params = kw.pop("oauth_params")
    if raw_params:
        changes["oauth_params"] = pairs(raw_params, "=", "--oauth-param")
    changes.update({k: v for k, v in kw.items() if v is not None})
    if headers or no_header:
        changes["headers"] = pairs(headers, ":", "--header")
    if query or no_query:
        changes["query"] = pairs(query, "=", "--query")
    if description is not None:
        changes["description"] = description
    with db_connection() as conn:
        info = catalog.update_connection(conn, name, expected_version=expected_version, **changes)
    said(f"connection {name} updated to version {info.version}", as_json, info.to_json())


@connection.command("delete")
@click.argument("name")
@as_json_option
@handles_errors
def connection_delete(name: str, as_json: bool) -> None:
    """Delete connection NAME (refused while a destination uses it)."""
    with db_connection() as conn:
        catalog.delete_connection(conn, name)
    said(f"connection {name} deleted", as_json, {"connection": name, "deleted": True})


# --- destinations -----------------------------------------------------------------------------


@click.group()
def destination() -> None:
    """API destinations: an endpoint, its method, connection, rate limit and TLS files."""


@destination.command("create")
@click.argument("name")
@click.option("--url", required=True)
@click.option("--method", default="POST", show_default=True, type=click.Choice(catalog.METHODS))
@click.option("--connection", "connection_name", default=None)
@click.option(
    "--rate-limit", type=float, default=None, help="Invocations per second, whole destination."
)
@tls_options
@click.option("--description", default="")
@as_json_option
@handles_errors
def destination_create(
    name: str, url: str, connection_name: str | None, as_json: bool, **fields
) -> None:
    """Create API destination NAME."""
    with db_connection() as conn:
        info = catalog.create_destination(conn, name, url, connection=connection_name, **fields)
    said(f"destination {name} created -> {info.url}", as_json, info.to_json())


@destination.command("list")
@as_json_option
@handles_errors
def destination_list(as_json: bool) -> None:
    """List API destinations."""
    with db_connection() as conn:
        items = catalog.list_destinations(conn)
    columns = ("name", "url", "method", "connection", "rate_limit", "targets")
    show_list(items, as_json, "destinations", columns)


@destination.command("show")
@click.argument("name")
@as_json_option
@handles_errors
def destination_show(name: str, as_json: bool) -> None:
    """Show API destination NAME."""
    with db_connection() as conn:
        show(catalog.get_destination(conn, name), as_json, f"destination {name}")


@destination.command("update")
@click.argument("name")
@click.option("--url", default=None)
@click.option("--method", default=None, type=click.Choice(catalog.METHODS))
@click.option("--connection", "connection_name", default=None)
@click.option("--no-connection", is_flag=True, help="Send without a connection.")
@click.option("--rate-limit", type=float, default=None)
@click.option("--no-rate-limit", is_flag=True, help="No rate limit.")
@tls_options
@click.option("--no-tls", is_flag=True, help="Drop the client certificate and CA files.")
@click.option("--description", default=None)
@click.option("--expected-version", type=int, default=None)
@as_json_option
@handles_errors
def destination_update(
    name: str,
    connection_name: str | None,
    no_connection: bool,
    no_rate_limit: bool,
    no_tls: bool,
    expected_version: int | None,
    as_json: bool,
    **fields,
) -> None:
    """Change an API destination; the targets sending through it take the change live."""
    not_both({"--connection": connection_name}, "--no-connection", no_connection)
    not_both({"--rate-limit": fields["rate_limit"]}, "--no-rate-limit", no_rate_limit)
    not_both({f"--{k.replace('_', '-')}": fields[k] for k in TLS_FIELDS}, "--no-tls", no_tls)
    changes = {k: v for k, v in fields.items() if v is not None}
    if connection_name is not None or no_connection:
        changes["connection"] = None if no_connection else connection_name
    if no_rate_limit:
        changes["rate_limit"] = None
    if no_tls:
        changes.update(client_cert_file=None, client_key_file=None, ca_file=None)
    with db_connection() as conn:
        info = catalog.update_destination(conn, name, expected_version=expected_version, **changes)
    said(f"destination {name} updated to version {info.version}", as_json, info.to_json())


@destination.command("delete")
@click.argument("name")
@as_json_option
@handles_errors
def destination_delete(name: str, as_json: bool) -> None:
    """Delete API destination NAME (refused while a target uses it)."""
    with db_connection() as conn:
        catalog.delete_destination(conn, name)
    said(f"destination {name} deleted", as_json, {"destination": name, "deleted": True})
