"""``eventpush key``: access keys of the EventBridge-compatible API (``eventpush api``)."""

from __future__ import annotations

import click
from rich.table import Table

from eventpush.cli.common import handles_errors, out, print_json
from eventpush.db import connection


@click.group("key")
def key() -> None:
    """Access keys for the API (Signature Version 4)."""


@key.command("create")
@click.argument("name")
@click.option("--role", type=click.Choice(["admin", "producer"]), required=True)
@click.option(
    "--bus",
    "buses",
    multiple=True,
    help="A bus a producer key may put events on (repeat for more); admin keys take none.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handles_errors
def key_create(name: str, role: str, buses: tuple[str, ...], as_json: bool) -> None:
    """Create key NAME; its secret is printed this once and never again."""
    from eventpush.access_keys import create_key

    with connection() as conn:
        new = create_key(conn, name, role, list(buses))
    if as_json:
        print_json(
            {
                "name": new.info.name,
                "access_key_id": new.info.access_key_id,
                "secret_access_key": new.secret_access_key,
                "role": new.info.role,
                "buses": list(new.info.buses),
            }
        )
        return
    out.print(f"key {name} created ({role}); keep the secret now, it is not shown again:")
    out.print(f"access_key_id     {new.info.access_key_id}", highlight=False)
    out.print(f"secret_access_key {new.secret_access_key}", highlight=False)


@key.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handles_errors
def key_list(as_json: bool) -> None:
    """Every key: name, access key id, role, buses (never a secret)."""
    from eventpush.access_keys import list_keys

    with connection() as conn:
        keys = list_keys(conn)
    if as_json:
        print_json({"keys": [k.to_json() for k in keys]})
        return
    table = Table()
    for col in ("name", "access key id", "role", "buses", "created"):
        table.add_column(col)
    for k in keys:
        table.add_row(k.name, k.access_key_id, k.role, ",".join(k.buses), k.created_at.isoformat())
    out.print(table)


@key.command("delete")
@click.argument("name")
@handles_errors
def key_delete(name: str) -> None:
    """Delete key NAME: requests signed with it are refused from then on."""
    from eventpush.access_keys import delete_key

    with connection() as conn:
        delete_key(conn, name)
    out.print(f"key {name} deleted")
