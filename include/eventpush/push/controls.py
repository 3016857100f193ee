"""Runtime controls: knobs that running workers pick up without a restart.

Stored in ``event_runtime_control`` as (scope, name, key) -> JSON value. Worker keys:
``paused``, ``pool_core``, ``pool_max``, ``buffer_records``, ``buffer_bytes``,
``buffer_span``. Runner keys: ``paused``, ``lane_limit``, ``concurrency``. A change notifies
the catalog's channel, so running workers read it at once (and every couple of seconds
anyway); pool_core never exceeds pool_max (checked here and again in the engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from eventpush.db import Connection, transaction
from eventpush.sources.postgres import CATALOG_CHANNEL

WORKER_KEYS = {
    "pool_core": (1, 10_000),
    "pool_max": (1, 10_000),
    "buffer_records": (1, 1_000_000),
    "buffer_bytes": (1024, 16 * 1024**3),
    "buffer_span": (1, 10_000_000),
}
RUNNER_KEYS = {"lane_limit": (1, 1_000_000), "concurrency": (1, 1024)}


class ControlError(ValueError):
    """A refused adjustment, said in one line."""


@dataclass(frozen=True)
class WorkerSettings:
    """Engine defaults (docs/ARCHITECTURE.md), overridden by controls."""

    pool_core: int = 64
    pool_max: int = 256
    buffer_records: int = 1000
    buffer_bytes: int = 100 * 1024 * 1024
    buffer_span: int = 2000


def _exists(cur, scope: str, name: str) -> None:
    if scope == "worker":
        cur.execute("SELECT 1 FROM event_push_worker WHERE name = %s", (name,))
    else:  # a deleted target's runner keeps its name in its books, never its controls
        cur.execute(
            "SELECT 1 FROM event_target_runner WHERE name = %s AND deleted_at IS NULL", (name,)
        )
    if cur.fetchone() is None:
        raise ControlError(f"unknown {scope} {name!r}")


def read_controls(conn: Connection, scope: str, name: str) -> dict:
    with transaction(conn) as cur:
        cur.execute(
            "SELECT key, value FROM event_runtime_control WHERE scope = %s AND name = %s",
            (scope, name),
        )
        return dict(cur.fetchall())


def adjust(conn: Connection, scope: str, name: str, changes: dict) -> dict:
    """Validate and store ``changes`` for a worker or runner; returns the controls now in force.

    Every change is checked against its bounds and, for workers, pool_core <= pool_max with
    the stored and default values taken into account; nothing is written if anything fails.
    """
    if scope not in ("worker", "runner"):
        raise ControlError(f"scope must be worker or runner, not {scope!r}")
    allowed = WORKER_KEYS if scope == "worker" else RUNNER_KEYS
    if not changes:
        raise ControlError("nothing to adjust")
    for key, value in changes.items():
        if key not in allowed:
            raise ControlError(
                f"{scope} setting {key!r} is unknown: use one of {', '.join(sorted(allowed))}"
            )
        low, high = allowed[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ControlError(f"{key} must be an integer from {low} to {high}, got {value!r}")
    with transaction(conn) as cur:
        _exists(cur, scope, name)
        cur.execute(
            "SELECT key, value FROM event_runtime_control WHERE scope = %s AND name = %s "
            "FOR UPDATE",
            (scope, name),
        )
        current = dict(cur.fetchall())
        merged = {**current, **changes}
        if scope == "worker":
            core = merged.get("pool_core", WorkerSettings.pool_core)
            top = merged.get("pool_max", WorkerSettings.pool_max)
            if core > top:
                raise ControlError(f"pool_core ({core}) must not exceed pool_max ({top})")
        for key, value in changes.items():
            _upsert(cur, scope, name, key, value)
    return merged


def set_paused(conn: Connection, scope: str, name: str, paused: bool) -> None:
    """Pause or resume a worker or a runner (a runner's pause is also its state column)."""
    with transaction(conn) as cur:
        _exists(cur, scope, name)
        _upsert(cur, scope, name, "paused", paused)
        if scope == "runner":
            cur.execute(
                "UPDATE event_target_runner SET state = %s WHERE name = %s AND deleted_at IS NULL",
                ("PAUSED" if paused else "RUNNING", name),
            )


def _upsert(cur, scope: str, name: str, key: str, value: object) -> None:
    cur.execute(
        "INSERT INTO event_runtime_control (scope, name, key, value) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (scope, name, key) DO UPDATE SET value = EXCLUDED.value, mtime = now()",
        (scope, name, key, json.dumps(value)),
    )
    cur.execute("SELECT pg_notify(%s, '0')", (CATALOG_CHANNEL,))  # 0: no bus in particular


def worker_settings(controls: dict) -> WorkerSettings:
    """Settings in force for a worker, defaults where no control is set."""
    base = WorkerSettings()
    values = {k: controls.get(k, getattr(base, k)) for k in WORKER_KEYS}
    values["pool_core"] = min(values["pool_core"], values["pool_max"])
    return WorkerSettings(**values)
