"""The audit and replay Spark jobs on a NATS JetStream bus: Spark reads the stream through the
``eventpush_bus`` Python data source (one partition per queue and position range), finds
deleted delivery rows exactly, and replay re-reads the events from the stream."""

from __future__ import annotations

import json
from dataclasses import replace

from batch_support import spark  # noqa: F401

from eventpush import catalog, sources
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.sinks.contract import record_key
from eventpush.sources import nats as nats_source
from eventpush.sparkjobs import bus_events
from eventpush.sparkjobs.audit import run_audit
from eventpush.sparkjobs.bus_events import BusEventsReader, source_bodies
from eventpush.sparkjobs.replay import ReplayRequest, run_replay


def test_audit_and_replay_of_a_nats_bus(db_url, conn, spark, nats_server):  # noqa: F811
    with Receiver(keep_bodies=True) as rx:
        catalog.create_bus(conn, "orders", 3, source=nats_server.url)
        catalog.create_rule(conn, "orders", "big", {"detail": {"n": [{"numeric": [">=", 10]}]}})
        catalog.create_target(conn, "orders", "big", catalog.TargetSpec(name="t", url=rx.url))
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        lines = [
            json.dumps({"source": "s", "detail-type": "d", "detail": {"n": i}}) for i in range(60)
        ]
        publish(conn, "orders", lines)
        assert run_worker("w1", until_idle=True, max_seconds=60).delivered == 50
        with conn.cursor() as cur:
            cur.execute(
                "DELETE FROM event_push_delivery WHERE ctid IN (SELECT ctid FROM "
                'event_push_delivery ORDER BY queue_id, "offset" LIMIT 4) '
                'RETURNING queue_id, "offset", message_id'
            )
            deleted = sorted(cur.fetchall())
        conn.commit()

        audit = run_audit(spark, db_url, bus="orders")
        [runner] = audit.runners
        assert (runner.expected, runner.delivered, runner.missing, runner.pending) == (50, 46, 4, 0)

        before = len(rx.state.requests)
        replay = run_replay(spark, db_url, ReplayRequest(what="missing", bus="orders"))
        assert (replay.selected, replay.delivered, replay.failed) == (4, 4, 0)
        again = rx.state.requests[before:]
        with conn.cursor() as cur:
            cur.execute("SELECT id FROM event_target_runner")
            [(runner_id,)] = cur.fetchall()
        conn.commit()
        assert sorted(r.headers["webhook-id"] for r in again) == sorted(
            record_key(runner_id, q, o) for q, o, _ in deleted
        )
        assert all(json.loads(r.body)["detail"]["n"] >= 10 for r in again)

    assert run_audit(spark, db_url, bus="orders").runners[0].missing == 0


def test_one_input_partition_per_queue_and_position_range():
    bus = {"id": 1, "name": "b", "queues": 2, "source_url": "nats://127.0.0.1:1"}
    reader = BusEventsReader(
        {"ranges": json.dumps([[bus, 0, 1, 25], [bus, 1, 5, 6], [bus, 1, 9, 9]]), "slice": "10"}
    )
    parts = [(p.queue_id, p.start, p.end) for p in reader.partitions()]
    assert parts == [(0, 1, 11), (0, 11, 21), (0, 21, 25), (1, 5, 6)]


def test_replay_look_ups_read_the_positions_asked_not_the_span(conn, nats_server, monkeypatch):
    """Replay's executors looked events up by reading each queue from the first position asked
    to the last, everything between held in memory: two events 3000 positions apart read
    3000. Now near positions are read as runs and a lone one by a get of its own, for NATS and
    (through runs of read_range) for a kind without read_positions."""
    from nats.js.manager import JetStreamManager

    catalog.create_bus(conn, "orders", 1, source=nats_server.url)
    publish(
        conn,
        "orders",
        [json.dumps({"source": "s", "detail-type": "d", "detail": {"n": i}}) for i in range(3000)],
    )
    bus = sources.bus_named(conn, "orders")
    # Positions are the stream's sequences, 1 to 3000 (one queue): event n is at n + 1.
    keys = [(7, bus.id, 0, p) for p in (1, 2, 3, 1500, 3000)] + [(8, bus.id, 0, 3000)]
    received = []
    fetch, get_msg = nats_source.Puller.fetch, JetStreamManager.get_msg

    async def fetched(self, n, timeout=nats_source.REQUEST_TIMEOUT_S):
        msgs = await fetch(self, n, timeout)
        received.extend(_ack_seq(m) for m in msgs)
        return msgs

    async def got(self, stream, seq=None, *args, **kwargs):
        if seq is not None:  # not a head's look-up (by subject)
            received.append(seq)
        return await get_msg(self, stream, seq, *args, **kwargs)

    monkeypatch.setattr(nats_source.Puller, "fetch", fetched)
    monkeypatch.setattr(JetStreamManager, "get_msg", got)
    bodies = source_bodies(conn, keys)
    assert {k: json.loads(b)["detail"]["n"] for k, b in bodies.items()} == {
        (rid, 0, p): p - 1 for rid, _, _, p in keys
    }
    assert sorted(received) == [1, 2, 3, 1500, 3000]

    # A kind without read_positions: its read_range over runs of near positions.
    spans = []
    read_range = nats_source.KIND.read_range

    def ranged(conn, bus, queue_id, start, stop):
        spans.append((start, stop))
        return read_range(conn, bus, queue_id, start, stop)

    kind = replace(nats_source.KIND, read_positions=None, read_range=ranged)
    monkeypatch.setattr(bus_events, "kind_for", lambda url: kind)
    assert source_bodies(conn, keys) == bodies
    assert spans == [(1, 4), (1500, 1501), (3000, 3001)]


def _ack_seq(msg) -> int:
    return nats_source._ack_fields(msg.reply)[0]


def test_an_archive_replay_of_a_bus_made_again_leaves_the_deleted_bus_events(
    db_url,
    conn,
    spark,  # noqa: F811
    nats_server,
):
    """A new bus of a deleted NATS bus's name adopts the stream the deleted one kept: an
    archive replay (``what=all``) read it from position 0 and sent the deleted bus's events
    to the new bus's targets as its own. It reads from where the new bus began."""
    lines = [json.dumps({"source": "s", "detail-type": "d", "detail": {"n": i}}) for i in range(8)]
    with Receiver(keep_bodies=True) as rx:
        catalog.create_bus(conn, "orders", 2, source=nats_server.url)
        publish(conn, "orders", lines[:5])
        catalog.delete_bus(conn, "orders")
        catalog.create_bus(conn, "orders", 2, source=nats_server.url)
        catalog.create_rule(conn, "orders", "all", {"source": ["s"]})
        catalog.create_target(conn, "orders", "all", catalog.TargetSpec(name="t", url=rx.url))
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(conn, "orders", lines[5:])
        assert run_worker("w1", until_idle=True, max_seconds=60).delivered == 3
        before = len(rx.state.requests)
        replay = run_replay(spark, db_url, ReplayRequest(what="all", bus="orders", everything=True))
        assert (replay.selected, replay.delivered, replay.failed) == (3, 3, 0)
        again = [json.loads(r.body)["detail"]["n"] for r in rx.state.requests[before:]]
        assert sorted(again) == [5, 6, 7]
