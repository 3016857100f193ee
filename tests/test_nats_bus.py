"""A bus on NATS JetStream: created or adopted, published to from outside eventpush and through
it, pushed by real workers to a loopback HTTP receiver, through crashes of the worker and of
the NATS server. Every test starts its own nats-server (tests/nats_support.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from eventpush import catalog, sources
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.sinks.contract import record_key
from eventpush.status import read_status

EXE = str(Path(sys.executable).with_name("eventpush"))


def delivered_keys(conn) -> dict[str, str]:
    """event id -> the record key (webhook-id) of its delivery, from the delivery rows."""
    with conn.cursor() as cur:
        cur.execute('SELECT message_id, runner_id, queue_id, "offset" FROM event_push_delivery')
        found = {mid: record_key(rid, q, o) for mid, rid, q, o in cur.fetchall()}
    conn.commit()
    return found


def event(n: int, **extra) -> dict:
    return {"source": "shop", "detail-type": "Order", "detail": {"n": n}, **extra}


def raw_publish(url: str, items: list[tuple[str, bytes]]) -> list[int]:
    """Publish with plain nats-py, as a producer that is not eventpush would."""

    async def go() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            return [(await js.publish(subject, data)).seq for subject, data in items]
        finally:
            await nc.close()

    return asyncio.run(go())


def stream_info(url: str, name: str):
    async def go():
        nc = await nats.connect(url)
        try:
            return await nc.jetstream().stream_info(name)
        finally:
            await nc.close()

    return asyncio.run(go())


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        out = cur.fetchall()
    conn.rollback()
    return out


def setup(conn, server, url: str, *, queues: int = 3, pattern=None, **spec) -> None:
    catalog.create_bus(conn, "orders", queues, source=server.url)
    catalog.create_rule(conn, "orders", "r", pattern or {"source": ["shop"]})
    catalog.create_target(conn, "orders", "r", catalog.TargetSpec(name="t", url=url, **spec))
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def test_bus_create_makes_the_stream_and_refuses_what_it_cannot_adopt(conn, nats_server):
    catalog.create_bus(conn, "orders", 4, source=nats_server.url, retention="2d")
    info = stream_info(nats_server.url, "orders")
    assert info.config.subjects == ["orders.*"]
    assert info.config.max_age == 2 * 86400  # the bus's retention (issue 35)
    catalog.update_bus_retention(conn, "orders", "36h")
    assert stream_info(nats_server.url, "orders").config.max_age == 36 * 3600
    [(source_url, heads)] = rows(
        conn,
        "SELECT b.source_url, array_agg(q.next_offset ORDER BY q.queue_id) FROM event_bus b "
        "JOIN event_bus_queue q ON q.bus_id = b.id GROUP BY b.source_url",
    )
    assert source_url == nats_server.url and heads == [0, 0, 0, 0]

    # A stream whose subjects do not cover the queues is not adopted, and no bus is left.
    async def other():
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().add_stream(name="billing", subjects=["billing.0"])
        await nc.close()

    asyncio.run(other())
    with pytest.raises(sources.SourceError, match="do not cover billing.0 … billing.1"):
        catalog.create_bus(conn, "billing", 2, source=nats_server.url)
    assert rows(conn, "SELECT count(*) FROM event_bus WHERE name = 'billing'") == [(0,)]
    # An existing stream that covers them is adopted, with its heads.
    raw_publish(nats_server.url, [("billing.0", b"{}")])
    catalog.create_bus(conn, "billing", 1, source=nats_server.url)
    assert rows(
        conn,
        "SELECT q.next_offset FROM event_bus_queue q JOIN event_bus b ON b.id = q.bus_id "
        "WHERE b.name = 'billing'",
    ) == [(2,)]


def test_a_bus_made_again_on_its_kept_stream_begins_at_the_stream_end(conn, nats_server):
    """Deleting a NATS bus keeps its stream (others may own or read it), and a new bus of the
    same name adopted it with the deleted bus's events as its own: an archive replay sent them
    to the new bus's targets and an audit from the start judged them. It now begins where the
    stream ended (``first_offset``); a stream that no deleted bus left (other producers') is
    adopted whole, as before. The archive counts the stream's messages of the bus's queues
    from where it began (it gave no count for a NATS bus before)."""
    from eventpush.api.archives import _archive_figures

    lines = [json.dumps(event(n, detail={"k": n})) for n in range(6)]
    catalog.create_bus(conn, "orders", 2, source=nats_server.url)
    publish(conn, "orders", lines, partition_key="detail.k")
    assert _archive_figures(conn, "orders") == (6, 0)
    old_heads = rows(conn, "SELECT queue_id, next_offset FROM event_bus_queue ORDER BY queue_id")
    catalog.delete_bus(conn, "orders")
    assert stream_info(nats_server.url, "orders").state.messages == 6  # the stream is kept

    catalog.create_bus(conn, "orders", 2, source=nats_server.url)
    live = (
        "SELECT q.queue_id, q.first_offset, q.next_offset FROM event_bus_queue q "
        "JOIN event_bus b ON b.id = q.bus_id WHERE b.deleted_at IS NULL ORDER BY q.queue_id"
    )
    assert rows(conn, live) == [(q, head, head) for q, head in old_heads]
    assert _archive_figures(conn, "orders") == (0, 0)
    publish(conn, "orders", [json.dumps(event(n)) for n in range(100, 103)])
    raw_publish(nats_server.url, [("orders.1", json.dumps(event(200)).encode())])
    assert _archive_figures(conn, "orders") == (4, 0)

    # Other producers' stream, adopted by a name no bus had: its events are the bus's.
    asyncio.run(_add_stream(nats_server.url, "billing"))
    raw_publish(nats_server.url, [("billing.0", b"{}"), ("billing.0", b"{}")])
    catalog.create_bus(conn, "billing", 1, source=nats_server.url)
    assert rows(
        conn,
        "SELECT q.first_offset, q.next_offset FROM event_bus_queue q "
        "JOIN event_bus b ON b.id = q.bus_id WHERE b.name = 'billing'",
    ) == [(0, 3)]
    assert _archive_figures(conn, "billing") == (2, 0)


async def _add_stream(url: str, name: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(name=name, subjects=[f"{name}.*"])
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("nats://user:pw@127.0.0.1:4222", "must not carry credentials"),
        ("nats://127.0.0.1:4222/orders", "names the NATS server only"),
        ("http://127.0.0.1:4222", "no source kind for scheme 'http'"),
        ("nats://127.0.0.2:4222", "127.0.0.2 is in the denied range"),
    ],
)
def test_bad_sources_are_refused_in_one_line(conn, source, why):
    with pytest.raises(ValueError, match=why) as caught:
        catalog.create_bus(conn, "orders", 2, source=source)
    assert "pw" not in str(caught.value) and "\n" not in str(caught.value)
    assert rows(conn, "SELECT count(*) FROM event_bus") == [(0,)]


def test_bus_names_that_cannot_be_streams_are_refused(conn, nats_server):
    with pytest.raises(sources.SourceError, match="no '.'"):
        catalog.create_bus(conn, "orders.eu", 2, source=nats_server.url)


def test_cli_bus_create_and_publish(cli, db_url, nats_server):
    made = cli("bus", "create", "orders", "--queues", "2", "--source", nats_server.url)
    assert made.returncode == 0, made.stderr
    lines = "\n".join(json.dumps(event(i, detail={"k": i % 2})) for i in range(10))
    done = cli("publish", "--bus", "orders", "--partition-key", "detail.k", "--json", input=lines)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["count"] == 10 and sum(doc["counts"].values()) == 10
    info = stream_info(nats_server.url, "orders")
    assert info.state.messages == 10
    # A bad line refuses the whole input: nothing reaches the stream.
    bad = cli("publish", "--bus", "orders", input=lines + "\n{oops")
    assert bad.returncode == 2 and "line 11" in bad.stderr
    assert stream_info(nats_server.url, "orders").state.messages == 10
    # The NATS server away: one line, exit 3, no traceback.
    nats_server.kill()
    down = cli("publish", "--bus", "orders", input=lines)
    assert down.returncode == 3 and "Traceback" not in down.stderr, down.stderr
    assert "NATS server" in down.stderr


def test_publish_places_events_by_key_and_a_retried_publish_lands_once(conn, nats_server):
    catalog.create_bus(conn, "orders", 3, source=nats_server.url)
    lines = [json.dumps(event(i, id=f"e{i}", detail={"k": i % 3})) for i in range(30)]
    first = publish(conn, "orders", lines, partition_key="detail.k")
    assert first.count == 30 and sum(first.counts.values()) == 30
    again = publish(conn, "orders", lines, partition_key="detail.k")  # same ids: de-duplicated
    assert again.offsets == first.offsets
    info = stream_info(nats_server.url, "orders")
    assert info.state.messages == 30
    queues_of_key: dict[int, set[int]] = {}
    for queue_id, (lo, hi) in first.offsets.items():
        got = list(
            sources.kind_for(nats_server.url).read_range(
                conn, sources.bus_named(conn, "orders"), queue_id, lo, hi + 1
            )
        )
        assert len(got) == first.counts[queue_id]
        for stored in got:
            queues_of_key.setdefault(json.loads(stored.body)["detail"]["k"], set()).add(queue_id)
    assert sorted(queues_of_key) == [0, 1, 2]
    assert all(len(queues) == 1 for queues in queues_of_key.values())
    heads = rows(conn, "SELECT queue_id, next_offset FROM event_bus_queue ORDER BY queue_id")
    assert heads == [(q, first.offsets[q][1] + 1 if q in first.offsets else 0) for q in range(3)]


def test_worker_pushes_events_from_outside_and_from_eventpush(conn, nats_server):
    with Receiver(keep_bodies=True) as rx:
        pattern = {"detail": {"n": [{"numeric": [">=", 0]}]}}
        setup(conn, nats_server, rx.url + "/ok", pattern=pattern)
        outside = [
            (f"orders.{i % 3}", json.dumps(event(i)).encode()) for i in range(20)
        ]  # no id, no time: derived from the stream
        outside.append(("orders.1", b"not json"))  # skipped with a warning
        outside.append(("orders.2", json.dumps({"detail": {"n": -1}}).encode()))  # filtered
        raw_publish(nats_server.url, outside)
        publish(conn, "orders", [json.dumps(event(100 + i)) for i in range(10)])
        report = run_worker("w1", until_idle=True, max_seconds=60)
        assert (report.delivered, report.failed) == (30, 0)
        bodies = [json.loads(r.body) for r in rx.state.requests]
        ids = sorted(b["id"] for b in bodies if b["detail"]["n"] < 100)
        assert ids == sorted(f"nats-orders-{seq}" for seq in range(1, 21))
        assert all(b.get("time") for b in bodies)
        assert {r.headers["webhook-id"] for r in rx.state.requests} == set(
            delivered_keys(conn).values()
        ) and len(delivered_keys(conn)) == len(bodies)
        # Read again from the start (a new runner would): the same derived ids.
        bus = sources.bus_named(conn, "orders")
        again = [
            s.message_id
            for q in range(3)
            for s in sources.kind_for(bus.source_url).read_range(conn, bus, q, 0, 1000)
        ]
        # (sequence 21 is the message that is not JSON, 22 the event no rule matches)
        assert sorted(i for i in again if i.startswith("nats-")) == sorted([*ids, "nats-orders-22"])
    # Offsets committed to the heads, rows say where each event was.
    status = read_status(conn)
    [runner] = status["runners"]
    assert (runner["lag"], runner["delivered"]) == (0, 30)
    assert rows(conn, "SELECT DISTINCT broker_name FROM event_push_offset") == [("nats",)]


def test_delivery_and_failure_rows_name_the_nats_broker(conn, nats_server):
    """broker_name on the delivery and failure rows of a NATS bus's runners, live and replayed,
    is the bus's source kind (not the column default of eventpush's own store)."""
    from eventpush.push.store import load_targets
    from eventpush.sinks.contract import DELIVERED, FINAL, Outcome, Record
    from eventpush.sparkjobs.replay_push import _write_outcomes

    with Receiver() as rx:
        setup(conn, nats_server, rx.url + "/ok", queues=2)
        gone = catalog.TargetSpec(name="gone", url=rx.url + "/gone", max_attempts=1)
        catalog.create_target(conn, "orders", "r", gone)
        catalog.assign(conn)
        publish(conn, "orders", [json.dumps(event(i)) for i in range(4)])
        report = run_worker("w1", until_idle=True, max_seconds=60)
        assert (report.delivered, report.failed) == (4, 4)
    assert rows(conn, "SELECT DISTINCT broker_name FROM event_push_delivery") == [("nats",)]
    assert rows(conn, "SELECT DISTINCT broker_name FROM event_push_failure") == [("nats",)]

    # A replay's rows, written by its own writer: the same broker_name.
    with conn.cursor() as cur:
        cur.execute("DELETE FROM event_push_delivery")
        cur.execute("DELETE FROM event_push_failure")
        ok, gone_target = sorted(load_targets(cur), key=lambda t: t.name != "t")
        record = Record(0, 99, "ev-99", {}, "{}", attempts=1)
        counts = {"delivered": 0, "failed": 0}
        _write_outcomes(
            cur,
            [
                (ok, [record], Outcome(DELIVERED, 200, None, 1.0)),
                (gone_target, [record], Outcome(FINAL, 410, "HTTP 410", 1.0)),
            ],
            None,
            counts,
        )
    conn.commit()
    assert counts == {"delivered": 1, "failed": 1}
    assert rows(conn, "SELECT origin, broker_name FROM event_push_delivery") == [("replay", "nats")]
    assert rows(conn, "SELECT status, broker_name FROM event_push_failure") == [("dead", "nats")]


def test_a_feeder_waiting_at_the_end_wakes_for_a_raw_publish(conn, nats_server):
    with Receiver() as rx:
        setup(conn, nats_server, rx.url + "/ok")
        done = {}

        def worker() -> None:
            done["report"] = run_worker("w1", max_seconds=6)

        import threading

        t = threading.Thread(target=worker)
        t.start()
        time.sleep(2.0)
        sent = time.monotonic()
        raw_publish(nats_server.url, [("orders.1", json.dumps(event(1)).encode())])
        while not rx.state.requests and time.monotonic() - sent < 3:
            time.sleep(0.01)
        latency = time.monotonic() - sent
        t.join()
    assert done["report"].delivered == 1
    # Woken by the subscription, not the one-second poll.
    assert latency < 0.5, latency


def test_the_worker_and_the_nats_server_killed_mid_run_lose_nothing(conn, nats_server):
    n = 3000
    with Receiver(keep_bodies=True) as rx:
        setup(conn, nats_server, rx.url + "/slow?ms=2", queues=3)
        raw_publish(
            nats_server.url,
            [(f"orders.{i % 3}", json.dumps(event(i, id=f"e{i}")).encode()) for i in range(n)],
        )
        for pause in (1.0, 1.5):
            proc = subprocess.Popen([EXE, "worker", "run", "w1", "--max-seconds", "60"])
            time.sleep(pause)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        proc = subprocess.Popen(
            [EXE, "worker", "run", "w1", "--until-idle", "--max-seconds", "120", "--json"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        nats_server.kill()
        time.sleep(1.5)
        nats_server.start()
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        received = [r.headers["webhook-id"] for r in rx.state.requests]
    keys = delivered_keys(conn)
    assert set(received) == {keys[f"e{i}"] for i in range(n)}
    [(delivered_rows, distinct)] = rows(
        conn, "SELECT count(*), count(DISTINCT message_id) FROM event_push_delivery"
    )
    assert distinct == n
    # HTTP duplicates only from what was in flight at each kill: within the backpressure
    # bound (1000 records a queue, 3 queues) per kill.
    assert len(received) - n <= 2 * 3000
    assert delivered_rows - n <= 2 * 3000
    [runner] = read_status(conn)["runners"]
    assert runner["lag"] == 0


def test_a_worker_lets_go_of_the_buses_it_no_longer_reads(conn, db_url, nats_server):
    """Weeks of NATS buses created and deleted under one worker, in brief: 6 buses, each
    pushed from and deleted, leave the worker holding the one bus still there, not a bus
    (its subscription, its queues' pull consumers, a heads read at every heartbeat) per bus
    it ever read."""
    from destination_support import EngineThread
    from support import wait_until

    def held(worker) -> set[str]:
        return {r.target.runner for r in list(worker.engine.runners.values())}

    with Receiver() as rx:
        catalog.create_bus(conn, "live", 1, source=nats_server.url)
        catalog.create_rule(conn, "live", "r", {"source": ["shop"]})
        spec = catalog.TargetSpec(name="t", url=rx.url + "/ok/live")
        catalog.create_target(conn, "live", "r", spec)
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        worker = EngineThread("w1", db_url).start()
        try:
            for i in range(6):
                bus = f"b{i}"
                catalog.create_bus(conn, bus, 2, source=nats_server.url)
                catalog.create_rule(conn, bus, "r", {"source": ["shop"]})
                spec = catalog.TargetSpec(name="t", url=f"{rx.url}/ok/{bus}")
                catalog.create_target(conn, bus, "r", spec)
                catalog.assign(conn)
                wait_until(lambda bus=bus: f"{bus}/r/t" in held(worker), what=f"{bus} held")
                publish(conn, bus, [json.dumps(event(i))])
                wait_until(lambda bus=bus: rx.state.count[f"/ok/{bus}"] == 1, what=bus)
                catalog.delete_bus(conn, bus, force=True)
                wait_until(lambda bus=bus: f"{bus}/r/t" not in held(worker), what=f"{bus} gone")
            time.sleep(2.5)  # a refresh and a round of the reader's watch
            engine = worker.engine
            [live] = rows(conn, "SELECT id FROM event_bus WHERE name = 'live'")
            buses = set(engine.buses)
            signals = set(engine.signals.events) - {live[0]}
            reader = engine.sources["nats"]
            watched, fed = set(reader.watching), {k[0] for k in reader.feeds}
        finally:
            worker.stop()
    assert buses == {live[0]}, buses
    assert signals == set(), signals
    assert watched == {live[0]}, watched
    assert fed <= {live[0]}, fed
