"""The plugin's API over HTTP, inside the real Airflow API server app, with Airflow's auth."""

from __future__ import annotations

import base64
import json
import time

import pytest

from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from tests.airflow_fixtures import PASSWORDS, StandaloneWorker, order_events, seed, wait_for

pytest_plugins = ["tests.airflow_fixtures"]


@pytest.fixture(scope="module")
def tokens(client) -> dict[str, str]:
    out = {}
    for user, password in PASSWORDS.items():
        r = client.post("/auth/token", json={"username": user, "password": password})
        assert r.status_code == 201, r.text
        out[user] = r.json()["access_token"]
    return out


@pytest.fixture
def api(client, tokens, airflow_conn_env):
    """Requests as a given user (None: no credentials), against this test's database."""
    from eventpush.airflow import queries

    queries._url_cache.clear()

    def call(method: str, path: str, user: str | None = "viewer", **kw):
        headers = {"Authorization": f"Bearer {tokens[user]}"} if user else {}
        return client.request(method, f"/eventpush/api/{path}", headers=headers, **kw)

    return call


def test_reads_need_an_authenticated_user(api, conn):
    seed(conn, "http://127.0.0.1:9/ok")
    assert api("GET", "status", user=None).status_code == 401
    r = api("GET", "status", user="viewer")
    assert r.status_code == 200
    body = r.json()
    assert {w["worker"] for w in body["workers"]} == {"w1", "w2"}
    runner = body["runners"][0]
    for key in ("lag", "in_flight", "waiting", "delivered", "failed", "controls", "latest_metric"):
        assert key in runner
    assert "url" not in r.text and "secret" not in r.text
    for path in ("audits", "failures", "metrics?minutes=5"):
        assert api("GET", path).status_code == 200
        assert api("GET", path, user=None).status_code == 401


def test_a_forged_token_is_refused(client, airflow_conn_env):
    r = client.get("/eventpush/api/status", headers={"Authorization": "Bearer not.a.jwt"})
    assert r.status_code in (401, 403)


def test_writes_need_an_editor(api, conn):
    seed(conn, "http://127.0.0.1:9/ok")
    body = {"scope": "worker", "name": "w1", "changes": {"pool_core": 4, "pool_max": 8}}
    assert api("POST", "adjust", user=None, json=body).status_code == 401
    assert api("POST", "adjust", user="viewer", json=body).status_code == 403
    assert (
        api("POST", "pause", user="viewer", json={"scope": "worker", "name": "w1"}).status_code
        == 403
    )
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_runtime_control")
        assert cur.fetchone()[0] == 0  # nothing written by the refused calls
    conn.rollback()
    r = api("POST", "adjust", user="editor", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["controls"] == {"pool_core": 4, "pool_max": 8}


def test_the_catalog_reads_for_readers_and_rules_switch_for_editors(api, conn):
    seed(conn, "http://127.0.0.1:9/ok?token=abc")
    r = api("GET", "catalog")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert [b["name"] for b in doc["buses"]] == ["orders"]
    assert [(x["name"], x["state"], x["targets"]) for x in doc["rules"]] == [
        ("orders-rule", "ENABLED", 2)
    ]
    assert {t["url"] for t in doc["targets"]} == {"http://127.0.0.1:9/ok?***"}
    assert "abc" not in r.text and "secret_fingerprint" not in r.text
    body = {"bus": "orders", "name": "orders-rule"}
    assert api("POST", "rule/disable", user=None, json=body).status_code == 401
    assert api("POST", "rule/disable", user="viewer", json=body).status_code == 403
    r = api("POST", "rule/disable", user="editor", json=body)
    assert r.status_code == 200 and (r.json()["state"], r.json()["version"]) == ("DISABLED", 2)
    r = api("POST", "rule/enable", user="editor", json={"bus": "orders", "name": "nope"})
    assert r.status_code == 404 and "unknown rule 'nope'" in r.json()["detail"]
    page = api("GET", "dashboard")
    assert page.status_code == 200 and "ruleSwitch(" in page.text and "DISABLED" in page.text


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"scope": "worker", "name": "w1", "changes": {"pool_core": 300}}, 422, "must not exceed"),
        ({"scope": "worker", "name": "w1", "changes": {"pool_max": 0}}, 422, "from 1 to"),
        ({"scope": "worker", "name": "w1", "changes": {"warp": 9}}, 422, "unknown"),
        ({"scope": "worker", "name": "w1", "changes": {}}, 422, "nothing to adjust"),
        ({"scope": "worker", "name": "nobody", "changes": {"pool_max": 4}}, 404, "unknown worker"),
        (
            {"scope": "runner", "name": "orders/orders-rule/t0", "changes": {"lane_limit": -1}},
            422,
            "lane_limit",
        ),
        ({"scope": "galaxy", "name": "w1", "changes": {"pool_max": 4}}, 422, "scope"),
    ],
)
def test_impossible_adjustments_are_refused_with_the_reason(api, conn, body, status, says):
    seed(conn, "http://127.0.0.1:9/ok")
    r = api("POST", "adjust", user="admin", json=body)
    assert r.status_code == status, r.text
    assert says in r.text
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_runtime_control")
        assert cur.fetchone()[0] == 0
    conn.rollback()


