"""The HTTP client on the event loop (libcurl through ``eventpush.sinks.transfers``), against
real servers on loopback: raw asyncio servers where the answer must be malformed or oddly
timed, the demo receiver elsewhere."""

from __future__ import annotations

import asyncio
import os

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
    """A receiver that goes away and comes back on the same port: the pooled connections it
    closed are dropped (their sockets unwatched and closed), new ones made; once the session
    is closed the process holds no more descriptors than before."""

    async def run() -> tuple[list[str], int]:
        first = Receiver()
        first.__enter__()
        url = first.url + "/ok"
        async with http.new_session() as session:
            try:
                sends = [http.attempt(session, target(url), b"{}", {}) for _ in range(32)]
                kinds = [o.kind for o in await asyncio.gather(*sends)]
            finally:
                first.__exit__(None, None, None)
            with Receiver(port=int(url.rsplit(":", 1)[1].split("/")[0])) as second:
                await asyncio.sleep(0.1)  # the old connections' ends arrive while idle
                sends = [http.attempt(session, target(url), b"{}", {}) for _ in range(32)]
                outs = await asyncio.gather(*sends)
                kinds += [o.kind for o in outs]
                arrived = second.state.count["/ok"]
        return kinds, arrived

    before = open_fds()
    kinds, arrived = asyncio.run(run())
    assert kinds == [contract.DELIVERED] * 64 and arrived == 32
    assert open_fds() <= before


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
