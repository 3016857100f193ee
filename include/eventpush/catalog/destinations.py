"""API destinations: an HTTP endpoint, its method, the connection it authenticates with, its
rate limit and its TLS files (issue 32). Targets send through one with ``--destination``.

A target's ``url`` is kept equal to its destination's, so everything that reads target URLs
(status, audit, replay, the dashboard) needs nothing new. A change moves the destination's
``version`` on, and the version of every live target using it, so running workers take it
live (push/versions.py); a delete is refused while a live target uses it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg2
import psycopg2.errors

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
    refuse_if_used,
)
from eventpush.catalog.connections import connection_row, retarget
from eventpush.db import Connection, transaction
from eventpush.sinks import validate_url

METHODS = ("POST", "PUT", "PATCH", "DELETE", "GET")
MAX_RATE_LIMIT = 100_000.0  # invocations per second
# One an hour: below it a destination would wait longer than any lease or operator does
# (1e-320 passed as "more than 0" and never sent again).
MIN_RATE_LIMIT = 1 / 3600
TLS_FIELDS = ("client_cert_file", "client_key_file", "ca_file")
FIELDS = ("url", "method", "connection", "rate_limit", "description", *TLS_FIELDS)


def check_tls_files(where: str, cert: str | None, key: str | None, ca: str | None) -> None:
    """Client certificate and key (both or neither) and a CA bundle: absolute paths to PEM
    files that load now (the worker reads them again when it connects)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    if (cert is None) != (key is None):
        raise CatalogError(f"{where}: --client-cert-file and --client-key-file go together")
    for option, path, load in (
        ("--client-cert-file", cert, x509.load_pem_x509_certificates),
        ("--client-key-file", key, lambda data: load_pem_private_key(data, None)),
        ("--ca-file", ca, x509.load_pem_x509_certificates),
    ):
        if path is None:
            continue
        if not isinstance(path, str) or not Path(path).is_absolute():
            raise CatalogError(f"{where}: {option} must be an absolute path, got {path!r}")
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise CatalogError(f"{where}: {option} {path}: {exc.strerror or exc}") from None
        try:
            load(data)
        except (ValueError, TypeError):
            what = "an unencrypted PEM private key" if "key" in option else "PEM certificates"
            raise CatalogError(f"{where}: {option} {path} does not hold {what}") from None


def check_destination(name: str, url: str, method: str, rate_limit: float | None) -> str:
    """The destination's URL, checked; the method and rate limit too."""
    check_name("destination", name)
    where = f"destination {name!r}"
    try:
        url = validate_url(url)
    except InvalidTargetUrlError as exc:
        raise CatalogError(f"{where}: {exc}") from None
    if not url.lower().startswith(("http://", "https://")):
        raise CatalogError(f"{where}: --url must be an http or https URL")
    if method not in METHODS:
        raise CatalogError(f"{where}: --method must be one of {', '.join(METHODS)}, got {method!r}")
    if rate_limit is not None and (
        isinstance(rate_limit, bool)
        or not isinstance(rate_limit, int | float)
        or not math.isfinite(rate_limit)
        or not MIN_RATE_LIMIT <= rate_limit <= MAX_RATE_LIMIT
    ):
        raise CatalogError(
            f"{where}: --rate-limit must be from {MIN_RATE_LIMIT:.6f} (one an hour) to "
            f"{MAX_RATE_LIMIT:g} invocations per second, got {rate_limit!r}"
        )
    return url


def create_destination(
    conn: Connection,
    name: str,
    url: str,
    *,
    method: str = "POST",
    connection: str | None = None,
    rate_limit: float | None = None,
    description: str = "",
    client_cert_file: str | None = None,
    client_key_file: str | None = None,
    ca_file: str | None = None,
) -> DestinationInfo:
    method = str(method).upper()
    url = check_destination(name, url, method, rate_limit)
    check_description(f"destination {name!r}", description)
    check_tls_files(f"destination {name!r}", client_cert_file, client_key_file, ca_file)
    try:
        with transaction(conn) as cur:
            connection_id = None
            if connection is not None:
                connection_id = connection_row(cur, connection, "share")
            cur.execute(
                "INSERT INTO event_api_destination (name, url, method, connection_id, "
                "rate_limit, description, client_cert_file, client_key_file, ca_file) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
                (
                    name,
                    url,
                    method,
                    connection_id,
                    rate_limit,
                    description,
                    client_cert_file,
                    client_key_file,
                    ca_file,
                ),
            )
            cur.execute(DESTINATION_INFO_SQL + " AND d.id = %s", (cur.fetchone()[0],))
            return _info(cur.fetchone())
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"destination {name!r} already exists") from None


