"""A runner's position on one queue: what it has pulled, what is in flight, what it may commit.

Offsets are taken in increasing order, so the insertion-ordered ``inflight`` dict keeps its
lowest offset first: the committable offset (the next one not finished) is its first key, or
``pulled`` when nothing is in flight. Filtered-out records never enter ``inflight``.
"""

from __future__ import annotations


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

    def take(self, offset: int, size: int) -> None:
        self.inflight[offset] = size
        self.inflight_bytes += size

    def finish(self, offset: int, message_id: str) -> None:
        self.inflight_bytes -= self.inflight.pop(offset)
        self.last_message_id = message_id

    def committable(self) -> int:
        for offset in self.inflight:
            return offset
        return self.pulled

    def span(self) -> int:
        return self.pulled - self.committable()

    def over(self, records: int, size: int, span: int) -> bool:
        """Backpressure: stop pulling while any bound is passed."""
        return len(self.inflight) >= records or self.inflight_bytes >= size or self.span() >= span
