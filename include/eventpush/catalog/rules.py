"""Rules: creating, reading, changing, enabling, disabling and deleting them.

Every change moves the rule's ``version`` on by one; an update naming the version it read
(``expected_version``) is refused as a conflict when another change came first. Running
workers hear of the change (``notify``) and record, per queue, the offset from which the
new version judges their events (``event_runner_version``, see push/versions.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import psycopg2
import psycopg2.errors

from eventpush.catalog.common import (
    CatalogError,
    ConflictError,
    bus_row,
    check_description,
    check_name,
    check_version,
    iso,
    notify,
    rule_row,
)
from eventpush.db import Connection, transaction
from eventpush.rules.parse import MAX_JSON_DEPTH, nested_deeper_than


@dataclass(frozen=True)
class RuleInfo:
    bus: str
    name: str
    pattern: dict
    description: str
    state: str  # ENABLED or DISABLED
    version: int
    targets: int
    updated_at: str | None

    def to_json(self) -> dict:
        return asdict(self)


def parse_pattern(name: str, pattern: str | dict) -> dict:
    """The pattern as a dict, compiled once to refuse an invalid one."""
    from eventpush.rules.patterns import InvalidPatternError, compile_pattern

    too_deep = CatalogError(
        f"rule {name!r}: pattern is nested more than {MAX_JSON_DEPTH} levels deep"
    )
    if isinstance(pattern, str):
        try:
            pattern = json.loads(pattern)
        except json.JSONDecodeError as exc:
            raise CatalogError(f"rule {name!r}: pattern is not valid JSON: {exc}") from None
        except RecursionError:
            raise too_deep from None
    if nested_deeper_than(pattern):
        raise too_deep
    try:
        compile_pattern(pattern)
    except InvalidPatternError as exc:
        raise CatalogError(f"rule {name!r}: invalid pattern: {exc}") from None
    return pattern


def create_rule(
    conn: Connection,
    bus: str,
    name: str,
    pattern: str | dict,
    description: str = "",
    *,
    enabled: bool = True,
) -> int:
    """A rule on ``bus``; the pattern is compiled first and refused when invalid."""
    check_name("rule", name)
    pattern = parse_pattern(name, pattern)
    check_description(f"rule {bus}/{name}", description)
    try:
        with transaction(conn) as cur:
            bus_id, _ = bus_row(cur, bus)
            cur.execute(
                "INSERT INTO event_rule (bus_id, name, pattern, description, state) "
                "VALUES (%s, %s, %s, %s, %s) RETURNING id",
                (bus_id, name, json.dumps(pattern), description, _state(enabled)),
            )
            return cur.fetchone()[0]
    except psycopg2.errors.UniqueViolation:
        raise ConflictError(f"rule {name!r} already exists on bus {bus!r}") from None


def _state(enabled: bool) -> str:
    return "ENABLED" if enabled else "DISABLED"


RULE_SQL = """
SELECT b.name, ru.name, ru.pattern, ru.description, ru.state, ru.version,
       (SELECT count(*) FROM event_target t WHERE t.rule_id = ru.id AND t.deleted_at IS NULL),
       ru.updated_at