def test_adjust_pause_and_resume_reach_a_running_worker(api, conn, airflow_conn_env):
    with Receiver() as rx:
        runners = seed(conn, f"{rx.url}/ok", workers=("w1",))
        from eventpush import catalog
        from eventpush.catalog import TargetSpec

        slow = catalog.create_target(
            conn, "orders", "orders-rule", TargetSpec(name="slow", url=f"{rx.url}/slow?ms=1")
        )
        catalog.assign(conn)
        with StandaloneWorker("w1", airflow_conn_env) as worker:
            wait_for(lambda: worker.engine.runners, what="the worker to start")
            # a pool adjustment reaches the running engine
            r = api(
                "POST",
                "adjust",
                user="editor",
                json={"scope": "worker", "name": "w1", "changes": {"pool_core": 2, "pool_max": 4}},
            )
            assert r.status_code == 200, r.text
            wait_for(lambda: worker.engine.settings.pool_max == 4, what="pool_max to reach it")
            assert worker.engine.settings.pool_core == 2
            # pausing one runner stops its deliveries; the other keeps going
            r = api("POST", "pause", user="editor", json={"scope": "runner", "name": slow})
            assert r.status_code == 200, r.text
            wait_for(
                lambda: any(
                    r.paused for r in worker.engine.runners.values() if r.target.runner == slow
                ),
                what="the pause to reach the engine",
            )
            publish(conn, "orders", order_events(5))
            wait_for(lambda: len(rx.state.delivered("/ok")) == 5, what="the running runner")
            time.sleep(1)
            assert rx.state.delivered("/slow") == []
            status = api("GET", "status").json()
            paused = {r["runner"]: r["state"] for r in status["runners"]}
            assert paused == {runners["w1"]: "RUNNING", slow: "PAUSED"}
            # resumed: the held-back events go out, no restart
            assert (
                api(
                    "POST", "resume", user="editor", json={"scope": "runner", "name": slow}
                ).status_code
                == 200
            )
            wait_for(lambda: len(rx.state.delivered("/slow")) == 5, what="the resumed runner")


def test_the_plugin_is_registered_with_its_nav_link(client, tokens):
    r = client.get("/api/v2/plugins", headers={"Authorization": f"Bearer {tokens['admin']}"})
    assert r.status_code == 200, r.text
    (plugin,) = [p for p in r.json()["plugins"] if p["name"] == "eventpush"]
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/eventpush"
    (view,) = plugin["external_views"]
    assert view["destination"] == "nav" and view["href"] == "eventpush/dashboard"
    assert client.get("/eventpush/dashboard").status_code == 401


