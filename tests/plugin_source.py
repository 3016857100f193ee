"""A source kind that is not part of eventpush, plugged in by entry point in test_source_plugin:
``jsonl://local/DIR`` keeps queue ``i`` of a bus in ``DIR/BUS.i.jsonl``, one event a line.
Positions step by ``STEP`` (line n is position n * STEP), so the engine meets gaps, as it
does on a broker's sequences."""

from __future__ import annotations

import json
from pathlib import Path

from eventpush.sources import Bus, Chunk, Reader, SourceError, SourceKind, Stored

STEP = 10


def _dir(url: str) -> Path:
    return Path("/" + url.split("://", 1)[1].split("/", 1)[1])


def _file(bus: Bus, queue_id: int) -> Path:
    return _dir(bus.source_url) / f"{bus.name}.{queue_id}.jsonl"


def _lines(bus: Bus, queue_id: int) -> list[str]:
    path = _file(bus, queue_id)
    return path.read_text().splitlines() if path.exists() else []


def check(url: str) -> str:
    if not url.startswith("jsonl://local/"):
        raise SourceError(f"a jsonl source is jsonl://local/DIR, got {url!r}")
    return url


def create(conn, bus: Bus) -> None:
    _dir(bus.source_url).mkdir(parents=True, exist_ok=True)


def publish(conn, bus: Bus, events) -> dict:
    placed: dict[int, tuple[int, int, int]] = {}
    for event in events:
        lines = _lines(bus, event.queue_id)
        with _file(bus, event.queue_id).open("a") as f:
            f.write(event.body + "\n")
        position = len(lines) * STEP
        first, _, n = placed.get(event.queue_id, (position, position, 0))
        placed[event.queue_id] = (first, position, n + 1)
    return placed


def heads(conn, bus: Bus) -> dict[int, int]:
    counts = {q: len(_lines(bus, q)) for q in range(bus.queues)}
    return {q: (n - 1) * STEP + 1 if n else 0 for q, n in counts.items()}


def _rows(bus: Bus, queue_id: int, start: int, stop: int):
    for n, line in enumerate(_lines(bus, queue_id)):
        if start <= n * STEP < stop:
            yield n * STEP, json.loads(line)["id"], line


class JsonlReader(Reader):
    def __init__(self, database_url: str) -> None:
        self.reads = 0

    async def read(self, bus: Bus, queue_id: int, start: int, stop: int) -> Chunk:
        self.reads += 1
        rows = list(_rows(bus, queue_id, start, stop))
        later = next(_rows(bus, queue_id, stop, 1 << 62), None)
        if later is not None:  # the gap up to the next event is known: step over it
            return Chunk(rows, later[0])
        return Chunk(rows, rows[-1][0] + 1 if rows else start)


def read_range(conn, bus: Bus, queue_id: int, start: int, stop: int):
    for position, message_id, line in _rows(bus, queue_id, start, stop):
        yield Stored(queue_id, position, message_id, json.loads(line)["time"], line)


def position_at(conn, bus: Bus, queue_id: int, when) -> int:
    return 0


KIND = SourceKind(
    scheme="jsonl",
    check=check,
    create=create,
    open_reader=JsonlReader,
    publish=publish,
    heads=heads,
    read_range=read_range,
    position_at=position_at,
)
