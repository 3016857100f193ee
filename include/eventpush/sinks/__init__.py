"""Sinks: what sending needs from a kind of target, and how a kind is found by its URL scheme.

A **sink kind** is a class; the engine and replay open one instance of it per process and send
every target of that kind through it:

- ``Kind(policy)`` opens it (cheap: connections are made on first use), with the address
  policy every connection it makes must pass, checked on the resolved address;
- ``await sink.send(target, records, transform, traceparent)`` makes **one attempt** at one
  record or a batch (``len(records) <= target.batch_size``), carrying ``traceparent`` (the
  attempt's W3C trace context, a string, or None) where the destination has a place for it,
  and classifies it as an
  :class:`~eventpush.sinks.contract.Outcome`: ``DELIVERED``, ``RETRY`` (with
  ``retry_after_s`` when the target asked for a delay) or ``FINAL``. It never raises for
  trouble with the target, and it never changes ``records`` (attempt counts, retries, rows
  and offsets stay the engine's);
- ``await sink.close()`` lets everything go;
- ``Kind.validate_url(url, policy)`` checks a target URL when the target is created, its
  host through the address policy (:func:`eventpush.addresses.check_host`);
  :func:`validate_url` hands a URL to its kind's.

The contract's types (:class:`Target`, :class:`Record`, :class:`Outcome`, the answers) are in
:mod:`eventpush.sinks.contract`, the retry arithmetic in :mod:`eventpush.sinks.retry`; neither
imports the push runtime.

**The idempotency key.** Every record a runner sends has one key,
:func:`eventpush.sinks.contract.record_key` (``msg_<runner id>.<queue>.<offset>``): the same
for every retry, for the worker that takes the runner over after a crash and for every
replay of that record to that target, so a destination that drops repeated keys drops the
copies those make; and never the same for two runners, so two targets writing one
destination (two subjects of one JetStream stream, two rules posting to one URL) never look
like copies of each other. A sink that hands a destination its own idempotency field uses
this key, per record, also inside a batch (JetStream's ``Nats-Msg-Id``: one message and one
key per record). HTTP's ``webhook-id`` is the record's key too
(:func:`~eventpush.sinks.contract.webhook_id`): Standard Webhooks receivers drop a
``webhook-id`` they have seen, so an id per event, shared by its targets, would lose every
copy but the first at a receiver two targets post to; a batch request's ``webhook-id`` is a
digest of its runner and positions and names that request only. The event's own ``id``
stays in the body for a receiver that wants the event once whatever the target.

**Reading back** (optional): a kind whose destination can be read has ``await
sink.read_back(url, since, found)``, which calls ``found(key)`` for the key of every record the
destination holds for the target at ``url`` (at least those stored at or after ``since``, a
datetime or None for all; more is harmless) and returns a
:class:`~eventpush.sinks.contract.Retention`: what it read and what the destination's own
limits removed (aged out, not lost). It raises when the destination cannot be read. ``audit
--verify-sinks`` compares it with the books (:mod:`eventpush.sinks.readback`); a kind without
the method is reported as not readable.

A kind is found through the entry-point group ``eventpush.sinks``: the entry point's name is
the URL scheme, its value the class. eventpush declares its own (``http``, ``https``,
``nats``) in ``pyproject.toml``; a third party adds a scheme by declaring one in its own
package, without editing eventpush. The built-in kinds are also known without metadata, so a
checkout that was not reinstalled and Spark executors (which import eventpush from a zip)
find them too. Sources are found the same way (:class:`eventpush.plugins.Registry`): a
scheme claimed twice, or a built-in's claimed by a plug-in, is refused.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

from eventpush import tracing
from eventpush.addresses import (
    AddressPolicy,
    InvalidTargetUrlError,
    address_policy,
    scheme_of,
    split_url,
)
from eventpush.errors import first_line
from eventpush.plugins import PluginConflictError, Registry
from eventpush.sinks.contract import FINAL, RETRY, Outcome, Record, Sink, Target
from eventpush.sinks.retry import backoff_s, out_of_attempts

GROUP = "eventpush.sinks"
REGISTRY = Registry(
    GROUP,
    {
        "http": "eventpush.sinks.http:HttpSink",
        "https": "eventpush.sinks.http:HttpSink",
        "nats": "eventpush.sinks.nats:NatsSink",
        "bus": "eventpush.bus_targets:BusSink",
    },
    "sink scheme",
)
# The name callers and plug-in authors know (two packages claiming one scheme).
SinkConflictError = PluginConflictError
# Target URLs whose sink and sender a process keeps (past it they are looked up afresh): a
# worker runs for weeks while targets are created, changed and deleted.
URL_CACHE = 10_000


def readable(url: str) -> bool:
    """Whether the sink kind of ``url`` can read its destination back (``read_back``)."""
    try:
        return callable(getattr(sink_kind(scheme_of(url)), "read_back", None))
    except InvalidTargetUrlError:
        return False


def schemes() -> list[str]:
    """Every scheme a target URL may use here."""
    return REGISTRY.names()


def sink_kind(scheme: str) -> type[Sink]:
    """The sink class for ``scheme`` (InvalidTargetUrlError when nothing provides it)."""
    kind = REGISTRY.load(scheme)
    if kind is None:
        raise InvalidTargetUrlError(
            f"no sink for URL scheme {scheme!r}: known schemes are {', '.join(schemes())}; "
            f"a plug-in adds one through the entry-point group {GROUP!r}"
        )
    return kind


def validate_url(url: str, policy: AddressPolicy | None = None) -> str:
    """A target URL, checked by the sink kind of its scheme; raises InvalidTargetUrlError
    saying what is wrong."""
    url, parts, _, where = split_url(url, "target URL")
    scheme = parts.scheme
    if scheme:
        try:
            kind = sink_kind(scheme)
        except InvalidTargetUrlError:
            pass
        else:
            return kind.validate_url(url, policy)
    raise InvalidTargetUrlError(
        f"target URL {where!r} must use http or https, nats, or a scheme a sink plug-in "
        f"registers; not {scheme or 'no scheme'!r}"
    )


Sender = Callable[[Target, list[Record], object, str | None], Awaitable[Outcome]]


def _takes_traceparent(send: Callable) -> bool:
    """Whether a kind's ``send`` takes the trace context: plug-ins written before it was an
    argument take three, and are sent to without it rather than broken."""
    try:
        params = inspect.signature(send).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C callable): assume current
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (
        any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        or sum(p.kind in positional for p in params) >= 4
    )


def transform_failed(exc: BaseException) -> Outcome:
    """A transform that cannot apply to these events: final, and nothing left the process."""
    return Outcome(FINAL, None, f"transform failed: {first_line(exc)}", 0.0, reached=False)


class Sinks:
    """The sinks one process sends through: one open instance per kind, opened on first use,
    all under one address policy (default: the environment's, read now so a bad range fails
    at start)."""

    def __init__(self, policy: AddressPolicy | None = None) -> None:
        self.policy = policy if policy is not None else address_policy()
        self._open: dict[type, Sink] = {}
        self._by_url: dict[str, Sink] = {}
        # Each URL's sender, its signature read once: replay sends through ``send`` on every
        # attempt, and reading a signature costs a third of an HTTP attempt's own CPU.
        self._senders: dict[str, Sender] = {}

    def sink_for(self, url: str) -> Sink:
        sink = self._by_url.get(url)
        if sink is None:
            kind = sink_kind(scheme_of(url))
            sink = self._open.get(kind)
            if sink is None:
                sink = self._open[kind] = kind(self.policy)
            if len(self._by_url) >= URL_CACHE:  # bounded: every URL ever sent to stayed
                self._by_url.clear()
            self._by_url[url] = sink
        return sink

    def sender_for(self, url: str) -> Sender:
        """``send`` of the sink for ``url``, looked up once so a caller may keep it per target;
        with no sink for the URL's scheme, a send whose every attempt fails finally."""
        sender = self._senders.get(url)
        if sender is None:
            if len(self._senders) >= URL_CACHE:  # bounded: every URL ever sent to stayed
                self._senders.clear()
            sender = self._senders[url] = self._sender(url)
        return sender

    def _sender(self, url: str) -> Sender:
        try:
            send = self.sink_for(url).send
        except InvalidTargetUrlError as exc:  # its plug-in was uninstalled since
            error = str(exc)

            async def unavailable(
                target: Target, records: list[Record], transform, traceparent: str | None
            ) -> Outcome:
                return Outcome(FINAL, None, error, 0.0, reached=False)

            return unavailable
        if _takes_traceparent(send):
            return send

        def without_trace(target: Target, records: list[Record], transform, traceparent):
            return send(target, records, transform)

        return without_trace

    async def send(
        self, target: Target, records: list[Record], transform, traceparent: str | None = None
    ) -> Outcome:
        """One attempt through the target's sink."""
        return await self.sender_for(target.url)(target, records, transform, traceparent)

    async def deliver(self, target: Target, records: list[Record], transform) -> Outcome:
        """Attempts with retries inline (as replay does), each in its own trace span: the
        final outcome, with ``records[*].attempts`` updated. Records a sink answers one by one
        (``Outcome.per_record``) are retried alone; the outcome then holds each one's last
        answer, and in ``held`` the records the destination held already at the first
        attempt."""
        start = time.monotonic()
        for r in records:
            r.first_seen = r.first_seen or start
        answers: list[tuple[str, str | None]] = [(RETRY, None)] * len(records)
        todo = list(range(len(records)))  # indexes of the records still to send
        held = None  # what the first attempt found held already (a retry's says nothing)
        while True:
            sending = [records[i] for i in todo]
            outcome = await tracing.in_deliver_span(
                target,
                sending,
                lambda parent, sending=sending: self.send(target, sending, transform, parent),
            )
            if held is None:
                held = (outcome.held or [], outcome.held_by)
            for r in sending:
                r.attempts += 1
            parts = outcome.per_record or [(outcome.kind, outcome.error)] * len(sending)
            for i, part in zip(todo, parts, strict=True):
                answers[i] = part
            todo = [i for i, (kind, _) in zip(todo, parts, strict=True) if kind == RETRY]
            if not todo:
                break
            delay = backoff_s(target, records[todo[0]].attempts, outcome.retry_after_s)
            if out_of_attempts(target, records[todo[0]], time.monotonic(), delay):
                break
            await asyncio.sleep(delay)
        if len(set(answers)) > 1:
            outcome.per_record = answers
        outcome.held, outcome.held_by = (held[0] or None), held[1]
        return outcome

    async def close(self) -> None:
        sinks, self._open, self._by_url = list(self._open.values()), {}, {}
        self._senders = {}
        for sink in sinks:
            await sink.close()

    async def __aenter__(self) -> Sinks:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
