"""A sink kind outside eventpush, found only through the ``eventpush.sinks`` entry points
(tests/test_sink_plugins.py declares it in a distribution's metadata on sys.path)."""

from __future__ import annotations

from eventpush.addresses import InvalidTargetUrlError
from eventpush.sinks.contract import DELIVERED, FINAL, RETRY, Outcome

SENT: list[tuple[str, list[str], list[bytes]]] = []  # (runner, message ids, bodies)
TRACED: list[tuple[list[str], str | None]] = []  # AnsweringSink's (message ids, traceparent)


class MemorySink:
    """``memory://BOX``: keeps what it is sent; a record whose event says ``"refuse": true``
    is refused for good. Its ``send`` takes no ``traceparent``, as plug-ins written before
    the contract had one: the registry sends to it without."""

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


class AnsweringSink:
    """``answering://BOX``: answers each record of a batch on its own (as JetStream does): an
    event whose detail says ``"refuse": true`` is refused for good, one that says
    ``"busy": n`` is answered "retry" on its first n attempts; the rest are kept."""

    def __init__(self, policy) -> None:
        self.policy = policy

    @staticmethod
    def validate_url(url: str, policy=None) -> str:
        if not url.startswith("answering://"):
            raise InvalidTargetUrlError(f"target URL {url!r} must be answering://BOX")
        return url

    async def send(self, target, records, transform, traceparent) -> Outcome:
        TRACED.append(([r.message_id for r in records], traceparent))
        answers = []
        for r in records:
            detail = r.event.get("detail", {})
            if detail.get("refuse"):
                answers.append((FINAL, "refused by the box"))
            elif r.attempts < detail.get("busy", 0):
                answers.append((RETRY, "box busy"))
            else:
                SENT.append((target.runner, [r.message_id], [r.raw.encode()]))
                answers.append((DELIVERED, None))
        worst = min(answers, key=lambda a: (a[0] != FINAL, a[0] != RETRY))
        outcome = Outcome(worst[0], None, worst[1], 0.1)
        if len(set(answers)) > 1:
            outcome.per_record = answers
        return outcome

    async def close(self) -> None:
        pass
