"""Publishing to a bus: parse, validate and complete events, place them on queues, and hand
them to the bus's source (eventpush.sources: COPY into PostgreSQL, all or nothing, or a broker).

An event is an EventBridge-style envelope: ``source`` and ``detail-type`` (required strings),
``detail`` (an object, ``{}`` when absent), and optional ``id``, ``time`` (ISO 8601),
``resources``, ``account``, ``region``. Missing ``id``, ``time``, ``version`` and
``resources`` are filled in. Events with the same partition key land on the same queue (a
stable CRC-32 of the key); events without one are spread round-robin.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from eventpush import tracing
from eventpush.db import Connection
from eventpush.sources import bus_named, kind_for
from eventpush.tracing import TRACEPARENT_FIELD

# EventBridge's PutEvents entry limit, counted its way (entry_size), at the front doors: the
# API's PutEvents and `eventpush publish`.
MAX_EVENT_BYTES = 256 * 1024
# Any stored event's ceiling (envelope and escaping included), under NATS's default
# max_payload of 1 MiB. Bus-to-bus targets re-publish what a front door took: only this
# applies to them, since the entry limit counted on a re-encoded detail (1e2 is 100.0) or a
# transform's output could refuse for good an event the first bus accepted.
MAX_STORED_BYTES = 512 * 1024


class MalformedEventError(ValueError):
    """An input line that is not a valid event; the message names the line."""


@dataclass
class PublishResult:
    bus: str
    count: int
    # queue_id -> (first offset, last offset) of what this publish appended
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)
    # queue_id -> how many (a broker's positions have gaps: not last - first + 1)
    counts: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class Prepared:
    queue_id: int
    message_id: str
    source: str
    detail_type: str
    time: str
    body: str
    size: int


def new_id() -> str:
    """A random (version 4) UUID, formatted without uuid.UUID's per-call overhead."""
    return new_ids(1)[0]


# A random hex digit's variant digit (10xx in binary: 8, 9, a or b), by lookup: int(h, 16) on
# each id cost a fifth of new_ids.
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}


def new_ids(n: int) -> list[str]:
    """``n`` random (version 4) UUIDs from one ``os.urandom`` call (a system call each
    costs more than the formatting)."""
    h = os.urandom(16 * n).hex()
    variant = _VARIANT
    return [
        f"{h[a : a + 8]}-{h[a + 8 : a + 12]}-4{h[a + 13 : a + 16]}-{variant[h[a + 16]]}"
        f"{h[a + 17 : a + 20]}-{h[a + 20 : a + 32]}"
        for a in range(0, 32 * n, 32)
    ]


def _fail(where: int | str, why: str) -> MalformedEventError:
    """``where`` is a line number (the CLI's input) or a label such as ``entry 3``."""
    label = f"line {where}" if isinstance(where, int) else where
    return MalformedEventError(f"{label}: {why}")


def parse_time(value: object, where: int | str) -> str:
    """The timestamp for the ``event_time`` column; the event keeps its own spelling."""
    if not isinstance(value, str):
        raise _fail(where, "'time' must be an ISO 8601 string")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise _fail(where, f"'time' {value[:40]!r} is not ISO 8601") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.isoformat()


def _key_of(event: dict, path: list[str]) -> str | None:
    value: object = event
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if value is None or isinstance(value, dict | list):
        return None if value is None else json.dumps(value, sort_keys=True)
    return str(value)


def prepare_event(
    line: str, line_no: int, now_iso: str, key_path: list[str] | None
) -> tuple[dict, str, str | None]:
    """Parse and validate one line: the completed event, its time and its partition key."""
    try:
        event = _decode(line)
    except msgspec.DecodeError as exc:
        raise _fail(line_no, f"not valid JSON ({exc})") from None
    return complete_event(event, line_no, now_iso, key_path)


def complete_event(
    event: object, where: int | str, now_iso: str, key_path: list[str] | None
) -> tuple[dict, str, str | None]:
    """Validate a decoded event and fill in what it may leave out: the completed event, its
    time and its partition key (the API hands its entries here, the CLI its lines)."""
    if not isinstance(event, dict):
        raise _fail(where, f"an event must be a JSON object, got {type(event).__name__}")
    for name in ("source", "detail-type"):
        value = event.get(name)
        if not isinstance(value, str) or not value:
            raise _fail(where, f"'{name}' is required and must be a non-empty string")
    detail = event.setdefault("detail", {})
    if not isinstance(detail, dict):
        raise _fail(where, "'detail' must be a JSON object")
    message_id = event.get("id")
    if message_id is None:
        event["id"] = new_id()
    elif not isinstance(message_id, str) or not message_id:
        raise _fail(where, "'id' must be a non-empty string")
    if "time" in event:
        event_time = parse_time(event["time"], where)
    else:
        event["time"] = event_time = now_iso
    check_resources(event.setdefault("resources", []), where)
    for name in ("account", "region"):
        if name in event and not isinstance(event[name], str):
            raise _fail(where, f"'{name}' must be a string")
    event.setdefault("version", "0")
    key = _key_of(event, key_path) if key_path else None
    return event, event_time, key


def check_resources(resources: object, where: int | str) -> None:
    if not isinstance(resources, list) or (
        resources and not all(isinstance(r, str) for r in resources)
    ):
        raise _fail(where, "'resources' must be an array of strings")