def test_replays_are_listed_for_readers_with_their_outcome(api, conn, client, tokens):
    from eventpush.sparkjobs.replay import ReplayRequest

    seed(conn, "http://127.0.0.1:9/ok")
    done = ReplayRequest(what="failed", target="t0", label="manual__ui-1")
    refused = ReplayRequest(what="all", bus="orders", dry_run=True, label="manual__ui-2")
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO event_replay_run (request, what, dry_run, status, selected, delivered, "
            "failed, finished_at) VALUES (%s, 'failed', false, 'succeeded', 3, 3, 0, now())",
            (json.dumps(done.to_json()),),
        )
        cur.execute(
            "INSERT INTO event_replay_run (request, what, dry_run, status, error) "
            "VALUES (%s, 'all', true, 'failed', 'selection check failed: <b>too many</b>')",
            (json.dumps(refused.to_json()),),
        )
    conn.commit()
    assert api("GET", "replays", user=None).status_code == 401
    replays = api("GET", "replays").json()["replays"]
    assert [(r["run"], r["status"], r["target"], r["delivered"]) for r in replays] == [
        ("manual__ui-2", "failed", None, 0),
        ("manual__ui-1", "succeeded", "t0", 3),
    ]
    page = client.get(
        "/eventpush/dashboard", headers={"Authorization": f"Bearer {tokens['viewer']}"}
    ).text
    replays_html = page.split("<h2>Replays</h2>", 1)[1]
    assert "manual__ui-1" in replays_html and "target t0" in replays_html
    assert "all (dry run)" in replays_html and "bus orders" in replays_html
    assert "&lt;b&gt;too many&lt;/b&gt;" in replays_html  # errors are escaped, not markup


def test_delivered_means_live_and_replayed_and_the_audit_line_sums_its_table(
    api, conn, client, tokens
):
    runners = seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    runner = runners["w1"]
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM event_target_runner WHERE name = %s", (runner,))
        (rid,) = cur.fetchone()
        # offset 0 delivered live; offset 1 failed live, then delivered by a replay; offset 2
        # failed live and still open (the books as the engine and a replay write them: the
        # runner's counters and the rows together)
        cur.execute(
            "UPDATE event_target_runner SET delivered_total = 1, failed_total = 2, "
            "replayed_total = 1 WHERE id = %s",
            (rid,),
        )
        for offset, origin in ((0, "live"), (1, "replay")):
            cur.execute(
                "INSERT INTO event_push_delivery (runner_id, consumer_group, topic_name, "
                'queue_id, "offset", message_id, attempts, http_status, latency_ms, origin) '
                "VALUES (%s, %s, 'orders', 0, %s, %s, 1, 200, 1.0, %s)",
                (rid, runner, offset, f"m{offset}", origin),
            )
        for offset, status in ((1, "replayed"), (2, "failed")):
            cur.execute(
                "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, "
                'queue_id, "offset", message_id, attempts, last_error, status) '
                "VALUES (%s, %s, 'orders', 0, %s, %s, 3, 'HTTP 503', %s)",
                (rid, runner, offset, f"m{offset}", status),
            )
        # the audit of the same records: two delivered, one failed
        audited = {"runner": runner, "expected": 3, "delivered": 2, "failed": 1}
        audited.update(missing=0, pending=0, duplicates=0)
        cur.execute(
            "INSERT INTO event_audit_report (bus, expected, delivered, failed, missing, "
            "pending, duplicates, runners) VALUES ('orders', 3, 2, 1, 0, 0, 0, %s)",
            (json.dumps([audited]),),
        )
    conn.commit()
    (status,) = api("GET", "status").json()["runners"]
    assert (status["delivered"], status["replayed"], status["failed"]) == (2, 1, 1)
    assert (status["delivered"], status["failed"]) == (audited["delivered"], audited["failed"])
    assert status["open_failures"] == 1 and status["delivered_live"] == 1

    def page_part(heading: str) -> str:
        page = client.get(
            "/eventpush/dashboard", headers={"Authorization": f"Bearer {tokens['viewer']}"}
        ).text
        return page.split(f"<h2>{heading}</h2>", 1)[1].split("<h2>", 1)[0]

    cells = page_part("Runners").split("<td>")
    assert [c.split("</td>")[0] for c in cells[7:10]] == ["2", "1", '<span class="bad">1</span>']
    assert "nothing missing" in page_part("Last audit")
    # a report saved before runner ids were recorded: "-" for the id
    assert f"<td>{runner}</td><td>-</td>" in page_part("Last audit")
    # an audit without runners in its scope says so, and never a count the table lacks
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO event_audit_report (bus, expected, delivered, failed, missing, "
            "pending, duplicates, runners) VALUES ('orders', 0, 0, 0, 3, 0, 0, '[]')"
        )
    conn.commit()
    last = page_part("Last audit")
    assert "missing" not in last.split("<table>")[0] and "no runner in its scope" in last
    # A deleted target's runner and the live one re-created with its names: a row each, told
    # apart by id.
    same = [
        audited | {"runner_id": 7, "deleted": True, "delivered": 1, "missing": 2},
        audited | {"runner_id": 8, "deleted": False, "delivered": 0, "missing": 3},
    ]
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO event_audit_report (bus, expected, delivered, failed, missing, "
            "pending, duplicates, runners) VALUES ('orders', 6, 1, 2, 5, 0, 0, %s)",
            (json.dumps(same),),
        )
    conn.commit()
    last = page_part("Last audit")
    assert '<span class="bad">5 missing</span>' in last
    rows = [row.split("</tr>")[0] for row in last.split("<tr>")[2:]]
    assert rows == [
        f"<td>{runner}</td><td>7</td><td>3</td><td>1</td><td>1</td><td>2</td><td>0</td><td>0</td>",
        f"<td>{runner}</td><td>8</td><td>3</td><td>0</td><td>1</td><td>3</td><td>0</td><td>0</td>",
    ]


