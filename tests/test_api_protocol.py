"""The API's HTTP protocol (eventpush.api.protocol): a real uvicorn server on loopback, whose
connections' socket transports are wrapped to record each write the protocol makes on them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import boto3
import psutil
import pytest
import uvicorn
from botocore.config import Config
from botocore.exceptions import ClientError
from ports import free_port

from eventpush.api.protocol import MAX_HEAD, OneWriteProtocol

BIG = 16 << 20  # past both sockets' buffers: the transport's own buffer and flow control work
KEEP_ALIVE = 1  # seconds: impatient_port's timeout_keep_alive
CROWD = 4  # crowded_port's limit_concurrency
MID = 48 << 10  # under the transport's high-water mark (64 KiB)

writes: list[bytes] = []


class _Recorded:
    """A socket transport that notes what it is asked to write (the rest is its own)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _RecordedProtocol(OneWriteProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Recorded(transport))  # type: ignore[arg-type]


class _SmallBufferProtocol(_RecordedProtocol):
    """Its sockets' send buffers are small (not grown by the kernel): what a client leaves
    unread soon waits in the transport."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        super().connection_made(transport)


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(KEEP_ALIVE * 1.5)
    body = b"x" * {"/big": BIG, "/mid": MID}.get(scope["path"], 64)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def _serving(protocol: type = _RecordedProtocol, **options) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        _app, host="127.0.0.1", port=port, http=protocol, log_level="warning", **options
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def port():
    with _serving() as port:
        yield port


@pytest.fixture(scope="module")
def impatient_port():
    """A server whose keep-alive timeout is KEEP_ALIVE seconds."""
    with _serving(timeout_keep_alive=KEEP_ALIVE) as port:
        yield port


@pytest.fixture(scope="module")
def stalling_port():
    """A server whose keep-alive timeout is KEEP_ALIVE seconds and whose sockets' send buffers
    are small."""
    with _serving(_SmallBufferProtocol, timeout_keep_alive=KEEP_ALIVE) as port:
        yield port


@pytest.fixture(scope="module")
def crowded_port():
    """A server that takes CROWD connections at once."""
    with _serving(limit_concurrency=CROWD) as port:
        yield port


def _read_response(sock: socket.socket, pending: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """One response's head and body read off ``sock`` (by its Content-Length), and what
    followed it."""
    data = pending
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed inside a response's head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside a response's body"
        rest += chunk
    return head, rest[:length], rest[length:]


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_each_response_leaves_in_one_write(port):
    writes.clear()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        rest = b""
        for i in range(20):
            sock.sendall(f"POST /{i} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi".encode())
            head, body, rest = _read_response(sock, rest)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert body == b"x" * 64
    assert len(writes) == 20, [w[:40] for w in writes]
    assert all(w.startswith(b"HTTP/1.1 200") and w.endswith(b"x" * 64) for w in writes)


def test_pipelined_requests_are_answered_in_order_and_whole(port):
    writes.clear()
    requests = b"".join(
        f"POST /{i} HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n{i % 10}".encode()
        for i in range(10)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(requests)
        rest = b""
        for _ in range(10):
            head, body, rest = _read_response(sock, rest)
            assert head.startswith(b"HTTP/1.1 200") and body == b"x" * 64
    assert sum(w.count(b"HTTP/1.1 200") for w in writes) == 10


def test_a_response_before_close_arrives_whole(port):
    """``Connection: close``: uvicorn closes the transport right after the body; what was held
    goes out first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        )
        data = _read_to_close(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
    assert body == b"x" * 64


def _aws_error(answer: bytes) -> tuple[int, str, dict]:
    """An answer's status, its x-amzn-errortype and its JSON body, checked to be AWS's error
    shape whole (Content-Length, Content-Type, the code in header and body alike)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert int(headers["content-length"]) == len(body), answer
    assert headers["content-type"] == "application/x-amz-json-1.1", answer
    doc = json.loads(body)
    assert doc["__type"].lower() == headers["x-amzn-errortype"], answer
    return int(lines[0].split()[1]), doc["__type"], doc


def test_a_malformed_request_gets_its_400_whole(port):
    """In AWS's shape (uvicorn's was plain text, which an SDK made an error coded "400")."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        data = _read_to_close(sock)
    assert data.startswith(b"HTTP/1.1 400"), data[:80]
    status, code, doc = _aws_error(data)
    assert (status, code) == (400, "SerializationException")
    assert doc["message"] == "Invalid HTTP request received."


