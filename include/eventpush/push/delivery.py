"""One HTTP delivery attempt to a target, and the retry policy around it.

Used through the HTTP sink (``eventpush.sinks.http``) by the push engine, which schedules
retries itself in a low-priority lane, and by replay, which retries inline
(``eventpush.sinks.Sinks.deliver``). Classification follows docs/ARCHITECTURE.md: 2xx
delivered; 5xx, 408, 429, timeouts and connection errors retried; any other status final.

Targets are treated as adversaries: a redirect is an answer (final, never followed), a body is
read up to ``BODY_CAP`` bytes and the connection dropped past that, ``Retry-After`` is clamped
to finite bounds, every address is checked against the address policy and the client pinned
to it before it connects (:class:`Session`), and every error text passes
:func:`eventpush.config.redact` before it leaves this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import math
import random
import re
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

from pyreqwest.client import Client, ClientBuilder
from pyreqwest.exceptions import PyreqwestError, RequestTimeoutError
from pyreqwest.http import Url

from eventpush import tracing
from eventpush.config import redact, redact_url
from eventpush.push.policy import DEFAULTS, LIMITS
from eventpush.push.targets import (
    AddressPolicy,
    InvalidTargetUrlError,
    RefusedAddressError,
    address_policy,
)

USER_AGENT = "eventpush/0.1"
RETRY_AFTER_CAP_S = 300.0
BACKOFF_CAP_S = 60.0
BODY_CAP = 64 * 1024  # what we read of an answer; a target may send more, we never hold it
URL_CACHE = 10_000  # parsed target URLs kept (a replay may meet many)
PIN_TTL_S = 60.0  # how long a checked address stays pinned before the name is resolved again
# A re-pinned client is closed once no send can still be using it: past the longest timeout.
RETIRED_CLOSE_S = LIMITS["timeout_ms"][1] / 1000 + 30
# RFC 9110 delay-seconds is digits only; a fraction is tolerated, signs and exponents are not.
_DELAY_SECONDS = re.compile(r"\d+(\.\d+)?")

DELIVERED = "delivered"
RETRY = "retry"
FINAL = "final"


@dataclass(frozen=True)
class Target:
    """A runner's target as the engine pushes it (secret included: never log this object)."""

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
    max_attempts: int = DEFAULTS.max_attempts
    backoff_ms: int = DEFAULTS.backoff_ms
    max_age_s: int = DEFAULTS.max_age_s
    timeout_ms: int = DEFAULTS.timeout_ms
    batch_size: int = DEFAULTS.batch_size
    concurrency: int = DEFAULTS.concurrency
    ordered: bool = False
    # The bus's settings for the input transformer's <aws.events.event> and rule ARN.
    bus_account: str | None = None
    bus_region: str | None = None
    # The bus's source kind: the broker_name of the runner's delivery and failure rows.
    broker: str = "eventpush"


@dataclass(slots=True)
class Record:
    """One event on its way to one runner's target."""

    queue_id: int
    offset: int
    message_id: str
    event: dict
    raw: str
    first_seen: float = 0.0  # monotonic time it was pulled: max_age_s counts from here
    attempts: int = 0


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


TARGET_SQL = """
SELECT r.id, r.name, b.name, b.id, ru.name, ru.pattern::text, t.name, t.url, t.secret,
       t.transform_kind, t.transform_spec, t.max_attempts, t.backoff_ms, t.max_age_s,
       t.timeout_ms, t.batch_size, t.concurrency, t.ordered, b.account, b.region, b.source_url
FROM event_target_runner r
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus b ON b.id = ru.bus_id
"""


def load_targets(cur, where: str = "TRUE", params: tuple = ()) -> list[Target]:
    """Targets joined with their runner, rule and bus; ``where`` is a fixed SQL condition
    over aliases r, t, ru, b with its values in ``params``."""
    from eventpush.sources import broker_name

    cur.execute(f"{TARGET_SQL} WHERE {where} ORDER BY r.id", params)
    return [Target(*row[:-1], broker=broker_name(row[-1])) for row in cur.fetchall()]


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


