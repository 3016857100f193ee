"""The NATS JetStream source: the bus ``NAME`` is the stream ``NAME``, queue ``i`` is the subject
``NAME.i``, and an event's position is its stream sequence (it grows within a queue, with gaps:
the other queues' events take the sequences between).

- **Bus creation** makes the stream (file storage, subjects ``NAME.*``) or adopts an existing
  one whose subjects cover ``NAME.0`` … ``NAME.{N-1}``. Deleting a bus keeps its stream
  (others may own or read it): a later bus of that name adopts it but begins at its end
  (``event_bus_queue.first_offset``), so the deleted bus's events are not replayed, audited
  or counted as its own (catalog.buses).
- **Producers** that are not eventpush publish JSON events to ``NAME.i``. An event without a
  string ``id`` gets ``nats-NAME-SEQ`` (the same on every read) and one without ``time`` the
  time the stream stored it; a message that is not a JSON object is skipped with a warning
  (no rule could match it).
- **eventpush publish** validates the whole input first, then publishes with up to
  ``PUBLISH_IN_FLIGHT`` acknowledgements outstanding; ``Nats-Msg-Id`` is the event id, so a
  publish retried after a lost acknowledgement lands once (within the stream's duplicate
  window).
- **Reading** (chosen by measurement, bench/nats_bus.py ``read``): per queue, an ephemeral
  pull consumer filtered on the queue's subject, started at the position asked for, without
  acknowledgements (positions are committed in PostgreSQL), read by :class:`Puller` in
  no-wait batches; kept while reads go forward and started again where a read jumps.
  Wake-ups come from a plain subscription to ``NAME.*`` (only a flag is set per message); a
  feeder at the end of a queue fetches again only after one, or after ``IDLE_FETCH_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime

import msgspec

from eventpush.addresses import RefusedAddressError
from eventpush.backoff import Backoff
from eventpush.config import ConfigError, redact
from eventpush.db import Connection, transaction
from eventpush.errors import first_line
from eventpush.nats_client import NatsUrlError, connect, parse_url
from eventpush.sources.contract import (
    Bus,
    Chunk,
    Reader,
    SourceError,
    SourceKind,
    SourceUnavailableError,
    Stored,
    position_runs,
)
from eventpush.sources.heads import first_positions, record_heads

log = logging.getLogger("eventpush.sources")

STREAM_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
FETCH_BATCH = 512
IDLE_FETCH_S = 1.0  # a queue at its end is fetched at least this often without a wake-up
FEEDS_PER_QUEUE = 4  # consumers kept per queue for runners at different positions
CONSUMER_IDLE_S = 60.0  # the server drops a consumer we forgot after this long
PUBLISH_IN_FLIGHT = 256
PUBLISH_ATTEMPTS = 5
REQUEST_TIMEOUT_S = 5.0
RANGE_STALL_S = 30.0  # a batch read that gets nothing this long while messages are pending fails
WINDOW_PER_QUEUE = 256  # an engine window spans this many positions per queue of the bus
# Replay's look-ups (read_positions): a position alone is one get, this many at once; runs
# of near ones (contract.position_runs) are read through one consumer each.
GETS_IN_FLIGHT = 64

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def check(url: str) -> str:
    try:
        where = parse_url(url, "--source")
    except NatsUrlError as exc:
        raise SourceError(str(exc)) from None
    if where.path:
        raise SourceError(
            "--source names the NATS server only (nats://HOST:PORT): the stream is the bus's name"
        )
    return f"nats://{where.host}:{where.port}"


def subject(bus: Bus, queue_id: int) -> str:
    return f"{bus.name}.{queue_id}"


def run(coro_fn: Callable, *args):
    """Run ``coro_fn(*args)`` to its end from synchronous code, on a loop of its own (in a
    thread when the caller already runs one, as Airflow's API server does)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn(*args))
    box: list = []

    def target() -> None:
        try:
            box.append((True, asyncio.run(coro_fn(*args))))
        except BaseException as exc:
            box.append((False, exc))

    thread = threading.Thread(target=target, name="eventpush-nats", daemon=True)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


async def _with_nats(bus: Bus, work: Callable):
    """``work(nc)`` on a connection of its own; failures said in one line, without secrets."""
    try:
        nc = await connect(bus.source_url, name=f"eventpush {bus.name}")
    except (RefusedAddressError, NatsUrlError, ConfigError) as exc:
        raise SourceError(str(exc)) from None
    except Exception as exc:
        why = redact(f"NATS server {bus.source_url} of bus {bus.name}: {first_line(exc)}")
        raise SourceUnavailableError(why) from None
    try:
        return await work(nc)
    except SourceError:
        raise
    except Exception as exc:
        why = redact(f"NATS stream {bus.name} at {bus.source_url}: {first_line(exc)}")
        raise SourceUnavailableError(why) from None
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


# --- bus creation -------------------------------------------------------------------------------


def create(conn: Connection, bus: Bus) -> None:
    if not STREAM_NAME_RE.fullmatch(bus.name):
        raise SourceError(
            f"bus {bus.name!r} cannot be a JetStream stream: use letters, digits, '_' or '-' "
            "(no '.')"
        )
    run(_with_nats, bus, lambda nc: _create(nc, bus))


async def _create(nc, bus: Bus) -> None:
    # Deferred: the nats client library is loaded only when a NATS bus is read.
    from nats.js.api import StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
    wanted = f"{bus.name}.*"
    try:
        info = await js.stream_info(bus.name)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=bus.name,
                subjects=[wanted],
                storage=StorageType.FILE,
                # The bus's retention; an adopted stream keeps its own until `bus update`.
                max_age=float(bus.retention_s) if bus.retention_s else None,
            )
        )
        return
    subjects = set(info.config.subjects or [])
    covered = bool({wanted, f"{bus.name}.>"} & subjects) or all(
        subject(bus, q) in subjects for q in range(bus.queues)
    )
    if not covered:
        raise SourceError(
            f"stream {bus.name!r} exists with subjects {sorted(subjects)}, which do not cover "
            f"{bus.name}.0 … {bus.name}.{bus.queues - 1}: it is not adopted"
        )


