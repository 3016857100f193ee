"""Events: ``PutEvents`` and ``TestEventPattern``.

``PutEvents`` takes 1-10 entries, each on its own bus (``default`` when it names none). An
entry that is not a valid event (no ``Source``, ``Detail`` that is not a JSON object, over 256
KiB, ...) gets its error in ``Entries`` and is not stored, as AWS does; the valid ones are
stored, each bus's in one group commit shared with concurrent requests (eventpush.group_publish).
The answer is sent only once they are committed (or acknowledged by JetStream). A producer key
naming a bus it was not given is refused whole (``AccessDeniedException``): nothing stored.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from datetime import UTC, datetime

import msgspec

from eventpush.api.errors import ApiError, validation
from eventpush.api.service import BusView, Call
from eventpush.api.shapes import bus_name, check_owner, checked, required
from eventpush.publish import (
    MAX_EVENT_BYTES,
    MalformedEventError,
    Prepared,
    check_resources,
    check_size,
    encode_event,
    entry_size,
    new_ids,
    parse_time,
)

MAX_ENTRIES = 10
_decode = msgspec.json.Decoder().decode  # the hot path: several times json's speed
_check_json = msgspec.json.Decoder(msgspec.Raw).decode  # one JSON value, checked, not built
_encode = msgspec.json.Encoder().encode
_string = json.encoder.encode_basestring  # a str as a JSON string (in C), non-ASCII kept
REQUIRED_EVENT_FIELDS = ("id", "account", "source", "time", "region", "detail-type")
_LABELS = tuple(f"entry {i}" for i in range(1, MAX_ENTRIES + 1))  # where, in error messages
_now: list = [None, ""]  # the second last formatted, and its text


def _now_iso() -> str:
    """The time of an entry that gives none, to the second as AWS sets it; formatted once a
    second (``strftime`` on every request cost ~3 µs, more than an entry's own checks)."""
    second = int(time.time())
    if second != _now[0]:
        _now[:] = [second, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second))]
    return _now[1]


def _entry_error(code: str, message: str) -> dict:
    return {"ErrorCode": code, "ErrorMessage": message}


