"""The retry arithmetic of deliveries: how an answer is classified, what a ``Retry-After``
means, how long to wait before the next attempt and when there is none.

Shared by the engine (which schedules retries in a low-priority lane), replay (which retries
inline, ``Sinks.deliver``) and every sink.
"""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from eventpush.backoff import clamp
from eventpush.sinks.contract import DELIVERED, FINAL, RETRY, Record, Target

RETRY_AFTER_CAP_S = 300.0
BACKOFF_CAP_S = 60.0
# RFC 9110 delay-seconds is digits only; a fraction is tolerated, signs and exponents are not.
_DELAY_SECONDS = re.compile(r"\d+(\.\d+)?")


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
    return clamp(seconds, 0.0, RETRY_AFTER_CAP_S)


def backoff_s(target: Target, attempts: int, retry_after_s: float | None = None) -> float:
    """Delay before the next attempt: what the target asked, within the policy's bounds (no
    sooner than the target's backoff, no later than RETRY_AFTER_CAP_S), or else exponential
    with full jitter. Always finite."""
    floor = min(target.backoff_ms / 1000, RETRY_AFTER_CAP_S)
    if retry_after_s is not None:
        return clamp(retry_after_s, floor, RETRY_AFTER_CAP_S)
    ceiling = min(BACKOFF_CAP_S, target.backoff_ms / 1000 * 2 ** min(max(attempts - 1, 0), 64))
    return random.uniform(ceiling / 2, ceiling)


def out_of_attempts(target: Target, record: Record, now: float, delay: float = 0.0) -> bool:
    """True when another attempt is not allowed: by count, or by age once the delay passes."""
    if record.attempts >= target.max_attempts:
        return True
    return (now + delay) - record.first_seen > target.max_age_s