def set_retention(conn: Connection, bus: Bus, seconds: int) -> None:
    """The stream's ``max_age`` becomes the bus's retention."""
    run(_with_nats, bus, lambda nc: _set_max_age(nc, bus, seconds))


async def _set_max_age(nc, bus: Bus, seconds: int) -> None:
    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
    info = await js.stream_info(bus.name)
    config = info.config
    config.max_age = float(seconds)
    await js.update_stream(config)


# --- publishing ---------------------------------------------------------------------------------


def publish(conn: Connection, bus: Bus, events: Iterable) -> dict[int, tuple[int, int, int]]:
    """Every event validated first (a bad line refuses the input, nothing sent), then
    published with acknowledgements; the heads are recorded and workers notified."""
    prepared = list(events)
    if not prepared:
        return {}
    seqs = run(_with_nats, bus, lambda nc: _publish(nc, bus, prepared))
    placed: dict[int, tuple[int, int, int]] = {}
    for event, seq in zip(prepared, seqs, strict=True):
        first, last, n = placed.get(event.queue_id, (seq, seq, 0))
        placed[event.queue_id] = (min(first, seq), max(last, seq), n + 1)
    record_heads(conn, bus.id, {q: last + 1 for q, (_, last, _) in placed.items()})
    with transaction(conn) as cur:
        cur.execute("SELECT pg_notify('eventpush_publish', %s)", (str(bus.id),))
    return placed


async def _publish(nc, bus: Bus, prepared: list) -> list[int]:
    # Deferred: the nats client library is loaded only when a NATS bus is read.
    from nats.errors import NoRespondersError

    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)

    async def one(event) -> int:
        backoff = Backoff()
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                ack = await js.publish(
                    subject(bus, event.queue_id),
                    event.body.encode(),
                    headers={"Nats-Msg-Id": event.message_id},
                )
                return ack.seq
            except (TimeoutError, NoRespondersError):
                if attempt == PUBLISH_ATTEMPTS:
                    raise
                await backoff.wait()
        raise AssertionError("unreachable")

    seqs: list[int] = []
    for i in range(0, len(prepared), PUBLISH_IN_FLIGHT):
        seqs.extend(await asyncio.gather(*(one(e) for e in prepared[i : i + PUBLISH_IN_FLIGHT])))
    return seqs


# --- messages to events -------------------------------------------------------------------------


