"""What a native driver of libcurl would give the quarters goal end to end (issue 34):
``bench/push.py quarters`` run in turn on this tree and on a throwaway copy of it whose
``eventpush.sinks.http.post`` sends through ``bench/native_client.c`` (libcurl's multi
interface driven from C), each in its own worker process, the ratio to wrk from each run.

The copy is a measuring stick, not a client: it sends every request straight to the target's URL
(the bench's receiver, an IP literal on loopback), with no address policy, no pinned route, no
TLS files, no Retry-After or Location, and a failed transfer is a retry. What it keeps is the
engine around the send (reading, matching, building the request, the Outcome, committing).

Needs gcc and libcurl's headers (Debian: ``apt-get install libcurl4-openssl-dev``).

    .venv/bin/python bench/native_engine.py [--pairs 2] [--events 150000] [--placement mixed]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# post()'s first lines in the copy: the request handed to the C driver, nothing else.
NATIVE_POST = """    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    native = getattr(session, "_native", None)
    if native is None or native.loop is not loop:
        native = session._native = _Native(loop)
    lines = [line.encode() for line in header_lines(headers)]
    future = loop.create_future()
    native.multi.submit(target.url.encode(), body, lines, target.timeout_ms, future)
    code, status = await future
    if not status:
        return _outcome(target, RETRY, None, f"libcurl error {code}", started)
    kind = classify(status)
    return _outcome(target, kind, status, None if kind == DELIVERED else f"HTTP {status}", started)
"""

DRIVER = '''

import native_client as _native_client  # noqa: E402


class _Native:
    """The C driver on the running loop: its epoll set watched as one reader."""

    def __init__(self, loop):
        self.loop = loop
        self.multi = _native_client.Multi()
        loop.add_reader(self.multi.fileno(), self._ready)

    def _ready(self):
        for future, code, status in self.multi.run():
            if not future.done():
                future.set_result((code, status))

    def close(self):
        if not self.loop.is_closed():
            self.loop.remove_reader(self.multi.fileno())
        self.multi.close()
'''

CLOSE_BEFORE = "    async def close(self) -> None:\n        if self._transfers is not None:\n"
CLOSE_AFTER = (
    "    async def close(self) -> None:\n"
    '        if getattr(self, "_native", None) is not None:\n'
    "            self._native.close()\n"
    "            self._native = None\n"
    "        if self._transfers is not None:\n"
)
POST_START = (
    "    started = time.perf_counter()\n    try:\n        url, tls = target.url, target.tls\n"
)


def native_copy(where: Path) -> Path:
    """This tree's ``include`` with the native ``post``, and the C driver built beside it;
    returns the PYTHONPATH that puts both first."""
    sys.path.insert(0, str(HERE))
    from native_ab import build

    build(where)  # native_client*.so in ``where``
    shutil.copytree(
        REPO / "include",
        where / "include",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    http = where / "include" / "eventpush" / "sinks" / "http.py"
    text = http.read_text()
    for old, new in (
        (
            "from eventpush.sinks.transfers import Transfers\n",
            "from eventpush.sinks.transfers import Transfers\n" + DRIVER,
        ),
        (CLOSE_BEFORE, CLOSE_AFTER),
        (POST_START, NATIVE_POST + POST_START),
    ):
        if text.count(old) != 1:
            sys.exit(f"native_engine: eventpush/sinks/http.py changed; cannot place {old[:40]!r}")
        text = text.replace(old, new)
    http.write_text(text)
    return Path(f"{where / 'include'}{os.pathsep}{where}")


def quarters(pythonpath: Path | None, events: int, placement: str) -> None:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [sys.executable, str(HERE / "push.py"), "quarters", "--placement", placement]
    command += ["--events", str(events)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith(("quarters", "throughput", "  CPU us per delivery by part")):
            print("  " + line.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--events", type=int, default=150_000)
    parser.add_argument("--placement", default="mixed", choices=["aligned", "mixed"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as where:
        native = native_copy(Path(where))
        for pair in range(args.pairs):
            for name, path in (("main", None), ("native", native))[:: 1 if pair % 2 == 0 else -1]:
                print(f"{name} (pair {pair + 1}, load {os.getloadavg()[0]:.2f}):", flush=True)
                quarters(path, args.events, args.placement)


if __name__ == "__main__":
    main()
