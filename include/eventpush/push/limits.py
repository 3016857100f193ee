"""Concurrency limits whose size can change at run time, and the per-target circuit breaker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass


class Limiter:
    """A semaphore whose limit can be changed while tasks hold it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._changed = asyncio.Event()
        self._waiting = 0  # tasks in changed(): a release sets the event only for them

    def free(self) -> int:
        return max(self.limit - self.in_use, 0)

    def try_acquire(self) -> bool:
        if self.in_use < self.limit:
            self.in_use += 1
            return True
        return False

    def release(self) -> bool:
        """A slot back; True when the limiter was full before (someone may want this slot)."""
        self.in_use -= 1
        if self._waiting:  # nobody in changed(): no Event.set per release
            self._changed.set()
        return self.in_use >= self.limit - 1

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._changed.set()

    async def changed(self, timeout: float) -> None:
        self._changed.clear()
        self._waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # never wait_for: see lanes.wait_for_event
                    await self._changed.wait()
        finally:
            self._waiting -= 1


@dataclass(frozen=True, slots=True)
class Pass:
    """Leave for one request to go out: the breaker epoch it was admitted in, and whether it
    is the half-open probe."""

    epoch: int
    probe: bool = False


class CircuitBreaker:
    """Opens when nearly every recent attempt failed with a retryable error (at least
    ``ratio`` of the last ``window``), so a target that is merely flaky keeps being served
    while a dead or hanging one costs almost nothing. While open, one probe goes through
    after a cool-down that doubles (up to ``max_cooldown``) each time a probe fails.

    Every state change starts a new epoch, and an outcome counts only in the epoch its
    request was admitted in: answers to requests sent before the breaker opened neither
    stretch its cool-down nor close it; only the probe decides.
    """

    def __init__(
        self,
        window: int = 20,
        ratio: float = 0.9,
        cooldown: float = 1.0,
        max_cooldown: float = 30.0,
    ) -> None:
        self.recent: deque[bool] = deque(maxlen=window)  # True for a retryable failure
        self.threshold = int(window * ratio)
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.cooldown = cooldown
        self.is_open = False
        self.open_until = 0.0
        self.probing = False
        self.epoch = 0
        self._pass = Pass(0)  # the one pass of the current epoch while closed (hot path)

    def admit(self, now: float | None = None) -> Pass | None:
        """A pass for one request now, or None. In the half-open state one probe at a time."""
        if not self.is_open:
            if self._pass.epoch != self.epoch:
                self._pass = Pass(self.epoch)
            return self._pass
        now = time.monotonic() if now is None else now
        if now < self.open_until or self.probing:
            return None
        self.probing = True
        return Pass(self.epoch, probe=True)

    def wait_s(self, now: float | None = None) -> float | None:
        """Seconds until a probe may go; None while a probe is out (its outcome wakes us)."""
        if self.probing:
            return None
        now = time.monotonic() if now is None else now
        return max(self.open_until - now, 0.0)

    def record(self, granted: Pass, *, reached: bool, failed: bool) -> None:
        """Count one outcome. ``reached`` False (transform failed, address refused): the target
        said nothing, so nothing is counted, but a probe's turn is handed back."""
        if granted.probe and granted.epoch == self.epoch:
            self.probing = False
        if not reached or granted.epoch != self.epoch:
            return
        if failed:
            self._failure()
        else:
            self._success()

    def _success(self) -> None:
        self.recent.append(False)
        if self.is_open:
            self.is_open = False
            self.recent.clear()
            self.cooldown = self.base_cooldown
            self.epoch += 1

    def _failure(self) -> None:
        self.recent.append(True)
        if self.is_open:
            self.cooldown = min(self.cooldown * 2, self.max_cooldown)
            self.epoch += 1  # the next probe is a new epoch too
        elif len(self.recent) == self.recent.maxlen and sum(self.recent) >= self.threshold:
            self.is_open = True
            self.cooldown = self.base_cooldown
            self.epoch += 1
        if self.is_open:
            self.open_until = time.monotonic() + self.cooldown