def _ack_fields(reply: str) -> tuple[int, int, int]:
    """(stream sequence, timestamp ns, pending) from a JetStream message's reply subject
    ($JS.ACK.[domain.hash.]stream.consumer.delivered.sseq.cseq.ts.pending[.token])."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]), int(tokens[8])
    return int(tokens[7]), int(tokens[9]), int(tokens[10])


def event_row(stream: str, seq: int, ts_ns: int, data: bytes) -> tuple[int, str, str] | None:
    """(position, message id, JSON text) of one stored message, the same on every read; None
    for a message that is not a JSON object."""
    try:
        event = _decode(data)
    except msgspec.DecodeError:
        event = None
    if not isinstance(event, dict):
        log.warning("stream %s sequence %d is not a JSON object: skipped", stream, seq)
        return None
    message_id = event.get("id")
    changed = False
    if not isinstance(message_id, str) or not message_id:
        message_id = event["id"] = f"nats-{stream}-{seq}"
        changed = True
    if not isinstance(event.get("time"), str):
        stamp = datetime.fromtimestamp(ts_ns / 1e9, UTC)
        event["time"] = stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
        changed = True
    raw = _encode(event).decode() if changed else data.decode()
    return seq, message_id, raw


# --- pulling --------------------------------------------------------------------------------------


class Puller:
    """An ephemeral pull consumer on one queue, from a position on, without acknowledgements,
    read through a subscription of its own: ``fetch`` sends one no-wait pull request and
    collects what the server delivers until it says there is no more. (nats-py's
    ``PullSubscription.fetch`` waits for each message with a timeout of its own, several times
    slower: bench/nats_bus.py ``read``.)"""

    def __init__(self, nc, bus: Bus, queue_id: int) -> None:
        self.nc = nc
        self.bus = bus
        self.queue_id = queue_id
        self.sub = None
        self.next_subject = ""
        self.msgs: list = []
        self.want = 0
        self.done: asyncio.Event | None = None
        self.error: str | None = None

    async def open(self, start: int) -> Puller:
        # Deferred: the nats client library is loaded only when a NATS bus is read.
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        js = self.nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        info = await js.add_consumer(
            self.bus.name,
            ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=max(start, 1),
                ack_policy=AckPolicy.NONE,
                filter_subject=subject(self.bus, self.queue_id),
                inactive_threshold=CONSUMER_IDLE_S,
                mem_storage=True,
                num_replicas=1,
            ),
        )
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.bus.name}.{info.name}"
        self.sub = await self.nc.subscribe(
            self.nc.new_inbox(), cb=self._delivered, pending_msgs_limit=4 * FETCH_BATCH
        )
        return self

    async def _delivered(self, msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is not None and not msg.data:
            if self.done is not None:
                if status not in ("404", "408"):  # 404/408: nothing more for now
                    self.error = f"JetStream status {status} {msg.headers.get('Description', '')}"
                self.done.set()
            return
        # Kept even between fetches (the tail of a request given up on): the consumer has
        # moved past it and will not deliver it again.
        self.msgs.append(msg)
        if self.done is not None and len(self.msgs) >= self.want:
            self.done.set()

    async def fetch(self, n: int, timeout: float = REQUEST_TIMEOUT_S) -> list:
        """Up to ``n`` messages, in sequence order; [] when the queue has nothing more. A
        server that does not answer (down, or the consumer gone with it) raises."""
        if not self.msgs:
            self.want, self.error = n, None
            self.done = done = asyncio.Event()
            request = b'{"batch": %d, "no_wait": true}' % n
            try:
                await self.nc.publish(self.next_subject, request, reply=self.sub.subject)
                async with asyncio.timeout(timeout):
                    await done.wait()
            finally:
                self.done = None
            if self.error is not None:
                raise SourceUnavailableError(self.error)
        msgs, self.msgs = self.msgs, []
        return msgs

    async def close(self) -> None:
        if self.sub is not None:
            await _quietly(self.sub.unsubscribe())


# --- the engine's reader ------------------------------------------------------------------------


class _Feed:
    """One pull consumer on one queue: it has delivered every message below ``pos``; those
    at or above ``lo`` not yet handed out are in ``buffer``."""

    __slots__ = ("sub", "lo", "pos", "buffer", "at_end", "fetched_at", "used")

    def __init__(self, start: int) -> None:
        self.sub = None
        self.lo = self.pos = start
        self.buffer: deque[tuple[int, str, str]] = deque()
        self.at_end = False
        self.fetched_at = 0.0
        self.used = time.monotonic()


class NatsReader(Reader):
    """Every NATS bus a worker reads, on one connection per server."""

    def __init__(self, database_url: str) -> None:
        self.conns: dict[str, object] = {}
        self.feeds: dict[tuple[int, int], list[_Feed]] = {}
        self.locks: dict[tuple[int, int], asyncio.Lock] = {}
        self.news: set[tuple[int, int]] = set()  # queues with a message heard since a fetch
        self.watching: dict[int, object] = {}
        self.connect_lock = asyncio.Lock()
        self.cleanups: set[asyncio.Task] = set()

    def window_for(self, bus: Bus) -> int:
        return WINDOW_PER_QUEUE * bus.queues

    async def _nc(self, bus: Bus):
        async with self.connect_lock:
            nc = self.conns.get(bus.source_url)
            if nc is None or nc.is_closed:

                async def reconnected() -> None:
                    self._forget_consumers()

                nc = await connect(
                    bus.source_url,
                    name="eventpush worker",
                    persistent=True,
                    reconnected_cb=reconnected,
                )
                self.conns[bus.source_url] = nc
            return nc

    def _forget_consumers(self, key: tuple[int, int] | None = None) -> None:
        """Consumers that may be gone (the server restarted, a read failed): each feed starts
        a new one where it stands at its next read. Those of ``key``'s queue only, if given."""
        for feed_key, feeds in self.feeds.items():
            if key is None or feed_key == key:
                for feed in feeds:
                    self._drop_consumer(feed)

    def _drop_consumer(self, feed: _Feed) -> None:
        puller, feed.sub, feed.at_end = feed.sub, None, False
        if puller is not None:  # the server forgets its consumer after CONSUMER_IDLE_S
            task = asyncio.ensure_future(puller.close())
            self.cleanups.add(task)
            task.add_done_callback(self.cleanups.discard)

    async def read(self, bus: Bus, queue_id: int, start: int, stop: int) -> Chunk:
        key = (bus.id, queue_id)
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = asyncio.Lock()
        backoff = Backoff()
        async with lock:
            while True:
                try:
                    return await self._read(bus, queue_id, start, stop)
                except (asyncio.CancelledError, SourceError):
                    raise
                except Exception as exc:
                    log.warning(
                        "NATS bus %s queue %d not read (%s); retrying in %.1fs",
                        bus.name,
                        queue_id,
                        first_line(exc),
                        backoff.delay,
                    )
                    self._forget_consumers(key)
                    await backoff.wait()

    def _feed(self, key: tuple[int, int], start: int) -> _Feed:
        feeds = self.feeds.setdefault(key, [])
        for feed in feeds:
            if feed.lo <= start <= feed.pos:
                feed.used = time.monotonic()
                return feed
        if len(feeds) >= FEEDS_PER_QUEUE:
            old = min(feeds, key=lambda f: f.used)
            feeds.remove(old)
            self._drop_consumer(old)
        feed = _Feed(start)
        feeds.append(feed)
        return feed

    async def _read(self, bus: Bus, queue_id: int, start: int, stop: int) -> Chunk:
        key = (bus.id, queue_id)
        feed = self._feed(key, start)
        while feed.buffer and feed.buffer[0][0] < start:
            feed.buffer.popleft()
        while not (feed.buffer and feed.buffer[-1][0] >= stop):
            now = time.monotonic()
            if feed.at_end and key not in self.news and now - feed.fetched_at < IDLE_FETCH_S:
                break
            self.news.discard(key)
            got = await self._fetch(bus, queue_id, feed)
            feed.fetched_at = now
            if not got:
                break
        rows = []
        while feed.buffer and feed.buffer[0][0] < stop:
            rows.append(feed.buffer.popleft())
        end = feed.buffer[0][0] if feed.buffer else feed.pos
        feed.lo = min(stop, feed.pos)
        return Chunk(rows, end)

    async def _fetch(self, bus: Bus, queue_id: int, feed: _Feed) -> bool:
        """One batch into the feed's buffer; False when the queue had nothing more."""
        if feed.sub is None:
            feed.sub = await Puller(await self._nc(bus), bus, queue_id).open(feed.pos)
        msgs = await feed.sub.fetch(FETCH_BATCH)
        if not msgs:
            feed.at_end = True
            return False
        for msg in msgs:
            seq, ts_ns, pending = _ack_fields(msg.reply)
            if seq < feed.pos:
                continue  # delivered before a reset: already in the buffer or handed out
            feed.pos = seq + 1
            feed.at_end = pending == 0
            row = event_row(bus.name, seq, ts_ns, msg.data)
            if row is not None:
                feed.buffer.append(row)
        return bool(msgs)

    async def watch(self, buses, wake: Callable[[int], None]) -> None:
        """Subscribe to each NATS bus's subjects as it appears; a message sets a flag."""
        try:
            while True:
                for bus in list(buses()):
                    if bus.id in self.watching or bus.scheme != "nats":
                        continue
                    self.watching[bus.id] = await self._watch(bus, wake)
                await self._let_go(buses)
                await asyncio.sleep(1.0)
        finally:
            for sub in self.watching.values():
                await _quietly(sub.unsubscribe())
            self.watching.clear()

    async def _let_go(self, buses) -> None:
        """Buses the worker no longer reads (deleted, or their runners moved away): their
        subscription, pull consumers and locks go. Kept, every bus ever read here held a
        subscription and its queues' consumers for the worker's life."""
        read = {bus.id for bus in buses()}
        for bus_id in [b for b in self.watching if b not in read]:
            await _quietly(self.watching.pop(bus_id).unsubscribe())
        read = {bus.id for bus in buses()}  # again: no await from here on
        for key in [k for k in self.feeds if k[0] not in read]:
            for feed in self.feeds.pop(key):
                self._drop_consumer(feed)
        for key in [k for k in self.locks if k[0] not in read and not self.locks[k].locked()]:
            del self.locks[key]
        self.news.difference_update([k for k in self.news if k[0] not in read])

    async def _watch(self, bus: Bus, wake: Callable[[int], None]):
        nc = await self._nc(bus)
        prefix = len(bus.name) + 1
        news = self.news

        async def heard(msg) -> None:
            with contextlib.suppress(ValueError):
                news.add((bus.id, int(msg.subject[prefix:])))
            wake(bus.id)

        return await nc.subscribe(f"{bus.name}.*", cb=heard)

    async def heads(self, bus: Bus) -> dict[int, int]:
        return await _heads(await self._nc(bus), bus)

    async def close(self) -> None:
        for feeds in self.feeds.values():
            for feed in feeds:
                if feed.sub is not None:
                    await feed.sub.close()
        self.feeds.clear()
        for nc in self.conns.values():
            await _quietly(nc.close())
        self.conns.clear()