def test_the_dashboard_shows_each_destinations_limit_rate_throttling_and_auto_concurrency(
    api, conn, client, tokens
):
    """From the workers' heartbeats (as ``store.heartbeat`` writes them, in the shape the
    engine's beat gives: tests/test_rate_limits.py checks that shape from real workers):
    the alive workers' figures summed per destination, a stale worker's left out."""
    from eventpush import catalog
    from eventpush.catalog import TargetSpec
    from eventpush.push import store

    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["app.orders"]})
    catalog.create_destination(conn, "api", "http://127.0.0.1:9/api", rate_limit=50)
    catalog.create_destination(conn, "open", "http://127.0.0.1:9/open")
    for name, destination, auto in (("t0", "api", True), ("t2", "api", False)):
        spec = TargetSpec(name=name, url="", destination=destination, concurrency_auto=auto)
        catalog.create_target(conn, "orders", "r", spec)
    spec = TargetSpec(name="t1", url="http://127.0.0.1:9/plain", concurrency_auto=True)
    catalog.create_target(conn, "orders", "r", spec)

    def lane(destination, auto, concurrency):
        return {"destination": destination, "concurrency_auto": auto, "concurrency": concurrency}

    def figures(limit, sent, throttled, waiting, per_s):
        keys = ("rate_limit", "sent", "throttled_s", "waiting", "invocations_per_s")
        return dict(zip(keys, (limit, sent, throttled, waiting, per_s), strict=True))

    beats = {
        "w1": {
            "destinations": {"api": figures(50.0, 100, 2.5, True, 30.0)},
            "lanes": {"orders/r/t0": lane("api", True, 7)},
        },
        # A limit change on its way: this one still enforces the old limit.
        "w2": {
            "destinations": {"api": figures(40.0, 50, 1.0, False, 19.5)},
            "lanes": {"orders/r/t1": lane(None, True, 3), "orders/r/t2": lane("api", False, 16)},
        },
        "w3": {  # its last heartbeat an hour ago: not counted
            "destinations": {"api": figures(50.0, 9999, 500.0, True, 1000.0)},
            "lanes": {"orders/r/t9": lane("api", True, 64)},
        },
    }
    for worker, metrics in beats.items():
        store.heartbeat(conn, catalog.create_worker(conn, worker), metrics, [])
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE event_push_worker SET heartbeat_at = now() - interval '1 hour' "
            "WHERE name = 'w3'"
        )
    conn.commit()
    assert api("GET", "destinations", user=None).status_code == 401
    r = api("GET", "destinations")
    assert r.status_code == 200, r.text
    doc = {d["destination"]: d for d in r.json()["destinations"]}
    assert list(doc) == ["api", "open", None]
    assert doc["api"]["rate_limit"] == 50 and sorted(doc["api"]["enforced"]) == [40, 50]
    assert (doc["api"]["invocations_per_s"], doc["api"]["throttled_s"]) == (49.5, 3.5)
    assert doc["api"]["waiting"] is True
    assert [(a["runner"], a["concurrency"]) for a in doc["api"]["auto"]] == [("orders/r/t0", 7)]
    assert doc["open"]["rate_limit"] is None and doc["open"]["invocations_per_s"] is None
    assert [(a["runner"], a["concurrency"]) for a in doc[None]["auto"]] == [("orders/r/t1", 3)]
    page = client.get(
        "/eventpush/dashboard", headers={"Authorization": f"Bearer {tokens['viewer']}"}
    ).text
    part = page.split("<h2>Destinations</h2>", 1)[1].split("<h2>", 1)[0]
    cells = [
        [c.split("</td>")[0] for c in tr.split("<td>")[1:]]
        for tr in part.split("<tr>")[2:]  # past the header row
    ]
    assert cells == [
        ["api", "50/s (workers: 40/s)", "49.5", '<span class="bad">3.5 (waiting)</span>',
         "orders/r/t0: 7"],
        ["open", "none", "-", "-", "-"],
        ["(no destination)", "none", "-", "-", "orders/r/t1: 3"],
    ]  # fmt: skip


