"""A sink kind outside eventpush, found only through the ``eventpush.sinks`` entry points
(tests/test_sink_plugins.py declares it in a distribution's metadata on sys.path)."""

from __future__ import annotations

from eventpush.push.delivery import DELIVERED, FINAL, Outcome
from eventpush.push.targets import InvalidTargetUrlError

SENT: list[tuple[str, list[str], list[bytes]]] = []  # (runner, message ids, bodies)


class MemorySink:
    """``memory://BOX``: keeps what it is sent; a record whose event says ``"refuse": true``
    is refused for good."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.closed = False

    @staticmethod
    def validate_url(url: str, policy=None) -> str:
        if not url.startswith("memory://") or not url[len("memory://") :].isalnum():
            raise InvalidTargetUrlError(f"target URL {url!r} must be memory://BOX")
        return url

    async def send(self, target, records, transform) -> Outcome:
        if any(r.event.get("detail", {}).get("refuse") for r in records):
            return Outcome(FINAL, None, "refused by the box", 0.1)
        bodies = [r.raw.encode() for r in records]
        SENT.append((target.runner, [r.message_id for r in records], bodies))
        return Outcome(DELIVERED, None, None, 0.1)

    async def close(self) -> None:
        self.closed = True
