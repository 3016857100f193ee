"""The delivery client's own guard against DNS rebinding, with real loopback receivers.

A name's addresses are resolved and checked by the engine, and the HTTP client is pinned to
the address that passed: it never resolves the name itself. Only the name server is played
here (no name server in the sandbox may answer for a test name): the answers come from a
patched ``getaddrinfo`` on the running loop; every connection is real. 127.0.0.2 stands in
for a forbidden address (conftest allows 127.0.0.1 only); both receivers listen on the same
port, so only the address decides where a request lands.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from ports import free_port

from eventpush.demo.receiver import Receiver
from eventpush.sinks import contract, http

NAME = "hooks.rebind.test"


def _free_port_on_both() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.2", port))
            except OSError:
                continue
        return port
    pytest.skip("no port free on both 127.0.0.1 and 127.0.0.2")


@pytest.fixture
def receivers():
    port = _free_port_on_both()
    with Receiver(port=port) as allowed, Receiver(port=port, host="127.0.0.2") as denied:
        yield port, allowed, denied


def test_a_name_stays_pinned_to_its_checked_address_and_is_checked_again_later(receivers):
    port, allowed, denied = receivers
    answer = {"address": "127.0.0.1"}
    target = contract.Target(1, "b/r/t", "b", 1, "r", "{}", "t", f"http://{NAME}:{port}/ok")

    async def getaddrinfo(host, port, *args, **kwargs):
        assert host == NAME
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer["address"], port))]

    async def run() -> list[contract.Outcome]:
        asyncio.get_running_loop().getaddrinfo = getaddrinfo
        outcomes = []
        async with http.new_session() as session:
            outcomes.append(await http.attempt(session, target, b"{}", {}))
            # The name now points at a forbidden address: within the pin's lifetime every
            # request still goes to the address that was checked (a rebinding gains nothing).
            answer["address"] = "127.0.0.2"
            outcomes.append(await http.attempt(session, target, b"{}", {}))
            # Once the pin expires the name is resolved and checked again: refused.
            for route in session._routes.values():
                route.expires = 0.0
            outcomes.append(await http.attempt(session, target, b"{}", {}))
        return outcomes

    first, rebound, expired = asyncio.run(run())
    assert (first.kind, first.http_status) == (contract.DELIVERED, 200)
    assert (rebound.kind, rebound.http_status) == (contract.DELIVERED, 200)
    assert (expired.kind, expired.http_status, expired.reached) == (contract.FINAL, None, False)
    assert expired.error.startswith("refused address: address 127.0.0.2")
    assert allowed.state.count["/ok"] == 2
    assert sum(denied.state.count.values()) == 0


def test_a_name_with_any_denied_address_is_refused_before_connecting(receivers):
    port, allowed, denied = receivers
    target = contract.Target(1, "b/r/t", "b", 1, "r", "{}", "t", f"http://{NAME}:{port}/ok")

    async def getaddrinfo(host, port, *args, **kwargs):
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))
            for address in ("127.0.0.1", "127.0.0.2")
        ]

    async def run() -> contract.Outcome:
        asyncio.get_running_loop().getaddrinfo = getaddrinfo
        async with http.new_session() as session:
            return await http.attempt(session, target, b"{}", {})

    outcome = asyncio.run(run())
    assert (outcome.kind, outcome.reached) == (contract.FINAL, False)
    assert sum(allowed.state.count.values()) + sum(denied.state.count.values()) == 0
