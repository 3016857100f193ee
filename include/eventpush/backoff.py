"""Delays: clamping them to finite bounds, and waiting out a transient failure with
exponential backoff (one helper for every loop that retries). A leaf."""

from __future__ import annotations

import math


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
