"""How a target is pushed when its creator says nothing: the one definition of the defaults.

:class:`TargetPolicy` is the one list of a target's retry and flow settings:
``catalog.TargetSpec`` (what a target is made with) and ``sinks.contract.Target`` (what the
engine pushes) derive from it, so each field and its default is written here only. The
migration's column defaults and the CLI's ``target create`` options read (or, for the
migration, are tested against) these values and bounds, so a default changes in one place.
A kind of target may differ (``SCHEME_DEFAULTS``): ``catalog.create_target`` fills a
``TargetSpec`` field left at None from ``defaults_for`` its URL.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


# Keyword-only: a class deriving from it keeps its own fields' positions in its constructor.
@dataclass(frozen=True, kw_only=True)
class TargetPolicy:
    """Retry and flow settings of one target."""

    max_attempts: int = 5
    backoff_ms: int = 200
    max_age_s: int = 3600
    timeout_ms: int = 5000
    batch_size: int = 1
    concurrency: int = 16
    ordered: bool = False  # a queue's records one send at a time, in offset order


DEFAULTS = TargetPolicy()
# In the order of event_target's columns (the catalog's and the engine's SQL list them so).
POLICY_FIELDS = tuple(f.name for f in fields(TargetPolicy))

# A NATS JetStream target publishes each record of a batch as a message of its own (a batch
# changes nothing a stream's consumer sees, unlike an HTTP target's JSON array), so its
# default batch is the one that publishes fastest: at 64 messages in flight, batches of 64
# reach 0.8 of a bare nats-py loop's rate against 0.5 one message per send, at about 40
# against 65 us of the worker's CPU per message (docs/BENCHMARKS.md, the JetStream target).
# Each message keeps its own answer (a refused one fails alone, an unanswered one is sent
# again alone), so a batch costs its records nothing but sharing a send's deadline.
SCHEME_DEFAULTS = {"nats": TargetPolicy(batch_size=64)}


def defaults_for(url: str) -> TargetPolicy:
    """The defaults of a target at ``url``: its scheme's own, else DEFAULTS (HTTP's)."""
    return SCHEME_DEFAULTS.get(url.partition(":")[0].strip().lower(), DEFAULTS)


# Inclusive bounds, the same as the CHECK constraints on event_target.
LIMITS = {
    "max_attempts": (1, 186),  # EventBridge: 185 retries, 186 attempts
    "backoff_ms": (1, 3_600_000),
    "max_age_s": (1, 86_400),
    "timeout_ms": (1, 300_000),
    "batch_size": (1, 1000),
    "concurrency": (1, 1024),
}
