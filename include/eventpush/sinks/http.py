"""HTTP and HTTPS targets as a sink: a thin adapter over :mod:`eventpush.push.delivery`, which
holds the request, the Standard Webhooks headers, the guarded connections and the
classification."""

from __future__ import annotations

from eventpush.push import delivery
from eventpush.push.delivery import Outcome, Record, Target
from eventpush.push.targets import AddressPolicy, validate_url
from eventpush.sinks import transform_failed


class HttpSink:
    """One pooled HTTP session for every http(s) target of the process."""

    validate_url = staticmethod(validate_url)

    def __init__(self, policy: AddressPolicy) -> None:
        self.session = delivery.new_session(policy=policy)

    async def send(self, target: Target, records: list[Record], transform) -> Outcome:
        try:
            body, headers = delivery.build_request(target, records, transform)
        except Exception as exc:
            return transform_failed(exc)
        return await delivery.attempt(self.session, target, body, headers)

    async def close(self) -> None:
        await self.session.close()
