"""Buses, rules, targets, runners and workers: creating them and assigning runners.

Every function takes an open psycopg2 connection and does its work in one transaction, so a
refused input leaves nothing half-written. Errors are ``CatalogError`` with a one-line message.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, replace

import psycopg2
import psycopg2.errors
import psycopg2.extras
from psycopg2 import sql

from eventpush import sources
from eventpush.addresses import InvalidTargetUrlError
from eventpush.db import Connection, transaction
from eventpush.errors import CatalogError
from eventpush.policy import DEFAULTS, LIMITS, defaults_for
from eventpush.sinks import validate_url

# fullmatch, never match with "$": "$" also matches before a trailing newline ("bus\n").
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TRANSFORM_KINDS = ("ORIGINAL", "CONSTANT", "JSONPATH", "TEMPLATE")
MAX_QUEUES = 1024
# Mirrored by the CHECK constraints of migration 0002_bus_account_region.
ACCOUNT_RE = re.compile(r"^[0-9]{12}$")
REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]{1,2}$")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise CatalogError(
            f"{kind} name {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def runner_name(bus: str, rule: str, target: str) -> str:
    return f"{bus}/{rule}/{target}"


def _bus_id(cur, bus: str) -> tuple[int, int]:
    cur.execute("SELECT id, queues FROM event_bus WHERE name = %s", (bus,))
    row = cur.fetchone()
    if row is None:
        raise CatalogError(f"unknown bus {bus!r}")
    return row


def create_bus(
    conn: Connection,
    name: str,
    queues: int,
    description: str = "",
    *,
    account: str | None = None,
    region: str | None = None,
    source: str | None = None,
) -> int:
    """A bus with ``queues`` queues, and its partition of ``bus_event``. With ``source`` (a
    URL such as ``nats://HOST:PORT``) its events live there instead (eventpush.sources): the
    source's store for the bus is made or adopted before the bus row commits.

    ``account`` and ``region`` are what the input transformer reports for events that carry
    none (``<aws.events.event>``, ``<aws.events.rule-arn>``); defaults in rules/transforms.py.
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
    kind = None
    if source is not None:
        kind = sources.kind_for(source)
        source = kind.check(source)
    try:
        with transaction(conn) as cur:
            cur.execute(
                "INSERT INTO event_bus (name, queues, description, account, region, source_url) "
                "VALUES (%s, %s, %s, %s, %s, %s) RETURNING id",
                (name, queues, description, account, region, source),
            )
            bus_id = cur.fetchone()[0]
            cur.execute(
                "INSERT INTO event_bus_queue (bus_id, queue_id) "
                "SELECT %s, q FROM generate_series(0, %s - 1) AS q",
                (bus_id, queues),
            )
            cur.execute(
                sql.SQL("CREATE TABLE {} PARTITION OF bus_event FOR VALUES IN ({})").format(
                    sql.Identifier(f"bus_event_{bus_id}"), sql.Literal(bus_id)
                )
            )
            if kind is not None:
                from eventpush.sources import Bus, write_heads

                bus = Bus(bus_id, name, queues, source)
                kind.create(conn, bus)
                write_heads(cur, bus_id, kind.heads(conn, bus))  # an adopted stream's ends
    except psycopg2.errors.UniqueViolation:
        raise CatalogError(f"bus {name!r} already exists") from None
    return bus_id


def create_rule(
    conn: Connection, bus: str, name: str, pattern: str | dict, description: str = ""
) -> int:
    """A rule on ``bus``; the pattern is compiled first and refused when invalid."""
    from eventpush.rules.patterns import InvalidPatternError, compile_pattern

    check_name("rule", name)
    if isinstance(pattern, str):
        try:
            pattern = json.loads(pattern)
        except json.JSONDecodeError as exc:
            raise CatalogError(f"rule {name!r}: pattern is not valid JSON: {exc}") from None
    try:
        compile_pattern(pattern)
    except InvalidPatternError as exc:
        raise CatalogError(f"rule {name!r}: invalid pattern: {exc}") from None
    try:
        with transaction(conn) as cur:
            bus_id, _ = _bus_id(cur, bus)
            cur.execute(
                "INSERT INTO event_rule (bus_id, name, pattern, description) "
                "VALUES (%s, %s, %s, %s) RETURNING id",
                (bus_id, name, json.dumps(pattern), description),
            )
            return cur.fetchone()[0]
    except psycopg2.errors.UniqueViolation:
        raise CatalogError(f"rule {name!r} already exists on bus {bus!r}") from None


def check_secret(secret: str) -> str:
    """A Standard Webhooks secret: ``whsec_`` followed by base64 of 24 to 64 random bytes."""
    if not secret.startswith("whsec_"):
        raise CatalogError("--secret must be in Standard Webhooks form: whsec_<base64>")
    try:
        raw = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        raise CatalogError("--secret is not valid base64 after the whsec_ prefix") from None
    if not 24 <= len(raw) <= 64:
        raise CatalogError(f"--secret must decode to 24-64 bytes, got {len(raw)}")
    return secret


@dataclass(frozen=True)
class TargetSpec:
    """What a target is: where it goes and how it is pushed."""

    name: str
    url: str
    secret: str | None = None
    transform_kind: str = "ORIGINAL"
    transform_spec: object = None
    max_attempts: int = DEFAULTS.max_attempts
    backoff_ms: int = DEFAULTS.backoff_ms
    max_age_s: int = DEFAULTS.max_age_s
    timeout_ms: int = DEFAULTS.timeout_ms
    batch_size: int | None = None  # None: the default of the URL's kind (policy.defaults_for)
    concurrency: int = DEFAULTS.concurrency
    ordered: bool = False

    def resolved(self) -> TargetSpec:
        """This spec with the fields left to its kind's defaults filled in."""
        if self.batch_size is not None:
            return self
        return replace(self, batch_size=defaults_for(self.url).batch_size)


def check_target(spec: TargetSpec) -> None:
    spec = spec.resolved()
    check_name("target", spec.name)
    try:
        validate_url(spec.url)
    except InvalidTargetUrlError as exc:
        raise CatalogError(str(exc)) from None
    if spec.secret is not None:
        check_secret(spec.secret)
    for field, (low, high) in LIMITS.items():
        value = getattr(spec, field)
        if not isinstance(value, int) or not low <= value <= high:
            option = "--" + field.replace("_", "-")
            raise CatalogError(f"{option} must be between {low} and {high}, got {value}")
    kind = spec.transform_kind.upper()
    if kind not in TRANSFORM_KINDS:
        raise CatalogError(f"transform must be one of {', '.join(TRANSFORM_KINDS)}, got {kind}")
    from eventpush.rules.transforms import InvalidTransformError, compile_transform

    try:
        compile_transform(kind, spec.transform_spec)
    except InvalidTransformError as exc:
        raise CatalogError(f"target {spec.name!r}: invalid transform: {exc}") from None


def _record_source_heads(conn: Connection, bus: str) -> None:
    """A bus on a broker: its heads as they are now, so a new runner starts at its end."""
    found = sources.bus_named(conn, bus)
    if found.source_url is not None:
        try:
            heads = sources.kind_for(found.source_url).heads(conn, found)
        except Exception as exc:
            from eventpush.config import redact

            why = redact(f"bus {bus}: its source did not answer: {exc}", found.source_url)
            raise CatalogError(why.splitlines()[0]) from None
        sources.record_heads(conn, found.id, heads)


def create_target(conn: Connection, bus: str, rule: str, spec: TargetSpec) -> str:
    """A target on ``bus``/``rule`` and its runner, which starts at the bus's current end.

    Returns the runner's name. New runners see the events published after their creation,
    as a new EventBridge rule does; an archive replay covers what came before.
    """
    spec = spec.resolved()
    check_target(spec)
    name = runner_name(bus, rule, spec.name)
    _record_source_heads(conn, bus)
    try:
        with transaction(conn) as cur:
            bus_id, _ = _bus_id(cur, bus)
            cur.execute("SELECT source_url FROM event_bus WHERE id = %s", (bus_id,))
            broker = sources.broker_name(cur.fetchone()[0])
            cur.execute("SELECT id FROM event_rule WHERE bus_id = %s AND name = %s", (bus_id, rule))
            row = cur.fetchone()
            if row is None:
                raise CatalogError(f"unknown rule {rule!r} on bus {bus!r}")
            cur.execute(
                "INSERT INTO event_target (rule_id, name, url, secret, transform_kind, "
                "transform_spec, max_attempts, backoff_ms, max_age_s, timeout_ms, batch_size, "
                "concurrency, ordered) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "RETURNING id",
                (
                    row[0],
                    spec.name,
                    spec.url,
                    spec.secret,
                    spec.transform_kind.upper(),
                    None if spec.transform_spec is None else json.dumps(spec.transform_spec),
                    spec.max_attempts,
                    spec.backoff_ms,
                    spec.max_age_s,
                    spec.timeout_ms,
                    spec.batch_size,
                    spec.concurrency,
                    spec.ordered,
                ),
            )
            target_id = cur.fetchone()[0]
            cur.execute(
                "INSERT INTO event_target_runner (target_id, name) VALUES (%s, %s) RETURNING id",
                (target_id, name),
            )
            runner_id = cur.fetchone()[0]
            # Read the queue ends under a share lock so no publish slips between them.
            cur.execute(
                "INSERT INTO event_push_offset (runner_id, consumer_group, topic_name, "
                'broker_name, queue_id, "offset", start_offset, pulled) '
                "SELECT %s, %s, %s, %s, queue_id, next_offset, next_offset, next_offset "
                "FROM event_bus_queue WHERE bus_id = %s ORDER BY queue_id FOR SHARE",
                (runner_id, name, bus, broker, bus_id),
            )
    except psycopg2.errors.UniqueViolation:
        raise CatalogError(f"target {spec.name!r} already exists on rule {bus}/{rule}") from None
    return name


def create_worker(conn: Connection, name: str, capacity: int = 100) -> int:
    check_name("worker", name)
    if not isinstance(capacity, int) or not 1 <= capacity <= 1_000_000:
        raise CatalogError(f"--capacity must be between 1 and 1000000, got {capacity}")
    try:
        with transaction(conn) as cur:
            cur.execute(
                "INSERT INTO event_push_worker (name, capacity) VALUES (%s, %s) RETURNING id",
                (name, capacity),
            )
            return cur.fetchone()[0]
    except psycopg2.errors.UniqueViolation:
        raise CatalogError(f"worker {name!r} already exists") from None


def set_worker_enabled(conn: Connection, name: str, enabled: bool) -> int:
    """Enable or disable a worker. Disabling hands its runners to the other enabled workers
    (evenly, as ``assign`` does); returns how many runners moved."""
    with transaction(conn) as cur:
        cur.execute(
            "UPDATE event_push_worker SET enabled = %s WHERE name = %s RETURNING id",
            (enabled, name),
        )
        if cur.fetchone() is None:
            raise CatalogError(f"unknown worker {name!r}")
        return _assign(cur, origin=f"worker {'enable' if enabled else 'disable'} {name}")


def assign(conn: Connection) -> int:
    """Give unassigned runners (and those of disabled workers) to enabled workers, evenly
    relative to capacity, without moving the others. Returns how many runners it placed."""
    with transaction(conn) as cur:
        return _assign(cur, origin="assign")


def _assign(cur, origin: str) -> int:
    # Serialises with rebalancing and other assigns; readers are not blocked.
    cur.execute("LOCK TABLE event_target_runner IN SHARE ROW EXCLUSIVE MODE")
    cur.execute(
        "SELECT w.id, w.capacity, count(r.id) FROM event_push_worker w "
        "LEFT JOIN event_target_runner r ON r.worker_id = w.id "
        "WHERE w.enabled GROUP BY w.id, w.capacity ORDER BY w.id"
    )
    workers = {wid: [capacity, count] for wid, capacity, count in cur.fetchall()}
    cur.execute(
        "SELECT r.id FROM event_target_runner r "
        "LEFT JOIN event_push_worker w ON w.id = r.worker_id "
        "WHERE r.worker_id IS NULL OR NOT w.enabled ORDER BY r.id"
    )
    todo = [row[0] for row in cur.fetchall()]
    if not todo:
        return 0
    if not workers:
        cur.execute(
            "UPDATE event_target_runner SET worker_id = NULL WHERE id = ANY(%s)",
            (todo,),
        )
        return 0
    placement: dict[int, int] = {}
    for runner_id in todo:
        wid = min(workers, key=lambda w: ((workers[w][1] + 1) / workers[w][0], w))
        workers[wid][1] += 1
        placement[runner_id] = wid
    cur.execute(
        "INSERT INTO event_assignment (origin, moves) VALUES (%s, %s) RETURNING generation",
        (origin, len(placement)),
    )
    generation = cur.fetchone()[0]
    psycopg2.extras.execute_values(
        cur,
        "UPDATE event_target_runner r SET worker_id = v.worker_id, generation = v.generation "
        "FROM (VALUES %s) AS v(id, worker_id, generation) WHERE r.id = v.id",
        [(rid, wid, generation) for rid, wid in placement.items()],
    )
    return len(placement)
