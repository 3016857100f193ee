"""A worker killed with SIGKILL at random moments loses nothing (real subprocesses)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish

KILLS = 6
EVENTS = 3000


def test_sigkill_at_random_moments_loses_nothing(conn):
    exe = str(Path(sys.executable).with_name("eventpush"))
    rng = random.Random(int(os.environ.get("EVENTPUSH_CRASH_SEED", time.time())))
    with Receiver(keep_bodies=True) as rx:
        catalog.create_bus(conn, "orders", 3)
        catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
        catalog.create_rule(conn, "orders", "even", {"detail": {"even": [True]}})
        catalog.create_target(
            conn, "orders", "all", catalog.TargetSpec(name="a", url=rx.url + "/ok")
        )
        catalog.create_target(
            conn, "orders", "even", catalog.TargetSpec(name="b", url=rx.url + "/slow?ms=3")
        )
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(
            conn,
            "orders",
            [
                json.dumps(
                    {"source": "shop", "detail-type": "o", "detail": {"n": i, "even": i % 2 == 0}}
                )
                for i in range(EVENTS)
            ],
        )
        for _ in range(KILLS):
            proc = subprocess.Popen([exe, "worker", "run", "w1", "--max-seconds", "60"])
            time.sleep(rng.uniform(0.5, 2.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        final = subprocess.run(
            [exe, "worker", "run", "w1", "--until-idle", "--max-seconds", "120", "--json"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert final.returncode == 0, final.stderr
        received = {r.headers["webhook-id"] for r in rx.state.requests if r.path == "/ok"}
        received_even = {r.headers["webhook-id"] for r in rx.state.requests if r.path == "/slow"}

    with conn.cursor() as cur:
        cur.execute(
            "SELECT r.name, e.queue_id, e.\"offset\", (e.body::json->'detail'->>'even')::bool, "
            "  (SELECT count(*) FROM event_push_delivery d WHERE d.runner_id = r.id "
            '     AND d.queue_id = e.queue_id AND d."offset" = e."offset"), '
            "  EXISTS (SELECT 1 FROM event_push_failure f WHERE f.runner_id = r.id "
            '     AND f.queue_id = e.queue_id AND f."offset" = e."offset") '
            "FROM bus_event e CROSS JOIN event_target_runner r"
        )
        facts = cur.fetchall()
        cur.execute(
            "SELECT count(*) FROM event_push_offset o JOIN event_bus_queue q "
            'ON q.queue_id = o.queue_id WHERE o."offset" <> q.next_offset'
        )
        assert cur.fetchone()[0] == 0, "every offset is committed to the end"
    duplicates = 0
    for runner, _, _, even, deliveries, failed in facts:
        matches = runner == "orders/all/a" or even
        if not matches:
            assert deliveries == 0 and not failed, "delivered to a rule it does not match"
            continue
        assert deliveries >= 1 or failed, "an event was lost"
        duplicates += max(deliveries - 1, 0)
    # Redelivery is bounded by the in-flight window: at most buffer_records per runner queue
    # (1000 x 3 queues x 2 runners) per kill.
    assert duplicates <= KILLS * 6000
    assert len(received) == EVENTS
    assert len(received_even) == EVENTS // 2
