"""Delays: clamping them to finite bounds, and waiting out a transient failure with
exponential backoff (one helper for every loop that retries). A leaf."""

from __future__ import annotations

import asyncio
import math

FIRST_S = 0.1  # the first wait after a transient failure
MAX_S = 5.0  # the longest: a recovered dependency is noticed within this


def clamp(value: float, low: float, high: float) -> float:
    if not math.isfinite(value):
        return high if value > 0 else low  # nan counts as low: it asked for nothing
    return min(max(value, low), high)


def finite(value: float | None, fallback: float, low: float = 0.0, high: float = 3600.0) -> float:
    """``value`` within [low, high], or ``fallback`` when it is None, NaN or infinite: every
    delay the engine sleeps on or keys a heap with passes through here."""
    if value is None or not math.isfinite(value):
        return fallback
    return min(max(value, low), high)


class Backoff:
    """Waits between tries of something that fails transiently: ``first_s``, doubling up to
    ``max_s``. ``delay`` is the next wait (for the log line); ``await wait()`` sleeps it.

    The one retry-with-backoff of the package: the database slot, the commit, the NATS
    source's reads and publishes all wait through it."""

    __slots__ = ("delay", "max_s")

    def __init__(self, first_s: float = FIRST_S, max_s: float = MAX_S) -> None:
        self.delay = first_s
        self.max_s = max_s

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.max_s)
