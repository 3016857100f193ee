"""Shared helpers for the batch tests (audit, replay, rebalance, DAGs): one SparkSession per
test session, and a catalog with pushed events made without the push engine.

``simulate_push`` stands in for the engine: it evaluates each runner's rule with the Python
engine and writes delivery or failure rows and the committed offsets in one transaction,
as the engine's commit does.
"""

from __future__ import annotations

import json

import psycopg2.extras
import pytest

from eventpush import catalog
from eventpush.catalog import TargetSpec
from eventpush.publish import publish
from eventpush.rules.patterns import compile_pattern


@pytest.fixture(scope="session")
def spark():
    from eventpush.sparkjobs.session import get_spark

    return get_spark("local[2]", app_name="eventpush-tests", shuffle_partitions=4)


def make_runner(conn, bus, rule, target, pattern, url="http://127.0.0.1:9/hook", **spec):
    """Bus (if new), rule (if new), target and runner; returns the runner name."""
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM event_bus WHERE name = %s", (bus,))
        has_bus = cur.fetchone() is not None
        cur.execute("SELECT 1 FROM event_rule WHERE name = %s", (rule,))
        has_rule = cur.fetchone() is not None
    conn.rollback()
    if not has_bus:
        catalog.create_bus(conn, bus, 2)
    if not has_rule:
        catalog.create_rule(conn, bus, rule, pattern)
    return catalog.create_target(conn, bus, rule, TargetSpec(name=target, url=url, **spec))


def events(n, source="app.orders", start=0, **detail):
    return [
        json.dumps(
            {"source": source, "detail-type": "created", "detail": {"n": start + i, **detail}}
        )
        for i in range(n)
    ]


def publish_lines(conn, bus, lines):
    return publish(conn, bus, lines)


def simulate_push(conn, runner, fail=(), upto=None):
    """Push ``runner``'s bus the way the engine commits: matched events get a delivery row
    (or a failure row when their ``detail.n`` is in ``fail``); offsets move to the end (or
    to ``upto`` per queue). Returns {(queue_id, offset): message_id} of the delivered. A name
    a deleted target's runner shares with a live one is the live one's."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT r.id, b.id, b.name, ru.pattern::text FROM event_target_runner r "
            "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
            "JOIN event_bus b ON b.id = ru.bus_id WHERE r.name = %s "
            "ORDER BY r.deleted_at IS NOT NULL, r.id DESC LIMIT 1",
            (runner,),
        )
        runner_id, bus_id, bus, pattern = cur.fetchone()
        matcher = compile_pattern(pattern)
        cur.execute(
            'SELECT queue_id, "offset" FROM event_push_offset WHERE runner_id = %s', (runner_id,)
        )
        committed = dict(cur.fetchall())
        cur.execute(
            'SELECT queue_id, "offset", message_id, body::text FROM bus_event '
            'WHERE bus_id = %s ORDER BY queue_id, "offset"',
            (bus_id,),
        )
        delivered, failures, ends = [], [], dict(committed)
        for queue_id, offset, message_id, body in cur.fetchall():
            if offset < committed[queue_id] or (upto is not None and offset >= upto):
                continue
            ends[queue_id] = offset + 1
            event = json.loads(body)
            if not matcher.matches(event):
                continue
            row = (runner_id, runner, bus, queue_id, offset, message_id)
            if event["detail"].get("n") in fail:
                failures.append(row)
            else:
                delivered.append(row)
        psycopg2.extras.execute_values(
            cur,
            "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, latency_ms) VALUES %s',
            [(*r, 1, 200, 3.5) for r in delivered],
        )
        psycopg2.extras.execute_values(
            cur,
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, http_status, last_error) VALUES %s',
            [(*r, 3, 503, "HTTP 503") for r in failures],
        )
        for queue_id, end in ends.items():
            cur.execute(
                'UPDATE event_push_offset SET "offset" = %s, pulled = %s '
                "WHERE runner_id = %s AND queue_id = %s",
                (end, end, runner_id, queue_id),
            )
    conn.commit()
    return {(r[3], r[4]): r[5] for r in delivered}