def build_request(
    target: Target,
    records: list[Record],
    transform,
    now: datetime | None = None,
    traceparent: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one request: one event, or a JSON array for batch targets;
    with ``traceparent``, the header of that name too (built here, not copied in later)."""
    if target.batch_size > 1:
        body = b"[" + b",".join(_body(target, r, transform) for r in records) + b"]"
    else:
        body = _body(target, records[0], transform)
    msg_id = webhook_id(target, records)
    headers = {"content-type": "application/json", "user-agent": USER_AGENT, "webhook-id": msg_id}
    if target.secret:
        from standardwebhooks import Webhook

        now = now or datetime.now(UTC)
        headers["webhook-timestamp"] = str(int(now.timestamp()))
        headers["webhook-signature"] = Webhook(target.secret).sign(
            msg_id, now, body.decode("utf-8")
        )
    if traceparent is not None:
        headers["traceparent"] = traceparent
    return body, headers


def _body(target: Target, record: Record, transform) -> bytes:
    if target.transform_kind == "ORIGINAL":
        return record.raw.encode()  # the event exactly as stored: no re-serialising
    return transform.apply(
        record.event,
        target.rule,
        bus=target.bus,
        account=target.bus_account,
        region=target.bus_region,
    )


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


def classify(status: int) -> str:
    if 200 <= status < 300:
        return DELIVERED
    if status >= 500 or status in (408, 429):
        return RETRY
    return FINAL


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date), always finite
    and within [0, RETRY_AFTER_CAP_S]; None when the value means nothing (the usual backoff
    applies then)."""
    if not value:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        seconds = float(value)
    else:
        try:
            when = parsedate_to_datetime(value)
            if when.tzinfo is None:  # "-0000" dates parse naive; RFC 9110 dates are GMT
                when = when.replace(tzinfo=UTC)
            seconds = (when - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError, OverflowError, IndexError):
            return None
    return _clamp(seconds, 0.0, RETRY_AFTER_CAP_S)


def _clamp(value: float, low: float, high: float) -> float:
    if not math.isfinite(value):
        return high if value > 0 else low  # nan counts as low: it asked for nothing
    return min(max(value, low), high)


def backoff_s(target: Target, attempts: int, retry_after_s: float | None = None) -> float:
    """Delay before the next attempt: what the target asked, within the policy's bounds (no
    sooner than the target's backoff, no later than RETRY_AFTER_CAP_S), or else exponential
    with full jitter. Always finite."""
    floor = min(target.backoff_ms / 1000, RETRY_AFTER_CAP_S)
    if retry_after_s is not None:
        return _clamp(retry_after_s, floor, RETRY_AFTER_CAP_S)
    ceiling = min(BACKOFF_CAP_S, target.backoff_ms / 1000 * 2 ** min(max(attempts - 1, 0), 64))
    return random.uniform(ceiling / 2, ceiling)


def out_of_attempts(target: Target, record: Record, now: float, delay: float = 0.0) -> bool:
    """True when another attempt is not allowed: by count, or by age once the delay passes."""
    if record.attempts >= target.max_attempts:
        return True
    return (now + delay) - record.first_seen > target.max_age_s


class Session:
    """The pooled HTTP client of a worker or a replay partition (``async with`` closes it).

    Requests go through ``pyreqwest`` (reqwest, hyper and tokio underneath): the HTTP work
    runs on tokio's thread, off the event loop. reqwest would resolve names itself, after our
    checks, so this class does the resolving: per scheme, host and port it resolves the name,
    refuses it when any address is denied (a name mixing a public and a private address is a
    rebinding trick, not a target), and builds a client whose only route to that name is the
    checked address (``resolve(domain, ip, port)``), for ``PIN_TTL_S``. Every connection thus
    goes to an address the policy passed, and a name cannot be rebound between the check and
    the connect. IP-literal URLs are checked the same way."""

    def __init__(self, limit: int = 0, policy: AddressPolicy | None = None) -> None:
        self._policy = policy if policy is not None else address_policy()
        self._limit = limit
        self._routes: dict[str, _Route] = {}  # target URL -> its pinned client
        self._timeouts: dict[int, timedelta] = {}
        self._urls: dict[str, Url] = {}  # target URL -> parsed once (a str is parsed per request)
        self._retired: list[tuple[Client, float]] = []  # re-pinned clients, when retired

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        clients = {id(r.client): r.client for r in self._routes.values()}
        clients.update((id(c), c) for c, _ in self._retired)
        self._routes.clear()
        self._retired.clear()
        for client in clients.values():
            with contextlib.suppress(Exception):  # a client that will not close stops nothing
                await client.close()

    def url(self, url: str) -> Url:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= URL_CACHE:
                self._urls.clear()
            parsed = self._urls[url] = Url(url)
        return parsed

    def timeout(self, ms: int) -> timedelta:
        td = self._timeouts.get(ms)
        if td is None:
            td = self._timeouts[ms] = timedelta(milliseconds=ms)
        return td

    def pinned(self, url: str) -> Client | None:
        """The client pinned to ``url`` while its pin is fresh (no await on the hot path)."""
        route = self._routes.get(url)
        if route is not None and route.expires > time.monotonic():
            return route.client
        return None

    async def client_for(self, url: str) -> Client:
        """The client pinned to ``url``'s checked address; raises RefusedAddressError for a
        denied one, InvalidTargetUrlError for a URL that cannot be sent to, OSError when the
        name does not resolve."""
        client = self.pinned(url)
        if client is not None:
            return client
        route = self._routes.get(url)
        now = time.monotonic()
        origin = _origin(url)
        addresses = await self._checked_addresses(origin[1], origin[2])
        if route is not None and route.address in addresses:  # the pin still holds
            route.expires = now + PIN_TTL_S
            return route.client
        for other in self._routes.values():  # another target's fresh route to that origin
            if other.origin == origin and other.address in addresses and other.expires > now:
                self._routes[url] = other
                return other.client
        if route is not None:
            self._retire(route.client, now)
        route = self._routes[url] = _Route(self._build(origin, addresses[0]), origin, addresses[0])
        route.expires = now + PIN_TTL_S
        return route.client

    def _build(self, origin: tuple[str, str, int], address: str) -> Client:
        _, host, port = origin
        builder = (
            ClientBuilder()
            .follow_redirects(False)  # a 3xx is the target's answer
            .no_proxy()  # no proxy from the environment between us and the policy
            .gzip(False)  # we never look inside a body: no decompression bombs
            .brotli(False)
            .zstd(False)
            .deflate(False)
            .referer(False)
        )
        if self._limit:
            builder = builder.max_connections(self._limit)
        if address != host:  # a name: its one route is the address we checked
            builder = builder.resolve(host, address, port)
        return builder.build()

    def _retire(self, client: Client, now: float) -> None:
        """A client whose pin moved: closed once no send can still be using it."""
        due = [c for c, at in self._retired if now - at > RETIRED_CLOSE_S]
        self._retired = [(c, at) for c, at in self._retired if now - at <= RETIRED_CLOSE_S]
        self._retired.append((client, now))
        for old in due:
            asyncio.get_running_loop().create_task(old.close())

    async def _checked_addresses(self, host: str, port: int) -> list[str]:
        """Every address of ``host`` (itself for an IP literal), each passed by the policy."""
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
            addresses = list(dict.fromkeys(info[4][0] for info in infos))
        else:
            addresses = [host]
        if not addresses:
            raise OSError(f"{host} resolves to no address")
        for address in addresses:
            self._policy.check(address)
        return addresses


@dataclass(slots=True)
class _Route:
    client: Client
    origin: tuple[str, str, int]  # scheme, host, port
    address: str
    expires: float = 0.0


def _origin(url: str) -> tuple[str, str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidTargetUrlError(f"target URL is malformed: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidTargetUrlError("target URL must be http or https with a host")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def new_session(limit: int = 0, policy: AddressPolicy | None = None) -> Session:
    """A pooled HTTP session; ``limit`` caps the requests in flight per origin (0: no cap).
    ``policy`` is the address policy (default: the environment's, read now so a bad range
    fails at start)."""
    return Session(limit, policy)


def attempt(
    session: Session, target: Target, body: bytes, headers: dict[str, str]
) -> Awaitable[Outcome]:
    """One POST with the target's timeout (the client's own: no timer of ours), carrying the
    ``traceparent`` of the attempt under way (``tracing.OUTGOING``). Never raises for network
    trouble. Returns the request coroutine itself: no frame of its own on the hot path."""
    traceparent = tracing.OUTGOING.get()
    if traceparent is not None:  # the span of this attempt, so the receiver can join it
        headers = {**headers, "traceparent": traceparent}
    return post(session, target, body, headers)


async def post(session: Session, target: Target, body: bytes, headers: dict[str, str]) -> Outcome:
    """One POST of ``body`` with exactly ``headers``: :func:`attempt` without the trace
    context. Once the status line is in, it is the answer: trouble with the body after it
    changes nothing.

    The answer's body is never handed to Python: the client reads at most ``BODY_CAP`` of it
    before the status is returned (its streamed read buffer), and leaving the context drops
    whatever is left, with the connection when the body was longer. A short answer has been
    read to its end by then, so its connection goes back to the pool."""
    started = time.perf_counter()
    status: int | None = None
    retry_after = location = None
    try:
        client = session.pinned(target.url) or await session.client_for(target.url)
        request = (
            client.post(session.url(target.url))
            .headers(headers)
            .body_bytes(body)
            .timeout(session.timeout(target.timeout_ms))
            .streamed_read_buffer_limit(BODY_CAP)
            .build_streamed()
        )
        async with request as resp:
            status = resp.status
            retry_after = resp.get_header("retry-after")
            location = resp.get_header("location")
    except (RefusedAddressError, InvalidTargetUrlError) as exc:
        refused = _outcome(target, FINAL, None, f"refused address: {exc}", started)
        refused.reached = False
        return refused
    except RequestTimeoutError:
        if status is None:
            return _outcome(target, RETRY, None, f"timed out after {target.timeout_ms} ms", started)
    except (PyreqwestError, OSError, ValueError) as exc:
        # ValueError: a URL the client cannot send to (a final condition).
        if status is None:
            kind = FINAL if isinstance(exc, ValueError) else RETRY
            return _outcome(target, kind, None, f"connection failed: {_short(exc)}", started)
    kind = classify(status)
    if kind == DELIVERED:
        error = None
    elif 300 <= status < 400:
        where = f" to {redact_url(location)}" if location else ""
        error = f"HTTP {status}: redirect{where} not followed"
    else:
        error = f"HTTP {status}"
    outcome = _outcome(target, kind, status, error, started)
    if status in (429, 503):
        outcome.retry_after_s = parse_retry_after(retry_after)
    return outcome


def _outcome(
    target: Target, kind: str, status: int | None, error: str | None, started: float
) -> Outcome:
    if error is not None:
        error = redact(error, target.url)
    return Outcome(kind, status, error, (time.perf_counter() - started) * 1000)


def _short(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def load_json(value) -> object:
    return json.loads(value) if isinstance(value, str) else value
