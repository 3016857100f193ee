"""Publishing against the real PostgreSQL: all or nothing, contiguous offsets, keys."""

import json
import threading
import uuid
import zlib

import psycopg2
import pytest

from eventpush import catalog
from eventpush.publish import MalformedEventError, new_ids, parse_events, publish


def _event(i: int, **extra) -> str:
    return json.dumps({"source": "shop", "detail-type": "OrderPlaced", "detail": {"n": i}, **extra})


def _offsets(conn, bus_id: int = 1) -> dict[int, list[int]]:
    with conn.cursor() as cur:
        cur.execute(
            'SELECT queue_id, array_agg("offset" ORDER BY "offset") FROM bus_event '
            "WHERE bus_id = %s GROUP BY queue_id",
            (bus_id,),
        )
        return dict(cur.fetchall())


def _count(conn) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM bus_event")
        return cur.fetchone()[0]


def test_publish_100k_is_all_or_nothing(conn):
    catalog.create_bus(conn, "orders", 8)
    lines = [_event(i) for i in range(100_000)]
    lines[54_321] = '{"source": "shop", "detail-type": 7}'
    with pytest.raises(MalformedEventError, match=r"^line 54322: 'detail-type' is required"):
        publish(conn, "orders", lines)
    assert _count(conn) == 0
    with conn.cursor() as cur:
        cur.execute("SELECT sum(next_offset) FROM event_bus_queue")
        assert cur.fetchone()[0] == 0

    lines[54_321] = _event(54_321)
    result = publish(conn, "orders", lines)
    assert result.count == 100_000
    assert _count(conn) == 100_000
    offsets = _offsets(conn)
    assert sum(len(v) for v in offsets.values()) == 100_000
    for queue_id, got in offsets.items():
        assert got == list(range(len(got))), f"queue {queue_id} has gaps"
        assert result.offsets[queue_id] == (0, len(got) - 1)
    # round-robin spreads keyless events evenly
    assert max(map(len, offsets.values())) - min(map(len, offsets.values())) <= 1


def test_concurrent_publishers_keep_offsets_contiguous(db_url, conn):
    catalog.create_bus(conn, "orders", 4)
    errors = []

    def publisher(seed: int) -> None:
        c = psycopg2.connect(db_url)
        try:
            for batch in range(20):
                publish(c, "orders", [_event(seed * 10_000 + batch * 100 + i) for i in range(100)])
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=publisher, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    offsets = _offsets(conn)
    assert sum(len(v) for v in offsets.values()) == 4000
    for got in offsets.values():
        assert got == list(range(len(got)))
    with conn.cursor() as cur:
        cur.execute(
            "SELECT q.queue_id, q.next_offset, count(e.*) FROM event_bus_queue q "
            "LEFT JOIN bus_event e ON e.bus_id = q.bus_id AND e.queue_id = q.queue_id "
            "GROUP BY q.queue_id, q.next_offset"
        )
        for queue_id, next_offset, n in cur.fetchall():
            assert next_offset == n, queue_id


def test_same_partition_key_same_queue_in_order(conn):
    catalog.create_bus(conn, "orders", 5)
    lines = [_event(i, detail={"customer": f"c{i % 3}", "n": i}) for i in range(30)]
    publish(conn, "orders", lines, partition_key="detail.customer")
    with conn.cursor() as cur:
        cur.execute(
            "SELECT body::json->'detail'->>'customer', queue_id, (body::json->'detail'->>'n')::int "
            'FROM bus_event ORDER BY queue_id, "offset"'
        )
        rows = cur.fetchall()
    by_key: dict[str, set[int]] = {}
    for key, queue_id, _ in rows:
        by_key.setdefault(key, set()).add(queue_id)
        assert queue_id == zlib.crc32(key.encode()) % 5
    assert all(len(q) == 1 for q in by_key.values())
    for key in by_key:
        ns = [n for k, _, n in rows if k == key]
        assert ns == sorted(ns), "a key's events keep their publish order"


