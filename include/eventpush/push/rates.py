"""Destination rate limits: a token bucket per API destination in PostgreSQL, shared by every
worker, from which each worker leases small slices of tokens.

A destination's limit (``Target.rate_limit``, invocations per second) holds for the
destination as a whole: every rule and target that sends through it, on every worker, and
whichever worker a runner moves to, because the tokens come from one row
(``event_destination_rate``) keyed by the destination's name, refilled by the database's own
clock. A send takes one token, whatever its batch size (a batch is one invocation).

Precision. A worker leases at most ``SLICE_S`` of the limit at a time, and only once the
slice it holds is spent; the bucket holds at most ``BURST_S`` of it. So over any window of
T seconds the destination gets at most ``rate * (T + BURST_S) + workers * slice``
invocations: at 50/s and two workers, 535 in 10 s (7 % over at worst). A low limit is
rounded up to whole tokens (at 2/s, at most 2 * 10 + 1 + 2 in 10 s). The database sees one
round trip per slice, not per send.

A send over the limit waits (its runner's dispatcher is woken when tokens come); it is never
failed. The waiting shows as lag, as ``eventpush_destination_throttled_seconds_total`` and
in the worker's heartbeat (``status``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from eventpush.db import Connection, transaction

BURST_S = 0.5  # the bucket holds at most this many seconds of the limit
SLICE_S = 0.1  # a worker leases at most this many seconds of the limit at a time
MIN_WAIT_S = 0.002
MAX_WAIT_S = 1.0

LEASE_SQL = """
WITH clock AS (SELECT clock_timestamp() AS now),
bucket AS (
    SELECT least(%(cap)s, tokens + %(rate)s
                 * extract(epoch FROM (SELECT now FROM clock) - refreshed_at)) AS avail
    FROM event_destination_rate WHERE destination = %(destination)s FOR UPDATE
)
UPDATE event_destination_rate r
SET tokens = bucket.avail - least(greatest(floor(bucket.avail), 0), %(want)s),
    refreshed_at = (SELECT now FROM clock)
FROM bucket
WHERE r.destination = %(destination)s
RETURNING least(greatest(floor(bucket.avail), 0), %(want)s)::int, bucket.avail
"""


def bucket_size(rate: float) -> float:
    return max(1.0, rate * BURST_S)


def slice_size(rate: float) -> int:
    return max(1, min(int(rate * SLICE_S), int(bucket_size(rate))))


def lease(conn: Connection, destination: str, rate: float, want: int) -> tuple[int, float]:
    """Take up to ``want`` whole tokens of ``destination``'s bucket (refilled at ``rate`` per
    second up to :func:`bucket_size`): (tokens granted, seconds until the next whole token
    when none was). A new destination's bucket starts empty."""
    params = {"destination": destination, "rate": rate, "cap": bucket_size(rate), "want": want}
    with transaction(conn) as cur:
        cur.execute(LEASE_SQL, params)
        row = cur.fetchone()
        if row is None:
            cur.execute(
                "INSERT INTO event_destination_rate (destination, tokens) VALUES (%s, 0) "
                "ON CONFLICT (destination) DO NOTHING",
                (destination,),
            )
            return 0, 1.0 / rate
    granted, avail = row
    return granted, 0.0 if granted else (1.0 - avail) / rate


Lease = Callable[[str, float, int], Awaitable[tuple[int, float]]]


