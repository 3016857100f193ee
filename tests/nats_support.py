"""A NATS server with JetStream of the test's own: a free loopback port, a store directory in
the test's tmp dir, never the machine's shared server on 4222.

``tests/conftest.py`` imports the fixture, so any test takes a ``nats_server`` argument.
The object it yields has ``.url`` (``nats://127.0.0.1:PORT``), ``.port``, ``.store`` (the
JetStream directory), ``.kill()`` (SIGKILL, as a crash) and ``.start()``
(again on the same port and store, waiting until it serves). The server is stopped after the
test whatever happened.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from ports import free_port

START_TIMEOUT_S = 15.0


def nats_server_binary() -> str | None:
    return shutil.which("nats-server") or next(
        (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if Path(p).exists()), None
    )


class NatsServer:
    """One ``nats-server -js`` process on 127.0.0.1, restartable on the same port and store."""

    def __init__(self, binary: str, store: Path, port: int | None = None) -> None:
        self.binary = binary
        self.store = store
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = store.parent / f"nats-{self.port}.log"

    def start(self) -> None:
        """Start (or start again after ``kill``) and wait until it accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"nats-server on port {self.port} is already running")
        self.store.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-js",
                    "-sd",
                    str(self.store),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited at start: {self.tail()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s,
            ):
                # The INFO line comes once the server is ready to serve clients.
                s.settimeout(1.0)
                if s.recv(4).startswith(b"INFO"):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server did not start on port {self.port}: {self.tail()}")

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash (the store keeps what it had synced)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 800) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@pytest.fixture
def nats_server(tmp_path: Path):
    binary = nats_server_binary()
    if binary is None:
        pytest.fail("nats-server is not installed: scripts/setup.sh installs Debian's")
    server = NatsServer(binary, tmp_path / "jetstream")
    server.start()
    try:
        yield server
    finally:
        server.stop()
