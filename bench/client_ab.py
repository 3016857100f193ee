"""The HTTP client of two trees (``eventpush.sinks.http`` with its loop glue,
``eventpush.sinks.transfers``), compared inside one process: blocks of requests in turn, old
and new, so that a shared machine's drift (wrk's own figure moved 9,000-17,000 req/s within
minutes here) falls on both alike. Each block is ``bench/push.py clients``'s loop of
``http.attempt`` (64 callers on uvloop) against the demo receiver in a process of its own,
with ``--work-us`` of Python on the loop before each request (the engine's share of a
delivery); the figure is the loop thread's CPU per request.

    .venv/bin/python bench/client_ab.py OLD_TREE/include/eventpush/sinks \
        [--work-us 0] [--blocks 12] [--requests 6400]

Only those two modules differ between the blocks: everything else is this tree's. An old
tree is made with ``git archive COMMIT include | tar -x -C OLD_TREE``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import uvloop  # noqa: E402
from push import _client_loop  # noqa: E402

from eventpush.demo.receiver import ReceiverProcess  # noqa: E402
from eventpush.sinks import http  # noqa: E402


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def old_client(sinks: Path) -> ModuleType:
    """The other tree's ``http`` module, wired to that tree's ``transfers``."""
    client = _load(sinks / "http.py", "old_http")
    client.Transfers = _load(sinks / "transfers.py", "old_transfers").Transfers
    return client


async def _compare(url: str, old: ModuleType, blocks: int, n: int, work_us: float) -> None:
    got: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for b in range(blocks):
        order = (("old", old), ("new", http)) if b % 2 else (("new", http), ("old", old))
        for name, client in order:
            rate, cpu_us, _ = await _client_loop("http.attempt", url, n, 64, work_us, client)
            got[name].append((rate, cpu_us))
    common.ab_summary(got, "new", "old")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", type=Path, help="the other tree's include/eventpush/sinks")
    parser.add_argument("--work-us", type=float, default=0.0)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--requests", type=int, default=6400)
    args = parser.parse_args()
    old = old_client(args.old)
    print(f"machine: {common.machine()}; {args.work_us:.0f} us of loop work a request")
    with ReceiverProcess() as rx:
        uvloop.run(_compare(rx.url + "/ok/c", old, args.blocks, args.requests, args.work_us))


if __name__ == "__main__":
    main()
