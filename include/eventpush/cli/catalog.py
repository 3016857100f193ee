"""Catalog commands: ``db migrate``, ``bus create``, ``rule create``, ``target create``,
``assign``."""

from __future__ import annotations

import json

import click

from eventpush import catalog
from eventpush.cli.common import (
    NumberOrAuto,
    concurrency_option,
    err,
    fail,
    handles_errors,
    out,
    pairs,
    print_json,
    read_text_file,
    tls_options,
)
from eventpush.config import redact_url
from eventpush.db import connection
from eventpush.policy import DEFAULTS, SCHEME_DEFAULTS


@click.group()
def db() -> None:
    """The database schema."""


@db.command("migrate")
@handles_errors
def db_migrate() -> None:
    """Create or upgrade the schema (idempotent)."""
    import logging

    # Deferred: alembic is loaded only by a migration.
    from eventpush.schema import migrate

    # A migration waiting for a lock says on stderr which sessions hold it (migration_waits).
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    before, after = migrate()
    if before == after:
        out.print(f"schema is up to date (revision {after})")
    else:
        out.print(f"schema migrated from {before or 'empty'} to revision {after}")
    with connection() as conn:
        if _ensure_default_bus(conn):
            out.print(f"bus {DEFAULT_BUS} created (where API events that name no bus go)")


@db.command("maintain")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def db_maintain(as_json: bool) -> None:
    """Make time partitions ahead and drop those behind each bus's retention; delete failure
    rows past theirs (what the eventpush_retention DAG runs daily)."""
    # Deferred: partition maintenance is loaded only by this command.
    from eventpush.partitions import maintain

    with connection() as conn:  # a missed day's move told as it is made, on stderr
        report = maintain(
            conn, progress=lambda line: err.print(line, markup=False, highlight=False)
        )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    out.print(
        f"{len(report.created)} partitions made, {len(report.dropped)} dropped, "
        f"{report.failures_deleted} failure rows deleted"
    )
    if report.moved:
        out.print(
            f"{sum(report.moved.values()):,} rows moved from default partitions into "
            f"{len(report.moved)} missed days"
        )
    for name in report.dropped:
        out.print(f"dropped {name}")
    for name in report.postponed:
        out.print(f"{name} left for the next run: a reader held it through every lock try")


DEFAULT_BUS = "default"  # as on AWS: PutEvents entries without EventBusName go there


def _ensure_default_bus(conn) -> bool:
    """Make the bus ``default`` unless it exists; True when it was made."""
    try:
        catalog.create_bus(conn, DEFAULT_BUS, 4, "events sent to the API without a bus")
    except catalog.ConflictError:
        return False
    return True


# --- bus, rule, target ------------------------------------------------------------------------


@click.group()
def bus() -> None:
    """Event buses."""


@bus.command("create")
@click.argument("name")
@click.option("--queues", type=int, default=4, show_default=True, help="Number of queues.")
@click.option("--description", default="")
@click.option(
    "--account",
    default=None,
    help="AWS account id the input transformer reports for events without one "
    "[default: 000000000000].",
)
@click.option(
    "--region",
    default=None,
    help="AWS region the input transformer reports for events without one [default: us-east-1].",
)
@click.option(
    "--source",
    default=None,
    help="Where the events live: nats://HOST:PORT for the JetStream stream NAME (made or "
    "adopted) [default: the built-in PostgreSQL store].",
)
@click.option(
    "--retention",
    default=None,
    help="How long events are kept (12h, 7d, 2w; whole days are dropped at once); a new "
    "JetStream stream's max_age [default: EVENTPUSH_RETENTION, else 7d].",
)
@handles_errors
def bus_create(
    name: str,
    queues: int,
    description: str,
    account: str | None,
    region: str | None,
    source: str | None,
    retention: str | None,
) -> None:
    """Create bus NAME with --queues queues."""
    with connection() as conn:
        catalog.create_bus(
            conn,
            name,
            queues,
            description,
            account=account,
            region=region,
            source=source,
            retention=retention,
        )
    where = f" on {source.strip()}" if source else ""
    out.print(f"bus {name} created with {queues} queues{where}")


@click.group()
def rule() -> None:
    """Rules: EventBridge event patterns on a bus."""


@rule.command("create")
@click.option("--bus", "bus_name", required=True)
@click.option("--name", required=True)
@click.option("--pattern", required=True, help="The event pattern, as JSON.")
@click.option("--description", default="")
@handles_errors
def rule_create(bus_name: str, name: str, pattern: str, description: str) -> None:
    """Create a rule; an invalid pattern is refused."""
    with connection() as conn:
        catalog.create_rule(conn, bus_name, name, pattern, description)
    out.print(f"rule {bus_name}/{name} created")


@click.group()
def target() -> None:
    """Targets: where a rule's matches are pushed."""


