"""What the control plugin reads: the eventpush database (resolved at most every
``URL_CACHE_S``), and the SQL behind the API's and the dashboard's figures: progress, metric
series (averaged down in SQL to at most ``EVENTPUSH_DASHBOARD_POINTS`` points per runner),
the latest failures, audits and replays. The routes are in ``eventpush.airflow.routes``, the
page in ``eventpush.airflow.web``."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from eventpush.airflow.connection import database_url
from eventpush.config import setting
from eventpush.db import connection, transaction
from eventpush.status import read_status

URL_CACHE_S = 30.0
_url_cache: dict[str, tuple[float, str]] = {}


def _url() -> str:
    """The eventpush database (Airflow connection or env), resolved at most every 30 s."""

    hit = _url_cache.get("url")
    if hit and time.monotonic() - hit[0] < URL_CACHE_S:
        return hit[1]
    url = database_url()
    _url_cache["url"] = (time.monotonic(), url)
    return url


def _conn():
    return connection(_url())


# --------------------------------------------------------------------------- data


# One point per runner and bin of ``stride`` seconds: the totals and gauges as they were at
# the bin's last row, p50 averaged and p99 the worst, so a week costs as much as an hour.
METRICS_SQL = """
SELECT r.name, max(m.ts) AS ts, max(m.delivered), max(m.failed),
       (array_agg(m.lag ORDER BY m.ts DESC))[1],
       (array_agg(m.in_flight ORDER BY m.ts DESC))[1],
       (array_agg(m.waiting ORDER BY m.ts DESC))[1],
       avg(m.p50_ms)::real, max(m.p99_ms)
FROM event_push_metric m JOIN event_target_runner r ON r.id = m.runner_id
WHERE m.ts > now() - make_interval(mins => %(minutes)s)
  AND (%(runner)s::text IS NULL OR r.name = %(runner)s)
GROUP BY r.name, date_bin(make_interval(secs => %(stride)s), m.ts, TIMESTAMPTZ '2000-01-01')
ORDER BY r.name, ts
"""


def max_minutes() -> int:
    """The longest range the dashboard and the metrics API show."""
    return setting("EVENTPUSH_DASHBOARD_MAX_MINUTES", 1440)


def max_points() -> int:
    """The most points per runner a series has."""
    return setting("EVENTPUSH_DASHBOARD_POINTS", 240, minimum=2)


# One row per live runner through the (runner_id, ts) index: DISTINCT ON over the table read
# every row kept (a row per runner every 5 s for 48 h) on each poll of every open dashboard.
LATEST_METRIC_SQL = """
SELECT r.name, m.ts, m.p50_ms, m.p99_ms
FROM event_target_runner r
CROSS JOIN LATERAL (
    SELECT ts, p50_ms, p99_ms FROM event_push_metric
    WHERE runner_id = r.id ORDER BY ts DESC LIMIT 1
) m
WHERE r.deleted_at IS NULL
"""

# Newest first through the open failures' (mtime, id) index (migration 0014), read backwards:
# the limit's rows, not a sort of every open failure on each poll.
FAILURES_SQL = """
SELECT consumer_group, queue_id, "offset", message_id, attempts, http_status, last_error, mtime
FROM event_push_failure WHERE status = 'failed' ORDER BY mtime DESC, id DESC LIMIT %s
"""

AUDITS_SQL = """
SELECT id, bus, window_start, window_end, expected, delivered, failed, missing, pending,
       duplicates, runners, created_at
FROM event_audit_report ORDER BY created_at DESC, id DESC LIMIT %s
"""

# The request's scope fields only: the form's label is the Airflow run id, shown as "run".
REPLAYS_SQL = """
SELECT id, request->>'label', what, request->>'bus', request->>'rule', request->>'target',
       dry_run, status, selected, delivered, failed, error, started_at, finished_at
FROM event_replay_run ORDER BY id DESC LIMIT %s
"""


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def progress(conn) -> dict:
    """``read_status`` with each item's runtime controls and its latest latency metrics."""

    status = read_status(conn)
    with transaction(conn) as cur:
        cur.execute("SELECT scope, name, key, value FROM event_runtime_control")
        controls: dict[tuple[str, str], dict] = {}
        for scope, name, key, value in cur.fetchall():
            controls.setdefault((scope, name), {})[key] = value
        cur.execute(LATEST_METRIC_SQL)
        latest = {name: (ts, p50, p99) for name, ts, p50, p99 in cur.fetchall()}
    for w in status["workers"]:
        w["controls"] = controls.get(("worker", w["worker"]), {})
    for r in status["runners"]:
        r["controls"] = controls.get(("runner", r["runner"]), {})
        ts, p50, p99 = latest.get(r["runner"], (None, None, None))
        r["latest_metric"] = {"ts": _iso(ts), "p50_ms": p50, "p99_ms": p99}
    return status


