"""The sink contract: what the push runtime hands a sink and what a sink answers.

A sink kind (``eventpush.sinks``) sends :class:`Record` s to a :class:`Target` and answers one
:class:`Outcome` per attempt: ``DELIVERED``, ``RETRY`` or ``FINAL``. Attempt counts, retries,
rows and offsets stay the runtime's. This module imports nothing of the runtime, so a sink
(built in or a plug-in) depends on the contract alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import msgspec

from eventpush.addresses import AddressPolicy
from eventpush.policy import TargetPolicy

_decode = msgspec.json.Decoder().decode

DELIVERED = "delivered"
RETRY = "retry"
FINAL = "final"


API_KEY = "api-key"
BASIC = "basic"
OAUTH = "oauth-client-credentials"
AUTH_KINDS = (API_KEY, BASIC, OAUTH)


@dataclass(frozen=True)
class Auth:
    """A connection's credentials as a sink applies them (secret included: never log this).

    ``name`` is the API key's header name, the Basic user name or the OAuth2 client id;
    ``secret`` the key's value, the password or the client secret. ``connection_id`` and
    ``version`` key what a sink caches for it (an OAuth2 token): a changed or re-created
    connection never reuses the token of the one before."""

    connection_id: int
    connection: str  # its name, for errors
    version: int
    kind: str  # one of AUTH_KINDS
    name: str
    secret: str = field(repr=False)
    token_url: str | None = None
    scopes: tuple[str, ...] = ()
    params: tuple[tuple[str, str], ...] = ()  # extra fields of the token request

    @property
    def key(self) -> tuple[int, int]:
        return (self.connection_id, self.version)


@dataclass(frozen=True)
class Tls:
    """Client certificate and key (PEM files, both or neither) and a CA bundle to trust
    besides the public roots (certifi's), by path on the worker's host."""

    client_cert_file: str | None = None
    client_key_file: str | None = None
    ca_file: str | None = None


@dataclass(frozen=True)
class Target(TargetPolicy):
    """A runner's target as the engine pushes it (secret included: never log this object);
    its retry and flow settings are :class:`~eventpush.policy.TargetPolicy`'s (keyword-only)."""

    runner_id: int
    runner: str
    bus: str
    bus_id: int
    rule: str
    pattern: str
    name: str
    url: str
    secret: str | None = field(default=None, repr=False)
    transform_kind: str = "ORIGINAL"
    transform_spec: object = None
    # The bus's settings for the input transformer's <aws.events.event> and rule ARN.
    bus_account: str | None = None
    bus_region: str | None = None
    # The bus's source kind: the broker_name of the runner's delivery and failure rows.
    broker: str = "eventpush"
    # Standard Webhooks rotation: the previous secret also signs until ``secret_old_until``.
    secret_old: str | None = field(default=None, repr=False)
    secret_old_until: datetime | None = None
    # The catalog versions this target was read at (push/versions.py records from which
    # offset each one judges the runner's events), and its rule's state then.
    rule_version: int = 1
    target_version: int = 1
    rule_state: str = "ENABLED"
    # Issue 32: the API destination this target sends through (None: a plain --url target).
    # ``destination`` keys the whole-destination rate limit and the adaptive concurrency.
    destination: str | None = None
    method: str = "POST"
    rate_limit: float | None = None  # invocations per second for the destination as a whole
    concurrency_auto: bool = False  # --concurrency auto: the in-flight limit adapts (AIMD)
    # Issue 32, what each request carries besides the body and the Standard Webhooks headers:
    # the connection's credentials (secrets: repr off), the connection's then the target's
    # headers (lower-case names, checked at create: never a webhook-*, traceparent or
    # hop-by-hop one), the connection's query parameters, and the client certificate and CA
    # files (mTLS, private CAs).
    auth: Auth | None = field(default=None, repr=False)
    headers: tuple[tuple[str, str], ...] = ()
    query: tuple[tuple[str, str], ...] = ()
    tls: Tls | None = None

    def signing_secrets(self, now: datetime) -> list[str]:
        """The secrets that sign a request sent at ``now``: the current one first."""
        old, until = self.secret_old, self.secret_old_until
        if old is not None and until is not None and now < until:
            return [s for s in (self.secret, old) if s]
        return [self.secret] if self.secret else []


def parse_event(raw: str) -> dict:
    """A stored event's text as a dict: msgspec (several times faster than json); json for
    what msgspec refuses and PostgreSQL may still hold, such as a number past a float's range."""
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


@dataclass(slots=True)
class Record:
    """One event on its way to one runner's target. ``parsed`` may be None: the reader can
    know the record is its runner's without parsing it (push/reading.py), and a target that
    sends the body as stored never needs the dict; ``event`` parses it on first use."""

    queue_id: int
    offset: int
    message_id: str
    parsed: dict | None
    raw: str
    first_seen: float = 0.0  # monotonic time it was pulled: max_age_s counts from here
    attempts: int = 0

    @property
    def event(self) -> dict:
        if self.parsed is None:
            self.parsed = parse_event(self.raw)
        return self.parsed


@dataclass(slots=True)
class Outcome:
    """What one attempt came to."""

    kind: str  # DELIVERED, RETRY or FINAL
    http_status: int | None
    error: str | None
    latency_ms: float
    retry_after_s: float | None = None
    reached: bool = True  # False when refused before any packet left (address policy)
    # A sink whose batch records are answered one by one (JetStream) and whose answers
    # differ: (kind, error) per record, in the batch's order; ``kind`` and ``error`` above
    # then say what the send as a whole came to (for the breaker and the metrics).
    per_record: list[tuple[str, str | None]] | None = None
    # Indexes (in the send's order) of records the destination said it already held under
    # their key (a JetStream duplicate): delivered all the same; on a first send the engine
    # counts and warns (two writers share keys). ``held_by`` names the destination.
    held: list[int] | None = None
    held_by: str | None = None


@dataclass(frozen=True)
class Retention:
    """What a read-back read (``where``, e.g. ``stream ORDERS``) and what the destination's own
    limits removed: a record delivered before ``kept_from`` (None: no such time) is gone by
    them, not lost; with ``trimmed`` the destination drops its oldest records (a stream's
    first sequence has moved on), so a record older, in its runner's queue order, than every
    record of that queue it still holds was dropped by them too."""

    where: str
    kept_from: datetime | None = None
    trimmed: bool = False


class Sink(Protocol):
    """One open sink kind; see ``eventpush.sinks`` for the contract."""

    def __init__(self, policy: AddressPolicy) -> None: ...

    @staticmethod
    def validate_url(url: str, policy: AddressPolicy | None = None) -> str: ...

    def send(
        self, target: Target, records: list[Record], transform, traceparent: str | None = None
    ) -> Awaitable[Outcome]: ...

    async def close(self) -> None: ...


def record_key(runner_id: int, queue_id: int, offset: int) -> str:
    """A record's idempotency key at its target (the sink contract: ``eventpush.sinks``):
    ``msg_<runner id>.<queue>.<offset>``. One per runner and record: the same for every
    retry, every worker that takes the runner over after a crash and every replay of that
    record to that target (so the destination can drop the copies they make), and never
    the same for two runners, even when their targets write one destination (two subjects
    of one JetStream stream, one receiver URL). The event's own id is not in it: the
    targets of one event would share it, and a publisher may reuse an event id."""
    return f"msg_{runner_id}.{queue_id}.{offset}"


def webhook_id(target: Target, records: list[Record]) -> str:
    """The ``webhook-id`` of one request: the record's key (:func:`record_key`) for one
    record; for a batch, a digest of the runner and the records' positions, which names that
    request only (each record of it keeps its own key, which a sink writing records one by
    one uses)."""
    if len(records) == 1:
        r = records[0]
        return record_key(target.runner_id, r.queue_id, r.offset)
    digest = hashlib.sha256(
        (f"{target.runner_id}:" + ",".join(f"{r.queue_id}.{r.offset}" for r in records)).encode()
    ).hexdigest()[:32]
    return f"batch_{digest}"


def by_answer(records: list[Record], outcome: Outcome) -> list[tuple[Outcome, list[Record]]]:
    """A send's records grouped by their own answers (``outcome.per_record``, in the batch's
    order), each group with the outcome it settles on; one group when all share one."""
    if outcome.per_record is None:
        return [(outcome, records)]
    groups: dict[tuple[str, str | None], list[Record]] = {}
    for record, answer in zip(records, outcome.per_record, strict=True):
        groups.setdefault(answer, []).append(record)
    return [
        (Outcome(kind, outcome.http_status, error, outcome.latency_ms, outcome.retry_after_s), rs)
        for (kind, error), rs in groups.items()
    ]
