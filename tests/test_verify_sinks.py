"""``audit --verify-sinks``: JetStream destinations read back against the books, on a real
``nats-server -js`` (tests/nats_support.py), real workers, real Spark local. Messages deleted
from a stream are reported absent by queue and offset, messages a stream's own limits aged
out are expired (apart), an HTTP target says it cannot be read back, and a ``missing`` replay
brings the absent ones back."""

from __future__ import annotations

import asyncio
import json
import time

import nats
from batch_support import spark  # noqa: F401
from click.testing import CliRunner
from nats_support import nats_server  # noqa: F401

from eventpush import catalog
from eventpush.cli.batch import audit
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.sinks.contract import record_key
from eventpush.sparkjobs.audit import run_audit
from eventpush.sparkjobs.replay import ReplayRequest, run_replay

N = 40
WINDOW_S = 2  # the SINK stream's duplicate window: a deleted message's id is kept that long


def events(n: int) -> list[str]:
    return [
        json.dumps({"id": f"ev-{i}", "source": "shop", "detail-type": "o", "detail": {"n": i}})
        for i in range(n)
    ]


async def _streams(url: str) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SINK", subjects=["sink.>"], duplicate_window=WINDOW_S)
        # Keeps the last 10 messages: the stream's own limit ages the others out.
        await js.add_stream(name="KEEP", subjects=["keep.>"], max_msgs=10)
    finally:
        await nc.close()


async def _held(url: str, stream: str) -> list[tuple[int, str]]:
    """(stream sequence, Nats-Msg-Id) of every message on ``stream``."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        state = (await js.stream_info(stream)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                msg = await js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            out.append((seq, msg.headers["Nats-Msg-Id"]))
        return out
    finally:
        await nc.close()


async def _delete(url: str, stream: str, seqs: list[int]) -> None:
    nc = await nats.connect(url)
    try:
        for seq in seqs:
            await nc.jetstream().delete_msg(stream, seq)
    finally:
        await nc.close()


def test_verify_sinks_finds_deleted_messages_absent_and_a_replay_brings_them_back(
    conn,
    db_url,
    spark,  # noqa: F811
    nats_server,  # noqa: F811
):
    asyncio.run(_streams(nats_server.url))
    with Receiver() as rx:
        catalog.create_bus(conn, "orders", 2)
        catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
        for name, url in (
            ("js", f"{nats_server.url}/sink.orders"),
            ("kept", f"{nats_server.url}/keep.orders"),
            ("web", rx.url + "/ok"),
        ):
            catalog.create_target(conn, "orders", "all", catalog.TargetSpec(name=name, url=url))
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(conn, "orders", events(N))
        report = run_worker("w1", until_idle=True, max_seconds=60)
        assert (report.delivered, report.failed) == (3 * N, 0)

        with conn.cursor() as cur:
            cur.execute(
                "SELECT t.name, r.id FROM event_target_runner r "
                "JOIN event_target t ON t.id = r.target_id"
            )
            runner_ids = dict(cur.fetchall())
            cur.execute('SELECT queue_id, "offset" FROM bus_event')
            positions = {record_key(runner_ids["js"], q, o): (q, o) for q, o in cur.fetchall()}
        conn.commit()
        held = asyncio.run(_held(nats_server.url, "SINK"))
        assert sorted(key for _, key in held) == sorted(positions)
        # Five messages from the middle of the stream are deleted.
        gone = held[10:15]
        asyncio.run(_delete(nats_server.url, "SINK", [seq for seq, _ in gone]))
        lost = sorted(positions[key] for _, key in gone)

        # The CLI in this process (its Spark session is the fixture's: one JVM for the test).
        r = CliRunner().invoke(audit, ["--bus", "orders", "--verify-sinks", "--json"])
        assert r.exit_code == 1, r.output  # absent counts as missing
        doc = json.loads(r.stdout)
        print(json.dumps(doc["runners"], indent=1))  # for the record (pytest -s)
        by_name = {x["runner"]: x for x in doc["runners"]}
        js, kept, web = (by_name[f"orders/all/{t}"] for t in ("js", "kept", "web"))
        assert (js["missing"], js["delivered"], js["absent"], js["expired"]) == (0, N, 5, 0)
        assert js["sink"] == "verified: stream SINK"
        assert [(a["queue_id"], a["offset"]) for a in js["absent_records"]] == lost
        # KEEP kept its last 10: the 30 before them were aged out by its max_msgs.
        assert (kept["absent"], kept["expired"], kept["sink"]) == (
            0,
            N - 10,
            "verified: stream KEEP",
        )
        assert (web["absent"], web["sink"]) == (0, "not readable (http)")
        assert doc["totals"]["absent"] == 5 and doc["totals"]["missing"] == 0

        # A stream remembers a deleted message's id for its duplicate window (a replay within
        # it is acknowledged as a duplicate and restores nothing: it fails, saying why); past
        # it, the absent records are re-pushed, the expired ones are not.
        time.sleep(WINDOW_S + 0.5)
        result = run_replay(spark, db_url, ReplayRequest(what="missing", bus="orders"))
        assert (result.selected, result.delivered, result.failed) == (5, 5, 0)
        assert sorted(key for _, key in asyncio.run(_held(nats_server.url, "SINK"))) == sorted(
            positions
        )
        again = run_audit(spark, db_url, bus="orders", verify_sinks=True)
        by_name = {x.runner: x for x in again.runners}
        assert by_name["orders/all/js"].absent == 0 and again.unaccounted() == 0
        assert by_name["orders/all/kept"].expired == N - 10


def test_an_absent_record_the_stream_still_holds_fails_as_not_restored():
    """A replayed absent record whose first send the stream answers as a duplicate (it
    remembers the deleted message's id within its duplicate window) stored nothing: it fails,
    saying why; a record replayed for another reason keeps its answer."""
    from eventpush.sinks.contract import DELIVERED, FINAL, Outcome
    from eventpush.sparkjobs.replay_push import not_restored

    batch = [{"absent": True}, {"absent": False}, {"absent": True}]
    outcome = Outcome(DELIVERED, None, None, 1.0, held=[0, 1], held_by="stream SINK")
    not_restored(batch, outcome)
    assert outcome.kind == DELIVERED  # the send as a whole: its other records went through
    assert [kind for kind, _ in outcome.per_record] == [FINAL, DELIVERED, DELIVERED]
    assert outcome.per_record[0][1].startswith("stream SINK still holds this record's key")
    every = Outcome(DELIVERED, None, None, 1.0, held=[0], held_by="stream SINK")
    not_restored([{"absent": True}], every)
    assert every.kind == FINAL and "replay it again once the window has passed" in every.error


def test_runners_of_one_name_each_list_their_own_absent_records():
    """A deleted target's runner and the live one re-created with its names (bus delete
    --force, then the same names again) share a name: the absent records are kept by runner
    id, so each lists its own, in the JSON and in the table's lines."""
    from eventpush.sparkjobs.audit import AuditResult, RunnerAudit

    def runner(rid: int, deleted: bool, absent: int) -> RunnerAudit:
        return RunnerAudit(
            "b/r/t", 2, 2, 0, 0, 0, 0, deleted, absent, 0, "verified: stream S", runner_id=rid
        )

    listed = {3: [(1, 2, "m-old")], 4: [(5, 6, "m1"), (5, 7, "m2")]}
    result = AuditResult([runner(3, True, 1), runner(4, False, 2)], 1, None, None, listed)
    old, live = result.to_json()["runners"]
    assert (old["runner_id"], old["deleted"]) == (3, True)
    assert old["absent_records"] == [{"queue_id": 1, "offset": 2, "message_id": "m-old"}]
    assert live["runner_id"] == 4
    assert [a["message_id"] for a in live["absent_records"]] == ["m1", "m2"]


