"""Day-two catalog commands: list and show what exists; update, enable, disable and delete
it (added to the ``bus``, ``rule``, ``target`` and ``worker`` groups). Every command takes
``--json``: ``list --json`` gives one object per item with the fields ``show --json`` gives.
Secrets never appear: only whether one is set and its fingerprint."""

from __future__ import annotations

import datetime as dt
import json
import re

import click
from rich.table import Table

from eventpush import catalog
from eventpush.cli.catalog import bus, read_secret, rule, target
from eventpush.cli.common import (
    TLS_FIELDS,
    NumberOrAuto,
    concurrency_option,
    fail,
    handles_errors,
    not_both,
    out,
    pairs,
    print_json,
    tls_options,
)
from eventpush.cli.workers import worker
from eventpush.db import connection

_DURATION = re.compile(r"(\d+)([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(option: str, text: str) -> dt.timedelta:
    """``90s``, ``30m``, ``24h``, ``7d``: one number and one unit."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        fail(f"{option} must be a number and a unit (s, m, h or d), such as 24h; got {text!r}")
    try:
        return dt.timedelta(**{_UNITS[found[2]]: int(found[1])})
    except OverflowError:  # past timedelta's 999999999 days: not a ValueError, a traceback
        fail(f"{option} {text!r} is out of range")


def as_json_option(func):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(func)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def show(item, as_json: bool, title: str) -> None:
    """One item: its JSON object, or a two-column table of its fields."""
    doc = item.to_json()
    if as_json:
        print_json(doc)
        return
    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in doc.items():
        table.add_row(key, _cell(value))
    out.print(table)


def show_list(items: list, as_json: bool, title: str, columns: tuple[str, ...]) -> None:
    """Items: a JSON array of their objects, or a table of the chosen fields."""
    if as_json:
        print_json([item.to_json() for item in items])
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col.replace("_", " "), overflow="fold")
    for item in items:
        doc = item.to_json()
        table.add_row(*(_cell(doc[col]) for col in columns))
    out.print(table)


def said(message: str, as_json: bool, doc: dict) -> None:
    if as_json:
        print_json(doc)
    else:
        out.print(message, markup=False, soft_wrap=True)


# --- buses ------------------------------------------------------------------------------------


@bus.command("list")
@click.option("--prefix", default=None, help="Only buses whose name starts so.")
@as_json_option
@handles_errors
def bus_list(prefix: str | None, as_json: bool) -> None:
    """List buses."""
    with connection() as conn:
        items = catalog.list_buses(conn, name_prefix=prefix)
    show_list(items, as_json, "buses", ("name", "queues", "rules", "source_url", "description"))


@bus.command("show")
@click.argument("name")
@as_json_option
@handles_errors
def bus_show(name: str, as_json: bool) -> None:
    """Show bus NAME."""
    with connection() as conn:
        show(catalog.get_bus(conn, name), as_json, f"bus {name}")


@bus.command("update")
@click.argument("name")
@click.option(
    "--retention",
    default=None,
    help="How long events are kept (12h, 7d, 2w), or 'default' for EVENTPUSH_RETENTION; a "
    "JetStream stream's max_age changes with it.",
)
@as_json_option
@handles_errors
def bus_update(name: str, retention: str | None, as_json: bool) -> None:
    """Change bus NAME (its retention)."""
    if retention is None:
        fail("bus update: nothing to change (give --retention)")
    own = None if retention.strip() == "default" else retention
    with connection() as conn:
        info = catalog.update_bus_retention(conn, name, own)
    said(f"bus {name} keeps its events {info.retention}", as_json, info.to_json())


@bus.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Delete its rules and targets too.")
@as_json_option
@handles_errors
def bus_delete(name: str, force: bool, as_json: bool) -> None:
    """Delete bus NAME (refused while it has rules, unless --force)."""
    with connection() as conn:
        gone = catalog.delete_bus(conn, name, force=force)
    said(
        f"bus {name} deleted with {gone['rules']} rules and {gone['targets']} targets",
        as_json,
        {"bus": name, "deleted": True, **gone},
    )


# --- rules ------------------------------------------------------------------------------------


def rule_options(func):
    func = click.option("--name", required=True)(func)
    return click.option("--bus", "bus_name", required=True)(func)


@rule.command("list")
@click.option("--bus", "bus_name", default=None)
@click.option("--prefix", default=None, help="Only rules whose name starts so.")
@as_json_option
@handles_errors
def rule_list(bus_name: str | None, prefix: str | None, as_json: bool) -> None:
    """List rules (of one bus with --bus)."""
    with connection() as conn:
        items = catalog.list_rules(conn, bus_name, name_prefix=prefix)
    show_list(items, as_json, "rules", ("bus", "name", "state", "version", "targets", "pattern"))


@rule.command("show")
@rule_options
@as_json_option
@handles_errors
def rule_show(bus_name: str, name: str, as_json: bool) -> None:
    """Show one rule."""
    with connection() as conn:
        show(catalog.get_rule(conn, bus_name, name), as_json, f"rule {bus_name}/{name}")


@rule.command("update")
@rule_options
@click.option("--pattern", default=None, help="The new event pattern, as JSON.")
@click.option("--description", default=None)
@click.option(
    "--expected-version",
    type=int,
    default=None,
    help="Refuse (conflict) unless the rule is still at this version.",
)
@as_json_option
@handles_errors
def rule_update(
    bus_name: str,
    name: str,
    pattern: str | None,
    description: str | None,
    expected_version: int | None,
    as_json: bool,
) -> None:
    """Change a rule's pattern or description; running workers apply it within 2 s."""
    with connection() as conn:
        info = catalog.update_rule(
            conn,
            bus_name,
            name,
            pattern=pattern,
            description=description,
            expected_version=expected_version,
        )
    said(f"rule {bus_name}/{name} updated to version {info.version}", as_json, info.to_json())


def _rule_switch(enabled: bool) -> None:
    verb = "enable" if enabled else "disable"
    note = "it matches again" if enabled else "it matches nothing"

    @rule.command(verb, help=f"{verb.capitalize()} a rule: {note} from where workers are.")
    @rule_options
    @as_json_option
    @handles_errors
    def command(bus_name: str, name: str, as_json: bool) -> None:
        with connection() as conn:
            info = catalog.set_rule_enabled(conn, bus_name, name, enabled)
        said(f"rule {bus_name}/{name} {verb}d (version {info.version})", as_json, info.to_json())


_rule_switch(True)
_rule_switch(False)


@rule.command("delete")
@rule_options
@as_json_option
@handles_errors
def rule_delete(bus_name: str, name: str, as_json: bool) -> None:
    """Delete a rule (refused while it has targets)."""
    with connection() as conn:
        catalog.delete_rule(conn, bus_name, name)
    said(f"rule {bus_name}/{name} deleted", as_json, {"bus": bus_name, "rule": name})


# --- targets ----------------------------------------------------------------------------------


def target_options(func):
    func = click.option("--name", required=True)(func)
    func = click.option("--rule", "rule_name", required=True)(func)
    return click.option("--bus", "bus_name", required=True)(func)


@target.command("list")
@click.option("--bus", "bus_name", default=None)
@click.option("--rule", "rule_name", default=None)
@as_json_option
@handles_errors
def target_list(bus_name: str | None, rule_name: str | None, as_json: bool) -> None:
    """List targets (of one bus or rule with --bus, --rule)."""
    with connection() as conn:
        items = catalog.list_targets(conn, bus_name, rule_name)
    columns = ("bus", "rule", "name", "url", "state", "version", "worker", "secret_set")
    show_list(items, as_json, "targets", columns)


@target.command("show")
@target_options
@as_json_option
@handles_errors
def target_show(bus_name: str, rule_name: str, name: str, as_json: bool) -> None:
    """Show one target (its URL redacted, its secret only as a fingerprint)."""
    with connection() as conn:
        info = catalog.get_target(conn, bus_name, rule_name, name)
    show(info, as_json, f"target {bus_name}/{rule_name}/{name}")


@target.command("update")
@target_options
@click.option("--url", default=None, help="A new URL (the target leaves its destination).")
@click.option("--destination", default=None, help="Send through this API destination.")
@click.option("--header", "headers", multiple=True, metavar="K:V", help="Replaces all headers.")
@click.option("--no-header", is_flag=True, help="Drop every header of the target's own.")
@tls_options
@click.option("--no-tls", is_flag=True, help="Drop the target's own TLS files.")
@click.option("--secret", default=None, help="A new secret, whsec_<base64>; '-' reads stdin.")
@click.option("--secret-file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--no-secret", is_flag=True, help="Stop signing (the secret is removed).")
@click.option(
    "--keep-old-secret",
    default=None,
    help="With a new secret: the old one also signs for this long (24h, 30m, 7d).",
)
@click.option("--max-attempts", type=int, default=None)
@click.option("--backoff-ms", type=int, default=None)
@click.option("--max-age-s", type=int, default=None)
@click.option("--timeout-ms", type=int, default=None)
@click.option("--batch-size", type=int, default=None)
@click.option("--concurrency", type=NumberOrAuto(), default=None, help="Sends in flight, or auto.")
@click.option("--ordered/--unordered", default=None)
@click.option(
    "--transform",
    type=click.Choice(catalog.TRANSFORM_KINDS, case_sensitive=False),
    default=None,
)
@click.option("--transform-spec", default=None, help="The transform's spec, as JSON.")
@click.option("--expected-version", type=int, default=None)
@as_json_option
@handles_errors
def target_update(
    bus_name: str,
    rule_name: str,
    name: str,
    secret: str | None,
    secret_file: str | None,
    no_secret: bool,
    keep_old_secret: str | None,
    transform: str | None,
    transform_spec: str | None,
    expected_version: int | None,
    as_json: bool,
    headers: tuple[str, ...],
    no_header: bool,
    no_tls: bool,
    concurrency: str | None,
    **policy,
) -> None:
    """Change a target: any option of ``target create``; running workers apply it within 2 s."""
    not_both({"--header": headers}, "--no-header", no_header)
    not_both({f"--{k.replace('_', '-')}": policy[k] for k in TLS_FIELDS}, "--no-tls", no_tls)
    changes = {k: v for k, v in policy.items() if v is not None}
    changes.update(concurrency_option(concurrency))
    if headers or no_header:
        changes["headers"] = tuple(pairs(headers, ":", "--header"))
    if no_tls:
        changes.update(client_cert_file=None, client_key_file=None, ca_file=None)
    secret = read_secret(secret, secret_file)
    if no_secret and secret is not None:
        fail("give a new secret or --no-secret, not both")
    if secret is not None or no_secret:
        changes["secret"] = secret
    if transform is not None:
        changes["transform_kind"] = transform.upper()
    if transform_spec is not None:
        try:
            changes["transform_spec"] = json.loads(transform_spec)
        except json.JSONDecodeError as exc:
            fail(f"--transform-spec is not valid JSON: {exc}")
        except RecursionError:  # the parser's own limit, far past the catalog's
            fail("--transform-spec is nested too deeply")
    keep = None if keep_old_secret is None else parse_duration("--keep-old-secret", keep_old_secret)
    with connection() as conn:
        info = catalog.update_target(
            conn,
            bus_name,
            rule_name,
            name,
            keep_old_secret=keep,
            expected_version=expected_version,
            **changes,
        )
    said(
        f"target {bus_name}/{rule_name}/{name} updated to version {info.version}",
        as_json,
        info.to_json(),
    )


@target.command("delete")
@target_options
@as_json_option
@handles_errors
def target_delete(bus_name: str, rule_name: str, name: str, as_json: bool) -> None:
    """Delete a target: its runner stops; its delivery and failure rows stay."""
    with connection() as conn:
        catalog.delete_target(conn, bus_name, rule_name, name)
    said(
        f"target {bus_name}/{rule_name}/{name} deleted",
        as_json,
        {"bus": bus_name, "rule": rule_name, "target": name},
    )


# --- workers ----------------------------------------------------------------------------------


@worker.command("list")
@as_json_option
@handles_errors
def worker_list(as_json: bool) -> None:
    """List workers."""
    with connection() as conn:
        items = catalog.list_workers(conn)
    columns = ("name", "enabled", "capacity", "runners", "host", "pid", "heartbeat_at")
    show_list(items, as_json, "workers", columns)


@worker.command("delete")
@click.argument("name")
@as_json_option
@handles_errors
def worker_delete(name: str, as_json: bool) -> None:
    """Delete worker NAME (refused while it holds runners: disable it first)."""
    with connection() as conn:
        catalog.delete_worker(conn, name)
    said(f"worker {name} deleted", as_json, {"worker": name})
