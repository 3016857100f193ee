"""NATS JetStream targets (``nats://HOST:PORT/SUBJECT``) as a sink.

Each record becomes one message on ``SUBJECT`` with the body an HTTP target would get for it
alone (transformed as the target says) and the same headers (``webhook-id`` and, with a
secret, the Standard Webhooks signature), plus ``Nats-Msg-Id`` equal to ``webhook-id``, which
for one record is the record's key (``delivery.record_key``: one per runner and record, see
``eventpush.sinks``): a record sent again after a crash, a lost acknowledgement or a replay is
dropped by the server as a duplicate within its stream's duplicate window, and the targets of
several rules writing subjects of one stream never drop each other's messages. A record counts
as delivered on the JetStream acknowledgement (a duplicate's included: the stream holds that
id; the outcome names such records in ``Outcome.held`` and the engine warns when a first send
was one). A batch is published at once (one write, one flush) and its acknowledgements awaited
together; each record settles on its own answer (``Outcome.per_record``: a refused message
fails alone, an unanswered one is retried alone).
A stream whose duplicate window is shorter than the target's retry horizon is warned of once.

Classification: no stream listening on the subject (no responders) is final, as is any
JetStream refusal other than 503 and a message over the server's payload limit or refused
credentials; a broker that is down, restarting or slower than the target's timeout is
retried.

One connection per (host, port) is shared by every target on it, made by
``eventpush.nats_client``: every address of the host checked against the address policy, the
connection pinned to the checked one (reconnections after a broker restart never reach
another; addresses a cluster advertises are ignored), credentials from the file
``EVENTPUSH_NATS_CREDENTIALS`` names, never from the URL (see docs/OPERATIONS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import nats
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from eventpush.addresses import AddressPolicy, RefusedAddressError
from eventpush.config import ConfigError, redact
from eventpush.errors import first_line
from eventpush.nats_client import (
    NatsUrl,
    connect_pinned,
    credentials,
    parse_url,
    secrets_of,
    validate_target_url,
)
from eventpush.sinks import transform_failed
from eventpush.sinks.contract import DELIVERED, FINAL, RETRY, Outcome, Record, Retention, Target
from eventpush.sinks.request import build_request
from eventpush.sinks.retry import BACKOFF_CAP_S

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 0.25
# About 5 s of a broker gone, then the client closes and the next send resolves the host
# again (a cluster's name may point at another node by then).
MAX_RECONNECTS = 20
CLOSE_TIMEOUT_S = 2.0
MSG_ID = "Nats-Msg-Id"
# A read-back (``read_back``): messages per fetch, and how long one fetch or request may take.
READ_BATCH = 10_000
READ_TIMEOUT_S = 30.0
# A pull request's end with nothing more to deliver: no messages (404), its time up (408).
_NOTHING_MORE = ("404", "408")
# nats-py's own defaults, named because the hot path of ``send`` depends on them.
MAX_PENDING_ACKS = 4000
PENDING_BYTES = 2 * 1024 * 1024


@functools.lru_cache(maxsize=1024)
def _where(url: str) -> NatsUrl:
    """Host, port and subject of a nats:// target URL already validated (parsed once)."""
    return parse_url(url, "target URL")


class _AckTimeout(TimeoutError):
    """An acknowledgement not in by its send's deadline."""


