"""The push runtime: ``run_worker`` pushes one worker's runners (see ``engine``).

The engine is loaded on first use of its names, not by importing this package: a caller that
imports a light module of the package (``eventpush.push.controls``, say) does not load the
runtime."""

from __future__ import annotations

import importlib

_LAZY = {
    "Engine": "eventpush.push.engine",
    "HandOver": "eventpush.push.engine",
    "WorkerFailedError": "eventpush.push.engine",
    "WorkerReport": "eventpush.push.engine",
    "run_worker": "eventpush.push.engine",
    "LeaseLostError": "eventpush.push.store",
    "UnknownWorkerError": "eventpush.push.store",
    "WorkerBusyError": "eventpush.push.store",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