@dataclass(frozen=True)
class DestinationInfo:
    name: str
    url: str  # redacted
    method: str
    connection: str | None
    rate_limit: float | None
    client_cert_file: str | None
    client_key_file: str | None
    ca_file: str | None
    description: str
    version: int
    targets: int  # live targets using it
    updated_at: str | None
    created_at: str | None

    def to_json(self) -> dict:
        return asdict(self)


DESTINATION_INFO_SQL = """
SELECT d.name, d.url, d.method, c.name, d.rate_limit, d.client_cert_file, d.client_key_file,
       d.ca_file, d.description, d.version,
       (SELECT count(*) FROM event_target t
         WHERE t.destination_id = d.id AND t.deleted_at IS NULL), d.updated_at, d.ctime
FROM event_api_destination d
LEFT JOIN event_connection c ON c.id = d.connection_id
WHERE d.deleted_at IS NULL
"""


def _info(row) -> DestinationInfo:
    from eventpush.config import redact_url

    name, url, *rest, updated, created = row
    return DestinationInfo(name, redact_url(url), *rest, iso(updated), iso(created))


def destination_row(cur, name: str, lock: str = "") -> tuple[int, str]:
    """(id, url) of the live destination ``name`` (``lock``: "", "share" or "update")."""
    return named_row(cur, "event_api_destination", "destination", name, "id, url", lock)


def get_destination(conn: Connection, name: str) -> DestinationInfo:
    with transaction(conn) as cur:
        destination_id, _ = destination_row(cur, name)
        cur.execute(DESTINATION_INFO_SQL + " AND d.id = %s", (destination_id,))
        return _info(cur.fetchone())


def list_destinations(conn: Connection) -> list[DestinationInfo]:
    with transaction(conn) as cur:
        cur.execute(DESTINATION_INFO_SQL + " ORDER BY d.name")
        return [_info(row) for row in cur.fetchall()]


def update_destination(
    conn: Connection, name: str, *, expected_version: int | None = None, **changes
) -> DestinationInfo:
    """Change any field but the name (``connection``/``rate_limit``/TLS files None: none).
    The targets sending through it take the change live."""
    check_changes("destination", name, changes, FIELDS)
    if "description" in changes:
        check_description(f"destination {name!r}", changes["description"])
    with transaction(conn) as cur:
        destination_id, _ = destination_row(cur, name, "update")
        cur.execute(
            "SELECT d.url, d.method, c.name, d.rate_limit, d.description, d.client_cert_file, "
            "d.client_key_file, d.ca_file, d.version FROM event_api_destination d "
            "LEFT JOIN event_connection c ON c.id = d.connection_id WHERE d.id = %s",
            (destination_id,),
        )
        *current, version = cur.fetchone()
        check_version("destination", name, version, expected_version)
        merged = dict(zip(FIELDS, current, strict=True))
        merged.update(changes)
        merged["method"] = str(merged["method"]).upper()
        url = check_destination(name, merged["url"], merged["method"], merged["rate_limit"])
        check_tls_files(f"destination {name!r}", *(merged[f] for f in TLS_FIELDS))
        connection_id = None
        if merged["connection"] is not None:
            connection_id = connection_row(cur, merged["connection"], "share")
        cur.execute(
            "UPDATE event_api_destination SET url = %s, method = %s, connection_id = %s, "
            "rate_limit = %s, description = %s, client_cert_file = %s, client_key_file = %s, "
            "ca_file = %s, version = version + 1, updated_at = now() WHERE id = %s",
            (
                url,
                merged["method"],
                connection_id,
                merged["rate_limit"],
                merged["description"],
                *(merged[f] for f in TLS_FIELDS),
                destination_id,
            ),
        )
        retarget(cur, "d.id = %s", (destination_id,), url=url)
        cur.execute(DESTINATION_INFO_SQL + " AND d.id = %s", (destination_id,))
        return _info(cur.fetchone())


def delete_destination(conn: Connection, name: str) -> None:
    """Delete a destination (refused while a live target uses it)."""
    with transaction(conn) as cur:
        destination_id, _ = destination_row(cur, name, "update")
        cur.execute(
            "SELECT b.name || '/' || ru.name || '/' || t.name FROM event_target t "
            "JOIN event_rule ru ON ru.id = t.rule_id JOIN event_bus b ON b.id = ru.bus_id "
            "WHERE t.destination_id = %s AND t.deleted_at IS NULL ORDER BY 1",
            (destination_id,),
        )
        users = [row[0] for row in cur.fetchall()]
        hint = "delete them or point them elsewhere first"
        refuse_if_used("destination", name, users, "target", hint)
        cur.execute(
            "UPDATE event_api_destination SET deleted_at = now() WHERE id = %s", (destination_id,)
        )