def test_a_database_read_only_or_down_answers_one_line_not_a_traceback(
    api, conn, client, tokens, monkeypatch
):
    """A read-only database (a failover's standby) refuses writes with 503 and the database's
    own line, nothing written; a database that does not answer is 503 with the redacted
    line for every read, and the page says it as HTML."""
    from eventpush.airflow import queries

    seed(conn, "http://127.0.0.1:9/ok")
    dbname = conn.get_dsn_parameters()["dbname"]
    with conn.cursor() as cur:  # the test's own database: new connections are read-only
        cur.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
    conn.commit()
    try:
        r = api("POST", "pause", user="editor", json={"scope": "worker", "name": "w1"})
        assert r.status_code == 503, r.text
        assert r.json() == {
            "detail": "eventpush database: cannot execute INSERT in a read-only transaction"
        }
        body = {"bus": "orders", "name": "orders-rule"}
        r = api("POST", "rule/disable", user="editor", json=body)
        assert r.status_code == 503 and "read-only transaction" in r.json()["detail"], r.text
        assert api("GET", "catalog").status_code == 200  # reads go on
    finally:
        with conn.cursor() as cur:
            cur.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        conn.commit()
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_runtime_control")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT state FROM event_rule")
        assert cur.fetchone()[0] == "ENABLED"
    conn.rollback()

    # Down: the connection leads to a closed loopback port, a password in its URL.
    monkeypatch.setenv("AIRFLOW_CONN_EVENTPUSH_DB", "postgresql://ep:hunter2@127.0.0.1:1/ep")
    queries._url_cache.clear()
    for path in ("status", "dashboard", "catalog", "failures"):
        r = api("GET", path)
        assert r.status_code == 503, (path, r.text)
        detail = r.json()["detail"]
        assert detail.startswith("eventpush database: cannot connect to "), detail
        assert "\n" not in detail and "hunter2" not in detail
    r = api("POST", "resume", user="editor", json={"scope": "worker", "name": "w1"})
    assert r.status_code == 503 and "hunter2" not in r.text
    page = client.get(
        "/eventpush/dashboard", headers={"Authorization": f"Bearer {tokens['viewer']}"}
    )
    assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
    assert "eventpush database: cannot connect to " in page.text and "hunter2" not in page.text
    queries._url_cache.clear()