def test_a_large_response_to_a_slow_reader_arrives_whole(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        time.sleep(0.5)  # the sockets' buffers fill; the rest waits in the transport
        head, body, rest = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b"x" * BIG and rest == b""
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        head, body, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b"x" * 64


def test_a_connection_that_does_not_send_a_request_whole_is_closed(impatient_port):
    """The keep-alive timeout also bounds how long a request may take to arrive: a connection
    that sends nothing, stops inside its request line or headers, or sends less body than its
    Content-Length is closed (uvicorn held each for ever, and ``limit_concurrency`` of them
    shut every other client out). A request that arrived whole is not cut while it is served,
    however long that takes."""
    stalls = (
        b"",
        b"PO",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
    )
    started = time.monotonic()
    socks = [socket.create_connection(("127.0.0.1", impatient_port), timeout=10) for _ in stalls]
    try:
        for sock, sent in zip(socks, stalls, strict=True):
            if sent:
                sock.sendall(sent)
        for sock, sent in zip(socks, stalls, strict=True):
            answer = _read_to_close(sock)  # the socket's 10 s timeout fails a connection held
            assert answer == b"", (sent, answer[:80])
        assert time.monotonic() - started < KEEP_ALIVE + 5
    finally:
        for sock in socks:
            sock.close()
    with socket.create_connection(("127.0.0.1", impatient_port), timeout=10) as sock:
        sock.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        head, body, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b"x" * 64


@pytest.mark.parametrize(
    ("start", "piece"),
    [
        (b"POST / HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * 65536),
        (b"POST / HTTP/1.1\r\nHost: x\r\n", b"X-Many: a\r\n" * 6000),
        (b"POST /", b"a" * 65536),
    ],
    ids=["one-endless-header", "many-headers", "endless-url"],
)
def test_a_request_head_past_the_limit_is_refused_while_it_is_sent(port, start, piece):
    """A request line and headers past MAX_HEAD bytes get a 400 and the connection closed
    while they are still arriving (uvicorn held them, however long, and went on reading).
    The close may reset the connection under bytes still in flight, before its 400 is read."""
    offered, sent, answer = 64 << 20, 0, b""  # past both sockets' buffers
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(start)
            while sent < offered:
                if select.select([sock], [], [], 0)[0]:
                    answer = _read_to_close(sock)
                    break
                sock.sendall(piece)  # never ends: no blank line
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent < offered // 2, f"still reading after {sent:,} bytes of head"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:80]


def test_a_request_head_past_the_limit_in_one_write_is_refused(port):
    """A head past MAX_HEAD that arrives whole in one read of the socket (up to 256 KiB) was
    served: the count across reads never saw it unfinished. Now its own bytes are summed
    when the reads were large, and it is refused as any other head past the limit."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nContent-Length: 0\r\n\r\n"
            % (b"p" * (MAX_HEAD + 4096))
        )
        answer = _read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
    assert b"Request line and headers over %d bytes." % MAX_HEAD in answer


def test_a_request_head_under_the_limit_and_a_large_body_are_served(port):
    """The limit counts only the head: a request whose headers are nearly MAX_HEAD bytes,
    or whose body comes in the same writes as its head, is served as any other."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        rest = b""
        for extra, body in ((MAX_HEAD - 1024, b"hi"), (0, b"y" * (4 * MAX_HEAD))):
            sock.sendall(
                b"POST / HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (b"p" * extra, len(body), body)
            )
            head, answer, rest = _read_response(sock, rest)
            assert head.startswith(b"HTTP/1.1 200") and answer == b"x" * 64


def _served(port: int, sock: socket.socket) -> bool:
    """Whether the server (this process) still holds its end of ``sock``'s connection."""
    mine = sock.getsockname()
    return any(
        c.laddr.port == port and c.raddr and tuple(c.raddr) == mine
        for c in psutil.Process().net_connections(kind="tcp")
    )


def test_a_client_that_never_reads_its_answers_is_let_go(stalling_port):
    """A client that sends requests and reads none of the answers: the server's writes stall
    (past the high-water mark, uvicorn's next answer waits on them; under it, a close waits to
    send what is left). uvicorn held each such connection for ever, and ``limit_concurrency``
    of them shut every other client out; the keep-alive timeout bounds the stall, the
    connection is aborted."""
    posts = {
        "one-big-answer": b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        "pipelined": b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" * 3,
        "closed-with-bytes-left": b"POST /mid HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: 0\r\n\r\n",
    }
    socks = {}
    try:
        for name, sent in posts.items():
            sock = socks[name] = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
            sock.connect(("127.0.0.1", stalling_port))
            sock.sendall(sent)
        deadline = time.monotonic() + KEEP_ALIVE + 5
        while held := [n for n, sock in socks.items() if _served(stalling_port, sock)]:
            assert time.monotonic() < deadline, f"still held: {held}"
            time.sleep(0.1)
    finally:
        for sock in socks.values():
            sock.close()
    with socket.create_connection(("127.0.0.1", stalling_port), timeout=10) as sock:
        sock.sendall(b"POST /mid HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" * 3)
        time.sleep(KEEP_ALIVE / 2)  # a client that reads within the bound is served
        rest = b""
        for _ in range(3):
            head, body, rest = _read_response(sock, rest)
            assert head.startswith(b"HTTP/1.1 200") and body == b"x" * MID


def test_uvicorns_own_refusals_are_aws_errors_to_an_sdk(crowded_port):
    """uvicorn answers a head past MAX_HEAD with 400 and a request past limit_concurrency
    with 503 before the app sees them, in plain text: botocore raised ClientErrors coded "400"
    and "503". They are AWS's JSON errors: SerializationException and
    ServiceUnavailableException (which an SDK retries)."""
    events = boto3.client(
        "events",
        endpoint_url=f"http://127.0.0.1:{crowded_port}",
        region_name="us-east-1",
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="not-a-secret",
        config=Config(retries={"total_max_attempts": 1}),
    )

    def pad(request, **_) -> None:
        request.headers["X-Pad"] = "p" * (4 * MAX_HEAD)  # past one read of the socket too

    events.meta.events.register("before-send.events.ListEventBuses", pad)
    with pytest.raises(ClientError) as too_long:
        events.list_event_buses()
    assert too_long.value.response["Error"]["Code"] == "SerializationException"
    assert too_long.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    events.meta.events.unregister("before-send.events.ListEventBuses", pad)

    held = [socket.create_connection(("127.0.0.1", crowded_port), timeout=10) for _ in range(CROWD)]
    try:
        time.sleep(0.2)  # the server has taken them
        with pytest.raises(ClientError) as crowded:
            events.list_event_buses()
        assert crowded.value.response["Error"]["Code"] == "ServiceUnavailableException"
        assert crowded.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        with socket.create_connection(("127.0.0.1", crowded_port), timeout=10) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            answer = _read_to_close(sock)
        assert b"\r\nconnection: close\r\n" in answer, answer
        assert _aws_error(answer)[:2] == (503, "ServiceUnavailableException")
    finally:
        for sock in held:
            sock.close()