def test_a_deleted_runner_and_the_live_one_of_its_name_keep_their_absent_records_apart(
    conn,
    db_url,
    spark,  # noqa: F811
    nats_server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A JetStream target deleted and created again with the same names: two runners named
    orders/all/js, both delivered to SINK, each with messages deleted from it. Each runner
    keeps its own absent figure and records in the JSON, the table and the metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setenv("EVENTPUSH_METRICS_TEXTFILE_DIR", str(tmp_path))
    asyncio.run(_streams(nats_server.url))
    spec = catalog.TargetSpec(name="js", url=f"{nats_server.url}/sink.orders")
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
    catalog.create_worker(conn, "w1")
    for deleted in (True, False):  # the first runner deleted, the second live
        catalog.create_target(conn, "orders", "all", spec)
        catalog.assign(conn)
        publish(conn, "orders", events(10))
        assert run_worker("w1", until_idle=True, max_seconds=60).delivered == 10
        if deleted:
            catalog.delete_target(conn, "orders", "all", "js")
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM event_target_runner ORDER BY id")
        old, live = (rid for (rid,) in cur.fetchall())
    conn.commit()
    held = asyncio.run(_held(nats_server.url, "SINK"))
    assert len(held) == 20
    # Two of the deleted runner's messages, three of the live one's.
    gone = {old: held[2:4], live: held[14:17]}
    asyncio.run(_delete(nats_server.url, "SINK", [seq for g in gone.values() for seq, _ in g]))

    def keys(runner_id: int, entries) -> list[str]:
        return sorted(record_key(runner_id, a["queue_id"], a["offset"]) for a in entries)

    r = CliRunner().invoke(audit, ["--bus", "orders", "--verify-sinks", "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    by_id = {x["runner_id"]: x for x in doc["runners"]}
    assert {x["runner"] for x in doc["runners"]} == {"orders/all/js"} and set(by_id) == {old, live}
    for rid, deleted, absent in ((old, True, 2), (live, False, 3)):
        assert (by_id[rid]["deleted"], by_id[rid]["absent"]) == (deleted, absent)
        assert keys(rid, by_id[rid]["absent_records"]) == sorted(k for _, k in gone[rid])

    table = CliRunner().invoke(audit, ["--bus", "orders", "--verify-sinks"])
    assert table.exit_code == 1, table.output
    listed = dict(
        line.split(": absent (queue/offset) ")
        for line in table.stdout.splitlines()
        if "absent (queue/offset)" in line
    )
    assert {k: len(v.split(", ")) for k, v in listed.items()} == {
        f"orders/all/js (id {old})": 2,
        f"orders/all/js (id {live})": 3,
    }

    text = (tmp_path / "eventpush_audit.prom").read_text()
    absent = {
        s.labels["runner_id"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "eventpush_audit_absent_records"
    }
    assert absent == {str(old): 2, str(live): 3}