class DestinationGate:
    """One destination's tokens on this worker: what the worker leased and has not spent, and
    the runners waiting for more (their wake events are set when tokens come)."""

    def __init__(self, name: str, rate: float, lease_fn: Lease, spawn) -> None:
        self.name = name
        self.rate = rate
        self.lease_fn = lease_fn
        self.spawn = spawn
        self.tokens = 0
        self.waiters: set[asyncio.Event] = set()
        self.leasing: asyncio.Task | None = None
        self.sent = 0  # invocations let through on this worker
        self.throttled_s = 0.0  # time some send waited for a token
        self.blocked_since: float | None = None

    def try_take(self, wake: asyncio.Event) -> bool:
        """One token for one send now, or False: ``wake`` is set once tokens came."""
        if self.tokens > 0:
            self.tokens -= 1
            self.sent += 1
            return True
        self.waiters.add(wake)
        if self.blocked_since is None:
            self.blocked_since = time.monotonic()
        if self.leasing is None:
            self.leasing = self.spawn(self._lease(), f"rate limit {self.name}")
        return False

    def give_back(self) -> None:
        """A token taken for a send that did not go (no slot was free)."""
        self.tokens += 1
        self.sent -= 1

    def waiting(self) -> bool:
        return self.blocked_since is not None

    def throttled(self, now: float | None = None) -> float:
        """Seconds sends have waited for tokens, the wait under way included."""
        if self.blocked_since is None:
            return self.throttled_s
        return self.throttled_s + (now or time.monotonic()) - self.blocked_since

    async def _lease(self) -> None:
        try:
            while True:
                granted, wait = await self.lease_fn(self.name, self.rate, slice_size(self.rate))
                if granted:
                    self.tokens += granted
                    break
                wait = wait if math.isfinite(wait) else MAX_WAIT_S
                await asyncio.sleep(min(max(wait, MIN_WAIT_S), MAX_WAIT_S))
        finally:
            self.leasing = None
        if self.blocked_since is not None:
            self.throttled_s += time.monotonic() - self.blocked_since
            self.blocked_since = None
        waiters, self.waiters = self.waiters, set()
        for wake in waiters:
            wake.set()


class RateGates:
    """The worker's gates, one per destination with a rate limit."""

    def __init__(self, lease_fn: Lease | None, spawn) -> None:
        self.lease_fn = lease_fn
        self.spawn = spawn
        self.gates: dict[str, DestinationGate] = {}
        self.last_beat: tuple[float, dict[str, int]] | None = None  # (when, sent by gate)

    def gate_for(self, destination: str | None, rate: float | None) -> DestinationGate | None:
        """The gate a target's sends pass (None: no limit); a changed limit applies from
        the next lease."""
        if destination is None or rate is None or self.lease_fn is None:
            return None
        gate = self.gates.get(destination)
        if gate is None:
            gate = self.gates[destination] = DestinationGate(
                destination, rate, self.lease_fn, self.spawn
            )
        gate.rate = rate
        return gate

    def keep(self, destinations: set[str]) -> None:
        """Forget the gates of destinations no runner here sends through with a limit any
        more (its limit removed, its targets gone elsewhere): they leave the heartbeat and
        ``/metrics``. A lease under way is stopped and whoever waited on it woken (their
        runners no longer pass a gate)."""
        for name in [n for n in self.gates if n not in destinations]:
            gate = self.gates.pop(name)
            if gate.leasing is not None:
                gate.leasing.cancel()
            waiters, gate.waiters = gate.waiters, set()
            for wake in waiters:
                wake.set()

    async def close(self) -> None:
        """Stop every lease under way (the worker stops)."""
        tasks = [g.leasing for g in self.gates.values() if g.leasing is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def figures(self) -> dict[str, dict]:
        now = time.monotonic()
        return {
            name: {
                "rate_limit": gate.rate,
                "sent": gate.sent,
                "throttled_s": round(gate.throttled(now), 3),
                "waiting": gate.waiting(),
            }
            for name, gate in self.gates.items()
        }

    def heartbeat_figures(self) -> dict[str, dict]:
        """:meth:`figures` with ``invocations_per_s``: sends let through per second since the
        previous heartbeat (None at the first)."""
        now = time.monotonic()
        figures = self.figures()
        for name, f in figures.items():
            rate = None
            if self.last_beat is not None and now > self.last_beat[0]:
                sent = f["sent"] - self.last_beat[1].get(name, 0)
                rate = round(max(sent, 0) / (now - self.last_beat[0]), 2)
            f["invocations_per_s"] = rate
        self.last_beat = (now, {name: f["sent"] for name, f in figures.items()})
        return figures
