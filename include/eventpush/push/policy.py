"""How a target is pushed when its creator says nothing: the one definition of the defaults.

The migration's column defaults, ``catalog.TargetSpec``, ``delivery.Target`` and the CLI's
``target create`` options all read (or, for the migration, are tested against) these values
and bounds, so a default changes in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetPolicy:
    """Retry and flow settings of one target."""

    max_attempts: int = 5
    backoff_ms: int = 200
    max_age_s: int = 3600
    timeout_ms: int = 5000
    batch_size: int = 1
    concurrency: int = 16


DEFAULTS = TargetPolicy()

# Inclusive bounds, the same as the CHECK constraints on event_target.
LIMITS = {
    "max_attempts": (1, 185),
    "backoff_ms": (1, 3_600_000),
    "max_age_s": (1, 86_400),
    "timeout_ms": (1, 300_000),
    "batch_size": (1, 1000),
    "concurrency": (1, 1024),
}