def read_secret(secret: str | None, secret_file: str | None) -> str | None:
    """The secret from --secret, stdin (``--secret -``) or --secret-file; one line, the
    surrounding whitespace (a file's final newline) dropped."""
    if secret is not None and secret_file is not None:
        fail("give --secret or --secret-file, not both")
    if secret == "-":
        secret = click.get_text_stream("stdin").read()
    elif secret_file is not None:
        secret = read_text_file(secret_file, "--secret-file")
    else:
        return secret
    secret = secret.strip()
    if not secret:
        fail(
            "the secret read from "
            + ("stdin" if secret_file is None else "--secret-file")
            + " is empty"
        )
    return secret


@target.command("create")
@click.option("--bus", "bus_name", required=True)
@click.option("--rule", "rule_name", required=True)
@click.option("--name", required=True)
@click.option(
    "--url",
    default=None,
    help="http or https endpoint, nats://HOST:PORT/SUBJECT (a JetStream subject), or a scheme "
    "a sink plug-in adds.",
)
@click.option(
    "--destination",
    default=None,
    help="Send through this API destination (its URL, method, connection, rate limit) "
    "instead of --url.",
)
@click.option("--header", "headers", multiple=True, metavar="K:V", help="Header, repeatable.")
@click.option(
    "--secret",
    default=None,
    help="Standard Webhooks secret, whsec_<base64>; '-' reads it from stdin (kept out of "
    "shell history and ps).",
)
@click.option(
    "--secret-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Read the secret from this file instead.",
)
@click.option("--max-attempts", type=int, default=DEFAULTS.max_attempts, show_default=True)
@click.option("--backoff-ms", type=int, default=DEFAULTS.backoff_ms, show_default=True)
@click.option("--max-age-s", type=int, default=DEFAULTS.max_age_s, show_default=True)
@click.option("--timeout-ms", type=int, default=DEFAULTS.timeout_ms, show_default=True)
@click.option(
    "--batch-size",
    type=int,
    default=None,
    help=f"Records per send [default: {DEFAULTS.batch_size}; "
    f"{SCHEME_DEFAULTS['nats'].batch_size} for nats:// targets, each record still a message]",
)
@click.option(
    "--concurrency",
    type=NumberOrAuto(),
    default=DEFAULTS.concurrency,
    show_default=True,
    help="Sends in flight, or auto: the limit follows the destination's answers.",
)
@click.option("--ordered", is_flag=True, help="Deliver in order per queue.")
@click.option(
    "--transform",
    type=click.Choice(catalog.TRANSFORM_KINDS, case_sensitive=False),
    default="ORIGINAL",
    show_default=True,
)
@click.option("--transform-spec", default=None, help="The transform's spec, as JSON.")
@tls_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def target_create(
    bus_name: str,
    rule_name: str,
    name: str,
    url: str | None,
    destination: str | None,
    headers: tuple[str, ...],
    secret: str | None,
    secret_file: str | None,
    max_attempts: int,
    backoff_ms: int,
    max_age_s: int,
    timeout_ms: int,
    batch_size: int | None,
    concurrency: int | str,
    ordered: bool,
    transform: str,
    transform_spec: str | None,
    as_json: bool,
    **tls,
) -> None:
    """Create a target on a rule, and its runner (--url or --destination)."""
    if (url is None) == (destination is None):
        fail("give --url or --destination (one of them)")
    secret = read_secret(secret, secret_file)
    spec_value = None
    if transform_spec is not None:
        try:
            spec_value = json.loads(transform_spec)
        except json.JSONDecodeError as exc:
            fail(f"--transform-spec is not valid JSON: {exc}")
        except RecursionError:  # the parser's own limit, far past the catalog's
            fail("--transform-spec is nested too deeply")
    spec = catalog.TargetSpec(
        name=name,
        url=url or "",
        destination=destination,
        headers=tuple(pairs(headers, ":", "--header")),
        **concurrency_option(concurrency),
        **tls,
        secret=secret,
        transform_kind=transform.upper(),
        transform_spec=spec_value,
        max_attempts=max_attempts,
        backoff_ms=backoff_ms,
        max_age_s=max_age_s,
        timeout_ms=timeout_ms,
        batch_size=batch_size,
        ordered=ordered,
    )
    with connection() as conn:
        runner = catalog.create_target(conn, bus_name, rule_name, spec)
        info = catalog.get_target(conn, bus_name, rule_name, name)
    if as_json:
        print_json(info.to_json())
        return
    via = f" (destination {destination})" if destination else ""
    message = f"target created; runner {runner} -> {redact_url(info.url)}{via}"
    out.print(message, markup=False, soft_wrap=True)


@click.command("assign")
@handles_errors
def assign_cmd() -> None:
    """Give unassigned runners to workers, evenly, without moving assigned ones."""
    with connection() as conn:
        placed = catalog.assign(conn)
    out.print(f"{placed} runners assigned")
