"""A runner's position on one queue: what it has pulled, what is in flight, what it may commit.

Offsets are taken in increasing order, so the insertion-ordered ``inflight`` dict keeps its
lowest offset first: the committable offset (the next one not finished) is its first key, or
``pulled`` when nothing is in flight. Filtered-out records never enter ``inflight``.
``pulled`` only moves forward. The feeder (``lanes.Lanes.feed``) takes records into
``inflight`` and moves ``pulled`` itself, on locals written back once per pull.
"""

from __future__ import annotations

# How far (in buffer spans) a queue may be read past its committed offset: room for several
# commit intervals of work, and a hard stop when commits fail.
UNCOMMITTED_SPANS = 4


class QueueCursor:
    __slots__ = (
        "queue_id",
        "pulled",
        "inflight",
        "inflight_bytes",
        "committed_db",
        "pulled_db",
        "last_message_id",
        "at_end",
        "resent_below",
    )

    def __init__(self, queue_id: int, committed: int) -> None:
        self.queue_id = queue_id
        self.pulled = committed  # next offset to read
        self.inflight: dict[int, int] = {}  # offset -> size in bytes
        self.inflight_bytes = 0
        self.committed_db = committed  # what the database holds
        self.pulled_db = committed
        self.last_message_id: str | None = None
        self.at_end = False
        # Records below this offset may have been sent by the runner's previous owner (a
        # worker that crashed or handed it over): its pulls stopped UNCOMMITTED_SPANS spans
        # past this committed offset. Set when the runner starts (``Lanes.start``).
        self.resent_below = committed

    def advance(self, offset: int) -> None:
        """Everything before ``offset`` has been read."""
        if offset > self.pulled:
            self.pulled = offset

    def finish(self, offset: int, message_id: str) -> None:
        self.inflight_bytes -= self.inflight.pop(offset)
        self.last_message_id = message_id

    def committable(self) -> int:
        return next(iter(self.inflight)) if self.inflight else self.pulled

    def span(self) -> int:
        return self.pulled - self.committable()

    def over(self, records: int, size: int, span: int) -> bool:
        """Backpressure: stop pulling while any bound is passed. The span counts from the
        committed offset as well as from the oldest record in flight, so while commits fail
        the runner stops taking new work and finished rows waiting for a commit stay few."""
        inflight = self.inflight  # called per record pulled: the span is inlined
        pulled = self.pulled
        return (
            len(inflight) >= records
            or self.inflight_bytes >= size
            or pulled - (next(iter(inflight)) if inflight else pulled) >= span
            or pulled - self.committed_db >= UNCOMMITTED_SPANS * span
        )
