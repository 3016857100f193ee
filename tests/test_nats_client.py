"""The one NATS connection layer of buses and targets (eventpush.nats_client): a client pinned
to the checked address never takes in the servers a cluster advertises. Two real nats-server
processes form a cluster; the second advertises a client address the policy denies."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path

import nats
import pytest
from nats_support import nats_server_binary
from ports import free_port

from eventpush.nats_client import connect_pinned


def wait_for_info(port: int) -> None:
    """Until the server on ``port`` greets a client (it serves from then on)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.settimeout(1.0)
                if s.recv(4).startswith(b"INFO"):
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


@pytest.fixture
def cluster(tmp_path: Path):
    """(client port of A, the address B advertises): B routes to A and advertises 127.0.0.2."""
    binary = nats_server_binary()
    if binary is None:
        pytest.fail("nats-server is not installed: scripts/setup.sh installs Debian's")
    port_a, route_a, port_b, route_b = (free_port() for _ in range(4))
    common = ["-a", "127.0.0.1", "--cluster_name", "eventpush-test"]
    commands = [
        [binary, *common, "-p", str(port_a), "--cluster", f"nats://127.0.0.1:{route_a}"],
        [
            binary,
            *common,
            "-p",
            str(port_b),
            "--cluster",
            f"nats://127.0.0.1:{route_b}",
            "--routes",
            f"nats://127.0.0.1:{route_a}",
            "--client_advertise",
            f"127.0.0.2:{port_b}",
        ],
    ]
    procs = []
    try:
        for i, command in enumerate(commands):
            log = open(tmp_path / f"nats-{i}.log", "wb")  # noqa: SIM115 (closed with the process)
            procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
        yield port_a, f"127.0.0.2:{port_b}"
    finally:
        for proc, log in procs:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()


def test_a_pinned_client_never_takes_in_the_servers_a_cluster_advertises(cluster):
    port, advertised = cluster

    async def go() -> tuple[list[str], list[str]]:
        deadline = time.monotonic() + 15
        while True:  # A is up once it answers
            try:
                plain = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        pinned = await connect_pinned("127.0.0.1", port, name="eventpush-test")
        try:
            # Once the route is up, A tells its clients about B (a plain client adds it).
            while not plain.discovered_servers:
                assert time.monotonic() < deadline, "the cluster never advertised B"
                await asyncio.sleep(0.1)
            await pinned.flush()
            await plain.flush()
            return (
                [u.netloc for u in plain.servers],
                [u.netloc for u in pinned.servers],
            )
        finally:
            await plain.close()
            await pinned.close()

    unpinned, pinned = asyncio.run(go())
    assert advertised in unpinned  # the test's premise: the cluster does advertise B
    assert pinned == [f"127.0.0.1:{port}"]


def test_a_bus_authenticates_with_the_file_targets_use_and_never_shows_the_password(
    conn, tmp_path, monkeypatch
):
    """EVENTPUSH_NATS_CREDENTIALS serves buses as it serves targets (here a user:password
    line); a refused password appears in no error."""
    from eventpush import catalog
    from eventpush.sources import SourceError, SourceUnavailableError

    binary = nats_server_binary()
    if binary is None:
        pytest.fail("nats-server is not installed: scripts/setup.sh installs Debian's")
    port = free_port()
    command = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js")]
    command += ["--user", "alice", "--pass", "s3cret-right"]
    creds = tmp_path / "nats.credentials"
    monkeypatch.setenv("EVENTPUSH_NATS_CREDENTIALS", str(creds))
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_info(port)
            creds.write_text("alice:s3cret-wrong\n")
            with pytest.raises((SourceError, SourceUnavailableError)) as refused:
                catalog.create_bus(conn, "orders", 2, source=f"nats://127.0.0.1:{port}")
            assert "s3cret" not in str(refused.value)
            creds.write_text("alice:s3cret-right\n")
            catalog.create_bus(conn, "orders", 2, source=f"nats://127.0.0.1:{port}")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    with conn.cursor() as cur:
        cur.execute("SELECT source_url FROM event_bus WHERE name = 'orders'")
        assert cur.fetchall() == [(f"nats://127.0.0.1:{port}",)]
