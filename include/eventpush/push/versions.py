"""Which version of a runner's rule and target judges which events.

A change to a rule (pattern, enabled or disabled) or a target takes effect in a running
worker at the position its runner has reached on each queue: every event the runner read
before that offset was judged by the old version, every event from it on is judged by the
new one. The worker records these offsets (``event_runner_version``: runner, queue,
from_offset, versions, state, pattern) in the same transaction as the offsets they let pass,
so after a restart a worker judges the events it reads again exactly as before, and the
audit and replay read the same history.

The engine's rule index matches each window once with every runner's newest version; only
events the index could not judge rightly (read before a runner's newest version took effect,
or matched by an index older than it) are judged here, one runner at a time.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

from eventpush.rules.patterns import CompiledPattern, compile_pattern

ENABLED = "ENABLED"


@dataclass(frozen=True, slots=True)
class Version:
    """One version of a runner's rule and target, in force from ``from_offset`` on a queue."""

    from_offset: int
    rule_version: int
    target_version: int
    state: str
    pattern: str  # JSON text, as stored
    matcher: CompiledPattern | None  # None: the rule is disabled, it matches nothing

    @property
    def key(self) -> tuple[int, int]:
        return (self.rule_version, self.target_version)


def version(from_offset: int, rule_version: int, target_version: int, state: str, pattern):
    text = pattern if isinstance(pattern, str) else json.dumps(pattern)
    matcher = compile_pattern(text) if state == ENABLED else None
    return Version(from_offset, rule_version, target_version, state, text, matcher)


class History:
    """A runner's versions per queue, oldest first; the newest one is what its index holds."""

    def __init__(self, per_queue: dict[int, list[Version]] | None = None) -> None:
        self.per_queue: dict[int, list[Version]] = {}
        self.starts: dict[int, list[int]] = {}
        for qid, versions in (per_queue or {}).items():
            for v in sorted(versions, key=lambda v: (v.from_offset, v.key)):
                self.add(qid, v)

    def add(self, qid: int, v: Version) -> None:
        versions = self.per_queue.setdefault(qid, [])
        starts = self.starts.setdefault(qid, [])
        if versions and versions[-1].key == v.key:
            return  # already in force
        if versions and versions[-1].from_offset > v.from_offset:
            raise ValueError(f"queue {qid}: a version cannot take effect before the newest one")
        if versions and versions[-1].from_offset == v.from_offset:
            versions.pop()  # never in force for any event: the newer one replaces it
            starts.pop()
        versions.append(v)
        starts.append(v.from_offset)

    def newest(self, qid: int) -> Version | None:
        versions = self.per_queue.get(qid)
        return versions[-1] if versions else None

    def newest_from(self, qid: int) -> int:
        """The offset from which the newest version judges (the index's verdicts hold)."""
        versions = self.per_queue.get(qid)
        return versions[-1].from_offset if versions else 0

    def in_force(self, qid: int, offset: int) -> Version | None:
        starts = self.starts.get(qid)
        if not starts:
            return None
        i = bisect.bisect_right(starts, offset) - 1
        return self.per_queue[qid][max(i, 0)]

    def judge(self, qid: int, offset: int, event: dict) -> bool:
        """Does the version in force at ``offset`` match ``event``?"""
        v = self.in_force(qid, offset)
        return v is not None and v.matcher is not None and v.matcher.matches(event)

    def forget_before(self, qid: int, offset: int) -> None:
        """Versions no event at or past ``offset`` can need any more (committed past)."""
        starts = self.starts.get(qid)
        if not starts:
            return
        i = bisect.bisect_right(starts, offset) - 1
        if i > 0:
            del self.per_queue[qid][:i]
            del starts[:i]
