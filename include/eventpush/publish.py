"""Appending events to a bus: parse, validate, place on queues, COPY, all or nothing.

An event is an EventBridge-style envelope: ``source`` and ``detail-type`` (required strings),
``detail`` (an object, ``{}`` when absent), and optional ``id``, ``time`` (ISO 8601),
``resources``, ``account``, ``region``. Missing ``id``, ``time``, ``version`` and
``resources`` are filled in. Events with the same partition key land on the same queue (a
stable CRC-32 of the key); events without one are spread round-robin.
"""

from __future__ import annotations

import io
import json
import random
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from eventpush.db import Connection, transaction

MAX_EVENT_BYTES = 256 * 1024  # EventBridge's PutEvents entry limit


class MalformedEventError(ValueError):
    """An input line that is not a valid event; the message names the line."""


@dataclass
class PublishResult:
    bus: str
    count: int
    # queue_id -> (first offset, last offset) of what this publish appended
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class _Prepared:
    queue_id: int
    message_id: str
    source: str
    detail_type: str
    time: str
    body: str


def _fail(line_no: int, why: str) -> MalformedEventError:
    return MalformedEventError(f"line {line_no}: {why}")


def _parse_time(value: object, line_no: int) -> str:
    """The timestamp for the ``event_time`` column; the event keeps its own spelling."""
    if not isinstance(value, str):
        raise _fail(line_no, "'time' must be an ISO 8601 string")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise _fail(line_no, f"'time' {value[:40]!r} is not ISO 8601") from None
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
        event = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _fail(line_no, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(event, dict):
        raise _fail(line_no, f"an event must be a JSON object, got {type(event).__name__}")
    for name in ("source", "detail-type"):
        value = event.get(name)
        if not isinstance(value, str) or not value:
            raise _fail(line_no, f"'{name}' is required and must be a non-empty string")
    detail = event.setdefault("detail", {})
    if not isinstance(detail, dict):
        raise _fail(line_no, "'detail' must be a JSON object")
    message_id = event.get("id")
    if message_id is None:
        event["id"] = str(uuid.uuid4())
    elif not isinstance(message_id, str) or not message_id:
        raise _fail(line_no, "'id' must be a non-empty string")
    if "time" in event:
        event_time = _parse_time(event["time"], line_no)
    else:
        event["time"] = event_time = now_iso
    resources = event.setdefault("resources", [])
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        raise _fail(line_no, "'resources' must be an array of strings")
    for name in ("account", "region"):
        if name in event and not isinstance(event[name], str):
            raise _fail(line_no, f"'{name}' must be a string")
    event.setdefault("version", "0")
    key = _key_of(event, key_path) if key_path else None
    return event, event_time, key


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def parse_events(
    lines: Iterable[str], queues: int, partition_key: str | None = None
) -> list[_Prepared]:
    """Every line validated and placed on a queue, or MalformedEventError for the first bad one."""
    now_iso = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    key_path = partition_key.split(".") if partition_key else None
    next_queue = random.randrange(queues)
    prepared: list[_Prepared] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        event, event_time, key = prepare_event(line, line_no, now_iso, key_path)
        body = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        if len(body) > MAX_EVENT_BYTES // 4 and len(body.encode()) > MAX_EVENT_BYTES:
            raise _fail(line_no, f"event is over the {MAX_EVENT_BYTES}-byte limit")
        if key is None:
            queue_id = next_queue
            next_queue = (next_queue + 1) % queues
        else:
            queue_id = zlib.crc32(key.encode()) % queues
        prepared.append(
            _Prepared(
                queue_id, event["id"], event["source"], event["detail-type"], event_time, body
            )
        )
    return prepared


def publish(
    conn: Connection, bus: str, lines: Iterable[str], partition_key: str | None = None
) -> PublishResult:
    """Append every event of ``lines`` to ``bus`` in one transaction, or none of them."""
    from eventpush.catalog import CatalogError

    with transaction(conn) as cur:
        cur.execute("SELECT id, queues FROM event_bus WHERE name = %s", (bus,))
        row = cur.fetchone()
        if row is None:
            raise CatalogError(f"unknown bus {bus!r}")
        bus_id, queues = row
    events = parse_events(lines, queues, partition_key)
    result = PublishResult(bus=bus, count=len(events))
    if not events:
        return result
    per_queue: dict[int, int] = {}
    for event in events:
        per_queue[event.queue_id] = per_queue.get(event.queue_id, 0) + 1
    with transaction(conn) as cur:
        # Lock the queue rows in one order so concurrent publishers cannot deadlock; the
        # locks are held to commit, which keeps each queue's offsets gapless and in order.
        cur.execute(
            "SELECT queue_id, next_offset FROM event_bus_queue "
            "WHERE bus_id = %s AND queue_id = ANY(%s) ORDER BY queue_id FOR UPDATE",
            (bus_id, sorted(per_queue)),
        )
        next_offset = dict(cur.fetchall())
        cur.execute(
            "UPDATE event_bus_queue q SET next_offset = q.next_offset + v.n "
            "FROM unnest(%s::int[], %s::bigint[]) AS v(queue_id, n) "
            "WHERE q.bus_id = %s AND q.queue_id = v.queue_id",
            (list(per_queue), list(per_queue.values()), bus_id),
        )
        buf = io.StringIO()
        write = buf.write
        for event in events:
            offset = next_offset[event.queue_id]
            next_offset[event.queue_id] = offset + 1
            write(
                f"{bus_id}\t{event.queue_id}\t{offset}\t{event.message_id.translate(_COPY_ESCAPES)}"
                f"\t{event.source.translate(_COPY_ESCAPES)}"
                f"\t{event.detail_type.translate(_COPY_ESCAPES)}\t{event.time}"
                f"\t{len(event.body.encode())}\t{event.body.translate(_COPY_ESCAPES)}\n"
            )
        buf.seek(0)
        cur.copy_expert(
            'COPY bus_event (bus_id, queue_id, "offset", message_id, source, detail_type, '
            "event_time, size_bytes, body) FROM STDIN",
            buf,
        )
        # Wakes workers waiting on this bus; delivered only when the transaction commits.
        cur.execute("SELECT pg_notify('eventpush_publish', %s)", (str(bus_id),))
    for queue_id, n in sorted(per_queue.items()):
        end = next_offset[queue_id]
        result.offsets[queue_id] = (end - n, end - 1)
    return result