class _Deadlines:
    """The deadlines of the acknowledgements awaited on one connection, on one timer.

    ``asyncio.timeout`` around each send costs a timer armed and cancelled per message: 9 to
    12 of the worker's 74 to 90 us of CPU per message when every send carries one
    (bench/nats_target.py). Here each send's future (one per send, resolved by its last
    acknowledgement) joins a queue per timeout length; within one queue deadlines only grow,
    so a single timer, armed for the oldest pending one, fails each future still waiting at
    its deadline with ``_AckTimeout`` (the send then forgets its unanswered messages). Futures
    already resolved leave the queue's head as new ones join, so the queue holds about what
    is in flight (more while an old one waits at its head: at most what is sent within one
    timeout).
    """

    def __init__(self) -> None:
        self._queues: dict[float, deque[tuple[float, asyncio.Future]]] = {}
        self._timers: dict[float, asyncio.TimerHandle] = {}

    def watch(self, future: asyncio.Future, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queues.get(timeout_s)
        if queue is None:
            queue = self._queues[timeout_s] = deque()
        while queue and queue[0][1].done():
            queue.popleft()
        deadline = loop.time() + timeout_s
        queue.append((deadline, future))
        if timeout_s not in self._timers:
            self._timers[timeout_s] = loop.call_at(deadline, self._expire, timeout_s)

    def _expire(self, timeout_s: float) -> None:
        del self._timers[timeout_s]
        queue = self._queues[timeout_s]
        loop = asyncio.get_running_loop()
        now = loop.time()
        while queue:
            deadline, future = queue[0]
            if not future.done():
                if deadline > now:
                    self._timers[timeout_s] = loop.call_at(deadline, self._expire, timeout_s)
                    return
                future.set_exception(_AckTimeout())
            queue.popleft()
        del self._queues[timeout_s]

    def close(self) -> None:
        """The connection is closing: nothing still awaited will be answered (nats-py does not
        fail these futures itself), so each fails now instead of at its deadline."""
        for timer in self._timers.values():
            timer.cancel()
        for queue in self._queues.values():
            for _deadline, future in queue:
                if not future.done():
                    future.set_exception(nats.errors.ConnectionClosedError())
        self._timers.clear()
        self._queues.clear()


class _Acks:
    """The acknowledgements one send waits for: message ``i`` of the send is answered by the
    server on the reply subject ``inbox + str(first + i)``; ``answers[i]`` becomes the stream
    name (stored, a duplicate included) or the exception that says why not. ``done`` is
    resolved when the last one is in (one future and one deadline per send, not per message),
    or failed by the deadline or the connection closing."""

    __slots__ = ("first", "answers", "left", "done", "held")

    def __init__(self, first: int, n: int) -> None:
        self.first = first
        self.answers: list = [None] * n
        self.left = n
        self.held: list[int] | None = None  # indexes acknowledged as duplicates
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()


class _Connection:
    """One client, pinned to one checked address, and the JetStream acknowledgements awaited
    on it.

    Messages are published the way nats-py's ``publish_async`` does it (a message with a
    reply subject; the stream answers there), without its per-message costs: a random token
    (an ``os.urandom`` call), a semaphore, a future and a done callback per message, and the
    header checks of ``NATS.publish``. A send's messages go out as one protocol write and one
    flush; their replies come in on one subscription of this connection's own.
    """

    def __init__(self, client: nats.NATS) -> None:
        self.client = client
        self.js = client.jetstream()  # the JetStream API (stream_info), not for publishing
        self.deadlines = _Deadlines()
        self.inbox = client.new_inbox() + "."  # unique to this connection
        self._inbox_bytes = self.inbox.encode()
        self.awaited: dict[str, tuple[_Acks, int]] = {}  # reply token -> (send, index)
        self._sent = 0  # reply tokens are this counter's values: never reused on a connection
        self.room = asyncio.Event()  # set when acknowledgements leave ``awaited``
        _check_client(client)

    async def open(self) -> _Connection:
        await self.client.subscribe(self.inbox + "*", cb=self._answered)
        return self

    def publishes_at_once(self, messages: list[tuple[bytes, dict]]) -> bool:
        """Whether publishing ``messages`` cannot wait: the client is not closed (while it
        reconnects it buffers them or refuses them at once), fewer than MAX_PENDING_ACKS
        acknowledgements would be awaited and its outgoing buffer takes them with room to
        spare (else a publish waits for a flush, as long as a slow broker makes it)."""
        client = self.client
        if client.is_closed or len(self.awaited) + len(messages) > MAX_PENDING_ACKS:
            return False
        size = client.pending_data_size
        for body, _headers in messages:
            size += len(body) + 512  # the headers, the subject, the reply inbox
        return size < PENDING_BYTES // 2

    async def room_for(self, n: int) -> None:
        """Wait until ``n`` more acknowledgements may be awaited (the memory they hold is
        bounded per connection)."""
        while len(self.awaited) + n > MAX_PENDING_ACKS:
            self.room.clear()
            await self.room.wait()

    def expect(self, n: int) -> _Acks:
        acks = _Acks(self._sent, n)
        self._sent += n
        return acks

    async def publish(
        self, subject: str, messages: list[tuple[bytes, dict]], traceparent: str | None, acks
    ) -> None:
        """Publish ``messages`` to ``subject``, their replies awaited in ``acks``. Raises what
        ``NATS.publish`` would for the whole send: the connection closed or draining, the
        reconnection buffer full; a body over the server's max_payload is that message's
        answer (it is not sent; the others are)."""
        client = self.client
        if client.is_closed:
            raise nats.errors.ConnectionClosedError
        if client.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        max_payload = client.max_payload
        trailer = f"traceparent: {traceparent}\r\n\r\n" if traceparent else "\r\n"
        head_of = b"HPUB " + subject.encode() + b" " + self._inbox_bytes
        parts: list[bytes] = []
        sent: list[int] = []  # reply tokens of the messages going out
        size = 0
        for i, (body, headers) in enumerate(messages, acks.first):
            if len(body) > max_payload:
                acks.answers[i - acks.first] = nats.errors.MaxPayloadError()
                continue
            sent.append(i)
            # As NATS.publish writes headers (values on one line), the message id being
            # webhook-id's value: this one record's key (the send built one message per
            # record); HTTP's user-agent left out (a consumer has no use for it).
            lines = "".join(
                f"{key}: {value.strip().translate(_NEWLINES)}\r\n"
                for key, value in headers.items()
                if key != "user-agent"
            )
            msg_id = headers["webhook-id"].strip().translate(_NEWLINES)
            head = f"NATS/1.0\r\n{lines}{MSG_ID}: {msg_id}\r\n{trailer}".encode()
            parts.append(b"%s%d %d %d\r\n" % (head_of, i, len(head), len(head) + len(body)))
            parts += (head, body, b"\r\n")
            size += len(body)
        blob = b"".join(parts)
        # While it reconnects the client buffers what fits in its pending_size (PENDING_BYTES).
        if not client.is_connected and len(blob) + client.pending_data_size > PENDING_BYTES:
            raise nats.errors.OutboundBufferLimitError
        acks.left = len(sent)
        if not sent:  # every one over max_payload: all answered already
            acks.done.set_result(None)
            return
        awaited = self.awaited
        for i in sent:
            awaited[str(i)] = (acks, i - acks.first)
        client.stats["out_msgs"] += len(sent)
        client.stats["out_bytes"] += size
        # NATS.publish's own last steps, once for the whole send: into the outgoing buffer
        # (flushed at once, waiting, when it is over its size), and the flusher woken.
        await client._send_command(blob)
        if client._flush_queue is not None and client._flush_queue.empty():
            await client._flush_pending()

    async def _answered(self, msg) -> None:
        """A stream's answer to one message (on the subscription's own task)."""
        entry = self.awaited.pop(msg.subject[len(self.inbox) :], None)
        if not self.room.is_set():
            self.room.set()
        if entry is None:
            return  # its send gave up (deadline, cancelled) and forgot it
        acks, i = entry
        if acks.done.done():
            return
        answer: object
        if msg.headers and msg.headers.get("Status") == "503":  # no responders
            answer = nats.js.errors.NoStreamResponseError()
        else:
            try:
                reply = json.loads(msg.data)
                error = reply.get("error")
                answer = reply["stream"] if error is None else _api_error(error)
                if reply.get("duplicate"):  # stored already, under this message id
                    if acks.held is None:
                        acks.held = []
                    acks.held.append(i)
            except Exception as exc:  # not a JetStream acknowledgement
                answer = ValueError(f"unreadable JetStream acknowledgement: {exc}")
        acks.answers[i] = answer
        acks.left -= 1
        if not acks.left:
            acks.done.set_result(None)

    def forget(self, acks: _Acks) -> None:
        """A send is over with answers still missing: nothing waits for them any more."""
        awaited = self.awaited
        for i in range(acks.first, acks.first + len(acks.answers)):
            awaited.pop(str(i), None)
        if not self.room.is_set():
            self.room.set()


def _api_error(error: dict) -> nats.js.errors.APIError:
    """The exception nats-py makes of a JetStream error answer (its ``from_error`` raises it:
    a stream's refusal is an answer, not a failure to read one)."""
    try:
        nats.js.errors.APIError.from_error(error)
    except nats.js.errors.APIError as exc:
        return exc
    return nats.js.errors.APIError(**error)  # unreachable while from_error always raises


_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def _check_client(client: nats.NATS) -> None:
    """The sink writes a send's messages through nats-py's outgoing buffer itself (``publish``
    above): what it relies on must still be there (nats-py is pinned; an upgrade that moves it
    fails here, loudly, rather than publishing wrongly)."""
    for name in ("_send_command", "_flush_pending", "_flush_queue", "stats"):
        if not hasattr(client, name):
            raise RuntimeError(f"nats-py has no NATS.{name}: the JetStream sink needs review")


class NatsSink:
    """Every nats:// target of the process, one shared connection per (host, port)."""

    validate_url = staticmethod(validate_target_url)

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy
        self._conns: dict[tuple[str, int], _Connection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._secrets: list[str] = []  # credential values, masked out of every error text
        # (target URL, stream) pairs whose duplicate window was compared with the target's
        # retry horizon (once per process: see _check_window).
        self._windows_checked: set[tuple[str, str]] = set()

    async def send(
        self, target: Target, records: list[Record], transform, traceparent: str | None = None
    ) -> Outcome:
        started = time.perf_counter()
        where = _where(target.url)
        subject = where.path
        # One message per record: its own body and its own idempotency key.
        single = target if target.batch_size == 1 else replace(target, batch_size=1)
        try:
            messages = [build_request(single, [r], transform) for r in records]
        except Exception as exc:
            return transform_failed(exc)
        timeout_s = target.timeout_ms / 1000
        conn = acks = None
        try:
            conn = self._conns.get((where.host, where.port))
            if conn is not None and conn.publishes_at_once(messages):
                # The hot path: nothing here can wait (the connection is up or buffering a
                # reconnection, the client has room for every message), so only the
                # acknowledgements need the deadline: one per send, on a timer shared by the
                # connection's sends.
                acks = conn.expect(len(messages))
                await conn.publish(subject, messages, traceparent, acks)
                conn.deadlines.watch(acks.done, timeout_s)
                await acks.done
            else:
                async with asyncio.timeout(timeout_s):
                    conn = await self._connection(where.host, where.port)
                    await conn.room_for(len(messages))
                    acks = conn.expect(len(messages))
                    await conn.publish(subject, messages, traceparent, acks)
                    await acks.done
        except TimeoutError:
            if acks is None:
                error = f"no connection within {target.timeout_ms} ms"
                return self._outcome(target, RETRY, error, started)
            # Past the deadline: each message not answered by now is retryable.
        except Exception as exc:
            kind, error = self._classify(exc, subject)
            outcome = self._outcome(target, kind, error, started)
            outcome.reached = not isinstance(exc, RefusedAddressError | ConfigError)
            return outcome
        finally:
            if acks is not None:
                if acks.left:  # a deadline passed, the send was cancelled or failed
                    conn.forget(acks)
                acks.done.cancel()  # out of the deadlines' queue (a no-op once resolved)
        answers = acks.answers
        stored = next((a for a in answers if isinstance(a, str)), None)
        if stored is not None and (target.url, stored) not in self._windows_checked:
            await self._check_window(target, stored)
        parts = [
            (DELIVERED, None)
            if isinstance(a, str)
            else (RETRY, f"no acknowledgement within {target.timeout_ms} ms")
            if a is None
            else self._classify(a, subject)
            for a in answers
        ]
        failures = [part for part in parts if part[0] != DELIVERED]
        if not failures:
            outcome = self._outcome(target, DELIVERED, None, started)
            if acks.held is not None:
                outcome.held, outcome.held_by = acks.held, f"stream {stored}"
            return outcome
        # The send as a whole: its worst answer (final before retryable), for the breaker.
        kind, error = min(failures, key=lambda f: f[0] != FINAL)
        if len(failures) > 1:
            error = f"{error} (and {len(failures) - 1} more of {len(records)})"
        outcome = self._outcome(target, kind, error, started)
        if len(set(parts)) > 1:  # each record settles on its own answer
            outcome.per_record = [
                (k, None if e is None else self._mask(redact(e, target.url))) for k, e in parts
            ]
        if acks.held is not None:
            outcome.held, outcome.held_by = acks.held, f"stream {stored}"
        return outcome

    async def read_back(
        self, url: str, since: datetime | None, found: Callable[[str], object]
    ) -> Retention:
        """The message id of every message on the target's subject stored at or after
        ``since`` (all without), through one ephemeral pull consumer on the stream that
        takes the subject: filtered to it, headers only (no bodies cross the wire), no
        acknowledgements, fetched READ_BATCH at a time, up to what it had pending when it was
        made (what the books call delivered was stored before). Raises what the broker says
        (no stream for the subject, no connection) for the caller to report.

        What the stream's limits removed: ``kept_from`` is now minus its ``max_age`` and,
        once its first sequence has moved on, the time of its oldest message (with
        ``max_msgs_per_subject``, of the subject's); ``trimmed`` when its first sequence has
        moved on or it keeps a number per subject. A purge or a deletion of the stream's
        head looks the same: counted as expired, not absent."""
        where = _where(url)
        subject = where.path
        conn = await self._connection(where.host, where.port)
        js = conn.js
        stream = await js.find_stream_name_by_subject(subject)
        raw = await conn.client.request(f"$JS.API.STREAM.INFO.{stream}", b"", READ_TIMEOUT_S)
        info = json.loads(raw.data)
        if "error" in info:
            raise _api_error(info["error"])
        config, state = info["config"], info["state"]
        if since is None:
            policy = {"deliver_policy": DeliverPolicy.ALL}
        else:
            policy = {"deliver_policy": DeliverPolicy.BY_START_TIME, "opt_start_time": since}
        consumer = ConsumerConfig(
            filter_subject=subject,
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            mem_storage=True,
            inactive_threshold=READ_TIMEOUT_S * 4,
            **policy,
        )
        pull = await js.pull_subscribe(subject, stream=stream, config=consumer)
        kept: list[datetime] = []
        per_subject = config.get("max_msgs_per_subject", -1) > 0
        trimmed = state.get("first_seq", 1) > 1 or per_subject
        first_ts = state.get("first_ts")
        if state.get("first_seq", 1) > 1 and state.get("messages") and first_ts:
            kept.append(_nats_time(first_ts))
        if config.get("max_age"):
            kept.append(datetime.now(UTC) - timedelta(microseconds=config["max_age"] // 1000))
        # The messages come in on an inbox of our own, each handed to a callback: nats-py's
        # fetch awaits a future per message, about seven times the cost of this.
        client, loop = conn.client, asyncio.get_running_loop()
        batch: dict = {"received": 0, "due": 0, "done": loop.create_future(), "over": False}

        async def arrived(msg) -> None:
            headers = msg.headers
            if headers and "Status" in headers:  # the pull request ended short
                if not batch["done"].done():
                    status = headers.get("Status")
                    if status in _NOTHING_MORE:
                        # Fewer left than were pending when the consumer was made: the
                        # stream's limits (max_age) or a deletion removed some meanwhile.
                        # What is gone is gone; the read is over, not failed.
                        batch["over"] = True
                        batch["done"].set_result(None)
                        return
                    why = f"{status} {headers.get('Description', '')}".strip()
                    batch["done"].set_exception(RuntimeError(f"stream {stream} read: {why}"))
                return
            if batch["received"] == 0 and per_subject:  # the subject's oldest message held
                with contextlib.suppress(Exception):  # no metadata: the limit stays unknown
                    kept.append(msg.metadata.timestamp)
            batch["received"] += 1
            key = headers.get(MSG_ID) if headers else None
            if key is not None:
                found(key)
            if batch["received"] >= batch["due"] and not batch["done"].done():
                batch["done"].set_result(None)

        inbox = client.new_inbox()
        sub = await client.subscribe(inbox, cb=arrived)
        try:
            info = await pull.consumer_info()
            left = info.num_pending
            request = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{info.name}"
            while left > 0 and not batch["over"]:
                want = min(left, READ_BATCH)
                batch["due"] = batch["received"] + want
                batch["done"] = loop.create_future()
                expires = int(READ_TIMEOUT_S * 1e9)
                body = json.dumps({"batch": want, "expires": expires}).encode()
                await client.publish(request, body, reply=inbox)
                async with asyncio.timeout(READ_TIMEOUT_S + 5):
                    await batch["done"]
                left -= want
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await pull.unsubscribe()
        return Retention(f"stream {stream}", max(kept) if kept else None, trimmed)

    async def _check_window(self, target: Target, stream: str) -> None:
        """Warn, once per target and stream, when the stream forgets message ids sooner than
        the target may send a record again: a record whose acknowledgement was lost and that
        is sent again after the window lands twice. Never fails the send it follows."""
        self._windows_checked.add((target.url, stream))
        where = _where(target.url)
        conn = self._conns.get((where.host, where.port))
        if conn is None:
            return
        try:
            async with asyncio.timeout(target.timeout_ms / 1000):
                info = await conn.js.stream_info(stream)
        except Exception as exc:  # no permission for the JetStream API, a broker gone...
            log.debug("stream %s: duplicate window not read: %s", stream, type(exc).__name__)
            return
        window = info.config.duplicate_window or 0.0
        horizon = retry_horizon_s(target)
        if window < horizon:
            log.warning(
                "target %s: stream %s keeps message ids for %.0f s (its duplicate_window), "
                "less than the %.0f s over which the target may send a record again "
                "(timeout_ms, backoff_ms and max_attempts, within max_age_s): a record sent "
                "again after the window lands twice; see docs/OPERATIONS.md",
                target.runner,
                stream,
                window,
                horizon,
            )

    def _outcome(self, target: Target, kind: str, error: str | None, started: float) -> Outcome:
        if error is not None:
            error = self._mask(redact(error, target.url))
        return Outcome(kind, None, error, (time.perf_counter() - started) * 1000)

    def _mask(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    @staticmethod
    def _classify(exc: BaseException, subject: str) -> tuple[str, str]:
        if isinstance(exc, nats.js.errors.NoStreamResponseError | nats.errors.NoRespondersError):
            return FINAL, f"no JetStream stream takes subject {subject!r}"
        if isinstance(exc, nats.js.errors.APIError):
            why = f"JetStream refused the message: {exc.description or 'error'} (code {exc.code})"
            return (RETRY if exc.code == 503 else FINAL), why
        if isinstance(exc, nats.errors.MaxPayloadError):
            return FINAL, "message larger than the server's max_payload"
        if isinstance(exc, nats.errors.AuthorizationError):
            return FINAL, "the NATS server refused the credentials"
        if isinstance(exc, RefusedAddressError):
            return FINAL, f"refused address: {exc}"
        if isinstance(exc, ConfigError):
            return RETRY, str(exc)
        if isinstance(exc, TimeoutError):
            return RETRY, "timed out"
        return RETRY, f"{type(exc).__name__}: {first_line(exc)[:300]}"

    async def _connection(self, host: str, port: int) -> _Connection:
        key = (host, port)
        conn = self._conns.get(key)
        if conn is not None and not conn.client.is_closed:
            return conn
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._conns.get(key)
            if conn is None or conn.client.is_closed:
                conn = self._conns[key] = await self._connect(host, port)
            return conn

    async def _connect(self, host: str, port: int) -> _Connection:
        options = credentials()
        self._secrets = secrets_of(options)

        connecting = True

        async def on_error(exc: Exception) -> None:
            log.debug(
                "nats %s:%d: %s", host, port, self._mask(redact(f"{type(exc).__name__}: {exc}"))
            )
            # nats-py retries refused credentials forever; ending the first connect here
            # makes them a final answer (raised out of connect, never out of a reconnect).
            if connecting and _auth_refused(exc):
                raise nats.errors.AuthorizationError

        client = await connect_pinned(
            host,
            port,
            policy=self.policy,
            name="eventpush",
            allow_reconnect=True,
            max_reconnect_attempts=MAX_RECONNECTS,
            reconnect_time_wait=RECONNECT_WAIT_S,
            error_cb=on_error,
            pending_size=PENDING_BYTES,
            **options,
        )
        connecting = False
        try:
            return await _Connection(client).open()
        except BaseException:
            with contextlib.suppress(Exception):
                await client.close()
            raise

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.deadlines.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await conn.client.close()


def retry_horizon_s(target: Target) -> float:
    """The longest a target's record may go between a send that may have landed (its
    acknowledgement lost or late) and its last attempt: every attempt's timeout and the
    longest backoff before each retry (``retry.backoff_s``'s ceiling), within the
    record's ``max_age_s``. A replay or a worker crash can send a record again later still."""
    waits = sum(
        min(BACKOFF_CAP_S, target.backoff_ms / 1000 * 2 ** min(k - 1, 64))
        for k in range(1, target.max_attempts)
    )
    timeouts = target.max_attempts * target.timeout_ms / 1000
    return min(waits + timeouts, target.max_age_s + target.timeout_ms / 1000)


def _nats_time(text: str) -> datetime:
    """A NATS server time (RFC 3339 with up to nanoseconds, ``Z``) as an aware datetime."""
    head, _, rest = text.partition(".")
    if not rest:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    digits = "".join(c for c in rest if c.isdigit())
    zone = rest[len(digits) :].replace("Z", "+00:00") or "+00:00"
    return datetime.fromisoformat(f"{head}.{digits[:6].ljust(6, '0')}{zone}")


def _auth_refused(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or (
        "authorization violation" in str(exc).lower()
    )
