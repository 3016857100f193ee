"""The bus-to-bus sink kind: a target ``bus://NAME`` publishes each matched event on the bus
``NAME`` of this eventpush (EventBridge's event-bus target; the API makes one from a bus ARN).
Registered in ``eventpush.sinks`` by name only: it sits in a layer above the sinks because it
publishes through ``eventpush.publish``.

The event goes as the target's transform renders it (the original event by default), so a
transformed body must still be an event (a JSON object with ``source`` and ``detail-type``);
it keeps its ``id``, so the copy is traceable to its origin. A send is delivered once the
target bus committed it (one transaction per send, eventpush.publish: all or nothing). A
body that is not an event, or an unknown bus, is final at once; a database that does not
answer is retried. At-least-once as everywhere: a send retried after a commit whose answer
was lost publishes its events again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

from eventpush.addresses import AddressPolicy, InvalidTargetUrlError
from eventpush.errors import first_line
from eventpush.sinks import transform_failed
from eventpush.sinks.contract import DELIVERED, FINAL, RETRY, Outcome, Record, Target
from eventpush.sinks.request import build_request

SCHEME = "bus"
PREFIX = "bus://"


def bus_of(url: str) -> str:
    return url.strip().removeprefix(PREFIX)


class BusSink:
    """One connection to the eventpush database per process, used by one send at a time."""

    @staticmethod
    def validate_url(url: str, policy: AddressPolicy | None = None) -> str:
        from eventpush.catalog import NAME_RE

        name = bus_of(url)
        if not url.strip().startswith(PREFIX) or not NAME_RE.fullmatch(name):
            raise InvalidTargetUrlError(f"a bus target URL is bus://NAME, not {url[:100]!r}")
        return url.strip()

    def __init__(self, policy: AddressPolicy) -> None:
        self._conn = None
        self._lock = asyncio.Lock()

    async def send(
        self, target: Target, records: list[Record], transform, traceparent: str | None = None
    ) -> Outcome:
        # ``traceparent`` is not carried: the event published keeps its own (if any).
        started = time.perf_counter()
        single = target if target.batch_size == 1 else replace(target, batch_size=1)
        try:
            lines = [build_request(single, [r], transform)[0].decode() for r in records]
        except Exception as exc:
            return transform_failed(exc)
        async with self._lock:
            kind, error = await asyncio.to_thread(self._publish, bus_of(target.url), lines)
        return Outcome(kind, None, error, (time.perf_counter() - started) * 1000)

    def _publish(self, bus: str, lines: list[str]) -> tuple[str, str | None]:
        from eventpush.db import connect
        from eventpush.publish import publish

        try:
            if self._conn is None:
                self._conn = connect(application_name="eventpush-bus-sink")
            # What a front door took, re-published: the stored ceiling only (eventpush.publish).
            publish(self._conn, bus, lines, entry_limit=False)
        except (ValueError, LookupError) as exc:  # not an event, or no such bus: final
            return FINAL, f"bus {bus}: {str(exc).splitlines()[0]}"
        except Exception as exc:  # the database away (StoreError, psycopg2's): retried
            with contextlib.suppress(Exception):
                if self._conn is not None:
                    self._conn.close()
            self._conn = None
            return RETRY, f"bus {bus}: {first_line(exc)}"
        return DELIVERED, None

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