def test_envelope_is_completed_and_kept():
    [p] = parse_events([_event(1, time="2026-01-02T03:04:05Z", id="m-1")], 1)
    body = json.loads(p.body)
    assert body["id"] == "m-1" and p.message_id == "m-1"
    assert body["time"] == "2026-01-02T03:04:05Z"
    assert body["version"] == "0" and body["resources"] == []
    [q] = parse_events([_event(2)], 1)
    assert json.loads(q.body)["id"] == q.message_id


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: an event must be a JSON object, got list"),
        ('{"detail-type": "x"}', r"line 2: 'source' is required"),
        ('{"source": "s", "detail-type": "x", "detail": 5}', r"line 2: 'detail' must be"),
        ('{"source": "s", "detail-type": "x", "time": "yesterday"}', r"line 2: 'time'"),
        ('{"source": "s", "detail-type": "x", "resources": [1]}', r"line 2: 'resources'"),
        ('{"source": "s", "detail-type": "x", "id": ""}', r"line 2: 'id'"),
    ],
)
def test_malformed_lines_name_their_line(line, message):
    with pytest.raises(MalformedEventError, match=message):
        parse_events([_event(0), line], 3)


def test_oversized_event_is_refused():
    big = _event(0, detail={"blob": "x" * 300_000})
    with pytest.raises(MalformedEventError, match="line 1: event is over the 262144-byte limit"):
        parse_events([big], 1)


def test_the_entry_limit_is_counted_as_eventbridge_counts_it(conn):
    """256 KiB of Time (14), source, detail-type, detail and resources: the envelope (id,
    account, region, version, keys) is not counted. A bus-to-bus re-publish is held to the
    stored ceiling only (512 KiB); past it, every publish is refused."""
    from eventpush.publish import MAX_EVENT_BYTES, MAX_STORED_BYTES

    catalog.create_bus(conn, "sized", 1)
    counted = 14 + len("shop") + len("OrderPlaced") + len('{"blob":""}')

    def line(blob: int) -> str:
        return _event(0, detail={"blob": "x" * blob}, account="1" * 12, region="us-east-1")

    at_limit = line(MAX_EVENT_BYTES - counted)
    assert len(at_limit) > MAX_EVENT_BYTES
    assert publish(conn, "sized", [at_limit]).count == 1
    with pytest.raises(MalformedEventError, match="262,145 bytes, counted as EventBridge"):
        publish(conn, "sized", [line(MAX_EVENT_BYTES - counted + 1)])
    assert publish(conn, "sized", [line(300_000)], entry_limit=False).count == 1
    with pytest.raises(MalformedEventError, match="the stored event is over the 524288-byte"):
        publish(conn, "sized", [line(MAX_STORED_BYTES)], entry_limit=False)


def test_unknown_bus(conn):
    with pytest.raises(catalog.CatalogError, match="unknown bus 'nope'"):
        publish(conn, "nope", [_event(1)])


def test_new_ids_are_random_version_4_uuids():
    ids = new_ids(4096)
    assert len(set(ids)) == 4096
    for text in ids:
        parsed = uuid.UUID(text)
        assert str(parsed) == text
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    # every variant digit and every other digit appears: the bits are random, not fixed
    assert {text[19] for text in ids} == set("89ab")
    assert {text[0] for text in ids} == set("0123456789abcdef")


def test_a_big_file_shows_its_progress_on_a_terminal_only(tmp_path, monkeypatch):
    """`eventpush publish FILE` draws a bar on a terminal's stderr while it reads (a big file
    is minutes of COPY), passes every line through unchanged, and draws nothing when stderr
    is not a terminal (a pipe, a log)."""
    import io

    from rich.console import Console

    from eventpush.cli import publish as publish_cli

    lines = [
        json.dumps({"source": "s", "detail-type": "d", "detail": {"n": n}}) + "\n"
        for n in range(10_000)
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(lines))
    for terminal in (True, False):
        drawn = io.StringIO()
        monkeypatch.setattr(
            publish_cli, "err", Console(file=drawn, force_terminal=terminal, width=120)
        )
        with path.open() as file:
            assert list(publish_cli._shown(publish_cli._read(file), file)) == lines
        if terminal:
            assert "reading events 8,192" in drawn.getvalue(), drawn.getvalue()[-300:]
            size = f"/{path.stat().st_size / 1000:.1f} kB"  # known for a file: shown
            assert size in drawn.getvalue()
        else:
            assert drawn.getvalue() == ""