def destination_view(conn, status: dict) -> list[dict]:
    """Per API destination (and ``None`` for targets with adaptive concurrency and no
    destination): its rate limit as the catalog has it and as the alive workers enforce it,
    invocations per second and seconds throttled summed over the alive workers'
    heartbeats (``status``: :func:`progress`'s), whether sends wait for it now, and each
    adaptive target's concurrency limit as its worker last reported it."""
    from eventpush import catalog

    def row(name: str | None, rate_limit: float | None) -> dict:
        return {
            "destination": name,
            "rate_limit": rate_limit,
            "enforced": [],  # the limits the alive workers enforce (one, but for a change)
            "invocations_per_s": None,
            "throttled_s": None,
            "waiting": False,
            "auto": [],
        }

    view = {d.name: row(d.name, d.rate_limit) for d in catalog.list_destinations(conn)}
    for w in status["workers"]:
        if not w["alive"]:
            continue
        metrics = w["metrics"] or {}
        for name, f in (metrics.get("destinations") or {}).items():
            d = view.get(name)
            if d is None:  # deleted since
                continue
            if f.get("rate_limit") not in d["enforced"]:
                d["enforced"].append(f.get("rate_limit"))
            if f.get("invocations_per_s") is not None:
                d["invocations_per_s"] = (d["invocations_per_s"] or 0) + f["invocations_per_s"]
            d["throttled_s"] = round((d["throttled_s"] or 0) + f.get("throttled_s", 0), 3)
            d["waiting"] = d["waiting"] or bool(f.get("waiting"))
        for runner, lane in (metrics.get("lanes") or {}).items():
            if not lane.get("concurrency_auto"):
                continue
            name = lane.get("destination")
            if name is None and None not in view:
                view[None] = row(None, None)
            if name not in view:  # deleted since
                continue
            view[name]["auto"].append(
                {"runner": runner, "worker": w["worker"], "concurrency": lane["concurrency"]}
            )
    for d in view.values():
        d["auto"].sort(key=lambda a: a["runner"])
    return sorted(view.values(), key=lambda d: (d["destination"] is None, d["destination"] or ""))


def metric_series(conn, runner: str | None, minutes: int) -> dict[str, list[dict]]:
    """Per runner, its metric points of the last ``minutes`` (at most ``max_points()``, each
    summing up a bin of equal length), with throughput (delivered per second since the
    previous point)."""
    stride = max(1.0, minutes * 60 / max_points())
    # ceil: the window then spans at most max_points() bins (plus one partly filled)
    stride = float(int(stride) + (stride % 1 > 0))
    with transaction(conn) as cur:
        cur.execute(METRICS_SQL, {"minutes": minutes, "runner": runner, "stride": stride})
        rows = cur.fetchall()
    series: dict[str, list[dict]] = {}
    for name, ts, delivered, failed, lag, in_flight, waiting, p50, p99 in rows:
        points = series.setdefault(name, [])
        rate = None
        if points:
            prev = points[-1]
            dt = (ts - prev["_ts"]).total_seconds()
            if dt > 0:
                rate = max(delivered - prev["delivered"], 0) / dt
        points.append(
            {
                "_ts": ts,
                "ts": ts.isoformat(),
                "delivered": delivered,
                "failed": failed,
                "lag": lag,
                "in_flight": in_flight,
                "waiting": waiting,
                "throughput": rate,
                "p50_ms": p50,
                "p99_ms": p99,
            }
        )
    for points in series.values():
        for p in points:
            p.pop("_ts")
    return series


FAILURE_KEYS = (
    "runner",
    "queue_id",
    "offset",
    "message_id",
    "attempts",
    "http_status",
    "error",
    "at",
)
AUDIT_KEYS = (
    "id",
    "bus",
    "window_start",
    "window_end",
    "expected",
    "delivered",
    "failed",
    "missing",
    "pending",
    "duplicates",
    "runners",
    "created_at",
)
REPLAY_KEYS = (
    "id",
    "run",
    "what",
    "bus",
    "rule",
    "target",
    "dry_run",
    "status",
    "selected",
    "delivered",
    "failed",
    "error",
    "started_at",
    "finished_at",
)


def _latest(conn, sql: str, keys: tuple[str, ...], limit: int) -> list[dict]:
    with transaction(conn) as cur:
        cur.execute(sql, (limit,))
        rows = cur.fetchall()
    return [dict(zip(keys, map(_iso, row), strict=True)) for row in rows]


def latest_failures(conn, limit: int) -> list[dict]:
    return _latest(conn, FAILURES_SQL, FAILURE_KEYS, limit)


def latest_audits(conn, limit: int) -> list[dict]:
    return _latest(conn, AUDITS_SQL, AUDIT_KEYS, limit)


def latest_replays(conn, limit: int) -> list[dict]:
    return _latest(conn, REPLAYS_SQL, REPLAY_KEYS, limit)


def catalog_view(conn) -> dict:
    """Buses, rules and targets as the catalog shows them (no secret: ``secret_set`` only)."""
    from eventpush import catalog

    targets = []
    for t in catalog.list_targets(conn):
        doc = t.to_json()
        doc.pop("secret_fingerprint")  # the page needs only whether one is set
        targets.append(doc)
    return {
        "buses": [b.to_json() for b in catalog.list_buses(conn)],
        "rules": [r.to_json() for r in catalog.list_rules(conn)],
        "targets": targets,
    }
