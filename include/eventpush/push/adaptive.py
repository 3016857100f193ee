"""Adaptive concurrency (``--concurrency auto``): a target's in-flight limit that follows its
answers, after Vector's adaptive request concurrency (AIMD).

Answers are looked at in windows of about two round trips (at least ``MIN_WINDOW_S``). At the
end of each window:

- **back-pressure** (a 429, a 503, a timeout or a connection error in the window): the limit
  is halved;
- **rising latency** (the window's mean latency above ``LATENCY_RISE`` times the best seen):
  the limit shrinks by a tenth (by one at least; by up to half when the latency is that far
  above its best);
- otherwise, when the window used the whole limit, it grows: doubling below the slow-start
  threshold (at first the ceiling, so a fast target is not held at one for long), by one
  above it;
- the target's circuit breaker opening (nearly every answer failed) drops it to one at once,
  with the threshold at half what it was, as TCP does after a timeout.

Only answers to requests sent since the last change (the answer's time less its latency)
tell of the limit in force, and a window waits for half the limit's worth of them: a limit
that grew is judged on the latency it brings, not on answers still coming to the smaller one
(slow start would otherwise overshoot by a doubling or two). A limit that grows wakes the
runner's dispatcher, so the new slots are used at once.

The limit stays between 1 and its ceiling, the worker's pool (``pool_max``), or the runner's
``concurrency`` control when set lower. The best latency is the lowest window mean, which
forgets slowly (``BEST_FORGETS`` a window) so a destination that became slower for good is
not held down for ever. Every change is kept in ``decisions`` (time, limit, why) for status
and tests.
"""

from __future__ import annotations

import time
from collections import deque

from eventpush.push.limits import Limiter
from eventpush.sinks.contract import RETRY, Outcome

BACKPRESSURE_STATUS = frozenset({429, 503})
MIN_WINDOW_S = 0.05
MAX_WINDOW_S = 1.0
LATENCY_RISE = 1.15
LATENCY_SLACK_MS = 1.0  # a rise smaller than this is noise, whatever the ratio
BEST_FORGETS = 0.005
BACKPRESSURE_DECREASE = 0.5
LATENCY_DECREASE = 0.9


def backpressure(outcome: Outcome) -> bool:
    """The destination says it has too much: 429, 503, a timeout or a connection error."""
    if outcome.kind != RETRY or not outcome.reached:
        return False
    return outcome.http_status is None or outcome.http_status in BACKPRESSURE_STATUS


class AdaptiveLimiter(Limiter):
    """A :class:`Limiter` whose limit follows the answers (AIMD), between 1 and ``ceiling``."""

    def __init__(self, ceiling: int) -> None:
        super().__init__(1)
        self.ceiling = max(1, ceiling)
        self.pool = ceiling  # the worker's pool_max: never above it
        self.requested = ceiling  # the ceiling asked for (the runner's concurrency control)
        self.ssthresh = self.ceiling  # doubling below this, one by one above
        self.best_ms: float | None = None
        self.window_start: float | None = None  # the first answer starts the first window
        self.window_s = MIN_WINDOW_S
        self.count = 0
        self.sum_ms = 0.0
        self.pressed = False
        self.saturated = False
        self.changed_at = float("-inf")  # when the limit last changed
        self.wake = None  # set when the limit grows: the runner's dispatcher hands out more
        self.decisions: deque[tuple[float, int, str]] = deque(maxlen=4096)
        self.decisions.append((time.monotonic(), 1, "start"))

    def resize(self, limit: int) -> None:
        """An operator's limit is the ceiling here; the limit itself adapts."""
        self.set_ceiling(limit)

    def set_ceiling(self, ceiling: int) -> None:
        self.ceiling = max(1, min(ceiling, self.pool))
        self.requested = ceiling
        if self.limit > self.ceiling:
            self._set(self.ceiling, "ceiling", time.monotonic())

    def set_pool(self, pool_max: int) -> None:
        """The worker's pool size, which the limit never passes."""
        self.pool = max(1, pool_max)
        self.set_ceiling(self.requested)

    def observe(self, outcome: Outcome, now: float | None = None) -> None:
        """One answer, while its send still holds its slot."""
        now = time.monotonic() if now is None else now
        if backpressure(outcome):
            self.pressed = True
        elif not outcome.reached:
            return
        elif now - outcome.latency_ms / 1000 >= self.changed_at:  # sent at the current limit
            self.count += 1
            self.sum_ms += outcome.latency_ms
            if self.in_use >= self.limit:
                self.saturated = True
        if self.window_start is None:
            self.window_start = now
        elif now - self.window_start >= self.window_s and (
            self.pressed or self.count >= max(1, self.limit // 2)
        ):
            self._decide(now)

    def breaker_opened(self, now: float | None = None) -> None:
        """The target's breaker opened: down to one, slow start up to half the limit."""
        now = time.monotonic() if now is None else now
        self.ssthresh = max(1, self.limit // 2)
        self._set(1, "breaker open", now)
        self.window_start, self.count, self.sum_ms, self.pressed = now, 0, 0.0, False

    def _decide(self, now: float) -> None:
        mean = self.sum_ms / self.count if self.count else None
        limit = self.limit
        if self.pressed:
            self._set(max(1, int(limit * BACKPRESSURE_DECREASE)), "back-pressure", now)
            self.ssthresh = self.limit
        elif mean is not None:
            best = self.best_ms
            if best is None or mean < best:
                self.best_ms = best = mean
            if mean > best * LATENCY_RISE and mean - best > LATENCY_SLACK_MS:
                # By a tenth, or in proportion when far above its best (an overshoot).
                rise = LATENCY_RISE * best / mean
                factor = min(LATENCY_DECREASE, max(BACKPRESSURE_DECREASE, rise))
                self._set(max(1, min(int(limit * factor), limit - 1)), "latency", now)
                self.ssthresh = self.limit
            elif self.saturated and limit < self.ceiling:
                grown = min(limit * 2, self.ssthresh) if limit < self.ssthresh else limit + 1
                self._set(min(grown, self.ceiling), "increase", now)
            self.best_ms = best + (mean - best) * BEST_FORGETS
        if self.best_ms is not None:
            self.window_s = min(max(2 * self.best_ms / 1000, MIN_WINDOW_S), MAX_WINDOW_S)
        self.window_start = now
        self.count = 0
        self.sum_ms = 0.0
        self.pressed = False
        self.saturated = False

    def _set(self, limit: int, why: str, now: float) -> None:
        if limit != self.limit:
            if limit > self.limit and self.wake is not None:
                self.wake.set()
            self.limit = limit
            self.changed_at = now
            self.decisions.append((now, limit, why))
            self._changed.set()
