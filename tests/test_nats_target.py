"""NATS JetStream targets: a PostgreSQL bus pushed to ``nats://HOST:PORT/SUBJECT`` against a
real ``nats-server -js`` of each test's own (tests/nats_support.py), real workers, real kills."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import psycopg2
import pytest
from batch_support import spark  # noqa: F401
from click.testing import CliRunner
from nats.js.api import AckPolicy, ConsumerConfig
from nats_support import (
    nats_server,  # noqa: F401
    nats_server_binary,
)
from ports import free_port

from eventpush import catalog
from eventpush.addresses import InvalidTargetUrlError, address_policy
from eventpush.cli.batch import replay
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.push.controls import WorkerSettings
from eventpush.push.cursor import UNCOMMITTED_SPANS
from eventpush.sinks import validate_url
from eventpush.sinks.contract import DELIVERED, RETRY, Record, Target, record_key
from eventpush.sinks.nats import NatsSink

EXE = str(Path(sys.executable).with_name("eventpush"))


# --- helpers ---------------------------------------------------------------------------------


def events(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps({"id": f"ev-{i}", "source": "shop", "detail-type": "o", "detail": {"n": i}})
        for i in range(start, start + n)
    ]


async def _add_stream(url: str, name: str, subjects: list[str], **config) -> None:
    auth = {k: config.pop(k) for k in ("user", "password") if k in config}
    nc = await nats.connect(url, **auth)
    try:
        # De-duplication holds within the stream's window (2 min by default); a Spark replay
        # on a loaded machine can take longer than that, so the tests' streams keep 15 min.
        await nc.jetstream().add_stream(
            name=name, subjects=subjects, duplicate_window=900, **config
        )
    finally:
        await nc.close()


def add_stream(url: str, name: str = "OUT", subjects: tuple[str, ...] = ("out.>",), **config):
    asyncio.run(_add_stream(url, name, list(subjects), **config))


async def _messages(url: str, stream: str, **auth) -> list[tuple[str, str, dict]]:
    """Every message on ``stream``, in its order: (Nats-Msg-Id, subject, body). Read through an
    ephemeral consumer in fetches of thousands (one get_msg per message took 29 s for the
    100,000 of the batched crash test; this takes about 4)."""
    nc = await nats.connect(url, **auth)
    try:
        js = nc.jetstream()
        total = (await js.stream_info(stream)).state.messages
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=60)
        sub = await js.pull_subscribe("", stream=stream, config=config)  # "": every subject
        found = []
        while len(found) < total:
            for msg in await sub.fetch(min(total - len(found), 10_000), timeout=30):
                found.append((msg.headers["Nats-Msg-Id"], msg.subject, json.loads(msg.data)))
        return found
    finally:
        await nc.close()


def messages(url: str, stream: str = "OUT", **auth) -> list[tuple[str, dict]]:
    return [(mid, body) for mid, _, body in asyncio.run(_messages(url, stream, **auth))]


def topology(conn, url: str, **target) -> None:
    catalog.create_bus(conn, "orders", 3)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
    spec = {"max_attempts": 50, "backoff_ms": 100, **target}
    catalog.create_target(conn, "orders", "all", catalog.TargetSpec(name="js", url=url, **spec))
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def rows(conn, sql: str, params: tuple = ()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        out = cur.fetchall()
    conn.commit()
    return out


def keys_of(conn) -> dict[str, str]:
    """event id -> its record key (Nats-Msg-Id) for the one runner of ``topology``."""
    return {
        mid: record_key(rid, q, o)
        for rid, q, o, mid in rows(
            conn,
            'SELECT r.id, e.queue_id, e."offset", e.message_id '
            "FROM bus_event e CROSS JOIN event_target_runner r",
        )
    }


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --- URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("nats://127.0.0.1/orders", "has no port"),
        ("nats://127.0.0.1:4222", "one subject as the path"),
        ("nats://127.0.0.1:4222/", "one subject as the path"),
        ("nats://127.0.0.1:4222/a/b", "not a concrete NATS subject"),
        ("nats://127.0.0.1:4222/orders.*", "not a concrete NATS subject"),
        ("nats://127.0.0.1:4222/orders.>", "not a concrete NATS subject"),
        ("nats://127.0.0.1:4222/orders..x", "not a concrete NATS subject"),
        ("nats://127.0.0.1:4222/orders?x=1", "no query or fragment"),
        ("nats://:4222/orders", "has no host"),
        ("nats://127.0.0.1:0/orders", "port 0"),
        ("nats://127.0.0.2:4222/orders", "denied range 127.0.0.0/8"),
        ("nats://169.254.169.254:4222/orders", "cloud metadata"),
        ("nats://metadata.google.internal:4222/orders", "cloud metadata"),
        ("natsx://127.0.0.1:4222/orders", "must use http or https"),
    ],
)
def test_bad_nats_urls_are_refused_with_the_reason(url, why):
    with pytest.raises(InvalidTargetUrlError, match=why.replace(".", r"\.")):
        validate_url(url)


def test_a_nats_url_with_credentials_is_refused_without_showing_them():
    with pytest.raises(InvalidTargetUrlError) as info:
        validate_url("nats://alice:hunter2secret@127.0.0.1:4222/orders")
    assert "EVENTPUSH_NATS_CREDENTIALS" in str(info.value)
    assert "hunter2secret" not in str(info.value)


def test_good_nats_urls_pass():
    assert validate_url("nats://127.0.0.1:4222/orders") == "nats://127.0.0.1:4222/orders"
    assert validate_url("nats://nats.example.com:4222/shop.orders.v1")


# --- delivery --------------------------------------------------------------------------------


def test_every_event_lands_once_with_its_webhook_id(conn, nats_server):  # noqa: F811
    add_stream(nats_server.url)
    topology(conn, f"{nats_server.url}/out.orders")
    publish(conn, "orders", events(300))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (300, 0)
    found = messages(nats_server.url)
    assert sorted(mid for mid, _ in found) == sorted(keys_of(conn).values())
    assert all(mid == keys_of(conn)[body["id"]] for mid, body in found)
    assert sorted(body["detail"]["n"] for _, body in found) == list(range(300))
    assert rows(conn, "SELECT count(*), count(http_status) FROM event_push_delivery") == [(300, 0)]
    assert rows(conn, "SELECT count(*) FROM event_push_failure") == [(0,)]


def test_batches_publish_one_message_per_record(conn, nats_server):  # noqa: F811
    add_stream(nats_server.url)
    topology(conn, f"{nats_server.url}/out.orders", batch_size=10, concurrency=4)
    publish(conn, "orders", events(95))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (95, 0)
    found = messages(nats_server.url)
    assert sorted(mid for mid, _ in found) == sorted(keys_of(conn).values())
    assert len(found) == 95


def test_a_message_the_stream_refuses_fails_alone_in_its_batch(conn, nats_server):  # noqa: F811
    # Each record of a batch is its own message with its own answer: a stream refusing one
    # (too big for its max_msg_size) fails that record only; the rest of its batch is
    # delivered, not failed with it nor sent again.
    add_stream(nats_server.url, max_msg_size=400)
    topology(conn, f"{nats_server.url}/out.orders", batch_size=10, concurrency=2)
    big = {i for i in range(40) if i % 7 == 3}
    publish(
        conn,
        "orders",
        [
            json.dumps(
                {"id": f"ev-{i}", "source": "shop", "detail-type": "o", "detail": {"n": i}}
                | ({"pad": "x" * 600} if i in big else {})
            )
            for i in range(40)
        ],
    )
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed, report.retried) == (40 - len(big), len(big), 0)
    found = messages(nats_server.url)
    assert sorted(body["detail"]["n"] for _, body in found) == sorted(set(range(40)) - big)
    failed = rows(conn, "SELECT message_id, last_error FROM event_push_failure ORDER BY message_id")
    assert sorted(mid for mid, _ in failed) == sorted(f"ev-{i}" for i in big)
    assert all("JetStream refused the message" in error for _, error in failed), failed
    assert rows(conn, "SELECT count(*) FROM event_push_delivery") == [(40 - len(big),)]


def test_no_stream_is_final_and_replay_delivers_once_a_stream_exists(
    conn,
    nats_server,  # noqa: F811
    spark,  # noqa: F811
):
    """The replays are the real ``eventpush replay`` command run in this process, so its Spark
    session is the suite's one JVM (a subprocess would start one per call)."""
    topology(conn, f"{nats_server.url}/out.orders")
    publish(conn, "orders", events(5))
    started = time.monotonic()
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (0, 5)
    assert time.monotonic() - started < 30  # final at once, not retried 50 times
    failures = rows(
        conn, "SELECT attempts, http_status, last_error, status FROM event_push_failure"
    )
    assert len(failures) == 5
    for attempts, status, error, state in failures:
        assert (attempts, status, state) == (1, None, "failed")
        assert "no JetStream stream takes subject 'out.orders'" in error
    add_stream(nats_server.url)
    r = CliRunner().invoke(replay, ["--bus", "orders", "--what", "failed", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert (result["selected"], result["delivered"], result["failed"]) == (5, 5, 0)
    assert sorted(mid for mid, _ in messages(nats_server.url)) == sorted(keys_of(conn).values())
    assert len(keys_of(conn)) == 5
    assert rows(conn, "SELECT DISTINCT status FROM event_push_failure") == [("replayed",)]
    # A replay sent again lands nowhere new: the server drops it by Nats-Msg-Id.
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    r = CliRunner().invoke(replay, ["--bus", "orders", "--what", "all", "--since", since, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["delivered"] == 5
    assert len(messages(nats_server.url)) == 5


def _target(url: str, timeout_ms: int, batch_size: int = 1) -> Target:
    return Target(
        1, "r", "orders", 1, "all", "{}", "js", url, timeout_ms=timeout_ms, batch_size=batch_size
    )


def _record(i: int) -> Record:
    raw = events(1, i)[0]
    return Record(0, i, f"ev-{i}", json.loads(raw), raw)


def test_an_acknowledgement_that_never_comes_is_retryable_and_each_send_keeps_its_own(
    nats_server,  # noqa: F811
):
    """Sends to a subject whose only responder never answers (a plain subscriber, no stream)
    time out as retryable, each at its own target's timeout, while sends on the same
    connection to a stream are acknowledged; a timed-out send leaves nothing pending, and one
    still waiting when the sink closes is answered then."""
    add_stream(nats_server.url)
    url = nats_server.url

    async def ignore(_msg) -> None:
        return None

    async def main() -> None:
        listener = await nats.connect(url)
        await listener.subscribe("silent.orders", cb=ignore)
        await listener.flush()
        sink = NatsSink(address_policy())
        try:
            stream = _target(f"{url}/out.orders", 60_000)
            first = await sink.send(stream, [_record(0)], None)  # connects
            assert (first.kind, first.error) == (DELIVERED, None)
            # Sent first, with a long timeout: it must not hold back the shorter ones.
            patient = asyncio.create_task(
                sink.send(_target(f"{url}/silent.orders", 60_000), [_record(1)], None)
            )
            await asyncio.sleep(0.05)
            async with asyncio.timeout(30):  # a deadline never kept is a failure, not a hang
                outcomes = await asyncio.gather(
                    sink.send(_target(f"{url}/silent.orders", 300), [_record(2)], None),
                    sink.send(stream, [_record(3)], None),
                    sink.send(
                        _target(f"{url}/silent.orders", 300, 2), [_record(4), _record(5)], None
                    ),
                    sink.send(stream, [_record(6)], None),
                )
            assert [(o.kind, o.error) for o in outcomes] == [
                (RETRY, "no acknowledgement within 300 ms"),
                (DELIVERED, None),
                (RETRY, "no acknowledgement within 300 ms (and 1 more of 2)"),
                (DELIVERED, None),
            ]
            assert not patient.done()
            (conn,) = sink._conns.values()
            assert len(conn.awaited) == 1  # the patient one alone
            # Closing the sink answers a send still waiting at once: retryable.
            await sink.close()
            async with asyncio.timeout(30):
                closed = await patient
            assert (closed.kind, closed.error) == (
                RETRY,
                "ConnectionClosedError: nats: connection closed",
            )
        finally:
            await sink.close()
            await listener.close()

    asyncio.run(main())
    assert sorted(mid for mid, _ in messages(url)) == ["msg_1.0.0", "msg_1.0.3", "msg_1.0.6"]


def test_a_stream_forgetting_ids_sooner_than_the_target_retries_is_warned_of_once(
    nats_server,  # noqa: F811
    caplog,
):
    """A stream whose duplicate window (1 s) is shorter than the default target's retry
    horizon (5 attempts of 5 s and backoffs of 0.2 to 1.6 s: 28 s) is named in one warning,
    however many records go there; a stream keeping ids for 15 min is not."""
    url = nats_server.url
    add_stream(url)  # OUT, out.>: 15 minutes

    async def main() -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().add_stream(name="SHORT", subjects=["short.>"], duplicate_window=1)
        finally:
            await nc.close()
        sink = NatsSink(address_policy())
        try:
            short, long = _target(f"{url}/short.orders", 5000), _target(f"{url}/out.orders", 5000)
            for i in range(3):
                assert (await sink.send(short, [_record(i)], None)).kind == DELIVERED
                assert (await sink.send(long, [_record(i)], None)).kind == DELIVERED
            outcomes = await asyncio.gather(
                *(sink.send(t, [_record(i)], None) for i in range(3, 9) for t in (short, long))
            )
            assert {o.kind for o in outcomes} == {DELIVERED}
        finally:
            await sink.close()

    with caplog.at_level(logging.WARNING, logger="eventpush.sinks.nats"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "target r: stream SHORT keeps message ids for 1 s (its duplicate_window), less than "
        "the 28 s over which the target may send a record again (timeout_ms, backoff_ms and "
        "max_attempts, within max_age_s): a record sent again after the window lands twice; "
        "see docs/OPERATIONS.md"
    ]


def crash_run(conn, nats_server, total: int) -> tuple[str, list[str]]:  # noqa: F811
    """Worker w1 SIGKILLed twice mid-run, then the NATS server SIGKILLed mid-run (down 3 s)
    and restarted, then stopped (SIGTERM) once ``total`` offsets are committed (the sum over
    runners and queues): its --json report and every worker's stderr."""

    def committed() -> int:
        # Committed offsets: what a kill keeps (a count of delivery rows costs 0.2 s at
        # 100,000 rows, polled every 50 ms; these are a few rows).
        sql = 'SELECT coalesce(sum("offset" - start_offset), 0) FROM event_push_offset'
        return rows(conn, sql)[0][0]

    def worker() -> subprocess.Popen:
        return subprocess.Popen(
            [EXE, "worker", "run", "w1", "--max-seconds", "600", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    at_kills = [0]

    def kill_mid_run(kill) -> None:
        """``kill`` once the worker running has committed a fortieth of the total more; it
        must land before the last one is committed, or it tested nothing. (Filtered events
        move offsets fast: on a loaded machine commits ran 13,000 offsets past a tenth's mark
        before the kill landed, and the third kill of a 60,000-offset run came too late.)"""
        wait_for(lambda: committed() >= at_kills[-1] + total // 40, 300, "a fortieth more")
        kill()
        at_kills.append(committed())
        assert at_kills[-1] < total, f"a kill came after the run, not during it: {at_kills}"

    logs = []
    for _ in range(2):  # two SIGKILLs of the worker
        proc = worker()
        kill_mid_run(proc.kill)  # SIGKILL
        logs.append(proc.communicate(timeout=10)[1])
    proc = worker()
    kill_mid_run(nats_server.kill)
    # Down longer than the target's 2 s timeout: sends under way time out and are retried
    # (and what nats-py buffered meanwhile is flushed on reconnection: duplicates to drop).
    time.sleep(3.0)
    assert proc.poll() is None, "the worker stopped while the broker was down"
    nats_server.start()
    wait_for(lambda: committed() >= total, 300, "every event delivered after the restart")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    logs.append(err)
    return out, logs


def test_a_message_removed_during_a_read_back_ends_the_read_instead_of_failing_it(
    nats_server,  # noqa: F811
    monkeypatch,
):
    """A read-back asks for what the consumer had pending when it was made; a message the
    stream's limits (max_age) or a deletion remove meanwhile is never delivered, and the pull
    request ends with a 408 at its expiry. That ended the read as an error (every runner of
    the URL reported unreadable); now it ends the read, and the message counts as not held."""
    from nats.js.client import JetStreamContext

    from eventpush.sinks import nats as nats_sink
    from eventpush.sinks.readback import ABSENT, CHECKED, check_url

    add_stream(nats_server.url)
    url = f"{nats_server.url}/out.orders"
    keys = [record_key(1, 0, i) for i in range(5)]

    async def fill() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            for key in keys:
                await nc.jetstream().publish("out.orders", b"{}", headers={"Nats-Msg-Id": key})
        finally:
            await nc.close()

    asyncio.run(fill())
    counted = JetStreamContext.PullSubscription.consumer_info

    async def counted_then_one_removed(self):
        info = await counted(self)  # 5 pending; the first then goes, as max_age would take it
        await self._js.delete_msg("OUT", 1)
        return info

    monkeypatch.setattr(
        JetStreamContext.PullSubscription, "consumer_info", counted_then_one_removed
    )
    monkeypatch.setattr(nats_sink, "READ_TIMEOUT_S", 1.0)
    now = time.time()
    rows = list(check_url(url, [(1, 0, i, now, now) for i in range(5)], address_policy()))
    assert [row[3] for row in rows] == [CHECKED, ABSENT], rows
    assert rows[1][:3] == (1, 0, 0)


@pytest.mark.parametrize(
    ("batch_size", "n"),
    [
        # One record per send: each send's one answer settles it (never per record). Sends
        # run well ahead of commits: at 20,000, a fast quiet host's third worker had sent
        # every event before the broker was killed at a fortieth's more commits, and met
        # no dead broker; 60,000 leave the kills room on any host this suite runs on.
        (1, 60_000),
        # The JetStream default (None: the catalog fills it in), 64 messages a send: what a
        # killed worker left uncommitted is sent again in other batches than before, so only
        # the per-record Nats-Msg-Id keeps it from landing twice; sends unanswered when the
        # broker dies are retried 64 records at a time. Batches push about 30,000 events a
        # second at concurrency 1 as at 8 (the worker's CPU is the limit, not round trips):
        # 20,000 are all committed before the first kill, 100,000 leave it room.
        (None, 100_000),
    ],
    ids=["one-per-send", "default-batches"],
)
def test_crashes_of_worker_and_broker_lose_nothing_and_duplicate_nothing(
    conn,
    nats_server,  # noqa: F811
    batch_size,
    n,
):
    """A worker SIGKILLed twice mid-run and the NATS server SIGKILLed and restarted mid-run:
    every event is on the stream exactly once (by Nats-Msg-Id), none failed, each offset has
    one delivery row."""
    add_stream(nats_server.url)
    topology(
        conn,
        f"{nats_server.url}/out.orders",
        timeout_ms=2000,
        concurrency=8,
        batch_size=batch_size,
    )
    if batch_size is None:
        assert rows(conn, "SELECT batch_size FROM event_target") == [(64,)]
    publish(conn, "orders", events(n))

    out, _logs = crash_run(conn, nats_server, n)
    report = json.loads(out)
    assert report["retried"] > 0, f"the worker never met the dead broker: {report}"
    done = subprocess.run(
        [EXE, "worker", "run", "w1", "--until-idle", "--max-seconds", "120", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    found = messages(nats_server.url)
    events_on_stream = [body["id"] for _, body in found]
    assert len(events_on_stream) == len(set(events_on_stream)), "a duplicate reached the stream"
    assert sorted(events_on_stream) == sorted(f"ev-{i}" for i in range(n)), "an event is missing"
    keys = keys_of(conn)
    assert all(mid == keys[body["id"]] for mid, body in found)
    assert rows(conn, "SELECT count(*) FROM event_push_failure") == [(0,)]
    # One row per offset: a redelivery after a kill is logged only by the worker that
    # committed it (its offsets with its rows), never twice.
    assert rows(
        conn,
        'SELECT count(*), count(DISTINCT (queue_id, "offset")) FROM event_push_delivery',
    ) == [(n, n)]


# --- several targets writing one stream ------------------------------------------------------

SHARED_RULES = {  # rule -> (pattern, subject): one stream captures sink.>
    "big": ({"detail": {"amount": [{"numeric": [">=", 500]}]}}, "sink.big"),
    "eu": ({"detail": {"region": ["eu"]}}, "sink.eu"),
    "vip": ({"detail": {"vip": [True]}}, "sink.vip"),
}


def shared_events(n: int) -> list[dict]:
    """Events matching one, two or all three rules: amount >= 500 every 4th, region eu two in
    three, vip every 7th (so some match all three, some two, some one, a few none)."""
    return [
        {
            "id": f"ev-{i}",
            "source": "shop",
            "detail-type": "o",
            "detail": {
                "n": i,
                "amount": 900 if i % 4 == 0 else 10,
                "region": "eu" if i % 3 else "us",
                "vip": i % 7 == 0,
            },
        }
        for i in range(n)
    ]


def shared_expected(evs: list[dict]) -> dict[str, list[str]]:
    """subject -> the event ids each subject must hold, once each."""
    from eventpush.patterns import compile_pattern

    out: dict[str, list[str]] = {}
    for pattern, subject in SHARED_RULES.values():
        compiled = compile_pattern(pattern)
        out[subject] = sorted(e["id"] for e in evs if compiled.matches(e))
    return out


def shared_topology(conn, url: str, **target) -> None:
    catalog.create_bus(conn, "orders", 3)
    spec = {"max_attempts": 50, "backoff_ms": 100, **target}
    for rule, (pattern, subject) in SHARED_RULES.items():
        catalog.create_rule(conn, "orders", rule, pattern)
        catalog.create_target(
            conn, "orders", rule, catalog.TargetSpec(name="js", url=f"{url}/{subject}", **spec)
        )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def per_subject(url: str, stream: str = "SINK") -> dict[str, list[str]]:
    """subject -> the event ids on it, in the stream's order (duplicates kept)."""
    found: dict[str, list[str]] = {}
    for subject, body in subject_messages(url, stream):
        found.setdefault(subject, []).append(body["id"])
    return found


def subject_messages(url: str, stream: str = "SINK") -> list[tuple[str, dict]]:
    return [(subject, body) for _, subject, body in asyncio.run(_messages(url, stream))]


def test_targets_of_several_rules_on_one_stream_each_get_every_event_once_through_crashes(
    conn,
    nats_server,  # noqa: F811
):
    """Three rules, each with a JetStream target on its own subject of ONE stream (sink.>),
    events matching one, two or all three of them; the worker SIGKILLed twice and the broker
    once mid-run: every subject holds every event its rule matched, exactly once. (With one
    message id per event, shared by its targets, the stream dropped all but the first
    subject's copy as duplicates, and the books called them delivered.)"""
    # About as many sends as the one-target crash test (about 63,000 over 3 runners): the
    # kills must land before the last offset is committed, on a loaded machine and on a fast
    # quiet one (at 20,000 one commit moved 32,000 filtered offsets and the third kill came
    # after the run).
    n = 60_000
    add_stream(nats_server.url, name="SINK", subjects=("sink.>",))
    shared_topology(conn, nats_server.url, timeout_ms=2000, concurrency=8)
    evs = shared_events(n)
    expected = shared_expected(evs)
    publish(conn, "orders", [json.dumps(e) for e in evs])
    # Every runner's offsets move over every event (filtered ones included).
    out, logs = crash_run(conn, nats_server, 3 * n)
    # What a killed worker sent is sent again by the next at attempt 1, and the stream says
    # duplicate: that is expected, not another writer, so never warned of.
    assert not [line for log in logs for line in log.splitlines() if "already held" in line]
    assert json.loads(out)["already_held"] == 0
    found = per_subject(nats_server.url)
    counts = {s: (len(found.get(s, [])), len(ids)) for s, ids in expected.items()}
    print(f"per subject (on the stream, expected): {counts}")
    assert rows(conn, "SELECT count(*) FROM event_push_failure") == [(0,)]
    for subject, ids in expected.items():
        got = found.get(subject, [])
        assert len(got) == len(set(got)), f"{subject}: a duplicate reached the stream"
        assert sorted(got) == ids, f"{subject}: {len(set(ids) - set(got))} events missing"


def test_a_first_send_the_stream_already_holds_is_counted_and_warned_of_once(
    conn,
    db_url,
    nats_server,  # noqa: F811
    caplog,
):
    """Another writer put messages with this runner's record keys on the stream before the
    runner sent them: the stream acknowledges the runner's first sends as duplicates. They
    stay delivered (the stream holds those ids) but are counted in
    eventpush_sink_duplicates_total and warned of once, naming the stream; the records the
    stream did not hold are not counted."""
    from eventpush.push import engine

    add_stream(nats_server.url, name="SINK", subjects=("sink.>",))
    catalog.create_bus(conn, "orders", 1)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
    spec = catalog.TargetSpec(name="js", url=f"{nats_server.url}/sink.a", batch_size=4)
    catalog.create_target(conn, "orders", "all", spec)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    # Past the span a previous owner of the runner may have sent (UNCOMMITTED_SPANS buffer
    # spans from the committed offset the runner starts at): duplicates there are resends.
    n = UNCOMMITTED_SPANS * WorkerSettings().buffer_span + 10
    publish(conn, "orders", events(n))
    [(runner_id,)] = rows(conn, "SELECT id FROM event_target_runner")
    taken = [2, n - 9, n - 6, n - 5]  # offsets whose keys the other writer used first

    async def other_writer() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            for offset in taken:
                key = record_key(runner_id, 0, offset)
                await js.publish("sink.a", b"{}", headers={"Nats-Msg-Id": key})
        finally:
            await nc.close()

    asyncio.run(other_writer())
    worker = engine.Engine("w1", db_url, until_idle=True, max_seconds=60, metrics_port=0)
    with caplog.at_level(logging.WARNING, logger="eventpush.push.lanes"):
        report = asyncio.run(worker.run())
    # The first is within the span a previous owner may have sent: not counted.
    assert (report.delivered, report.failed, report.already_held) == (n, 0, 3)
    counted = worker.metrics.registry.get_sample_value(
        "eventpush_sink_duplicates_total", {"runner": "orders/all/js", "destination": "stream SINK"}
    )
    assert counted == 3
    warnings = [r.getMessage() for r in caplog.records if "already held" in r.getMessage()]
    assert len(warnings) == 1 and "stream SINK" in warnings[0], warnings
    assert "orders/all/js" in warnings[0]
    # The stream holds the other writer's four and the runner's others, one per key.
    held = messages(nats_server.url, "SINK")
    assert sorted(mid for mid, _ in held) == sorted(
        record_key(runner_id, 0, offset) for offset in range(n)
    )


# --- the address policy ----------------------------------------------------------------------


class AcceptRecorder:
    """A TCP listener on 127.0.0.2 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.2", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_a_nats_target_on_a_denied_address_is_never_connected(conn, monkeypatch):
    listener = AcceptRecorder()
    try:
        # Created while the range was open; the worker runs under the tests' policy, which
        # denies 127.0.0.2 (a name resolving there would be refused the same way).
        monkeypatch.setenv("EVENTPUSH_ALLOW_CIDRS", "127.0.0.0/8")
        topology(conn, f"nats://127.0.0.2:{listener.port}/out.orders", max_attempts=3)
        monkeypatch.setenv("EVENTPUSH_ALLOW_CIDRS", "127.0.0.1/32,::1/128")
        publish(conn, "orders", events(4))
        report = run_worker("w1", until_idle=True, max_seconds=60)
        assert (report.delivered, report.failed) == (0, 4)
        errors = rows(conn, "SELECT attempts, last_error FROM event_push_failure")
        assert len(errors) == 4
        for attempts, error in errors:
            assert attempts == 1
            assert "refused address: address 127.0.0.2 is in the denied range" in error
        assert listener.accepted == 0
        # The recorder does record: a plain connection is counted.
        socket.create_connection(("127.0.0.2", listener.port)).close()
        wait_for(lambda: listener.accepted == 1, 5, "the control connection")
    finally:
        listener.close()


# --- credentials -----------------------------------------------------------------------------

PASSWORD = "pw-Zq81Xv7Lm3"


@pytest.fixture
def auth_server(tmp_path):
    """A nats-server of its own that wants a user and password."""
    binary = nats_server_binary()
    if binary is None:
        pytest.fail("nats-server is not installed: scripts/setup.sh installs Debian's")
    port = free_port()
    args = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js")]
    proc = subprocess.Popen(
        [*args, "--user", "pusher", "--pass", PASSWORD],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"nats://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_credentials_come_from_a_file_and_never_show(
    conn, auth_server, tmp_path, cli, monkeypatch, caplog
):
    auth = {"user": "pusher", "password": PASSWORD}
    add_stream(auth_server, **auth)
    creds = tmp_path / "nats.creds"
    creds.write_text(f"pusher:{PASSWORD}\n")
    env = {"EVENTPUSH_NATS_CREDENTIALS": str(creds)}
    outputs = []
    for args in (
        ("bus", "create", "orders", "--queues", "2"),
        ("rule", "create", "--bus", "orders", "--name", "all", "--pattern", '{"source":["shop"]}'),
        (
            "target",
            "create",
            "--bus",
            "orders",
            "--rule",
            "all",
            "--name",
            "js",
            "--url",
            f"{auth_server}/out.orders",
        ),
        ("worker", "create", "w1"),
        ("assign",),
    ):
        r = cli(*args, env=env)
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout + r.stderr)
    assert f"-> {auth_server}/out.orders" in outputs[2]
    r = cli("publish", "--bus", "orders", input="\n".join(events(20)), env=env)
    assert r.returncode == 0, r.stderr
    r = cli("worker", "run", "w1", "--until-idle", "--max-seconds", "60", "--json", env=env)
    outputs.append(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["delivered"] == 20
    assert len(messages(auth_server, **auth)) == 20

    # A wrong password: final failures; no text, log line (debug included) or output holds
    # either password.
    creds.write_text("pusher:not-the-password-Qw9\n")
    r = cli("publish", "--bus", "orders", input="\n".join(events(3, 100)), env=env)
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("EVENTPUSH_NATS_CREDENTIALS", str(creds))
    caplog.set_level(logging.DEBUG)
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (0, 3)
    outputs.append("\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records))
    for args in (("status", "--json"), ("target", "create", "--help")):
        r = cli(*args, env=env)
        outputs.append(r.stdout + r.stderr)
    everything = "\n".join(outputs) + "\n".join(
        str(row)
        for table in (
            "event_target",
            "event_push_failure",
            "event_push_delivery",
            "event_push_worker",
            "event_runtime_control",
        )
        for row in rows(conn, f"SELECT * FROM {table}")  # noqa: S608 (fixed names)
    )
    assert "credentials" in rows(conn, "SELECT last_error FROM event_push_failure")[0][0]
    for secret in (PASSWORD, "not-the-password-Qw9"):
        assert secret not in everything


def test_the_cli_creates_a_nats_target_and_shows_its_url(cli, db_url):
    for args in (
        ("bus", "create", "orders", "--queues", "1"),
        ("rule", "create", "--bus", "orders", "--name", "all", "--pattern", '{"source":["shop"]}'),
    ):
        assert cli(*args).returncode == 0
    r = cli(
        "target", "create", "--bus", "orders", "--rule", "all", "--name", "js",
        "--url", "nats://127.0.0.1:4222/out.orders",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "target created; runner orders/all/js -> nats://127.0.0.1:4222/out.orders"
    )
    r = cli(
        "target", "create", "--bus", "orders", "--rule", "all", "--name", "web",
        "--url", "http://127.0.0.1:9/hook",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # Without --batch-size a JetStream target takes its kind's default, an HTTP one HTTP's.
    with psycopg2.connect(db_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT name, batch_size FROM event_target ORDER BY name")
        assert cur.fetchall() == [("js", 64), ("web", 1)]
    conn.close()
    r = cli(
        "target", "create", "--bus", "orders", "--rule", "all", "--name", "js2",
        "--url", "nats://u:s3cr3t-pw@127.0.0.1:4222/out.orders",
    )  # fmt: skip
    assert r.returncode != 0
    assert "s3cr3t-pw" not in r.stdout + r.stderr
    assert "EVENTPUSH_NATS_CREDENTIALS" in r.stderr
