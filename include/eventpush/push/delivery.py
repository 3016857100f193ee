"""One HTTP delivery attempt to a target, and the retry policy around it.

Used through the HTTP sink (``eventpush.sinks.http``) by the push engine, which schedules
retries itself in a low-priority lane, and by replay, which retries inline
(``eventpush.sinks.Sinks.deliver``). Classification follows docs/ARCHITECTURE.md: 2xx
delivered; 5xx, 408, 429, timeouts and connection errors retried; any other status final.

Targets are treated as adversaries: a redirect is an answer (final, never followed), a body is
read up to ``BODY_CAP`` bytes and the connection dropped past that, ``Retry-After`` is clamped
to finite bounds, every socket is checked against the address policy right before it connects,
and every error text passes :func:`eventpush.config.redact` before it leaves this module.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver

from eventpush import tracing
from eventpush.config import redact, redact_url
from eventpush.push.policy import DEFAULTS
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


TARGET_SQL = """
SELECT r.id, r.name, b.name, b.id, ru.name, ru.pattern::text, t.name, t.url, t.secret,
       t.transform_kind, t.transform_spec, t.max_attempts, t.backoff_ms, t.max_age_s,
       t.timeout_ms, t.batch_size, t.concurrency, t.ordered, b.account, b.region
FROM event_target_runner r
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus b ON b.id = ru.bus_id
"""


def load_targets(cur, where: str = "TRUE", params: tuple = ()) -> list[Target]:
    """Targets joined with their runner, rule and bus; ``where`` is a fixed SQL condition
    over aliases r, t, ru, b with its values in ``params``."""
    cur.execute(f"{TARGET_SQL} WHERE {where} ORDER BY r.id", params)
    return [Target(*row) for row in cur.fetchall()]


def webhook_id(target: Target, records: list[Record]) -> str:
    """The idempotency key: the same for every retry and replay of the same records."""
    if len(records) == 1:
        return f"msg_{records[0].message_id}"
    digest = hashlib.sha256(
        (f"{target.runner_id}:" + ",".join(f"{r.queue_id}.{r.offset}" for r in records)).encode()
    ).hexdigest()[:32]
    return f"batch_{digest}"


def build_request(
    target: Target, records: list[Record], transform, now: datetime | None = None
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one request: one event, or a JSON array for batch targets."""
    if target.batch_size > 1:
        body = b"[" + b",".join(_body(target, r, transform) for r in records) + b"]"
    else:
        body = _body(target, records[0], transform)
    headers = {"content-type": "application/json", "user-agent": USER_AGENT}
    msg_id = webhook_id(target, records)
    headers["webhook-id"] = msg_id
    if target.secret:
        from standardwebhooks import Webhook

        now = now or datetime.now(UTC)
        headers["webhook-timestamp"] = str(int(now.timestamp()))
        headers["webhook-signature"] = Webhook(target.secret).sign(
            msg_id, now, body.decode("utf-8")
        )
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


class GuardedResolver(AbstractResolver):
    """Resolves like aiohttp does, then refuses the name when any of its addresses is denied
    (a name that mixes a public and a private address is a rebinding trick, not a target)."""

    def __init__(self, policy: AddressPolicy) -> None:
        self._inner = DefaultResolver()
        self._policy = policy

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        infos = await self._inner.resolve(host, port, family)
        for info in infos:
            self._policy.check(info["host"])
        return infos

    async def close(self) -> None:
        await self._inner.close()


def guarded_socket_factory(policy: AddressPolicy):
    """Sockets for aiohttp that refuse denied addresses right before they connect. aiohttp
    skips the resolver for IP-literal URLs; every connection still passes here."""

    def make(addr_info) -> socket.socket:
        family, type_, proto, _, address = addr_info
        policy.check(address[0])
        return socket.socket(family=family, type=type_, proto=proto)

    return make


def new_session(limit: int = 0, policy: AddressPolicy | None = None) -> aiohttp.ClientSession:
    """A pooled HTTP session; ``limit`` caps open connections (0: no cap). ``policy`` is the
    address policy (default: the environment's, read now so a bad range fails at start)."""
    policy = policy if policy is not None else address_policy()
    connector = aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=0,
        resolver=GuardedResolver(policy),
        ttl_dns_cache=60,
        socket_factory=guarded_socket_factory(policy),
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        raise_for_status=False,
        auto_decompress=False,  # we never look inside a body: no decompression bombs
        trust_env=False,  # no proxy from the environment between us and the policy
    )


async def _read_capped(resp: aiohttp.ClientResponse) -> None:
    """Read the answer's body up to BODY_CAP; past that, drop the connection unread."""
    seen = 0
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            return  # the whole body: the connection goes back to the pool
        seen += len(chunk)
        if seen > BODY_CAP:
            resp.close()
            return


async def attempt(
    session: aiohttp.ClientSession, target: Target, body: bytes, headers: dict[str, str]
) -> Outcome:
    """One POST with the target's timeout. Never raises for network trouble. Once the status
    line is in, it is the answer: trouble with the body after it changes nothing."""
    started = time.perf_counter()
    status: int | None = None
    retry_after = location = None
    traceparent = tracing.OUTGOING.get()
    if traceparent is not None:  # the span of this attempt, so the receiver can join it
        headers = {**headers, "traceparent": traceparent}
    try:
        async with asyncio.timeout(target.timeout_ms / 1000):
            async with session.post(
                target.url, data=body, headers=headers, allow_redirects=False
            ) as resp:
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
                location = resp.headers.get("Location")
                try:
                    await _read_capped(resp)
                except (aiohttp.ClientError, OSError):
                    resp.close()
    except TimeoutError:
        if status is None:
            return _outcome(target, RETRY, None, f"timed out after {target.timeout_ms} ms", started)
    except InvalidTargetUrlError as exc:
        refused = _outcome(target, FINAL, None, f"refused address: {exc}", started)
        refused.reached = False
        return refused
    except aiohttp.ClientConnectorError as exc:
        cause = exc.os_error if exc.os_error is not None else exc
        if isinstance(cause, (RefusedAddressError, InvalidTargetUrlError)):
            refused = _outcome(target, FINAL, None, f"refused address: {cause}", started)
            refused.reached = False
            return refused
        return _outcome(target, RETRY, None, f"connection failed: {_short(cause)}", started)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        # ValueError: yarl or aiohttp refusing a URL it cannot send to (a final condition).
        kind = FINAL if isinstance(exc, ValueError) and status is None else RETRY
        if status is None:
            return _outcome(target, kind, None, f"{type(exc).__name__}: {_short(exc)}", started)
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