def entry_size(
    source: str, detail_type: str, detail_bytes: int, resources: list, timed: bool
) -> int:
    """An entry's size as EventBridge counts it: 14 bytes for a Time, then the UTF-8 bytes of
    Source, DetailType, Detail and each of Resources (the envelope is not counted)."""
    named = [source, detail_type, *resources]
    return (14 if timed else 0) + detail_bytes + sum(len(s.encode()) for s in named)


def check_size(size: int, where: int | str, entry: Callable[[], int] | None) -> None:
    """A stored event of ``size`` bytes within the ceiling and, with ``entry`` (its
    :func:`entry_size`), within EventBridge's entry limit; else MalformedEventError. A stored
    event holds every byte the entry counts (escaped, and more), so at 256 KiB or less both
    hold and ``entry`` is not called: the hot path pays one comparison. (Not quite every
    byte: a Detail's whitespace around it or between its lines is not stored, which makes
    the check a little more lenient than AWS for such details.)"""
    if size <= MAX_EVENT_BYTES:
        return
    if entry is not None and (counted := entry()) > MAX_EVENT_BYTES:
        raise _fail(
            where,
            f"event is over the {MAX_EVENT_BYTES}-byte limit ({counted:,} bytes, counted as "
            "EventBridge counts an entry: Time, Source, DetailType, Detail, Resources)",
        )
    if size > MAX_STORED_BYTES:
        raise _fail(where, f"the stored event is over the {MAX_STORED_BYTES}-byte limit")


def _has_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any("\x00" in k or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def iter_events(
    lines: Iterable[str],
    queues: int,
    partition_key: str | None = None,
    traceparent: str | None = None,
    entry_limit: bool = True,
) -> Iterator[Prepared]:
    """Each line validated and placed on a queue; MalformedEventError at the first bad one.
    ``traceparent`` is stamped on events that carry none (see ``eventpush.tracing``);
    ``entry_limit``: see :func:`encode_event`."""
    now_iso = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    key_path = partition_key.split(".") if partition_key else None
    next_queue = random.randrange(queues)
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event, event_time, key = prepare_event(line, line_no, now_iso, key_path)
        except RecursionError:
            # Exit 2 (refused input), never the traceback's exit 1 ("missing deliveries").
            raise _fail(line_no, "the event is nested too deeply") from None
        if traceparent is not None and TRACEPARENT_FIELD not in event:
            event[TRACEPARENT_FIELD] = traceparent
        if key is None:
            queue_id = next_queue
            next_queue = (next_queue + 1) % queues
        else:
            queue_id = zlib.crc32(key.encode()) % queues
        yield encode_event(event, event_time, queue_id, line_no, entry_limit=entry_limit)


def encode_event(
    event: dict,
    event_time: str,
    queue_id: int,
    where: int | str,
    *,
    timed: bool = True,
    detail_bytes: int | None = None,
    entry_limit: bool = True,
) -> Prepared:
    """A completed event, encoded and checked (no NUL, within the size limits), ready for a
    source's ``publish`` on ``queue_id``. For the entry's size: ``timed``, whether it gave a
    Time (a published line's is counted), and ``detail_bytes``, its Detail as sent when the
    caller has it (else the detail encoded); ``entry_limit`` False: only the stored ceiling
    applies (a bus-to-bus re-publish)."""
    try:
        encoded = _encode(event)
        # PostgreSQL's jsonb has no NUL; the cheap test on the encoding only rarely needs
        # the exact walk (an escaped backslash before "u0000" also contains the bytes).
        nul = b"\\u0000" in encoded and _has_nul(event)
    except RecursionError:
        raise _fail(where, "the event is nested too deeply") from None
    if nul:
        raise _fail(where, "a NUL character (\\u0000) is not allowed in an event")

    def entry() -> int:
        detail = len(_encode(event["detail"])) if detail_bytes is None else detail_bytes
        return entry_size(event["source"], event["detail-type"], detail, event["resources"], timed)

    check_size(len(encoded), where, entry if entry_limit else None)
    return Prepared(
        queue_id,
        event["id"],
        event["source"],
        event["detail-type"],
        event_time,
        encoded.decode(),
        len(encoded),
    )


def parse_events(
    lines: Iterable[str], queues: int, partition_key: str | None = None
) -> list[Prepared]:
    """Every line validated and placed on a queue, or MalformedEventError for the first bad one."""
    return list(iter_events(lines, queues, partition_key))


def publish(
    conn: Connection,
    bus: str,
    lines: Iterable[str],
    partition_key: str | None = None,
    *,
    entry_limit: bool = True,
) -> PublishResult:
    """Append every event of ``lines`` to ``bus`` in one transaction, or none of them. With
    tracing on, in a span of its own whose context events without a ``traceparent`` get.
    ``entry_limit`` False for a bus-to-bus re-publish (:data:`MAX_STORED_BYTES`)."""
    with tracing.publish_span(bus) as (span, stamp):
        result = _publish(conn, bus, lines, partition_key, stamp, entry_limit)
        if span.is_recording():
            span.set_attribute("eventpush.events", result.count)
    return result


def _publish(
    conn: Connection,
    bus: str,
    lines: Iterable[str],
    partition_key: str | None,
    traceparent: str | None,
    entry_limit: bool,
) -> PublishResult:
    found = bus_named(conn, bus)
    events = iter_events(lines, found.queues, partition_key, traceparent, entry_limit)
    placed = kind_for(found.source_url).publish(conn, found, events)
    result = PublishResult(bus=bus, count=0)
    for queue_id, (first, last, n) in sorted(placed.items()):
        result.offsets[queue_id] = (first, last)
        result.counts[queue_id] = n
        result.count += n
    return result