def _event_time(value: object, where: str) -> str:
    """An entry's ``Time`` when it gives one: epoch seconds (what the SDKs send) or ISO 8601
    text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            when = datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            raise MalformedEventError(f"{where}: Time {value!r} is out of range") from None
        return when.strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, str):
        return value
    raise MalformedEventError(f"{where}: Time must be a timestamp")


def _missing_member(where: str, *values: object) -> None:
    """Raise for the first of Source, DetailType and Detail that is not a non-empty string."""
    for member, value in zip(("Source", "DetailType", "Detail"), values, strict=True):
        if not isinstance(value, str) or not value:
            raise MalformedEventError(
                f"{where}: Parameter {member} is not valid. Reason: {member} is a required "
                "argument."
            )


def entry_event(
    entry: object, bus: BusView, where: str, now_iso: str, queue_id: int, event_id: str
) -> Prepared:
    """One ``PutEventsRequestEntry`` as a stored event with id ``event_id``, or
    MalformedEventError. The event is built whole here, checked as
    ``eventpush.publish.complete_event`` checks a published line (the same time and resources
    checks; what it would fill in, the API always sets): the hot path of every request.

    ``Detail`` is checked to be one JSON object and stored as the client spelled it, spliced
    into the envelope, rather than decoded into objects and encoded again (two fifths of an
    entry's cost in the server); a detail over several lines or holding an escaped NUL goes
    the long way (decoded, encoded compact, the NUL refused), since a stored body is one line
    of JSON without NUL."""
    if not isinstance(entry, dict):
        raise MalformedEventError(f"{where}: an entry must be a structure")
    get = entry.get
    source, detail_type, text = get("Source"), get("DetailType"), get("Detail")
    # Three non-empty strings (a decoded JSON string is exactly a str), tested inline: a
    # loop over the members cost a fifth of the entry; the message comes from one.
    if not (
        source.__class__ is str
        and source
        and detail_type.__class__ is str
        and detail_type
        and text.__class__ is str
        and text
    ):
        _missing_member(where, source, detail_type, text)
    try:
        _check_json(text)
    except (msgspec.DecodeError, RecursionError):
        raise _MalformedDetail(f"{where}: Detail is malformed (not JSON).") from None
    detail_text = text.strip()
    if detail_text[0] != "{":
        raise _MalformedDetail(f"{where}: Detail is malformed (not a JSON object).")
    # Time and Resources are usually absent: then no call checks them.
    given = get("Time")
    timed = given is not None
    if timed:
        time_text = _event_time(given, where)
        event_time = parse_time(time_text, where)
    else:
        time_text = event_time = now_iso
    resources = get("Resources")
    if resources is None:
        resources = []
    else:
        check_resources(resources, where)
    # The envelope as text, its strings escaped as JSON: a dict encoded whole cost a tenth of
    # the entry more.
    account, region = bus.envelope_json
    head = (
        f'{{"version":"0","id":"{event_id}","detail-type":{_string(detail_type)},'
        f'"source":{_string(source)},"account":{account},'
        f'"time":{_string(time_text)},"region":{region},'
        f'"resources":{_encode(resources).decode() if resources else "[]"},"detail":'
    )
    if "\n" in detail_text or "\\u0000" in detail_text or "\\u0000" in head:
        event = _decode(f"{head}null}}")  # the same envelope, as objects
        event["detail"] = _decode(detail_text)
        return encode_event(
            event, event_time, queue_id, where, timed=timed, detail_bytes=len(text.encode())
        )
    body = f"{head}{detail_text}}}"
    size = len(body) if body.isascii() else len(body.encode())
    if size > MAX_EVENT_BYTES:  # the limits' own check, and its lambda, only past the first
        check_size(
            size,
            where,
            lambda: entry_size(source, detail_type, len(detail_text.encode()), resources, timed),
        )
    return Prepared(queue_id, event_id, source, detail_type, event_time, body, size)


class _MalformedDetail(MalformedEventError):
    """AWS's ``MalformedDetail`` entry error."""


async def _publish_groups(
    call: Call, groups: dict[str, tuple[BusView, list[tuple[int, Prepared]]]]
) -> list[BaseException | None]:
    """Each bus's events in its group commit: ``None`` where stored, the error where not."""
    publish = call.service.publisher.publish
    if len(groups) == 1:  # the usual request, one bus: no tasks to make and gather
        ((bus, items),) = groups.values()
        try:
            await publish(bus.source, [p for _, p in items])
        except Exception as exc:
            return [exc]
        return [None]
    return await asyncio.gather(
        *(publish(bus.source, [p for _, p in items]) for bus, items in groups.values()),
        return_exceptions=True,
    )


def _bus_names(call: Call, entries: list) -> list[tuple[str, tuple[str, str] | None]]:
    """Each entry's bus (and the account and region an ARN claims), refused whole with
    AccessDeniedException when the key may not use one; each spelling read once."""
    seen: dict[str | None, tuple[str, tuple[str, str] | None]] = {}
    names = []
    for entry in entries:
        raw = entry.get("EventBusName") if isinstance(entry, dict) else None
        # A name (or none) is read once; anything else (not a string) is bus_name's to refuse.
        spelled = raw is None or raw.__class__ is str
        found = seen.get(raw) if spelled else None
        if found is None:
            found = bus_name(entry if isinstance(entry, dict) else {})
            call.allow_bus(found[0])
            if spelled:
                seen[raw] = found
        names.append(found)
    return names


async def put_events(call: Call, body: dict) -> dict:
    entries = required(body, "Entries", list)
    if not 1 <= len(entries) <= MAX_ENTRIES:
        raise validation(
            f"member 'Entries' must hold 1 to {MAX_ENTRIES} entries, got {len(entries)}"
        )
    names = _bus_names(call, entries)
    results: list[dict | None] = [None] * len(entries)
    groups: dict[str, tuple[BusView, list[tuple[int, Prepared]]]] = {}
    buses: dict[str, BusView | None] = {}  # each bus looked up once (None: no such bus)
    now_iso = _now_iso()
    ids = new_ids(len(entries))
    first_queue = random.getrandbits(30)  # round robin from a random queue, as the CLI does
    for i, (entry, (name, claimed)) in enumerate(zip(entries, names, strict=True)):
        if name not in buses:
            try:
                buses[name] = await call.bus(name)
            except ApiError as exc:
                if exc.code != "ResourceNotFoundException":
                    raise
                buses[name] = None
        bus = buses[name]
        if bus is None:
            results[i] = _entry_error(
                "ResourceNotFoundException", f"Event bus {name} does not exist."
            )
            continue
        if claimed is not None:  # an ARN: this server's account and region only
            check_owner(claimed, bus.account, bus.region, f"event bus {name}")
        queue_id = (first_queue + i) % bus.source.queues
        try:
            prepared = entry_event(entry, bus, _LABELS[i], now_iso, queue_id, ids[i])
        except _MalformedDetail as exc:
            results[i] = _entry_error("MalformedDetail", str(exc))
            continue
        except MalformedEventError as exc:
            results[i] = _entry_error("InvalidArgument", str(exc))
            continue
        group = groups.get(name)
        if group is None:
            group = groups[name] = (bus, [])
        group[1].append((i, prepared))
    outcomes = await _publish_groups(call, groups)
    stored = 0
    for (name, (_, items)), outcome in zip(groups.items(), outcomes, strict=True):
        if isinstance(outcome, BaseException):
            call.service.buses.drop(name)  # deleted or moved: read it again next time
            for i, _ in items:
                results[i] = _entry_error(
                    "InternalException", "not stored: the commit failed; send it again"
                )
            continue
        for i, prepared in items:
            results[i] = {"EventId": prepared.message_id}
            stored += 1
    failed = len(entries) - stored
    if groups and stored == 0 and failed == sum(len(items) for _, items in groups.values()):
        # Nothing was refused for its content, and nothing stored: the commit failed. The
        # whole request fails, so the SDK's own retry sends it again.
        raise ApiError("InternalException", "not stored: the commit failed; send it again")
    return {"FailedEntryCount": failed, "Entries": results}


async def test_event_pattern(call: Call, body: dict) -> dict:
    from eventpush.patterns import InvalidPatternError, compile_pattern

    pattern = required(body, "EventPattern")
    event_text = required(body, "Event")
    try:
        compiled = compile_pattern(pattern)
    except InvalidPatternError as exc:
        raise ApiError(
            "InvalidEventPatternException", f"Event pattern is not valid: {exc}"
        ) from None
    try:
        event = json.loads(event_text)
    except (ValueError, RecursionError):
        raise validation("Parameter Event is not valid: not JSON") from None
    checked(event, "Event", dict)
    for name in REQUIRED_EVENT_FIELDS:
        if name not in event:
            raise validation(f"Parameter Event is not valid: it has no '{name}'")
    return {"Result": bool(compiled.matches(event))}


OPERATIONS = {"PutEvents": put_events, "TestEventPattern": test_event_pattern}
