"""The push runtime: ``run_worker`` pushes one worker's runners (see ``engine``)."""

from eventpush.push.engine import Engine, HandOver, WorkerFailedError, WorkerReport, run_worker
from eventpush.push.store import LeaseLostError, UnknownWorkerError, WorkerBusyError

__all__ = [
    "Engine",
    "HandOver",
    "LeaseLostError",
    "UnknownWorkerError",
    "WorkerBusyError",
    "WorkerFailedError",
    "WorkerReport",
    "run_worker",
]
