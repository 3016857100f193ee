"""HTTP and HTTPS targets as a sink: a thin adapter over :mod:`eventpush.push.delivery`, which
holds the request, the Standard Webhooks headers, the guarded connections and the
classification."""

from __future__ import annotations

from collections.abc import Awaitable

from eventpush import tracing
from eventpush.push import delivery
from eventpush.push.delivery import Outcome, Record, Target
from eventpush.push.targets import AddressPolicy, validate_url
from eventpush.sinks import transform_failed


class HttpSink:
    """One pooled HTTP session for every http(s) target of the process."""

    validate_url = staticmethod(validate_url)

    def __init__(self, policy: AddressPolicy) -> None:
        self.session = delivery.new_session(policy=policy)

    def send(self, target: Target, records: list[Record], transform) -> Awaitable[Outcome]:
        """The attempt's awaitable: the request coroutine itself, so a send costs no
        coroutine frame of this adapter on the engine's hot path. The headers carry the
        attempt's ``traceparent`` (``tracing.OUTGOING``, as ``delivery.attempt`` adds it),
        put in as they are built rather than copied in after."""
        try:
            body, headers = delivery.build_request(
                target, records, transform, traceparent=tracing.OUTGOING.get()
            )
        except Exception as exc:
            return _ready(transform_failed(exc))
        return delivery.post(self.session, target, body, headers)

    async def close(self) -> None:
        await self.session.close()


async def _ready(outcome: Outcome) -> Outcome:
    return outcome