def test_status_of_a_nats_bus_reads_on_a_read_only_database(api, conn, nats_server):
    """Status asks a NATS bus for its heads and records them; on a read-only database (a
    standby) it still answers, lag counted to the heads it just asked, and writes nothing.
    Before, the heads' UPDATE made ``api/status`` and the dashboard a 503."""
    import asyncio

    import nats

    from eventpush import catalog
    from eventpush.airflow.triggers import WORK, slice_due

    catalog.create_bus(conn, "orders", 2, source=nats_server.url)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_target(
        conn, "orders", "r", catalog.TargetSpec(name="t", url="http://127.0.0.1:9/")
    )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)

    async def outside_producer() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            for q in (0, 1, 0, 1, 0):  # stream sequences 1-5: heads 6 (queue 0) and 5 (queue 1)
                await nc.jetstream().publish(f"orders.{q}", b'{"source": "shop"}')
        finally:
            await nc.close()

    asyncio.run(outside_producer())

    def recorded() -> list[int]:
        with conn.cursor() as cur:
            cur.execute("SELECT next_offset FROM event_bus_queue ORDER BY queue_id")
            out = [n for (n,) in cur.fetchall()]
        conn.rollback()
        return out

    assert recorded() == [0, 0]
    dbname = conn.get_dsn_parameters()["dbname"]
    with conn.cursor() as cur:  # the test's own database: new connections are read-only
        cur.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
    conn.commit()
    try:
        r = api("GET", "status")
        assert r.status_code == 200, r.text
        [runner] = r.json()["runners"]
        assert (runner["lag"], runner["waiting"]) == (11, 11)
        r = api("GET", "dashboard")
        assert r.status_code == 200 and "orders/r/t" in r.text, r.text
        assert api("GET", "dashboard?minutes=5").status_code == 200
        # The push trigger's check reads too: no slice could commit before writes come back.
        assert slice_due(conn.dsn, "w1") is None
        assert recorded() == [0, 0]  # nothing written
    finally:
        with conn.cursor() as cur:
            cur.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        conn.commit()
    r = api("GET", "status")
    assert r.status_code == 200 and r.json()["runners"][0]["lag"] == 11
    assert recorded() == [6, 5]  # writable again: the heads are recorded
    assert slice_due(conn.dsn, "w1") == WORK


def test_a_key_that_does_not_open_the_secrets_is_one_line_not_a_500(
    api, conn, tmp_path, monkeypatch
):
    """The catalog opens sealed target secrets (for their fingerprints): an API server whose
    EVENTPUSH_SECRET_KEY_FILE is another key answers 503 with a line saying so, neither a
    bare 500 nor the key file's path."""
    from eventpush import catalog
    from eventpush.catalog import TargetSpec
    from eventpush.sealed import write_key_file

    seed(conn, "http://127.0.0.1:9/ok")
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    spec = TargetSpec(name="signed", url="http://127.0.0.1:9/s", secret=secret)
    catalog.create_target(conn, "orders", "orders-rule", spec)
    other = tmp_path / "other.key"
    write_key_file(other)
    monkeypatch.setenv("EVENTPUSH_SECRET_KEY_FILE", str(other))
    for path in ("catalog", "dashboard"):
        r = api("GET", path)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["detail"].startswith("eventpush: the stored target secrets do not open")
        assert str(other) not in r.text and secret not in r.text
    assert api("GET", "status").status_code == 200  # what needs no secret is served
