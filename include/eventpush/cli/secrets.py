"""``secrets rotate-key``: every stored secret re-encrypted under a new key."""

from __future__ import annotations

from pathlib import Path

import click

from eventpush.cli.common import handles_errors, out, print_json
from eventpush.db import connection


@click.group()
def secrets() -> None:
    """Stored secrets (sealed with the key of EVENTPUSH_SECRET_KEY_FILE)."""


@secrets.command("rotate-key")
@click.option(
    "--new-key-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the new Fernet key (its first line seals).",
)
@click.option("--json", "as_json", is_flag=True)
@handles_errors
def rotate_key(new_key_file: str, as_json: bool) -> None:
    """Re-encrypt every stored secret under the new key, in one transaction; then point
    EVENTPUSH_SECRET_KEY_FILE at the new file (or put the new key first in the old one)."""
    from eventpush import sealed

    with connection() as conn:
        count = sealed.rotate_key(conn, Path(new_key_file))
    if as_json:
        print_json({"reencrypted": count, "key_file": new_key_file})
    else:
        out.print(f"{count} secrets re-encrypted under the key in {new_key_file}", markup=False)
