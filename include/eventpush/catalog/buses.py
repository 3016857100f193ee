"""Buses: creating, reading, listing and deleting them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import psycopg2
import psycopg2.errors

from eventpush import partitions, sources
from eventpush.catalog.common import (
    CatalogError,
    ConflictError,
    bus_row,
    check_description,
    check_name,
    iso,
    notify,
)
from eventpush.db import Connection, transaction

MAX_QUEUES = 1024
# Mirrored by the CHECK constraints of migration 0002_bus_account_region.
ACCOUNT_RE = re.compile(r"^[0-9]{12}$")
REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]{1,2}$")


@dataclass(frozen=True)
class BusInfo:
    name: str
    queues: int
    description: str
    account: str
    region: str
    source_url: str | None  # redacted
    rules: int
    created_at: str | None
    retention: str  # e.g. "7d"; the configured default when the bus has none of its own
    retention_default: bool  # True: the bus follows the configured default
    events_kept_since: str | None  # events before this were dropped by retention

    def to_json(self) -> dict:
        return asdict(self)


def create_bus(
    conn: Connection,
    name: str,
    queues: int,
    description: str = "",
    *,
    account: str | None = None,
    region: str | None = None,
    source: str | None = None,
    retention: str | None = None,
) -> int:
    """A bus with ``queues`` queues, and its partition of ``bus_event``. With ``source`` (a
    URL such as ``nats://HOST:PORT``) its events live there instead (eventpush.sources): the
    source's store for the bus is made or adopted before the bus row commits.

    ``account`` and ``region`` are what the input transformer reports for events that carry
    none (``<aws.events.event>``, ``<aws.events.rule-arn>``); defaults in rules/transforms.py.
    ``retention`` (``7d``, ``12h``, ``2w``): how long its events are kept; without it, the
    configured default (EVENTPUSH_RETENTION). A NATS stream gets it as its ``max_age``.
    """

    from eventpush.rules.transforms import DEFAULT_ACCOUNT, DEFAULT_REGION

    check_name("bus", name)
    if not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
        raise CatalogError(f"--queues must be between 1 and {MAX_QUEUES}, got {queues}")
    account = DEFAULT_ACCOUNT if account is None else account
    region = DEFAULT_REGION if region is None else region
    if not isinstance(account, str) or not ACCOUNT_RE.fullmatch(account):
        raise CatalogError(f"--account must be a 12-digit AWS account id, got {account!r}")
    if not isinstance(region, str) or not REGION_RE.fullmatch(region):
        raise CatalogError(f"--region must look like an AWS region (us-east-1), got {region!r}")
    check_description(f"bus {name!r}", description)
    retention_s = _retention(retention)
    kind = None
    if source is not None:
        kind = sources.kind_for(source)
        source = kind.check(source)
    try:
        with transaction(conn) as cur:
            cur.execute(
                "INSERT INTO event_bus (name, queues, description, account, region, source_url, "
                "retention_s) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
                (name, queues, description, account, region, source, retention_s),
            )
            bus_id = cur.fetchone()[0]
            cur.execute(
                "INSERT INTO event_bus_queue (bus_id, queue_id) "
                "SELECT %s, q FROM generate_series(0, %s - 1) AS q",
                (bus_id, queues),
            )
            partitions.create_bus_partition(cur, bus_id)
            if kind is not None:
                from eventpush.sources import Bus, write_heads

                bus = Bus(bus_id, name, queues, source, retention_s=effective(retention_s))
                kind.create(conn, bus)
                heads = kind.heads(conn, bus)
                write_heads(cur, bus_id, heads)  # an adopted stream's ends
                if _store_of_a_deleted_bus(cur, name, kind.scheme):
                    _begin_at(cur, bus_id, heads)
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"bus {name!r} already exists") from None
    return bus_id


def _store_of_a_deleted_bus(cur, name: str, scheme: str) -> bool:
    """Whether a deleted bus of this name had a source of the same kind: its store (a
    JetStream stream is named after the bus) was kept when it was deleted, since others may
    own or read it, and the new bus finds it. Any server of the kind counts: the same one
    under another spelling of its address would otherwise hand the old events on."""
    cur.execute(
        "SELECT source_url FROM event_bus WHERE name = %s AND deleted_at IS NOT NULL "
        "AND source_url IS NOT NULL",
        (name,),
    )
    return any(sources.source_scheme(url) == scheme for (url,) in cur.fetchall())


def _begin_at(cur, bus_id: int, heads: dict[int, int]) -> None:
    """The bus begins at its store's end as it is now (``first_offset``): what lies below is
    a deleted bus's, which an archive replay, an audit from the start and the archive's count
    must not take as this bus's events. Its runners start at its end anyway."""
    cur.execute(
        "UPDATE event_bus_queue q SET first_offset = v.head "
        "FROM unnest(%s::int[], %s::bigint[]) AS v(queue_id, head) "
        "WHERE q.bus_id = %s AND q.queue_id = v.queue_id",
        (list(heads), list(heads.values()), bus_id),
    )


BUS_SQL = """
SELECT b.name, b.queues, b.description, b.account, b.region, b.source_url,
       (SELECT count(*) FROM event_rule ru WHERE ru.bus_id = b.id AND ru.deleted_at IS NULL),
       b.ctime, b.retention_s, b.events_kept_since
FROM event_bus b WHERE b.deleted_at IS NULL
"""


def _bus_info(row) -> BusInfo:
    from eventpush.config import format_retention, redact_url

    name, queues, description, account, region, source, rules, ctime, retention_s, kept = row
    source = None if source is None else redact_url(source)
    return BusInfo(
        name,
        queues,
        description,
        account,
        region,
        source,
        rules,
        iso(ctime),
        format_retention(effective(retention_s)),
        retention_s is None,
        iso(kept),
    )


def _retention(text: str | None) -> int | None:
    from eventpush.config import retention_seconds

    if text is None:
        return None
    try:
        return retention_seconds(text, "--retention")
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


def effective(retention_s: int | None) -> int:
    """A bus's retention in seconds: its own, else the configured default."""
    from eventpush.config import default_retention_s

    return default_retention_s() if retention_s is None else retention_s


def update_bus_retention(conn: Connection, name: str, retention: str | None) -> BusInfo:
    """Set the bus's retention (``None``: follow the configured default again). A NATS bus's
    stream gets the new ``max_age`` before the row commits; the next maintenance run drops
    what the new retention no longer keeps."""
    retention_s = _retention(retention)
    with transaction(conn) as cur:
        bus_id, _ = bus_row(cur, name)
        cur.execute("SELECT queues, source_url FROM event_bus WHERE id = %s FOR UPDATE", (bus_id,))
        queues, source = cur.fetchone()
        cur.execute("UPDATE event_bus SET retention_s = %s WHERE id = %s", (retention_s, bus_id))
        if source is not None:
            from eventpush.sources import Bus

            kind = sources.kind_for(source)
            if kind.set_retention is not None:
                kind.set_retention(conn, Bus(bus_id, name, queues, source), effective(retention_s))
        notify(cur, bus_id)
    return get_bus(conn, name)


def get_bus(conn: Connection, name: str) -> BusInfo:
    with transaction(conn) as cur:
        bus_row(cur, name)
        cur.execute(BUS_SQL + " AND b.name = %s", (name,))
        return _bus_info(cur.fetchone())


def list_buses(conn: Connection, *, name_prefix: str | None = None) -> list[BusInfo]:
    with transaction(conn) as cur:
        cur.execute(BUS_SQL + " AND starts_with(b.name, %s) ORDER BY b.name", (name_prefix or "",))
        return [_bus_info(row) for row in cur.fetchall()]


def delete_bus(conn: Connection, name: str, *, force: bool = False) -> dict:
    """Delete a bus without rules; with ``force``, its rules and targets too (their runners
    stop, their books stay). Returns how many rules and targets went with it. A bus on a
    broker keeps its store (others may own or read it); a new bus of its name begins at the
    store's end (``create_bus``)."""
    from eventpush.catalog.targets import mark_targets_deleted

    with transaction(conn) as cur:
        bus_id, _ = bus_row(cur, name)
        cur.execute("SELECT id FROM event_bus WHERE id = %s FOR UPDATE", (bus_id,))
        cur.execute(
            "SELECT id FROM event_rule WHERE bus_id = %s AND deleted_at IS NULL FOR UPDATE",
            (bus_id,),
        )
        rule_ids = [row[0] for row in cur.fetchall()]
        if rule_ids and not force:
            raise ConflictError(
                f"bus {name!r} has {len(rule_ids)} rules: delete them first, or use --force"
            )
        targets = mark_targets_deleted(cur, "t.rule_id = ANY(%s)", (rule_ids,))
        cur.execute("UPDATE event_rule SET deleted_at = now() WHERE id = ANY(%s)", (rule_ids,))
        cur.execute("UPDATE event_bus SET deleted_at = now() WHERE id = %s", (bus_id,))
        notify(cur, bus_id)
    return {"rules": len(rule_ids), "targets": targets}