async def _quietly(awaitable) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await awaitable


# --- status and the batch jobs ------------------------------------------------------------------


async def _heads(nc, bus: Bus) -> dict[int, int]:
    # Deferred: the nats client library is loaded only when a NATS bus is read.
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)

    async def head(queue_id: int) -> int:
        try:
            msg = await js.get_last_msg(bus.name, subject(bus, queue_id))
        except NotFoundError:
            return 0
        return msg.seq + 1

    found = await asyncio.gather(*(head(q) for q in range(bus.queues)))
    return dict(enumerate(found))


def heads(conn: Connection, bus: Bus) -> dict[int, int]:
    return run(_with_nats, bus, lambda nc: _heads(nc, bus))


async def _range(
    nc, bus: Bus, queue_id: int, start: int, stop: int, keep: Callable[[int], bool] | None = None
) -> list[Stored]:
    """Every event of the queue in [start, stop) (those whose position ``keep`` takes, if
    given), through one throw-away consumer."""
    out: list[Stored] = []
    if stop <= start:
        return out
    puller = await Puller(nc, bus, queue_id).open(start)
    at = start
    try:
        while True:
            # The queue holds at most stop - at messages before stop: a batch asks no more, so
            # a short range is not sent a whole batch past its end.
            msgs = await puller.fetch(min(FETCH_BATCH, stop - at), RANGE_STALL_S)
            if not msgs:
                return out
            for msg in msgs:
                seq, ts_ns, pending = _ack_fields(msg.reply)
                if seq >= stop:
                    return out
                at = seq + 1
                row = None
                if keep is None or keep(seq):  # the others are passed over, never decoded
                    row = event_row(bus.name, seq, ts_ns, msg.data)
                if row is not None:
                    ctime = datetime.fromtimestamp(ts_ns / 1e9, UTC)
                    out.append(Stored(queue_id, seq, row[1], ctime, row[2]))
                if pending == 0 or at >= stop:
                    return out
    finally:
        await puller.close()


