"""One HTTP delivery attempt to a target, and the retry policy around it.

Shared by the push engine (which schedules retries itself, in a low-priority lane) and by
replay (which retries inline with :func:`deliver`). Classification follows docs/ARCHITECTURE.md: 2xx
delivered; 5xx, 408, 429, timeouts and connection errors retried; any other status final.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver

from eventpush.push.policy import DEFAULTS
from eventpush.push.targets import InvalidTargetUrlError, check_address

USER_AGENT = "eventpush/0.1"
RETRY_AFTER_CAP_S = 300.0
BACKOFF_CAP_S = 60.0

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
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date), capped."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_S)


def backoff_s(target: Target, attempts: int, retry_after_s: float | None = None) -> float:
    """Delay before the next attempt: exponential with full jitter, or what the target asked."""
    if retry_after_s is not None:
        return retry_after_s
    ceiling = min(BACKOFF_CAP_S, target.backoff_ms / 1000 * 2 ** max(attempts - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


def out_of_attempts(target: Target, record: Record, now: float, delay: float = 0.0) -> bool:
    """True when another attempt is not allowed: by count, or by age once the delay passes."""
    if record.attempts >= target.max_attempts:
        return True
    return (now + delay) - record.first_seen > target.max_age_s


class GuardedResolver(AbstractResolver):
    """Resolves like aiohttp does, then refuses denied addresses (metadata, link-local, ...)."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        infos = await self._inner.resolve(host, port, family)
        for info in infos:
            check_address(info["host"])
        return infos

    async def close(self) -> None:
        await self._inner.close()


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    """A pooled HTTP session; ``limit`` caps open connections (0: no cap)."""
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=0, resolver=GuardedResolver(), ttl_dns_cache=60
    )
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), raise_for_status=False
    )


async def attempt(
    session: aiohttp.ClientSession, target: Target, body: bytes, headers: dict[str, str]
) -> Outcome:
    """One POST with the target's timeout. Never raises for network trouble."""
    started = time.perf_counter()
    status: int | None = None
    try:
        async with asyncio.timeout(target.timeout_ms / 1000):
            async with session.post(target.url, data=body, headers=headers) as resp:
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
                await resp.read()
    except TimeoutError:
        return _outcome(RETRY, status, f"timed out after {target.timeout_ms} ms", started)
    except InvalidTargetUrlError as exc:
        return _outcome(FINAL, None, f"refused address: {exc}", started)
    except aiohttp.ClientConnectorError as exc:
        cause = exc.os_error if exc.os_error is not None else exc
        if isinstance(cause, InvalidTargetUrlError):
            return _outcome(FINAL, None, f"refused address: {cause}", started)
        return _outcome(RETRY, None, f"connection failed: {_short(cause)}", started)
    except (aiohttp.ClientError, OSError) as exc:
        return _outcome(RETRY, status, f"{type(exc).__name__}: {_short(exc)}", started)
    kind = classify(status)
    outcome = _outcome(kind, status, None if kind == DELIVERED else f"HTTP {status}", started)
    if status in (429, 503):
        outcome.retry_after_s = parse_retry_after(retry_after)
    return outcome


def _outcome(kind: str, status: int | None, error: str | None, started: float) -> Outcome:
    return Outcome(kind, status, error, (time.perf_counter() - started) * 1000)


def _short(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


async def deliver(
    session: aiohttp.ClientSession, target: Target, records: list[Record], transform
) -> Outcome:
    """Push ``records`` with retries inline (as replay does): the final outcome, with
    ``records[*].attempts`` updated."""
    try:
        body, headers = build_request(target, records, transform)
    except Exception as exc:  # a transform that cannot apply to these events: final, as live
        for r in records:
            r.attempts += 1
        return Outcome(FINAL, None, f"transform failed: {_short(exc)}", 0.0)
    start = time.monotonic()
    for r in records:
        r.first_seen = r.first_seen or start
    while True:
        outcome = await attempt(session, target, body, headers)
        for r in records:
            r.attempts += 1
        if outcome.kind != RETRY:
            return outcome
        delay = backoff_s(target, records[0].attempts, outcome.retry_after_s)
        if out_of_attempts(target, records[0], time.monotonic(), delay):
            return outcome
        await asyncio.sleep(delay)
        if target.secret:  # a fresh timestamp per attempt; the id stays
            body, headers = build_request(target, records, transform)


def load_json(value) -> object:
    return json.loads(value) if isinstance(value, str) else value