FROM event_rule ru JOIN event_bus b ON b.id = ru.bus_id
WHERE ru.deleted_at IS NULL AND b.deleted_at IS NULL
"""


def _rule_info(row) -> RuleInfo:
    bus, name, pattern, description, state, version, targets, updated = row
    return RuleInfo(bus, name, pattern, description, state, version, targets, iso(updated))


def _read(cur, rule_id: int) -> RuleInfo:
    cur.execute(RULE_SQL + " AND ru.id = %s", (rule_id,))
    return _rule_info(cur.fetchone())


def get_rule(conn: Connection, bus: str, name: str) -> RuleInfo:
    with transaction(conn) as cur:
        rule_id, _ = rule_row(cur, bus, name)
        return _read(cur, rule_id)


def list_rules(
    conn: Connection, bus: str | None = None, *, name_prefix: str | None = None
) -> list[RuleInfo]:
    with transaction(conn) as cur:
        where, params = " AND starts_with(ru.name, %s)", [name_prefix or ""]
        if bus is not None:
            bus_row(cur, bus)
            where += " AND b.name = %s"
            params.append(bus)
        cur.execute(RULE_SQL + where + " ORDER BY b.name, ru.name", params)
        return [_rule_info(row) for row in cur.fetchall()]


def _change(cur, bus: str, name: str, expected_version: int | None) -> tuple[int, int, int]:
    """Lock the rule for a change: (rule id, bus id, version it is at)."""
    rule_id, bus_id = rule_row(cur, bus, name, lock=True)
    cur.execute("SELECT version FROM event_rule WHERE id = %s", (rule_id,))
    version = cur.fetchone()[0]
    check_version("rule", f"{bus}/{name}", version, expected_version)
    return rule_id, bus_id, version


def update_rule(
    conn: Connection,
    bus: str,
    name: str,
    *,
    pattern: str | dict | None = None,
    description: str | None = None,
    enabled: bool | None = None,
    expected_version: int | None = None,
) -> RuleInfo:
    """A new pattern, description and/or state, in one transaction; the version moves on by
    one."""
    if pattern is None and description is None and enabled is None:
        raise CatalogError(f"rule {bus}/{name}: nothing to change (give a pattern or description)")
    if pattern is not None:
        pattern = parse_pattern(name, pattern)
    if description is not None:
        check_description(f"rule {bus}/{name}", description)
    state = None if enabled is None else _state(enabled)
    with transaction(conn) as cur:
        rule_id, bus_id, _ = _change(cur, bus, name, expected_version)
        cur.execute(
            "UPDATE event_rule SET pattern = coalesce(%s::json, pattern), "
            "description = coalesce(%s, description), state = coalesce(%s, state), "
            "version = version + 1, updated_at = now() WHERE id = %s",
            (None if pattern is None else json.dumps(pattern), description, state, rule_id),
        )
        notify(cur, bus_id)
        return _read(cur, rule_id)


def set_rule_enabled(
    conn: Connection, bus: str, name: str, enabled: bool, *, expected_version: int | None = None
) -> RuleInfo:
    """Enable or disable a rule; a rule already so is left as it is (same version)."""
    with transaction(conn) as cur:
        rule_id, bus_id, _ = _change(cur, bus, name, expected_version)
        cur.execute(
            "UPDATE event_rule SET state = %s, version = version + 1, updated_at = now() "
            "WHERE id = %s AND state <> %s",
            (_state(enabled), rule_id, _state(enabled)),
        )
        if cur.rowcount:
            notify(cur, bus_id)
        return _read(cur, rule_id)


def delete_rule(conn: Connection, bus: str, name: str) -> None:
    """Delete a rule without targets (refused while it has any)."""
    with transaction(conn) as cur:
        rule_id, bus_id, _ = _change(cur, bus, name, None)
        cur.execute(
            "SELECT count(*) FROM event_target WHERE rule_id = %s AND deleted_at IS NULL",
            (rule_id,),
        )
        targets = cur.fetchone()[0]
        if targets:
            raise ConflictError(f"rule {bus}/{name} has {targets} targets: delete them first")
        cur.execute("UPDATE event_rule SET deleted_at = now() WHERE id = %s", (rule_id,))
        notify(cur, bus_id)


def rule_names_by_target_url(
    conn: Connection, bus: str, url: str | None, *, destination: str | None = None
) -> list[str]:
    """The live rules of ``bus`` with a live target pushing to ``url`` (its own URL: a
    destination's target holds its destination's URL too), or with ``destination`` the
    rules with a target sending through that API destination."""
    if destination is None:
        match, value = "t.url = %s AND t.destination_id IS NULL", url
    else:
        match = (
            "t.destination_id = (SELECT id FROM event_api_destination "
            "WHERE name = %s AND deleted_at IS NULL)"
        )
        value = destination
    with transaction(conn) as cur:
        bus_id, _ = bus_row(cur, bus)
        cur.execute(
            "SELECT DISTINCT ru.name FROM event_rule ru JOIN event_target t ON t.rule_id = ru.id "
            "WHERE ru.bus_id = %s AND ru.deleted_at IS NULL AND t.deleted_at IS NULL "
            f"AND {match} ORDER BY ru.name",
            (bus_id, value),
        )
        return [row[0] for row in cur.fetchall()]
