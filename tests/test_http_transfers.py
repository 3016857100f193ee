"""The HTTP client on the event loop (libcurl through ``eventpush.sinks.transfers``), against
real servers on loopback: raw asyncio servers where the answer must be malformed or oddly
timed, the demo receiver elsewhere."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re

from eventpush.addresses import AddressPolicy
from eventpush.demo.receiver import Receiver
from eventpush.sinks import contract, http


def target(url: str, **kw) -> contract.Target:
    return contract.Target(1, "b/r/t", "b", 1, "r", "{}", "t", url, **kw)


async def raw_server(answer: bytes | None, hold_s: float = 0.0):
    """A server that reads a request's head and writes ``answer`` as it stands (None: nothing),
    then holds the connection ``hold_s``; returns (server, its URL, the requests it read)."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            if answer is not None:
                writer.write(answer)
                await writer.drain()
            await asyncio.sleep(hold_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/hook", heads


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def send_to(
    answer: bytes, headers: dict[str, str] | None = None, hold_s: float = 0.0, **target_kw
) -> tuple[contract.Outcome, list[bytes]]:
    """One attempt against a raw server answering ``answer``: the outcome and the request
    heads the server read."""

    async def run() -> tuple[contract.Outcome, list[bytes]]:
        server, url, heads = await raw_server(answer, hold_s)
        async with server, http.new_session() as session:
            t = target(url, **target_kw)
            return await http.attempt(session, t, b"{}", headers or {}), heads

    return asyncio.run(run())


def test_an_interim_answer_is_not_the_answer():
    outcome, _ = send_to(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
    assert (outcome.kind, outcome.http_status) == (contract.DELIVERED, 204)


def test_a_status_line_without_the_rest_of_its_headers_is_no_answer():
    """A 200 whose headers never end (the target then hangs) is a timeout, retried: an
    answer counts once its headers are complete."""
    outcome, _ = send_to(b"HTTP/1.1 200 OK\r\nContent-Type: te", hold_s=5, timeout_ms=300)
    assert (outcome.kind, outcome.http_status) == (contract.RETRY, None)
    assert outcome.error == "timed out after 300 ms"


def test_headers_complete_then_a_broken_body_is_still_the_answer():
    answer = b"HTTP/1.1 503 Busy\r\nRetry-After: 7\r\nContent-Length: 100\r\n\r\nshort"
    outcome, _ = send_to(answer)
    assert (outcome.kind, outcome.http_status, outcome.retry_after_s) == (contract.RETRY, 503, 7)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def test_a_header_with_a_line_break_is_never_sent():
    """Stored headers are checked when written; a row written around the checks still cannot
    split a request: the send is refused as final and nothing reaches the server."""
    outcome, heads = send_to(OK, {"x-note": "a\r\nx-injected: 1"})
    assert (outcome.kind, outcome.http_status) == (contract.FINAL, None)
    assert "line break" in outcome.error and "injected" not in outcome.error
    assert heads == []


def test_an_empty_header_is_sent_empty_and_the_method_and_query_are_the_targets():
    outcome, (head,) = send_to(OK, {"x-empty": ""}, method="PUT", query=(("a", "1 2"),))
    assert outcome.kind == contract.DELIVERED
    lines = head.decode().split("\r\n")
    assert lines[0] == "PUT /hook?a=1+2 HTTP/1.1"
    assert "x-empty:" in [line.rstrip() for line in lines]
    assert not any(line.lower().startswith("expect:") for line in lines)


def test_connections_closed_by_the_target_are_replaced_and_nothing_leaks():
    """A receiver that goes away and comes back on the same port. Its kept-alive connections
    stay in the Transfers' epoll set while idle; closed by the receiver, they leave it (as
    the kernel lists the set) and the loop rests (a socket nobody reads, ready for good, would
    wake it without pause); new connections are made; once the session is closed the process
    holds no more descriptors than before."""

    async def run() -> tuple[list[str], int, list[int], float]:
        first = Receiver()
        first.__enter__()
        url = first.url + "/ok"
        async with http.new_session() as session:
            try:
                sends = [http.attempt(session, target(url), b"{}", {}) for _ in range(32)]
                kinds = [o.kind for o in await asyncio.gather(*sends)]
            finally:
                first.__exit__(None, None, None)
            await asyncio.sleep(0.2)  # the old connections' ends arrive while idle
            cpu = sum(os.times()[:2])
            await asyncio.sleep(1.0)
            idle_cpu = sum(os.times()[:2]) - cpu
            held = watched_sockets(session.transfers())
            with Receiver(port=int(url.rsplit(":", 1)[1].split("/")[0])) as second:
                sends = [http.attempt(session, target(url), b"{}", {}) for _ in range(32)]
                outs = await asyncio.gather(*sends)
                kinds += [o.kind for o in outs]
                arrived = second.state.count["/ok"]
        return kinds, arrived, held, idle_cpu

    before = open_fds()
    kinds, arrived, held, idle_cpu = asyncio.run(run())
    assert kinds == [contract.DELIVERED] * 64 and arrived == 32
    assert held == []
    assert idle_cpu < 0.2, f"the loop spun while idle: {idle_cpu:.2f} s of CPU in 1 s"
    assert open_fds() <= before


def watched_sockets(transfers) -> list[int]:
    """The sockets the kernel holds in the Transfers' epoll set (its fdinfo lists them; an
    eventfd libcurl keeps for itself is not a connection)."""
    with open(f"/proc/self/fdinfo/{transfers._sockets.fileno()}") as f:
        fds = [int(n) for n in re.findall(r"^tfd:\s*(\d+)", f.read(), re.M)]
    return [fd for fd in fds if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")]


def test_a_cancelled_send_leaves_nothing_behind():
    async def run() -> int:
        server, url, heads = await raw_server(None, hold_s=5)
        async with server:
            session = http.new_session()
            send = asyncio.ensure_future(http.attempt(session, target(url), b"{}", {}))
            while not heads:
                await asyncio.sleep(0.01)
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)
            transfers = session.transfers()
            running = len(transfers._running)
            await session.close()
            return running

    before = open_fds()
    assert asyncio.run(run()) == 0
    assert open_fds() <= before


def test_new_connections_on_reused_socket_numbers_are_watched_anew():
    """A target that closes every connection after its answer: each request is a new socket,
    usually on the number the last one had. Each is watched as the socket it is (a number
    still in the epoll set from its predecessor is registered again, not taken for it):
    every send is answered, and the set (as the kernel lists it) keeps no more than the few
    sockets in use."""
    answer = b"HTTP/1.1 204 No Content\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

    async def run() -> tuple[list[str], int, int]:
        server, url, heads = await raw_server(answer)
        async with server, http.new_session() as session:
            kinds = []
            for _ in range(40):
                async with asyncio.timeout(10):
                    outcome = await http.attempt(session, target(url), b"{}", {})
                kinds.append(outcome.kind)
            return kinds, len(heads), len(watched_sockets(session.transfers()))

    kinds, requests, held = asyncio.run(run())
    assert kinds == [contract.DELIVERED] * 40 and requests == 40
    assert held <= 4, held


class CountingSet:
    """An epoll set that counts the changes asked of it (the watching left as it was)."""

    def __init__(self, real) -> None:
        self.real, self.changes = real, 0

    def modify(self, fd: int, events: int) -> None:
        self.changes += 1
        self.real.modify(fd, events)

    def register(self, fd: int, events: int) -> None:
        self.changes += 1
        self.real.register(fd, events)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_a_kept_alive_connection_is_taken_up_again_without_a_system_call():
    """Sequential sends to a server that keeps its connections: once the connections are
    made and watched (the first sends), a request finds its socket watched as it wants it,
    and asks the epoll set for nothing (the old client made one epoll_ctl a request). A
    target that closes every connection makes each new socket registered anew (the test
    above)."""

    async def run() -> tuple[list[str], int, int]:
        server, port, peers = await keepalive_server("127.0.0.1")
        async with server, http.new_session() as session:
            transfers = session.transfers()
            counting = transfers._sockets = CountingSet(transfers._sockets)
            kinds, settled = [], 0
            for n in range(40):
                if n == 10:
                    settled = counting.changes
                async with asyncio.timeout(10):
                    outcome = await http.attempt(
                        session, target(f"http://127.0.0.1:{port}/hook"), b"{}", {}
                    )
                kinds.append(outcome.kind)
            return kinds, settled, counting.changes - settled

    kinds, at_start, later = asyncio.run(run())
    assert kinds == [contract.DELIVERED] * 40
    assert at_start > 0  # the set was really counted
    assert later == 0, f"{later} changes of the epoll set in 30 requests on kept connections"


async def keepalive_server(host: str, port: int = 0):
    """A server answering 204 to every request on a connection, kept open: (server, port, the
    peer port of each request it answered, in order)."""
    peers: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[1]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                peers.append(peer)
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, host, port)
    return server, server.sockets[0].getsockname()[1], peers


def test_a_name_that_moves_is_re_pinned_and_a_target_sharing_the_old_route_keeps_it():
    """Two targets on one name share one pinned route. The name moves (127.0.0.1 to 127.0.0.3,
    both allowed): the next request of one target is re-pinned there, while the other, whose
    next resolution still offers the old address, keeps the old route, open, its request
    handle and connection reused. A move to a denied address (127.0.0.2) is refused.

    The name's answers come from a scripted resolver (``Session.resolve`` replaced): the
    machine's own DNS cannot be made to move a name here."""
    policy = AddressPolicy(
        allow=(ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("127.0.0.3/32"))
    )
    answers = ["127.0.0.1"]

    async def scripted(host: str, port: int) -> list[str]:
        assert host == "hooks.test"
        return list(answers)

    async def run() -> None:
        first, port, first_peers = await keepalive_server("127.0.0.1")
        moved, _, moved_peers = await keepalive_server("127.0.0.3", port)
        async with first, moved, http.new_session(policy=policy) as session:
            session.resolve = scripted
            a = target(f"http://hooks.test:{port}/a")
            b = target(f"http://hooks.test:{port}/b")

            async def send(t: contract.Target) -> contract.Outcome:
                return await http.attempt(session, t, b"{}", {})

            assert [(await send(t)).kind for t in (a, b)] == [contract.DELIVERED] * 2
            shared = session.pinned(a.url)
            assert shared is not None and session.pinned(b.url) is shared
            assert len(first_peers) == 2

            shared.expires = 0.0  # the pin's minute is over
            answers[:] = ["127.0.0.3"]
            assert (await send(a)).kind == contract.DELIVERED
            assert len(moved_peers) == 1 and session.pinned(a.url) is not shared

            answers[:] = ["127.0.0.1", "127.0.0.3"]  # b's resolution still offers the old one
            handles = set()
            for _ in range(3):
                assert (await send(b)).kind == contract.DELIVERED
                assert session.pinned(b.url) is shared and not shared.closed
                handles.add(id(shared.idle[-1]))
            assert len(first_peers) == 5 and len(set(first_peers[2:])) == 1  # one connection
            assert len(handles) == 1  # one request handle, pooled and reused

            session.pinned(a.url).expires = 0.0
            answers[:] = ["127.0.0.2"]  # rebound to a denied address
            refused = await send(a)
            assert refused.kind == contract.FINAL and not refused.reached
            assert "127.0.0.2" in refused.error and len(moved_peers) == 1

    asyncio.run(run())


def test_a_session_forgets_the_routes_of_urls_no_longer_sent_to(monkeypatch):
    """A worker runs for weeks while targets are created and deleted: 300 targets, each sent
    to once and then gone, beside one that stays on the same origin (whose route they
    share), leave the session holding the routes of the few sent to lately, not one entry
    (and a route's pooled request handles) per URL ever sent to. The pin's minute is made
    50 ms so that weeks pass in seconds."""
    monkeypatch.setattr(http, "PIN_TTL_S", 0.05)

    async def run() -> tuple[list[str], int, int]:
        with Receiver() as rx:
            async with http.new_session() as session:
                kinds = []
                live = target(f"{rx.url}/ok/live")  # shares its route with those that go
                for i in range(300):
                    t = target(f"{rx.url}/ok/{i}")
                    kinds.append((await http.attempt(session, t, b"{}", {})).kind)
                    kinds.append((await http.attempt(session, live, b"{}", {})).kind)
                    await asyncio.sleep(0.005)
                routes = {id(r): r for r in session._routes.values()}
                handles = sum(len(r.idle) for r in routes.values())
                return kinds, len(session._routes), handles

    kinds, urls, handles = asyncio.run(run())
    assert kinds == [contract.DELIVERED] * 600
    assert urls <= 50, f"{urls} target URLs still routed after 300 came and went"
    assert handles <= 50, f"{handles} request handles pooled for URLs long gone"


def test_the_sinks_keep_a_bounded_number_of_target_urls(monkeypatch):
    """Each target URL's sink and sender are looked up once and kept; 300 targets, each
    sent to once through the process's sinks and then gone, leave at most the cache's bound
    of them (made 100 here), not an entry per URL ever sent to."""
    from eventpush import sinks

    monkeypatch.setattr(sinks, "URL_CACHE", 100, raising=False)

    async def run() -> tuple[list[str], int, int]:
        with Receiver() as rx:
            async with sinks.Sinks() as process_sinks:
                kinds = []
                for i in range(300):
                    t = target(f"{rx.url}/ok/{i}")
                    kinds.append((await process_sinks.send(t, [record(i)], None)).kind)
                return kinds, len(process_sinks._senders), len(process_sinks._by_url)

    kinds, senders, by_url = asyncio.run(run())
    assert kinds == [contract.DELIVERED] * 300
    assert senders <= 100 and by_url <= 100, (senders, by_url)


def record(n: int) -> contract.Record:
    return contract.Record(0, n, f"m{n}", {}, json.dumps({"n": n}))