async def _get(js, bus: Bus, queue_id: int, seq: int) -> Stored | None:
    """The event at one position of the queue, by one request (the stream's message get, no
    consumer); None when the stream holds none there (aged out, deleted, another queue's, not
    a JSON object)."""
    # Deferred: the nats client library is loaded only when a NATS bus is read.
    from nats.js.errors import NotFoundError

    try:
        msg = await js.get_msg(bus.name, seq)
    except NotFoundError:
        return None
    if msg.subject != subject(bus, queue_id) or msg.time is None:
        return None
    ts_ns = round(msg.time.timestamp() * 1e6) * 1000
    row = event_row(bus.name, seq, ts_ns, msg.data or b"")
    return None if row is None else Stored(queue_id, seq, row[1], msg.time, row[2])


async def _positions(nc, bus: Bus, queue_id: int, positions: list[int]) -> list[Stored]:
    """The events at ``positions``: runs of near ones through a consumer each, keeping only
    those asked; a position far from any other by a get of its own. What is held is what was
    asked, however far apart (replay asked for the span between the first and the last)."""
    wanted = set(positions)
    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
    out: list[Stored] = []
    alone: list[int] = []
    for run in position_runs(sorted(wanted)):
        if len(run) == 1:
            alone.append(run[0])
        else:
            out += await _range(nc, bus, queue_id, run[0], run[-1] + 1, wanted.__contains__)
    for i in range(0, len(alone), GETS_IN_FLIGHT):
        got = await asyncio.gather(
            *(_get(js, bus, queue_id, p) for p in alone[i : i + GETS_IN_FLIGHT])
        )
        out += [event for event in got if event is not None]
    out.sort(key=lambda event: event.position)
    return out


