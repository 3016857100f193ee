"""Process-level tuning while push workers run in this process: the cyclic collector
(a higher first threshold, the start-up objects frozen out of its view) and the calling
thread's scheduling policy (Linux ``SCHED_BATCH``). Both are process- or thread-wide, so
they are counted per process and undone when the last worker ends; ``push.engine`` wraps
``run_worker`` in them."""

from __future__ import annotations

import contextlib
import gc
import os
import threading

# The cyclic collector while a worker runs (see ``collector_tuned``). Every delivery leaves a
# few dozen short-lived containers (records, futures, rows), so the default first threshold
# (700) ran a collection every few milliseconds at full speed (~200 a 5 s drain, each a pause
# of the event loop, every tenth one of the middle generation too); 10,000 makes them ~20 times
# rarer at ~1-2 ms each. What it costs: at most that many young objects more before a
# collection looks at them (a few MiB), whatever the worker's age.
GC_GEN0_THRESHOLD = 10_000

_collector_lock = threading.Lock()
_collector_users = 0  # workers running in this process (tests and benches run several)
_collector_saved: tuple[int, int, int] | None = None
_collector_frozen = False


@contextlib.contextmanager
def collector_tuned():
    """The cyclic collector tuned for the push loop while any worker of this process runs,
    put back as it was when the last one ends (workers share the process-wide collector)."""
    global _collector_users, _collector_saved, _collector_frozen
    with _collector_lock:
        if _collector_users == 0:
            _collector_saved = gc.get_threshold()
            gc.set_threshold(GC_GEN0_THRESHOLD, *_collector_saved[1:])
        _collector_users += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_users -= 1
            if _collector_users == 0:
                gc.set_threshold(*_collector_saved)
                if _collector_frozen:
                    gc.unfreeze()
                    _collector_frozen = False


def _freeze_startup_objects() -> None:
    """When the first worker of the process has started (modules imported, first assignment
    read, runners built), its objects leave the collector's view (``gc.freeze``): they live as
    long as the worker, yet a full collection walked all of them (~90,000 objects, a 60 ms
    pause of the loop, the longest one measured). The collector never frees frozen objects
    (reference counting still does), so this happens once, and is undone when the last
    worker ends: memory stays bounded for a worker that runs for weeks. No collection
    first: a fresh worker holds no cyclic garbage at this point (measured: none), and a
    full collection here would be the very pause this avoids."""
    global _collector_frozen
    with _collector_lock:
        if _collector_users and not _collector_frozen:
            gc.freeze()
            _collector_frozen = True


@contextlib.contextmanager
def batch_scheduled():
    """The calling thread scheduled as a batch workload (Linux ``SCHED_BATCH``) while a
    worker runs on it, and so every thread it starts meanwhile (the HTTP client's, the
    database calls'), which keep the policy after. A woken batch thread waits for the
    running one's slice instead of preempting it: the event loop, the HTTP client's thread
    and whatever shares the cores (the database, a receiver on the same machine) switch
    less often, measured as less CPU per delivery and more deliveries per second
    (docs/BENCHMARKS.md). Nothing else changes: same nice value, same share of the CPU. A
    policy chosen for the process (``chrt``: idle, round robin) is left alone, and so is a
    system that has no such call."""
    batch = getattr(os, "SCHED_BATCH", None)
    try:
        changed = batch is not None and os.sched_getscheduler(0) == os.SCHED_OTHER
        if changed:
            os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError:  # a sandbox that refuses the call: the worker runs as it is
        changed = False
    try:
        yield
    finally:
        if changed:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
