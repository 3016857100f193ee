"""Targets and their runners: creating, reading, changing and deleting them.

A target's secret is stored sealed (``eventpush.sealed``); reads give only whether one is set
and its fingerprint. A change moves the target's ``version`` on; a delete marks the target and
its runner (``deleted_at``) and takes the runner from its worker, which stops it at its next
re-read: its delivery and failure rows stay, keyed by the runner's id, so a new target of the
same name (a new runner id) never mixes with them.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from dataclasses import asdict, dataclass, field, fields, replace

import psycopg2
import psycopg2.errors

from eventpush import sealed, sources
from eventpush.addresses import InvalidTargetUrlError
from eventpush.catalog.common import (
    CatalogError,
    ConflictError,
    NotFoundError,
    bus_row,
    check_name,
    check_version,
    iso,
    live_id,
    notify,
    rule_row,
    runner_name,
)
from eventpush.catalog.destinations import check_tls_files, destination_row
from eventpush.db import Connection, transaction
from eventpush.policy import LIMITS, POLICY_FIELDS, TargetPolicy, defaults_for
from eventpush.rules.parse import MAX_JSON_DEPTH, nested_deeper_than
from eventpush.sinks import validate_url
from eventpush.sinks.headers import HeaderError, check_headers

TRANSFORM_KINDS = ("ORIGINAL", "CONSTANT", "JSONPATH", "TEMPLATE")
MAX_KEEP_OLD_SECRET = dt.timedelta(days=30)


def check_secret(secret: str) -> str:
    """A Standard Webhooks secret: ``whsec_`` followed by base64 of 24 to 64 random bytes."""
    if not isinstance(secret, str) or not secret.startswith("whsec_"):
        raise CatalogError("--secret must be in Standard Webhooks form: whsec_<base64>")
    try:
        raw = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        raise CatalogError("--secret is not valid base64 after the whsec_ prefix") from None
    if not 24 <= len(raw) <= 64:
        raise CatalogError(f"--secret must decode to 24-64 bytes, got {len(raw)}")
    return secret


@dataclass(frozen=True)
class TargetSpec(TargetPolicy):
    """What a target is: where it goes and how it is pushed (the retry and flow settings
    are :class:`~eventpush.policy.TargetPolicy`'s, keyword-only)."""

    name: str
    url: str
    secret: str | None = None
    transform_kind: str = "ORIGINAL"
    transform_spec: object = None
    # None: the default of the URL's kind (policy.defaults_for), filled in by ``resolved``.
    batch_size: int | None = field(default=None, kw_only=True)
    # Issue 32: send through an API destination (its URL, method, connection, rate limit and
    # TLS files; ``url`` is then left empty and filled from it), headers of the target's own,
    # adaptive concurrency, and TLS files of the target's own (over the destination's).
    destination: str | None = None
    headers: tuple = ()
    concurrency_auto: bool = False
    client_cert_file: str | None = None
    client_key_file: str | None = None
    ca_file: str | None = None

    def resolved(self) -> TargetSpec:
        """This spec with the fields left to its kind's defaults filled in."""
        if self.batch_size is not None:
            return self
        return replace(self, batch_size=defaults_for(self.url or "").batch_size)


SPEC_FIELDS = tuple(f.name for f in fields(TargetSpec))
_POLICY_COLUMNS = ", ".join(POLICY_FIELDS)  # event_target's columns are named as the fields


def check_target(spec: TargetSpec) -> None:
    spec = spec.resolved()
    check_name("target", spec.name)
    try:
        validate_url(spec.url)
    except InvalidTargetUrlError as exc:
        raise CatalogError(str(exc)) from None
    where = f"target {spec.name!r}"
    http = spec.url.strip().lower().startswith(("http://", "https://"))
    tls = (spec.client_cert_file, spec.client_key_file, spec.ca_file)
    if (spec.headers or any(tls)) and not http:
        raise CatalogError(f"{where}: --header and TLS files apply to http and https targets only")
    try:
        check_headers(spec.headers, where)
    except HeaderError as exc:
        raise CatalogError(str(exc)) from None
    check_tls_files(where, *tls)
    if not isinstance(spec.concurrency_auto, bool):
        raise CatalogError(f"{where}: concurrency_auto must be true or false")
    if spec.secret is not None:
        check_secret(spec.secret)
    for name, (low, high) in LIMITS.items():
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            option = "--" + name.replace("_", "-")
            raise CatalogError(f"{option} must be between {low} and {high}, got {value}")
    if not isinstance(spec.ordered, bool):
        raise CatalogError(f"ordered must be true or false, got {spec.ordered!r}")
    kind = str(spec.transform_kind).upper()
    if kind not in TRANSFORM_KINDS:
        raise CatalogError(f"transform must be one of {', '.join(TRANSFORM_KINDS)}, got {kind}")
    from eventpush.rules.transforms import InvalidTransformError, compile_transform

    if nested_deeper_than(spec.transform_spec):
        raise CatalogError(
            f"target {spec.name!r}: --transform-spec is nested more than {MAX_JSON_DEPTH} "
            "levels deep"
        )
    try:  # stored as JSON, which has no NaN or Infinity (PostgreSQL refuses the row)
        json.dumps(spec.transform_spec, allow_nan=False)
    except ValueError:
        raise CatalogError(
            f"target {spec.name!r}: --transform-spec holds a number that is not finite "
            "(NaN, Infinity or beyond 1e308)"
        ) from None
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
    if spec.destination is not None:
        if spec.url:
            raise CatalogError(f"target {spec.name!r}: give --url or --destination, not both")
        with transaction(conn) as cur:
            spec = replace(spec, url=destination_row(cur, spec.destination)[1])
    spec = spec.resolved()
    check_target(spec)
    name = runner_name(bus, rule, spec.name)
    _record_source_heads(conn, bus)
    secret = None if spec.secret is None else sealed.seal(spec.secret)
    try:
        with transaction(conn) as cur:
            rule_id, bus_id = rule_row(cur, bus, rule)
            cur.execute("SELECT source_url FROM event_bus WHERE id = %s", (bus_id,))
            broker = sources.broker_name(cur.fetchone()[0])
            destination_id, url = None, spec.url
            if spec.destination is not None:  # its URL as it is now, held until commit
                destination_id, url = destination_row(cur, spec.destination, "share")
            cur.execute(
                "INSERT INTO event_target (rule_id, name, url, secret, transform_kind, "
                f"transform_spec, {_POLICY_COLUMNS}, destination_id, headers, "
                "concurrency_auto, client_cert_file, client_key_file, ca_file) VALUES "
                f"({', '.join(['%s'] * (12 + len(POLICY_FIELDS)))}) RETURNING id",
                (
                    rule_id,
                    spec.name,
                    url,
                    secret,
                    spec.transform_kind.upper(),
                    None if spec.transform_spec is None else json.dumps(spec.transform_spec),
                    *(getattr(spec, f) for f in POLICY_FIELDS),
                    destination_id,
                    _headers_json(spec.headers),
                    spec.concurrency_auto,
                    spec.client_cert_file,
                    spec.client_key_file,
                    spec.ca_file,
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
            # Its first versions, from where it starts (push/versions.py records the next).
            cur.execute(
                "INSERT INTO event_runner_version (runner_id, queue_id, from_offset, "
                "rule_version, target_version, state, pattern) "
                "SELECT o.runner_id, o.queue_id, o.start_offset, ru.version, 1, ru.state, "
                "ru.pattern FROM event_push_offset o, event_rule ru "
                "WHERE o.runner_id = %s AND ru.id = %s",
                (runner_id, rule_id),
            )
            notify(cur, bus_id)
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"target {spec.name!r} already exists on rule {bus}/{rule}") from None
    return name


@dataclass(frozen=True)
class TargetInfo:
    bus: str
    rule: str
    name: str
    runner: str
    url: str  # credentials redacted
    transform_kind: str
    transform_spec: object
    max_attempts: int
    backoff_ms: int
    max_age_s: int
    timeout_ms: int
    batch_size: int
    concurrency: int
    ordered: bool
    secret_set: bool
    secret_fingerprint: str | None
    old_secret_until: str | None  # the previous secret also signs until then
    state: str  # the runner's: RUNNING or PAUSED
    version: int
    worker: str | None
    updated_at: str | None
    destination: str | None  # the API destination it sends through (its url is then that's)
    headers: list[list[str]]
    concurrency_auto: bool
    client_cert_file: str | None
    client_key_file: str | None
    ca_file: str | None

    def to_json(self) -> dict:
        return asdict(self)


TARGET_INFO_SQL = """
SELECT b.name, ru.name, t.name, r.name, t.url, t.transform_kind, t.transform_spec,
       t.max_attempts, t.backoff_ms, t.max_age_s, t.timeout_ms, t.batch_size, t.concurrency,
       t.ordered, t.secret, t.secret_old_until, r.state, t.version, w.name, t.updated_at,
       d.name, t.headers, t.concurrency_auto, t.client_cert_file, t.client_key_file, t.ca_file
FROM event_target t
JOIN event_target_runner r ON r.target_id = t.id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus b ON b.id = ru.bus_id
LEFT JOIN event_push_worker w ON w.id = r.worker_id
LEFT JOIN event_api_destination d ON d.id = t.destination_id
WHERE t.deleted_at IS NULL AND ru.deleted_at IS NULL AND b.deleted_at IS NULL
"""


def _target_info(row) -> TargetInfo:
    from eventpush.config import redact_url

    (bus, rule, name, runner, url, kind, spec, *policy, secret, old_until) = row[:16]
    state, version, worker, updated = row[16:20]
    secret_set = secret is not None
    return TargetInfo(
        bus,
        rule,
        name,
        runner,
        redact_url(url),
        kind,
        spec,
        *policy,
        secret_set,
        sealed.fingerprint(sealed.unseal(secret)) if secret_set else None,
        iso(old_until) if old_until is not None and old_until > _now() else None,
        state,
        version,
        worker,
        iso(updated),
        *row[20:],
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _target_row(cur, bus: str, rule: str, name: str, lock: bool = False) -> tuple[int, int]:
    """(target id, bus id) of a live target (FOR UPDATE with ``lock``)."""
    rule_id, bus_id = rule_row(cur, bus, rule)
    target_id = live_id(cur, "event_target", "rule_id", rule_id, name, lock)
    if target_id is None:
        raise NotFoundError(f"unknown target {name!r} on rule {bus}/{rule}")
    return target_id, bus_id


def get_target(conn: Connection, bus: str, rule: str, name: str) -> TargetInfo:
    with transaction(conn) as cur:
        target_id, _ = _target_row(cur, bus, rule, name)
        cur.execute(TARGET_INFO_SQL + " AND t.id = %s", (target_id,))
        return _target_info(cur.fetchone())


def list_targets(
    conn: Connection, bus: str | None = None, rule: str | None = None
) -> list[TargetInfo]:
    with transaction(conn) as cur:
        where, params = "", []
        if bus is not None:
            bus_row(cur, bus)
            where += " AND b.name = %s"
            params.append(bus)
        if rule is not None:
            if bus is not None:
                rule_row(cur, bus, rule)
            where += " AND ru.name = %s"
            params.append(rule)
        cur.execute(TARGET_INFO_SQL + where + " ORDER BY b.name, ru.name, t.name", params)
        return [_target_info(row) for row in cur.fetchall()]


def update_target(
    conn: Connection,
    bus: str,
    rule: str,
    name: str,
    *,
    keep_old_secret: dt.timedelta | None = None,
    expected_version: int | None = None,
    **changes,
) -> TargetInfo:
    """Change any field of a target but its name (``changes``: TargetSpec fields; ``secret``
    None removes signing). With a new secret and ``keep_old_secret``, the old one also signs
    for that long (Standard Webhooks rotation: both signatures in ``webhook-signature``)."""
    unknown = sorted(set(changes) - set(SPEC_FIELDS) - {"name"})
    if unknown:
        raise CatalogError(f"target {name!r}: no such field {unknown[0]!r}")
    if "name" in changes and changes["name"] != name:
        raise CatalogError(f"target {name!r}: a target cannot be renamed (delete and create)")
    if keep_old_secret is not None:
        if "secret" not in changes or changes["secret"] is None:
            raise CatalogError("--keep-old-secret needs a new --secret")
        if not dt.timedelta(0) < keep_old_secret <= MAX_KEEP_OLD_SECRET:
            raise CatalogError(
                f"--keep-old-secret must be more than 0 and at most "
                f"{MAX_KEEP_OLD_SECRET.days} days, got {keep_old_secret}"
            )
    if not changes:
        raise CatalogError(f"target {bus}/{rule}/{name}: nothing to change")
    with transaction(conn) as cur:
        target_id, bus_id = _target_row(cur, bus, rule, name, lock=True)
        cur.execute(
            "SELECT t.url, t.secret, t.transform_kind, t.transform_spec, "
            f"{', '.join('t.' + f for f in POLICY_FIELDS)}, "
            "d.name, t.headers, t.concurrency_auto, t.client_cert_file, t.client_key_file, "
            "t.ca_file, t.version FROM event_target t "
            "LEFT JOIN event_api_destination d ON d.id = t.destination_id WHERE t.id = %s",
            (target_id,),
        )
        url, secret, kind, tspec, *rest, version = cur.fetchone()
        check_version("target", f"{bus}/{rule}/{name}", version, expected_version)
        policy = dict(zip(POLICY_FIELDS, rest, strict=False))
        destination, headers, auto, cert, key, ca = rest[len(POLICY_FIELDS) :]
        current = TargetSpec(
            name,
            url,
            None,
            kind,
            tspec,
            destination=destination,
            headers=headers,
            concurrency_auto=auto,
            client_cert_file=cert,
            client_key_file=key,
            ca_file=ca,
            **policy,
        )
        changes = _destination_change(cur, name, changes)
        merged = replace(current, **{k: v for k, v in changes.items() if k != "secret"})
        if "batch_size" not in changes and "url" in changes:
            merged = replace(merged, batch_size=None)  # the new kind's default
        merged = merged.resolved()
        check_target(replace(merged, secret=changes.get("secret")))
        destination_id = None
        if merged.destination is not None:
            destination_id, _ = destination_row(cur, merged.destination, "share")
        new_secret, old_secret, old_until = secret, None, None
        if "secret" in changes:
            new_secret = None if changes["secret"] is None else sealed.seal(changes["secret"])
            if keep_old_secret is not None and secret is not None:
                old_secret, old_until = secret, _now() + keep_old_secret
        else:  # the secret stays: so does a rotation under way
            cur.execute(
                "SELECT secret_old, secret_old_until FROM event_target WHERE id = %s",
                (target_id,),
            )
            old_secret, old_until = cur.fetchone()
        cur.execute(
            "UPDATE event_target SET url = %s, secret = %s, secret_old = %s, "
            "secret_old_until = %s, transform_kind = %s, transform_spec = %s, "
            "max_attempts = %s, backoff_ms = %s, max_age_s = %s, timeout_ms = %s, "
            "batch_size = %s, concurrency = %s, ordered = %s, destination_id = %s, "
            "headers = %s, concurrency_auto = %s, client_cert_file = %s, "
            "client_key_file = %s, ca_file = %s, version = version + 1, "
            "updated_at = now() WHERE id = %s",
            (
                merged.url,
                new_secret,
                old_secret,
                old_until,
                merged.transform_kind.upper(),
                None if merged.transform_spec is None else json.dumps(merged.transform_spec),
                *(getattr(merged, f) for f in POLICY_FIELDS),
                destination_id,
                _headers_json(merged.headers),
                merged.concurrency_auto,
                merged.client_cert_file,
                merged.client_key_file,
                merged.ca_file,
                target_id,
            ),
        )
        notify(cur, bus_id)
        cur.execute(TARGET_INFO_SQL + " AND t.id = %s", (target_id,))
        return _target_info(cur.fetchone())


def _headers_json(headers) -> str:
    return json.dumps([[k.lower(), v] for k, v in dict(headers).items()])


def _destination_change(cur, name: str, changes: dict) -> dict:
    """``changes`` with the URL and destination made to agree: a new ``url`` leaves the
    destination; a new ``destination`` brings its URL."""
    destination = changes.get("destination")
    if changes.get("url") and destination is not None:
        raise CatalogError(f"target {name!r}: give --url or --destination, not both")
    if changes.get("url"):
        return {**changes, "destination": None}
    if destination is not None:
        # Under a share lock: its URL cannot change before this transaction commits.
        return {**changes, "url": destination_row(cur, destination, "share")[1]}
    if "destination" in changes:
        raise CatalogError(f"target {name!r}: leaving its destination needs a new --url")
    return changes


def mark_targets_deleted(cur, where: str, params: tuple) -> int:
    """Mark live targets (``where``: a fixed condition over alias t) and their runners
    deleted. A runner keeps its worker, which at its next re-read stops taking work,
    commits what its sends under way delivered (a commit needs the runner still its own)
    and only then lets go of it."""
    cur.execute(
        "UPDATE event_target t SET deleted_at = now() "
        f"WHERE t.deleted_at IS NULL AND {where} RETURNING t.id",
        params,
    )
    target_ids = [row[0] for row in cur.fetchall()]
    cur.execute(
        "UPDATE event_target_runner SET deleted_at = now() "
        "WHERE target_id = ANY(%s) RETURNING name",
        (target_ids,),
    )
    names = [row[0] for row in cur.fetchall()]
    # Runtime controls are keyed by runner name: a new target of the same name starts clean.
    cur.execute(
        "DELETE FROM event_runtime_control WHERE scope = 'runner' AND name = ANY(%s)", (names,)
    )
    return len(target_ids)


def delete_target(conn: Connection, bus: str, rule: str, name: str) -> None:
    with transaction(conn) as cur:
        target_id, bus_id = _target_row(cur, bus, rule, name, lock=True)
        mark_targets_deleted(cur, "t.id = %s", (target_id,))
        notify(cur, bus_id)
