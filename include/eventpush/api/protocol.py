"""The HTTP protocol uvicorn runs for the API: its httptools protocol, with each response
leaving in one write.

uvicorn writes a response's status line and headers as soon as the app starts it and the body
in a write of its own: two system calls and two TCP segments on every answer, the client woken
once for each (``strace -c`` on a server worker under bench/api.py: 2.0 writes a request).
Here the connection's transport holds what is written during one turn of the event loop and
sends it in one write at the end of the turn, which is when the body has followed the headers
(uvicorn's ``send`` does not wait between them unless the client stopped reading, and then the
socket's own buffer holds it anyway). Nothing waits longer than the turn it was written in.

uvicorn's keep-alive timeout (``timeout_keep_alive``) is also how long a connection may take
to send a request whole: uvicorn arms it only after a response and cancels it on the first
byte that arrives, so a connection that never sends anything, or stops in the middle of its
headers or body, was held for ever (2,048 of them, ``limit_concurrency``, and every other
client got 503). Here it is armed when the connection is made and cancelled only when a
request has arrived whole: no timer more per request than uvicorn's own.

Nor does uvicorn (or httptools) bound a request's line and headers: a client sending one
endless header grew the worker by its size, and httptools, adding each piece to the bytes
before, spent CPU on the square of it (200 MiB: 300 MiB held, 50 s of the event loop). Here a
request whose head passes :data:`MAX_HEAD` bytes is answered 400 and its connection
closed, whether it arrives over many reads or whole in one.

A request answered before its body arrived (413, a body over the limit) leaves the rest of
the body to be read and dropped, and uvicorn read on for as long as the client sent (10 GB
in 5 s on loopback, bounded only by the keep-alive timeout). Here the connection is closed
once :data:`MAX_DROPPED` bytes of it were dropped.

Nor does uvicorn bound how long an answer may wait for the client to read it: a client that
sends requests (pipelined, or with a small receive buffer) and never reads the answers
stalls the server's writes, and uvicorn's ``send`` waits for them to drain, and a close for
its last bytes to go, for ever (a ListRules pipelined 200 times: still held long after the
keep-alive timeout). Here a connection whose writes are held up longer than the keep-alive
timeout, or whose close still waits on unread bytes that long, is aborted, its request's task
and buffers freed. The timers are armed only when the transport's buffer passes its
high-water mark or a close finds bytes still unsent: none on a connection whose client reads.

uvicorn's own answers, the 400 to a malformed request (or one past :data:`MAX_HEAD`) and the
503 past ``limit_concurrency``, were plain text, which an SDK turns into an error coded
"400" or "503"; here they are AWS's JSON errors, ``SerializationException`` and
``ServiceUnavailableException``, as the app's own refusals are.

uvicorn warns in one line about each bad connection ("Invalid HTTP request received.", one
per connection a scanner opens): a client could fill the log. Here the protocol's warnings
go through :class:`_Bounded`, :data:`LOG_BURST` of them a :data:`LOG_INTERVAL`, the rest
counted. They are uvicorn's fixed texts and ours, never a byte of the request.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from eventpush.api.errors import CONTENT_TYPE, ApiError, error_parts

MAX_HEAD = 64 * 1024  # bytes of request line and headers; an SDK's are under 2 KiB
# Bytes of a body answered before it arrived (413) read and dropped, past them the connection
# closed (reset, under the bytes still coming): more than the two sockets' buffers hold in
# flight (Linux grows them to tcp_wmem's and tcp_rmem's maxima, 4 + 6 MiB by default, 32 MiB
# of receive buffer on some hosts), so that a client that looks for an early answer between
# its writes, or an overshoot of a few MiB, reads its 413 before that.
MAX_DROPPED = 64 * 1024 * 1024
LOG_BURST = 10  # warnings about clients logged in each LOG_INTERVAL seconds; the rest counted
LOG_INTERVAL = 60.0


class _Bounded(logging.Filter):
    """At most :data:`LOG_BURST` records below ERROR in each :data:`LOG_INTERVAL` seconds:
    one line says when the rest start being left out, another how many were, on the first
    record after the interval."""

    def __init__(self) -> None:
        super().__init__()
        self._until = 0.0  # the end of the interval
        self._passed = self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.__dict__.get("bounded") is self:
            return True
        now = time.monotonic()
        if now >= self._until:
            if self._left_out:
                self._note("%d warnings about clients were left out", self._left_out)
            self._until, self._passed, self._left_out = now + LOG_INTERVAL, 0, 0
        if self._passed < LOG_BURST:
            self._passed += 1
            return True
        if not self._left_out:
            self._note(
                "more warnings about clients in the next %d s are counted, not logged",
                round(self._until - now),
            )
        self._left_out += 1
        return False

    def _note(self, message: str, *args) -> None:
        CLIENT_LOG.warning(message, *args, extra={"bounded": self})


# Under uvicorn.error, so its lines are logged as uvicorn's own. Warnings and errors only: its
# level set, uvicorn's trace lines (tested against the logger's own level) cost nothing.
CLIENT_LOG = logging.getLogger("uvicorn.error.clients")
CLIENT_LOG.setLevel(logging.WARNING)
CLIENT_LOG.addFilter(_Bounded())


def _refusal(code: str, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """AWS's answer to ``code``: status, headers (connection closed) and body."""
    status, body, headers = error_parts(ApiError(code, message))
    return (
        status,
        [
            (b"content-type", CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *headers,
        ],
        body,
    )


_OVERLOADED = _refusal(
    "ServiceUnavailableException",
    "the server is at its limit of concurrent connections; retry later",
)


async def _overloaded(scope, receive, send) -> None:
    """The app past ``limit_concurrency``, in uvicorn's service_unavailable's place."""
    status, headers, body = _OVERLOADED
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_HEAD_TOO_LARGE = f"Request line and headers over {MAX_HEAD} bytes."


class _HeadOver(Exception):
    """Raised from the parser's callback to stop it: the head is past MAX_HEAD."""


def _head_size(protocol: HttpToolsProtocol) -> int:
    """The bytes of the request line and headers the parser has handed over, about as sent
    (each header's name, value, ': ' and line end)."""
    return len(protocol.url) + sum(len(name) + len(value) + 4 for name, value in protocol.headers)


class _TurnTransport:
    """A connection's transport whose writes of one loop turn go out as one: everything but
    ``write``, ``close`` and ``abort`` is the transport's own."""

    __slots__ = ("_transport", "_loop", "_held", "_patience")

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, patience: float
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None
        self._patience = patience  # seconds a close may wait for the client to read the rest

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = [data]
            self._loop.call_soon(self._flush)
        else:
            self._held.append(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()  # a response written just before (Connection: close) goes first
        self._transport.close()
        if self._transport.get_write_buffer_size():  # closed only once the client reads it
            self._loop.call_later(self._patience, self._transport.abort)

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class OneWriteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a :class:`_TurnTransport`."""

    # Bytes received since the last request ended (or the connection began) while no request
    # has its headers whole: None while a request's body is read.
    _head_bytes: int | None = 0
    # Bytes of the body being dropped (see on_message_complete for its reset).
    _dropped: int = 0
    # Set when a head that arrived whole was past MAX_HEAD: the parser's error is that.
    _head_over: bool = False
    # Armed while the transport's buffer is past its high-water mark (the client not reading).
    _write_stalled: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.logger = CLIENT_LOG
        # Checked in on_headers_complete instead of uvicorn's check, to answer in AWS's shape.
        self._limit, self.limit_concurrency = self.limit_concurrency, None
        turn = _TurnTransport(transport, self.loop, self.timeout_keep_alive)
        super().connection_made(turn)  # type: ignore[arg-type]
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()  # the stall's timer goes with the connection
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stalled is None:
            patience = self.timeout_keep_alive
            self._write_stalled = self.loop.call_later(patience, self.transport.abort)

    def resume_writing(self) -> None:
        if self._write_stalled is not None:
            self._write_stalled.cancel()
            self._write_stalled = None
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        # uvicorn's cancels the timeout here, on any byte: left armed until the request is whole.
        head = self._head_bytes
        if head is not None:
            self._head_bytes = head + len(data)
        elif self.cycle.response_complete:  # a body answered before it arrived (413)
            self._dropped += len(data)
            if self._dropped > MAX_DROPPED:
                self.transport.close()
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = _HEAD_TOO_LARGE if self._head_over else "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        # Counted before the parser ran, reset by it when a request's headers were whole.
        if self._head_bytes is not None and self._head_bytes > MAX_HEAD:
            self.logger.warning(_HEAD_TOO_LARGE)
            self.send_400_response(_HEAD_TOO_LARGE)

    def on_headers_complete(self) -> None:
        # A head that arrived whole within the reads counted: the bytes counted include any
        # body that came with it, so only then are the head's own bytes summed (no cost to a
        # request whose reads were small), and a head past the limit stops the parser.
        received = self._head_bytes
        if received is not None and received > MAX_HEAD and _head_size(self) > MAX_HEAD:
            self._head_over = True
            raise _HeadOver
        self._head_bytes = None
        limit = self._limit
        if limit is None or (len(self.connections) < limit and len(self.tasks) < limit):
            super().on_headers_complete()
            return
        self.logger.warning("Exceeded concurrency limit.")
        self.app = _overloaded  # the app this request's cycle is given
        try:
            super().on_headers_complete()
        finally:
            self.app = self.config.loaded_app

    def send_400_response(self, msg: str) -> None:
        status, headers, body = _refusal("SerializationException", msg)
        head = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            head += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join((*head, b"\r\n", body)))
        self.transport.close()

    def on_message_complete(self) -> None:
        self._head_bytes = 0
        if not self.cycle.response_complete:
            self._unset_keepalive_if_required()
        else:  # the rest of a body answered early (413), dropped
            self._dropped = 0
        super().on_message_complete()
