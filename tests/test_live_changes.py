"""Changes applied live by a running worker (a subprocess), made through the CLI: a new
pattern, a disabled and enabled rule, a target's new URL and secret (both signing while the
old one is kept), a deleted target and a new one of the same name. Each batch of events is
delivered as the version in force at its offsets says; another runner is never disturbed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg2
import pytest
from batch_support import spark  # noqa: F401  (a fixture)
from standardwebhooks import Webhook

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECRET2 = "whsec_QUJDREVGR0hJSktMTU5PUFFSU1RVVldY"
WAIT_S = 60  # generous: the machine may be loaded; speed is measured in bench/, not here


@pytest.fixture
def rx():
    with Receiver() as r:
        yield r


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        out = cur.fetchall()
    conn.commit()
    return out


def until(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def batch(tag: str, kinds=("a", "b"), n: int = 4) -> list[str]:
    return [
        json.dumps({"source": "shop", "detail-type": "O", "detail": {"k": k, "tag": tag, "i": i}})
        for k in kinds
        for i in range(n)
    ]


def received(rx, path: str) -> list[tuple[str, str]]:
    """(tag, kind) of every event delivered to ``path``."""
    out = []
    for r in rx.state.delivered(path):
        doc = json.loads(r.body)
        out.append((doc["detail"]["tag"], doc["detail"]["k"]))
    return sorted(out)


@pytest.fixture
def worker(db_url, conn):
    catalog.create_worker(conn, "w1")
    exe = str(Path(sys.executable).with_name("eventpush"))
    procs = []

    def start():
        catalog.assign(conn)
        proc = subprocess.Popen(
            [exe, "worker", "run", "w1", "--max-seconds", "600"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        until(lambda: rows(conn, "SELECT pid FROM event_push_worker")[0][0], "worker started")
        return proc

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]


def version_took_effect(conn, runner: str, rule_version: int, target_version: int = 1):
    """The runner recorded, on every queue, the offset where these versions took effect."""
    return until(
        lambda: (
            rows(
                conn,
                "SELECT count(*) FROM event_runner_version v JOIN event_target_runner r "
                "ON r.id = v.runner_id WHERE r.name = %s AND r.deleted_at IS NULL "
                "AND v.rule_version = %s AND v.target_version = %s",
                runner,
                rule_version,
                target_version,
            )[0][0]
            == 2
        ),
        f"{runner} at rule version {rule_version}, target version {target_version}",
    )


def all_committed(conn) -> bool:
    [(lag,)] = rows(
        conn,
        'SELECT coalesce(sum(q.next_offset - o."offset"), 0) FROM event_push_offset o '
        "JOIN event_target_runner r ON r.id = o.runner_id AND r.deleted_at IS NULL "
        "JOIN event_target t ON t.id = r.target_id JOIN event_rule ru ON ru.id = t.rule_id "
        "JOIN event_bus_queue q ON q.bus_id = ru.bus_id AND q.queue_id = o.queue_id",
    )
    return lag == 0


def test_pattern_and_state_changes_follow_the_offsets(conn, rx, cli, worker, db_url, spark):  # noqa: F811
    catalog.create_bus(conn, "shop", 2)
    catalog.create_rule(conn, "shop", "r", {"detail": {"k": ["a"]}})
    catalog.create_target(conn, "shop", "r", catalog.TargetSpec("t", rx.url + "/ok/t"))
    catalog.create_rule(conn, "shop", "all", {"source": ["shop"]})
    catalog.create_target(conn, "shop", "all", catalog.TargetSpec("o", rx.url + "/ok/o"))
    worker()
    publish(conn, "shop", batch("A"))
    until(lambda: len(received(rx, "/ok/t")) == 4, "batch A")
    rule = ("--bus", "shop", "--name", "r")
    r = cli("rule", "update", *rule, "--pattern", '{"detail": {"k": ["b"]}}')
    assert r.returncode == 0, r.stderr
    version_took_effect(conn, "shop/r/t", 2)
    publish(conn, "shop", batch("B"))
    until(lambda: ("B", "b") in received(rx, "/ok/t"), "batch B")
    assert cli("rule", "disable", *rule).returncode == 0
    version_took_effect(conn, "shop/r/t", 3)
    publish(conn, "shop", batch("C"))  # while disabled: never delivered
    assert cli("rule", "enable", *rule).returncode == 0
    version_took_effect(conn, "shop/r/t", 4)
    publish(conn, "shop", batch("D"))
    until(lambda: len(received(rx, "/ok/o")) == 32, "every batch to the other runner")
    until(lambda: ("D", "b") in received(rx, "/ok/t"), "batch D")
    time.sleep(1)  # anything wrongly matched would arrive meanwhile
    expected = sorted([("A", "a")] * 4 + [("B", "b")] * 4 + [("D", "b")] * 4)
    assert received(rx, "/ok/t") == expected
    assert len(received(rx, "/ok/o")) == 32  # the other runner: every event, once
    # The history the audit reads: per queue, four versions, in offset order.
    history = rows(
        conn,
        "SELECT queue_id, array_agg(rule_version ORDER BY from_offset, rule_version) "
        "FROM event_runner_version v JOIN event_target_runner r ON r.id = v.runner_id "
        "WHERE r.name = 'shop/r/t' GROUP BY queue_id ORDER BY queue_id",
    )
    assert history == [(0, [1, 2, 3, 4]), (1, [1, 2, 3, 4])]

    # The audit follows the versions: nothing missing, nothing unexpected.
    from eventpush.db import connection, transaction
    from eventpush.sparkjobs.audit import run_audit
    from eventpush.sparkjobs.replay import ReplayRequest, check_request, run_replay

    until(lambda: all_committed(conn), "every offset committed")
    # Replay: the version in force at each offset by default, the pattern now when told.
    ask = {"what": "all", "target": "t", "everything": True, "dry_run": True}
    assert run_replay(spark, db_url, ReplayRequest(**ask)).selected == 12
    now = ReplayRequest(**ask, pattern_version="current")
    assert run_replay(spark, db_url, now).selected == 16  # every "b" of the four batches
    assert cli("target", "delete", "--bus", "shop", "--rule", "r", "--name", "t").returncode == 0
    refused = pytest.raises(ValueError, match="^target 't' was deleted: nothing is replayed")
    with connection(db_url) as c, transaction(c) as cur, refused:
        check_request(ReplayRequest(what="failed", target="t"), cur)
    # The audit follows the versions: nothing missing, nothing unexpected; the deleted
    # target's books are still read, marked.
    audit = {r.runner: r for r in run_audit(spark, db_url).runners}
    t, o = audit["shop/r/t"], audit["shop/all/o"]
    assert (t.expected, t.delivered, t.missing, t.pending, t.failed) == (12, 12, 0, 0, 0)
    assert t.deleted and not o.deleted
    assert (o.expected, o.delivered, o.missing) == (32, 32, 0)


def _commit_waits(conn) -> bool:
    [(waits,)] = rows(
        conn,
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query ILIKE 'LOCK TABLE event_target_runner%%')",
    )
    return waits


def verifies(secret: str, request) -> bool:
    headers = {k: v for k, v in request.headers.items() if k.startswith("webhook-")}
    try:
        Webhook(secret).verify(request.body.decode(), headers)
    except Exception:
        return False
    return True


def test_target_url_secret_and_delete_apply_live(conn, rx, cli, worker, db_url):
    catalog.create_bus(conn, "shop", 2)
    catalog.create_rule(conn, "shop", "r", {"source": ["shop"]})
    spec = catalog.TargetSpec("t", rx.url + "/ok/one", secret=SECRET)
    catalog.create_target(conn, "shop", "r", spec)
    worker()
    target = ("--bus", "shop", "--rule", "r", "--name", "t")
    publish(conn, "shop", batch("A", kinds=("a",)))
    until(lambda: len(rx.state.delivered("/ok/one")) == 4, "batch A")
    r = cli(
        "target",
        "update",
        *target,
        "--url",
        rx.url + "/ok/two",
        "--secret",
        "-",
        "--keep-old-secret",
        "24h",
        input=SECRET2,
    )
    assert r.returncode == 0, r.stderr
    version_took_effect(conn, "shop/r/t", 1, 2)
    until(lambda: all_committed(conn), "batch A committed")
    # Batch B is delivered but its commit held back until the target is deleted: a commit
    # takes the runner table's ROW EXCLUSIVE lock first, which this SHARE lock holds off.
    hold = psycopg2.connect(db_url)
    try:
        with hold.cursor() as cur:
            cur.execute("LOCK TABLE event_target_runner IN ROW EXCLUSIVE MODE")  # the delete's
            cur.execute("LOCK TABLE event_target_runner IN SHARE MODE")
        publish(conn, "shop", batch("B", kinds=("a",)))
        until(lambda: len(rx.state.delivered("/ok/two")) == 4, "batch B at the new URL")
        until(lambda: _commit_waits(conn), "batch B's commit waits for the runner table")
        [(old_runner,)] = rows(conn, "SELECT id FROM event_target_runner")
        catalog.delete_target(hold, "shop", "r", "t")  # commits: the commit goes on
    finally:
        hold.close()
    assert len(rx.state.delivered("/ok/one")) == 4
    for request in rx.state.delivered("/ok/one"):
        assert verifies(SECRET, request) and not verifies(SECRET2, request)
    for request in rx.state.delivered("/ok/two"):
        assert len(request.headers["webhook-signature"].split(" ")) == 2
        assert verifies(SECRET, request) and verifies(SECRET2, request)
    until(
        lambda: (
            rows(conn, "SELECT metrics->'lanes' ? 'shop/r/t' FROM event_push_worker") == [(False,)]
        ),
        "the deleted target's runner stopped",
    )
    until(
        lambda: rows(conn, "SELECT worker_id FROM event_target_runner") == [(None,)],
        "the deleted runner let go of by its worker",
    )
    publish(conn, "shop", batch("C", kinds=("a",)))  # nobody's: the target is gone
    spec = catalog.TargetSpec("t", rx.url + "/ok/three")
    catalog.create_target(conn, "shop", "r", spec)  # the name again: a new runner
    catalog.assign(conn)
    publish(conn, "shop", batch("D", kinds=("a",)))
    until(lambda: len(rx.state.delivered("/ok/three")) == 4, "batch D to the new target")
    time.sleep(1)
    assert {json.loads(r.body)["detail"]["tag"] for r in rx.state.delivered("/ok/three")} == {"D"}
    assert len(rx.state.delivered("/ok/two")) == 4  # nothing after the delete
    books = rows(
        conn,
        "SELECT runner_id, count(*) FROM event_push_delivery GROUP BY runner_id ORDER BY 1",
    )
    assert books[0] == (old_runner, 8) and books[1][1] == 4 and books[1][0] != old_runner
