"""The audit and replay Spark jobs on a NATS JetStream bus: Spark reads the stream through the
``eventpush_bus`` Python data source (one partition per queue and position range), finds
deleted delivery rows exactly, and replay re-reads the events from the stream."""

from __future__ import annotations

import json

from batch_support import spark  # noqa: F401

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.sinks.contract import record_key
from eventpush.sparkjobs.audit import run_audit
from eventpush.sparkjobs.bus_events import BusEventsReader
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