def read_positions(
    conn: Connection, bus: Bus, queue_id: int, positions: list[int]
) -> Iterator[Stored]:
    if positions:
        yield from run(_with_nats, bus, lambda nc: _positions(nc, bus, queue_id, positions))


async def _count(nc, bus: Bus, firsts: dict[int, int]) -> int:
    """The messages of the bus's queues from where each began: the stream's per-subject counts
    (one request; its total would count subjects not the bus's), or, for a queue whose
    beginning is past the stream's first message (a deleted bus's messages still below it),
    the pending count of a consumer started there."""
    # Deferred: the nats client library is loaded only when a NATS bus is read.
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
    info = await js.stream_info(bus.name, subjects_filter=f"{bus.name}.*")
    held = info.state.subjects or {}

    async def from_first(queue_id: int) -> int:
        first = firsts.get(queue_id, 0)
        if first <= info.state.first_seq:
            return held.get(subject(bus, queue_id), 0)
        consumer = await js.add_consumer(
            bus.name,
            ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=first,
                ack_policy=AckPolicy.NONE,
                filter_subject=subject(bus, queue_id),
                inactive_threshold=CONSUMER_IDLE_S,
                mem_storage=True,
                num_replicas=1,
            ),
        )
        await _quietly(js.delete_consumer(bus.name, consumer.name))
        return consumer.num_pending or 0

    return sum(await asyncio.gather(*(from_first(q) for q in range(bus.queues))))


def count(conn: Connection, bus: Bus) -> int:
    firsts = first_positions(conn, bus.id)
    return run(_with_nats, bus, lambda nc: _count(nc, bus, firsts))


def read_range(
    conn: Connection, bus: Bus, queue_id: int, start: int, stop: int
) -> Iterator[Stored]:
    yield from run(_with_nats, bus, lambda nc: _range(nc, bus, queue_id, start, stop))


async def _position_at(nc, bus: Bus, queue_id: int, when: datetime) -> int:
    # Deferred: the nats client library is loaded only when a NATS bus is read.
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=when.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        ack_policy=AckPolicy.NONE,
        inactive_threshold=CONSUMER_IDLE_S,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await js.pull_subscribe(subject(bus, queue_id), stream=bus.name, config=config)
    try:
        if not (await sub.consumer_info()).num_pending:
            return (await _heads(nc, bus))[queue_id]
        msgs = await sub.fetch(1, timeout=RANGE_STALL_S)
        return _ack_fields(msgs[0].reply)[0]
    finally:
        await _quietly(sub.unsubscribe())


def position_at(conn: Connection, bus: Bus, queue_id: int, when: datetime) -> int:
    return run(_with_nats, bus, lambda nc: _position_at(nc, bus, queue_id, when))


KIND = SourceKind(
    scheme="nats",
    check=check,
    create=create,
    open_reader=NatsReader,
    publish=publish,
    heads=heads,
    read_range=read_range,
    position_at=position_at,
    set_retention=set_retention,
    read_positions=read_positions,
    count=count,
)
