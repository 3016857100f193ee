"""The plugin API's bounds (issue 16): its description behind the same auth as the rest, a
bounded ``minutes``, series downsampled in SQL, metric rows pruned by retention. Real Airflow
API server app, real PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from eventpush.airflow import queries
from eventpush.push import store
from tests.airflow_fixtures import PASSWORDS, seed

pytest_plugins = ["tests.airflow_fixtures"]


@pytest.fixture(scope="module")
def viewer(client) -> dict[str, str]:
    r = client.post("/auth/token", json={"username": "viewer", "password": PASSWORDS["viewer"]})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['access_token']}"}


def test_openapi_description_needs_an_authenticated_user(client, viewer, airflow_conn_env):
    assert client.get("/eventpush/openapi.json").status_code == 401
    r = client.get("/eventpush/openapi.json", headers=viewer)
    assert r.status_code == 200 and "/api/status" in r.json()["paths"]
    for path in ("/eventpush/docs", "/eventpush/redoc"):
        assert client.get(path).status_code in (401, 404)
        assert client.get(path, headers=viewer).status_code == 404


def test_minutes_is_bounded(client, viewer, airflow_conn_env):
    queries._url_cache.clear()
    r = client.get("/eventpush/api/metrics?minutes=10080", headers=viewer)
    assert r.status_code == 422
    assert client.get("/eventpush/api/metrics?minutes=1440", headers=viewer).status_code == 200
    r = client.get("/eventpush/dashboard?minutes=10080", headers=viewer)
    assert r.status_code == 422


def _runner(conn) -> tuple[int, int, str]:
    seed(conn, "http://127.0.0.1:9/ok", workers=("w1",))
    with conn.cursor() as cur:
        cur.execute("SELECT id, worker_id, name FROM event_target_runner")
        return cur.fetchone()


def _insert(conn, rows) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO event_push_metric (ts, worker_id, runner_id, delivered, failed, lag, "
            "in_flight, waiting, p50_ms, p99_ms) VALUES (%s, %s, %s, %s, 0, %s, 0, %s, 1, %s)",
            rows,
        )
    conn.commit()


def test_series_are_downsampled_in_sql(conn):
    rid, wid, name = _runner(conn)
    now = datetime.now(UTC)
    # A day of points every 5 seconds: 17,280 rows.
    rows = [
        (now - timedelta(seconds=5 * i), wid, rid, 100_000 - i, i % 50, i % 50, float(i % 97))
        for i in range(17_280)
    ]
    _insert(conn, rows)
    series = queries.metric_series(conn, None, 1440)[name]
    assert 200 <= len(series) <= 241  # EVENTPUSH_DASHBOARD_POINTS (240), plus a partial bin
    last = series[-1]
    assert last["delivered"] == 100_000 and last["lag"] == 0  # the bin's last row
    assert max(p["p99_ms"] for p in series) == 96.0  # the worst p99 survives the averaging
    assert all(p["throughput"] is not None and p["throughput"] >= 0 for p in series[1:])
    hour = queries.metric_series(conn, name, 60)[name]
    assert len(hour) <= 241 and hour[-1]["ts"] == last["ts"]


def test_heartbeat_prunes_metric_rows_past_retention(conn, monkeypatch):
    rid, wid, _ = _runner(conn)
    now = datetime.now(UTC)
    _insert(
        conn,
        [(now - timedelta(hours=h), wid, rid, 1, 0, 0, 1.0) for h in (0.5, 2, 30, 49, 100)],
    )
    store.heartbeat(conn, wid, {}, [(rid, 1.0, 2.0)])
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_push_metric WHERE ts < now() - interval '48h'")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT count(*) FROM event_push_metric")
        assert cur.fetchone()[0] == 4  # 0.5 h, 2 h, 30 h and the heartbeat's own row
    conn.commit()
    monkeypatch.setenv("EVENTPUSH_METRIC_RETENTION_HOURS", "1")
    store.heartbeat(conn, wid, {}, [(rid, 1.0, 2.0)])
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_push_metric")
        assert cur.fetchone()[0] == 3


def _rows_read(plan: dict, table: str) -> int:
    """The rows a plan (EXPLAIN ANALYZE's JSON) read from ``table``, over all its loops."""
    own = plan["Actual Rows"] * plan["Actual Loops"] if plan.get("Relation Name") == table else 0
    return own + sum(_rows_read(p, table) for p in plan.get("Plans", []))


def test_latest_metrics_read_one_row_per_runner(conn):
    """Each runner's latest latency (``api/status`` and every dashboard poll) reads one metric
    row per runner, not the whole table (a row per runner every 5 s, kept 48 h)."""
    rid, wid, name = _runner(conn)
    now = datetime.now(UTC)
    rows = [
        (now - timedelta(seconds=5 * i), wid, rid, 5_000 - i, 0, 0, float(i)) for i in range(5000)
    ]
    _insert(conn, rows)
    with conn.cursor() as cur:
        cur.execute("ANALYZE event_push_metric")
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queries.LATEST_METRIC_SQL)
        plan = cur.fetchone()[0][0]["Plan"]
    conn.rollback()
    assert _rows_read(plan, "event_push_metric") <= 1
    (runner,) = queries.progress(conn)["runners"]
    assert runner["runner"] == name and runner["latest_metric"]["p99_ms"] == 0.0
    assert datetime.fromisoformat(runner["latest_metric"]["ts"]) == now


def _nodes(plan: dict) -> list[dict]:
    return [plan, *(n for p in plan.get("Plans", []) for n in _nodes(p))]


def test_latest_failures_read_only_the_limit_through_an_index(conn):
    """The latest open failures (``api/failures`` and every dashboard poll) come from the
    open-failures-by-mtime index in order: the limit's rows read, no sort of every open
    failure. Replayed and dead rows are not open and stay out."""
    rid, _, _ = _runner(conn)
    now = datetime.now(UTC)
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO event_push_failure (runner_id, consumer_group, topic_name, queue_id, "
            '"offset", message_id, attempts, last_error, status, mtime) '
            "VALUES (%s, 'g', 't', 0, %s, %s, 3, 'HTTP 500', %s, %s)",
            [
                (rid, i, f"m{i}", "failed" if i % 4 else "replayed", now - timedelta(seconds=i))
                for i in range(5000)
            ],
        )
        cur.execute("ANALYZE event_push_failure")
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queries.FAILURES_SQL, (50,))
        plan = cur.fetchone()[0][0]["Plan"]
    conn.commit()
    nodes = _nodes(plan)
    assert not [n for n in nodes if n["Node Type"] in ("Sort", "Incremental Sort")], plan
    assert [n.get("Index Name") for n in nodes if n.get("Relation Name")] == [
        "event_push_failure_open_mtime"
    ], plan
    assert _rows_read(plan, "event_push_failure") <= 50
    failures = queries.latest_failures(conn, 50)
    assert [f["offset"] for f in failures] == [i for i in range(67) if i % 4][:50]
