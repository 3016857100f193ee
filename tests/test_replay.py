"""Replay against real PostgreSQL, Spark local mode and a real HTTP receiver on loopback."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from batch_support import events, make_runner, publish_lines, simulate_push, spark  # noqa: F401
from click.testing import CliRunner

from eventpush.demo.receiver import Receiver
from eventpush.sinks.contract import record_key
from eventpush.sparkjobs.audit import run_audit
from eventpush.sparkjobs.replay import ReplayRequest, ReplayRequestError, check_request, run_replay
from eventpush.status import read_status


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


def audit_of(spark, db_url, runner):  # noqa: F811
    return next(r for r in run_audit(spark, db_url).runners if r.runner == runner)


def test_missing_replay_repairs_the_gap_and_second_audit_is_clean(
    db_url,
    conn,
    spark,  # noqa: F811
    receiver,
):
    runner = make_runner(
        conn, "orders", "all", "crm", {"source": ["app.orders"]}, url=f"{receiver.url}/ok"
    )
    publish_lines(conn, "orders", events(12))
    simulate_push(conn, runner)
    with conn.cursor() as cur:
        cur.execute(
            "DELETE FROM event_push_delivery WHERE id IN (SELECT id FROM event_push_delivery "
            'ORDER BY id LIMIT 4) RETURNING runner_id, queue_id, "offset"'
        )
        lost = {record_key(*row) for row in cur.fetchall()}
    conn.commit()
    assert audit_of(spark, db_url, runner).missing == 4

    result = run_replay(spark, db_url, ReplayRequest(what="missing", bus="orders"))
    assert (result.selected, result.delivered, result.failed) == (4, 4, 0)
    got = {r.headers.get("webhook-id") for r in receiver.state.delivered("/ok")}
    assert lost <= got
    after = audit_of(spark, db_url, runner)
    assert after.missing == 0 and after.delivered == 12 and after.duplicates == 0

    again = run_replay(spark, db_url, ReplayRequest(what="missing", bus="orders"))
    assert again.selected == 0 and again.delivered == 0
    with conn.cursor() as cur:
        cur.execute(
            "SELECT count(*), min(replay_id) FROM event_push_delivery WHERE origin = 'replay'"
        )
        assert cur.fetchone() == (4, result.replay_id)
        cur.execute("SELECT status, selected, delivered, failed FROM event_replay_run ORDER BY id")
        assert cur.fetchall() == [("succeeded", 4, 4, 0), ("succeeded", 0, 0, 0)]


def test_failed_replay_after_target_recovers(db_url, conn, spark, receiver):  # noqa: F811
    runner = make_runner(
        conn,
        "orders",
        "all",
        "flaky",
        {"source": ["app.orders"]},
        url=f"{receiver.url}/down",
        max_attempts=2,
        backoff_ms=1,
    )
    publish_lines(conn, "orders", events(6))
    simulate_push(conn, runner, fail={1, 2, 3})
    with conn.cursor() as cur:
        cur.execute("SELECT message_id FROM bus_event WHERE (body->'detail'->>'n')::int = 1")
        first = cur.fetchone()[0]
    conn.rollback()

    # Still down: the chosen record fails again and is marked dead.
    down = run_replay(spark, db_url, ReplayRequest(what="failed", message_ids=(first,)))
    assert (down.selected, down.delivered, down.failed) == (1, 0, 1)

    receiver.state.recover("/down")
    up = run_replay(spark, db_url, ReplayRequest(what="failed", bus="orders"))
    assert (up.selected, up.delivered, up.failed) == (2, 2, 0)
    with conn.cursor() as cur:
        cur.execute("SELECT status, count(*) FROM event_push_failure GROUP BY status ORDER BY 1")
        assert cur.fetchall() == [("dead", 1), ("replayed", 2)]
    conn.rollback()
    # Status counts the replay's deliveries from the runner's own counter, not its rows.
    (status,) = read_status(conn)["runners"]
    assert (status["runner"], status["replayed"]) == (runner, 2)
    assert run_replay(spark, db_url, ReplayRequest(what="failed")).selected == 0
    audit = audit_of(spark, db_url, runner)
    assert (audit.delivered, audit.failed, audit.missing) == (5, 1, 0)


def test_a_replay_waits_for_the_one_pushing_and_takes_only_what_it_left(
    db_url,
    conn,
    spark,  # noqa: F811
    receiver,
):
    """Two replays of the same open failures at once (a form sent twice, the CLI beside the
    DAG) delivered each record twice. One pushes at a time: held by another session here,
    a replay waits, pushing nothing; let go, it pushes each record once, and the next one
    finds nothing left."""
    import threading

    import psycopg2

    from eventpush.sparkjobs.replay import REPLAY_LOCK_KEY

    runner = make_runner(
        conn, "orders", "all", "late", {"source": ["app.orders"]}, url=f"{receiver.url}/ok/late"
    )
    publish_lines(conn, "orders", events(3))
    simulate_push(conn, runner, fail={0, 1, 2})
    holder = psycopg2.connect(db_url)
    holder.autocommit = True
    with holder.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s)", (REPLAY_LOCK_KEY,))
    results: list = []
    # A database URL with its own short timeouts (as an Airflow connection's options may
    # give) bounds the work, not the wait for the replay before.
    timed = db_url + ("&" if "?" in db_url else "?") + "options=-c%20statement_timeout%3D1s"
    waiting = threading.Thread(
        target=lambda: results.append(
            run_replay(spark, timed, ReplayRequest(what="failed", bus="orders"))
        )
    )
    try:
        waiting.start()
        waiting.join(3)
        assert waiting.is_alive() and receiver.state.count["/ok/late"] == 0
        with conn.cursor() as cur:  # nor selected: it selects what the one before it left
            cur.execute("SELECT count(*) FROM event_replay_run")
            assert cur.fetchone()[0] == 0
        conn.rollback()
        dry = run_replay(spark, db_url, ReplayRequest(what="failed", bus="orders", dry_run=True))
        assert dry.selected == 3  # a dry run pushes nothing, so it waits for nobody
    finally:
        holder.close()  # the holder's session ends: its lock goes with it
    waiting.join(120)
    assert not waiting.is_alive()
    [first] = results
    assert (first.selected, first.delivered) == (3, 3)
    assert any("waited" in w and "another replay" in w for w in first.warnings), first.warnings
    assert run_replay(spark, db_url, ReplayRequest(what="failed", bus="orders")).selected == 0
    assert receiver.state.count["/ok/late"] == 3


def test_all_dry_run_max_count_and_rate_limit(db_url, conn, spark, receiver):  # noqa: F811
    make_runner(
        conn, "orders", "all", "archive", {"source": ["app.orders"]}, url=f"{receiver.url}/ok"
    )
    publish_lines(conn, "orders", events(5) + events(3, source="app.other"))
    dry = run_replay(
        spark, db_url, ReplayRequest(what="all", bus="orders", dry_run=True, everything=True)
    )
    assert dry.selected == 5 and dry.delivered == 0
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_push_delivery")
        assert cur.fetchone()[0] == 0
    conn.rollback()
    some = run_replay(
        spark, db_url, ReplayRequest(what="all", max_count=3, rate_limit=50.0, everything=True)
    )
    assert (some.selected, some.delivered) == (3, 3)


@pytest.mark.parametrize(
    "request_kw, message",
    [
        (
            {"since": datetime(2024, 2, 1, tzinfo=UTC), "until": datetime(2024, 1, 1, tzinfo=UTC)},
            "until .* must be after since",
        ),
        ({"max_count": 0}, "max count must be a positive number"),
        ({"rate_limit": -1.0}, "rate limit must be a positive"),
        ({"bus": "nope"}, "unknown bus 'nope'"),
        ({"bus": "orders", "rule": "nope"}, "unknown rule 'nope' on bus 'orders'"),
        ({"target": "nope"}, "unknown target 'nope'"),
        ({"what": "everything"}, "what must be one of failed, missing, all"),
        ({"message_ids": ("",)}, "message ids must be non-empty"),
    ],
)
def test_impossible_requests_refused(db_url, conn, request_kw, message):
    make_runner(conn, "orders", "all", "crm", {"source": ["app.orders"]})
    with pytest.raises(ReplayRequestError, match=message), conn.cursor() as cur:
        check_request(ReplayRequest(**request_kw), cur)


def test_replay_cli_json(db_url, conn, spark, receiver):  # noqa: F811
    from eventpush.cli.batch import replay

    make_runner(conn, "orders", "all", "crm", {"source": ["app.orders"]}, url=f"{receiver.url}/ok")
    publish_lines(conn, "orders", events(2))
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    result = CliRunner().invoke(replay, ["--what", "all", "--since", since, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["selected"], doc["delivered"], doc["failed"]) == (2, 2, 0)
    bad = CliRunner().invoke(replay, ["--max-count", "0"])
    assert bad.exit_code == 2 and "max count" in bad.output


def test_replay_treats_targets_as_adversaries_like_the_engine(
    db_url,
    conn,
    spark,  # noqa: F811
    receiver,
):
    """Replay sends through the engine's delivery client: no redirect followed, a huge body
    not read, a hostile Retry-After clamped, a denied IP literal refused at connect time
    (127.0.0.2 stands in for it), and no URL secret in a failure row."""
    from urllib.parse import quote

    with Receiver(host="127.0.0.2") as denied:
        location = quote(f"{denied.url}/ok?token=REPLAYSECRET", safe="")
        specs = {
            "redirect": f"{receiver.url}/redirect?code=307&to={location}&token=REPLAYSECRET",
            "literal": f"{receiver.url}/ok/literal",
            "retry": f"{receiver.url}/retryafter/replay?value=nan",
            "huge": f"{receiver.url}/huge?mib=64",
        }
        runners = {
            name: make_runner(conn, "orders", "all", name, {"source": ["app.orders"]}, url=url)
            for name, url in specs.items()
        }
        with conn.cursor() as cur:  # a target made before the policy, or written directly
            cur.execute(
                "UPDATE event_target SET url = %s WHERE name = 'literal'",
                (f"{denied.url}/ok?token=REPLAYSECRET",),
            )
        conn.commit()
        publish_lines(conn, "orders", events(3))
        for runner in runners.values():
            simulate_push(conn, runner, fail={0, 1, 2})

        result = run_replay(spark, db_url, ReplayRequest(what="failed", bus="orders"))

        assert (result.selected, result.delivered, result.failed) == (12, 6, 6)
        assert sum(denied.state.count.values()) == 0, "nothing may reach the denied address"
    assert receiver.state.count["/huge"] == 3
    with conn.cursor() as cur:
        cur.execute(
            "SELECT t.name, f.status, f.http_status, f.last_error FROM event_push_failure f "
            "JOIN event_target_runner r ON r.id = f.runner_id "
            "JOIN event_target t ON t.id = r.target_id ORDER BY 1"
        )
        got = {(name, status, http, error) for name, status, http, error in cur.fetchall()}
    conn.rollback()
    assert ("huge", "replayed", 503, "HTTP 503") in got and (
        "retry",
        "replayed",
        503,
        "HTTP 503",
    ) in got
    dead = {
        (name, http, error.split(" (open it")[0]) for name, st, http, error in got if st == "dead"
    }
    assert dead == {
        (
            "redirect",
            307,
            "HTTP 307: redirect to http://127.0.0.2:"
            + denied.url.rsplit(":", 1)[1]
            + "/ok?*** not followed",
        ),
        ("literal", None, "refused address: address 127.0.0.2 is in the denied range 127.0.0.0/8"),
    }
    assert not any("REPLAYSECRET" in str(row) for row in got)


SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_replay_sends_a_batch_target_batches_signed_and_an_ordered_one_in_order(
    db_url,
    conn,
    spark,  # noqa: F811
):
    """As the live engine: batches of the target's size, Standard Webhooks signatures that the
    library verifies, and per queue, in offset order, for an ordered target."""
    from standardwebhooks import Webhook

    with Receiver() as receiver:  # its own: the module's receiver has other tests' requests
        _replay_batched_and_ordered(db_url, conn, spark, receiver, Webhook(SECRET))


def _replay_batched_and_ordered(db_url, conn, spark, receiver, hook):  # noqa: F811

    batched = make_runner(
        conn,
        "orders",
        "all",
        "bulk",
        {"source": ["app.orders"]},
        url=f"{receiver.url}/ok?t=bulk",
        batch_size=5,
        secret=SECRET,
    )
    ordered = make_runner(
        conn,
        "orders",
        "all",
        "ledger",
        {"source": ["app.orders"]},
        url=f"{receiver.url}/ok?t=ledger",
        ordered=True,
    )
    publish_lines(conn, "orders", events(23))
    for runner in (batched, ordered):
        simulate_push(conn, runner, fail=set(range(23)))  # every record on the books as failed
    result = run_replay(spark, db_url, ReplayRequest(what="failed", bus="orders"))
    assert (result.selected, result.delivered, result.failed) == (46, 46, 0)

    bulk = [r for r in receiver.state.delivered("/ok") if "webhook-signature" in r.headers]
    sizes = sorted(len(json.loads(r.body)) for r in bulk)
    # Two queues: 23 records split into whole batches of five per runner, the rest together.
    assert sum(sizes) == 23 and max(sizes) == 5 and len(sizes) <= 6
    for r in bulk:
        headers = {k: v for k, v in r.headers.items() if k.startswith("webhook")}
        assert isinstance(hook.verify(r.body, headers), list)
    single = [r for r in receiver.state.delivered("/ok") if "webhook-signature" not in r.headers]
    assert len(single) == 23
    with conn.cursor() as cur:
        cur.execute('SELECT message_id, queue_id, "offset" FROM bus_event')
        position = {m: (q, o) for m, q, o in cur.fetchall()}
    conn.rollback()
    arrived: dict[int, list[int]] = {}
    for r in sorted(single, key=lambda r: r.at):
        queue, offset = position[json.loads(r.body)["id"]]
        arrived.setdefault(queue, []).append(offset)
    assert arrived and all(offsets == sorted(offsets) for offsets in arrived.values())


def test_a_small_replay_pushes_from_one_partition_a_large_one_from_every_core():
    from eventpush.sparkjobs.replay_push import RECORDS_PER_PUSH_PARTITION, push_partitions

    assert push_partitions(1, 8) == 1
    assert push_partitions(RECORDS_PER_PUSH_PARTITION, 8) == 1
    assert push_partitions(RECORDS_PER_PUSH_PARTITION + 1, 8) == 2
    assert push_partitions(100 * RECORDS_PER_PUSH_PARTITION, 4) == 4


def test_spread_keeps_an_ordered_queue_whole_and_deals_the_rest_round():
    from eventpush.sparkjobs.replay_push import spread

    rows = [{"runner_id": 1, "queue_id": q, "offset": o} for q in (0, 1) for o in range(6)]
    rows += [{"runner_id": 2, "queue_id": 0, "offset": o} for o in range(7)]
    assert spread(rows, 1, {1}) == [rows]
    groups = spread(rows, 3, {1})
    assert len(groups) == 3
    for queue in (0, 1):  # each ordered queue in exactly one group, in offset order
        holding = [
            g for g in groups if any(r["runner_id"] == 1 and r["queue_id"] == queue for r in g)
        ]
        assert len(holding) == 1
        offsets = [
            r["offset"] for r in holding[0] if r["runner_id"] == 1 and r["queue_id"] == queue
        ]
        assert offsets == list(range(6))
    unordered = [sum(r["runner_id"] == 2 for r in g) for g in groups]
    assert sorted(unordered) == [2, 2, 3]
    assert sorted(map(id, (r for g in groups for r in g))) == sorted(map(id, rows))


def test_failed_selection_binds_operator_values(db_url, conn):
    """The ``failed`` selection's SQL text has its values bound by psycopg2: a quote in a
    message id is a quote, not SQL."""
    from eventpush.sparkjobs.replay import open_failures_sql

    runner = make_runner(conn, "orders", "all", "crm", {"source": ["app.orders"]})
    publish_lines(conn, "orders", events(3))
    simulate_push(conn, runner, fail={0, 1, 2})
    with conn.cursor() as cur:
        cur.execute("SELECT message_id, runner_id FROM event_push_failure ORDER BY 1 LIMIT 1")
        first, runner_id = cur.fetchone()
    conn.rollback()
    since = datetime.now(UTC) - timedelta(hours=1)
    cases = [
        (ReplayRequest(message_ids=(first, "x' OR true --")), 1),
        (ReplayRequest(since=since, max_count=2), 2),
        (ReplayRequest(until=since), 0),
    ]
    for req, count in cases:
        with conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM ({open_failures_sql(db_url, req, [runner_id])}) q")
            assert cur.fetchone()[0] == count, req
        conn.rollback()
