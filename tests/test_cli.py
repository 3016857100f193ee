"""The ``eventpush`` console script, run for real: the contract scripts rely on."""

import json

from eventpush import catalog


def test_end_to_end_through_the_cli(cli, db_url):
    assert cli("db", "migrate").returncode == 0
    assert cli("bus", "create", "orders", "--queues", "2").returncode == 0
    r = cli("rule", "create", "--bus", "orders", "--name", "r", "--pattern", '{"source": [1, {"x"')
    assert r.returncode == 2 and r.stderr.startswith("error: rule 'r': pattern is not valid JSON")
    r = cli("rule", "create", "--bus", "orders", "--name", "r", "--pattern", '{"source": {"a": 1}}')
    assert r.returncode == 2 and "invalid pattern" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("rule", "create", "--bus", "orders", "--name", "r", "--pattern", '{"source": ["shop"]}')
    assert r.returncode == 0, r.stderr
    r = cli(
        "target", "create", "--bus", "orders", "--rule", "r", "--name", "t", "--url", "gopher://x"
    )
    assert r.returncode == 2 and "http or https" in r.stderr
    r = cli(
        "target",
        "create",
        "--bus",
        "orders",
        "--rule",
        "r",
        "--name",
        "t",
        "--url",
        "http://127.0.0.1:1/hook",
        "--secret",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    )
    assert r.returncode == 0 and "orders/r/t" in r.stdout
    assert "whsec_" not in r.stdout + r.stderr
    assert cli("worker", "create", "w1").returncode == 0
    assert "1 runners assigned" in cli("assign").stdout

    lines = "\n".join(
        json.dumps({"source": "shop", "detail-type": "x", "detail": {"i": i}}) for i in range(5)
    )
    r = cli("publish", "--bus", "orders", "--json", input=lines + "\n")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["count"] == 5 and sum(b - a + 1 for a, b in doc["offsets"].values()) == 5
    r = cli("publish", "--bus", "orders", input=lines + "\n{oops\n")
    assert r.returncode == 2 and r.stderr.startswith("error: line 6: not valid JSON")

    status = json.loads(cli("status", "--json").stdout)
    [runner] = status["runners"]
    assert runner["runner"] == "orders/r/t" and runner["worker"] == "w1"
    assert (runner["lag"], runner["in_flight"], runner["waiting"]) == (5, 0, 5)
    assert {"workers", "runners"} <= status.keys()

    r = cli("worker", "adjust", "w1", "--pool-core", "500")
    assert r.returncode == 2 and "must not exceed pool_max" in r.stderr
    assert cli("runner", "pause", "orders/r/t").returncode == 0
    assert json.loads(cli("status", "--json").stdout)["runners"][0]["state"] == "PAUSED"
    r = cli("runner", "pause", "orders/r/nope")
    assert r.returncode == 2 and "unknown runner" in r.stderr


def test_missing_database_url_is_a_clear_error(cli):
    r = cli("status", env={"EVENTPUSH_DATABASE_URL": ""})
    assert r.returncode == 3
    assert r.stderr.strip() == "error: EVENTPUSH_DATABASE_URL is not set: give it a PostgreSQL URL"


def test_password_never_shown_in_connection_errors(cli):
    r = cli("status", env={"EVENTPUSH_DATABASE_URL": "postgresql://u:sup3rs3cret@127.0.0.1:1/x"})
    assert r.returncode == 3
    assert "sup3rs3cret" not in r.stderr and "***" in r.stderr


def test_worker_disable_and_enable_say_what_the_assignment_did(cli, conn):
    catalog.create_bus(conn, "orders", 1)
    catalog.create_rule(conn, "orders", "r", {"source": ["a"]})
    for name in ("t1", "t2"):
        catalog.create_target(
            conn, "orders", "r", catalog.TargetSpec(name=name, url="http://127.0.0.1:9/x")
        )
    for name in ("w1", "w2"):
        catalog.create_worker(conn, name)
    assert catalog.assign(conn) == 2
    said = {}  # rich may wrap a long line: compare the words
    for verb, name in (("disable", "w1"), ("disable", "w2"), ("enable", "w1")):
        r = cli("worker", verb, name)
        assert r.returncode == 0, r.stderr
        said[verb, name] = " ".join(r.stdout.split())
    assert said == {
        ("disable", "w1"): "worker w1 disabled; 1 runners moved to other workers",
        # no other worker left: its runners wait unassigned
        ("disable", "w2"): "worker w2 disabled; 0 runners moved to other workers",
        ("enable", "w1"): "worker w1 enabled; 2 unassigned runners placed",
    }
    r = cli("worker", "enable", "w9")
    assert r.returncode == 2 and "unknown worker 'w9'" in r.stderr
