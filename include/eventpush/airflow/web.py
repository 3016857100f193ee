"""The control plugin's web app: a JSON API and a dashboard, mounted in Airflow's API server.

Routes (under the plugin's ``/eventpush`` prefix):

| route | does | who |
| --- | --- | --- |
| ``GET api/status`` | workers and runners: progress, lag, controls, latest metrics | reader |
| ``GET api/metrics?runner=R&minutes=M`` | one runner's metric series | reader |
| ``GET openapi.json`` | this API's description | reader |
| ``GET api/failures?limit=N`` | latest open failures | reader |
| ``GET api/audits?limit=N`` | latest audit reports | reader |
| ``GET api/replays?limit=N`` | latest replays: what was asked, outcome and counts | reader |
| ``POST api/adjust`` ``{"scope", "name", "changes"}`` | validated runtime adjustment | editor |
| ``POST api/pause`` / ``api/resume`` ``{"scope", "name"}`` | pause or resume | editor |
| ``GET api/catalog`` | buses, rules and targets (URL redacted, no secret) | reader |
| ``POST api/rule/enable`` / ``api/rule/disable`` ``{"bus", "name"}`` | switch a rule | editor |
| ``GET dashboard`` | charts of lag and throughput, failures, the last audit, replays | reader |
| ``GET api/dashboard?minutes=M`` | the dashboard's live part as JSON (polled every 5 s) | reader |

Authentication is Airflow's own (``airflow.api_fastapi.core_api.security``): a JWT bearer
token or the UI's session cookie. Readers need read access to the ``eventpush_push`` DAG,
editors edit access to it; anyone else gets 401 (no credentials) or 403; the API's own
description too (FastAPI's public ``/docs`` and ``/redoc`` are off). Refused adjustments
answer 422 with the reason. Target URLs and secrets are never shown.

``minutes`` is at most ``EVENTPUSH_DASHBOARD_MAX_MINUTES`` (1440), and a series is averaged
down in SQL to at most ``EVENTPUSH_DASHBOARD_POINTS`` (240) points per runner, so neither the
database nor the page pays for a long range. Metric rows older than
``EVENTPUSH_METRIC_RETENTION_HOURS`` are pruned by the workers' heartbeats
(``eventpush.push.store.heartbeat``).
"""

from __future__ import annotations

import html
import json
import time
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from eventpush.airflow.connection import database_url
from eventpush.charts import line_chart
from eventpush.config import setting
from eventpush.db import connection, transaction
from eventpush.push.controls import ControlError, adjust, set_paused
from eventpush.status import read_status

DAG_ID = "eventpush_push"
POLL_S = 5  # how often the dashboard re-reads its figures
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


LATEST_METRIC_SQL = """
SELECT DISTINCT ON (m.runner_id) r.name, m.ts, m.p50_ms, m.p99_ms
FROM event_push_metric m JOIN event_target_runner r ON r.id = m.runner_id
ORDER BY m.runner_id, m.ts DESC
"""

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


# --------------------------------------------------------------------------- page

STYLE = """
body{font:14px system-ui,sans-serif;margin:16px 24px;color:#1d2733;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 8px}
.muted{color:#667}.grid2{display:flex;flex-wrap:wrap;gap:16px}
.card{border:1px solid #dde3ea;border-radius:8px;padding:10px 12px}
table{border-collapse:collapse;font-size:13px}
th,td{padding:4px 10px;border-bottom:1px solid #eef1f4;text-align:right}
th:first-child,td:first-child{text-align:left} th{background:#f6f8fa}
.chart text{font:11px system-ui,sans-serif;fill:#555}.chart .title{font-size:13px;fill:#1d2733}
.chart .grid{stroke:#eef1f4}.chart .empty{fill:#999}
.legend{font-size:12px;max-width:640px}.key{margin-right:12px;white-space:nowrap}
.key i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.bad{color:#b3261e;font-weight:600}.ok{color:#1e7b34}
button{font-size:12px;padding:2px 8px}
td.err{text-align:left;max-width:420px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
"""

SCRIPT = """
async function post(path, body) {
  const r = await fetch('api/' + path, {method: 'POST',
    headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});
  if (!r.ok) { alert((await r.json()).detail || r.statusText); return; }
  refresh();
}
function control(action, scope, name) { return post(action, {scope, name}); }
function ruleSwitch(verb, bus, name) { return post('rule/' + verb, {bus, name}); }
// Short polling: the live part is replaced in place, the page (and its scroll) stays.
async function refresh() {
  try {
    const r = await fetch('api/dashboard' + location.search,
                          {headers: {Accept: 'application/json'}});
    if (!r.ok) return;
    const page = await r.json();
    document.getElementById('live').innerHTML = page.html;
    document.getElementById('updated').textContent = page.generated_at;
  } catch (e) { /* offline for a moment: the next poll tries again */ }
}
setInterval(refresh, POLL_MS);
"""


def _table(headers: list[str], rows: list[list[Any]], raw: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{cell}</td>" if i in raw else f"<td>{html.escape(str(cell))}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _button(action: str, scope: str, name: str) -> str:
    args = html.escape(json.dumps([action, scope, name])[1:-1], quote=True)
    return f'<button onclick="control({args})">{action}</button>'


def _rule_button(verb: str, bus: str, name: str) -> str:
    args = html.escape(json.dumps([verb, bus, name])[1:-1], quote=True)
    return f'<button onclick="ruleSwitch({args})">{verb}</button>'


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


def render_catalog(view: dict) -> str:
    """The catalog section: rules with enable/disable, targets with their policy."""
    rules = [
        [
            f"{r['bus']}/{r['name']}",
            f'<span class="{"ok" if r["state"] == "ENABLED" else "bad"}">{r["state"]}</span>',
            r["version"],
            r["targets"],
            json.dumps(r["pattern"], separators=(",", ":")),
            _rule_button("disable" if r["state"] == "ENABLED" else "enable", r["bus"], r["name"]),
        ]
        for r in view["rules"]
    ]
    targets = [
        [
            t["runner"],
            t["url"],
            t["state"],
            t["version"],
            f"{t['max_attempts']} x, {t['timeout_ms']} ms, batch {t['batch_size']}, "
            f"{t['concurrency']} at once" + (", ordered" if t["ordered"] else ""),
            "yes" if t["secret_set"] else "no",
        ]
        for t in view["targets"]
    ]
    return (
        "<h2>Rules</h2>"
        + (
            _table(["rule", "state", "version", "targets", "pattern", ""], rules, {1, 5})
            if rules
            else '<p class="muted">none</p>'
        )
        + "<h2>Targets</h2>"
        + (
            _table(["target", "url", "state", "version", "policy", "signed"], targets)
            if targets
            else '<p class="muted">none</p>'
        )
    )


def render_dashboard(conn, minutes: int = 60) -> str:
    """The whole page; its ``#live`` part is re-read every ``POLL_S`` from ``api/dashboard``."""
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>eventpush</title><style>{STYLE}</style>
<script>const POLL_MS = {POLL_S * 1000};{SCRIPT}</script></head><body>
<h1>eventpush</h1><p class="muted">push progress, last {minutes} min · updated
<span id="updated">{now}</span> · live every {POLL_S} s</p>
<div id="live">{render_live(conn, minutes)}</div>
</body></html>"""


def render_live(conn, minutes: int = 60) -> str:
    """The dashboard's figures: charts and tables, as the page shows them."""
    status = progress(conn)
    series = metric_series(conn, None, minutes)
    failures = latest_failures(conn, 20)
    audits = latest_audits(conn, 1)
    replays = latest_replays(conn, 10)

    def points(key: str) -> dict[str, list[tuple[float, float]]]:
        return {
            name: [(datetime.fromisoformat(p["ts"]).timestamp(), p[key]) for p in pts]
            for name, pts in series.items()
        }

    charts = (
        line_chart("Lag per runner", points("lag"), "events", 430)
        + line_chart("Throughput per runner", points("throughput"), "delivered/s", 430)
        + line_chart("Failures per runner (total)", points("failed"), "records", 430)
    )
    worker_rows = [
        [
            w["worker"],
            "yes" if w["enabled"] else "no",
            '<span class="ok">alive</span>' if w["alive"] else '<span class="muted">idle</span>',
            w["runners"],
            "paused" if w["controls"].get("paused") else "running",
            _button("resume" if w["controls"].get("paused") else "pause", "worker", w["worker"]),
        ]
        for w in status["workers"]
    ]
    runner_rows = [
        [
            r["runner"],
            r["worker"] or "-",
            r["state"],
            r["lag"],
            r["in_flight"],
            r["waiting"],
            r["delivered"],
            r["replayed"],
            f'<span class="bad">{r["failed"]}</span>' if r["failed"] else "0",
            "-" if r["latest_metric"]["p99_ms"] is None else f"{r['latest_metric']['p99_ms']:.1f}",
            _button("resume" if r["state"] == "PAUSED" else "pause", "runner", r["runner"]),
        ]
        for r in status["runners"]
    ]
    failure_rows = [
        [
            f["runner"],
            f["queue_id"],
            f["offset"],
            f["attempts"],
            f["http_status"] or "-",
            f'<span title="{html.escape(f["error"])}">{html.escape(f["error"][:120])}</span>',
            f["at"][:19],
        ]
        for f in failures
    ]
    if audits:
        a = audits[0]
        audit_keys = ("expected", "delivered", "failed", "missing", "pending", "duplicates")
        rows = [[r.get("runner"), *(r.get(k) or 0 for k in audit_keys)] for r in a["runners"] or []]
        # The line says what the table shows, summed from its very rows: they cannot disagree.
        missing = sum(row[4] for row in rows)
        verdict = (
            f'<span class="bad">{missing} missing</span>'
            if missing
            else '<span class="ok">nothing missing</span>'
            if rows
            else '<span class="muted">no runner in its scope</span>'
        )
        audit_html = (
            f"<p>{html.escape(str(a['created_at'])[:19])} · bus {html.escape(a['bus'] or 'all')}"
            f" · {verdict}</p>" + _table(["runner", *audit_keys], rows)
        )
    else:
        audit_html = '<p class="muted">no audit yet</p>'
    replay_rows = [
        [
            r["id"],
            r["run"] or "-",
            r["what"] + (" (dry run)" if r["dry_run"] else ""),
            " ".join(f"{k} {r[k]}" for k in ("bus", "rule", "target") if r[k]) or "all",
            f'<span class="{"ok" if r["status"] == "succeeded" else "bad"}">'
            f"{html.escape(r['status'])}</span>",
            r["selected"],
            r["delivered"],
            f'<span class="bad">{r["failed"]}</span>' if r["failed"] else "0",
            r["started_at"][:19],
            f'<span title="{html.escape(r["error"] or "")}">'
            f"{html.escape((r['error'] or '')[:120])}</span>",
        ]
        for r in replays
    ]
    return f"""<div class="grid2" id="charts">{charts}</div>
<h2>Workers</h2>{
        _table(["worker", "enabled", "heartbeat", "runners", "state", ""], worker_rows, {2, 5})
    }
<h2>Runners</h2><p class="muted">delivered: live and by replay (of which replayed); failed:
records that stand failed now, as the audit counts them</p>{
        _table(
            [
                "runner",
                "worker",
                "state",
                "lag",
                "in flight",
                "waiting",
                "delivered",
                "replayed",
                "failed",
                "p99 ms",
                "",
            ],
            runner_rows,
            {8, 10},
        )
    }
<h2>Open failures</h2>{
        _table(["runner", "queue", "offset", "attempts", "http", "error", "at"], failure_rows, {5})
        if failure_rows
        else '<p class="muted">none</p>'
    }
{render_catalog(catalog_view(conn))}
<h2>Last audit</h2>{audit_html}
<h2>Replays</h2>{
        _table(
            [
                "replay",
                "run",
                "what",
                "scope",
                "status",
                "selected",
                "delivered",
                "failed",
                "started",
                "error",
            ],
            replay_rows,
            {4, 7, 9},
        )
        if replay_rows
        else '<p class="muted">none yet</p>'
    }"""


# --------------------------------------------------------------------------- app


class Target(BaseModel):
    scope: Literal["worker", "runner"]
    name: str = Field(min_length=1, max_length=200)


class RuleName(BaseModel):
    bus: str = Field(min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=64)


class Adjustment(Target):
    changes: dict[str, Any]


def create_app():
    """The FastAPI app the plugin mounts at ``/eventpush``."""
    # Deferred: Airflow's SDK is loaded only when an Airflow process calls this.
    from airflow.api_fastapi.core_api.security import requires_access_dag

    # Deferred: FastAPI is loaded only by the webserver that mounts the plugin's app.
    from fastapi import Depends, FastAPI, HTTPException, Query
    from fastapi.responses import HTMLResponse

    read = [Depends(requires_access_dag("GET", param_dag_id=DAG_ID))]
    write = [Depends(requires_access_dag("PUT", param_dag_id=DAG_ID))]
    # FastAPI serves its description and docs to anyone; they are turned off and the
    # description is served below behind the same check as every read.
    app = FastAPI(
        title="eventpush",
        description="Progress and runtime controls of the eventpush push workers.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    minutes_query = Query(60, ge=1, le=max_minutes())

    @app.get("/openapi.json", dependencies=read, include_in_schema=False)
    def get_openapi() -> dict:
        return app.openapi()

    @app.get("/api/status", dependencies=read)
    def get_status() -> dict:
        with _conn() as conn:
            return progress(conn)

    @app.get("/api/metrics", dependencies=read)
    def get_metrics(runner: str | None = None, minutes: int = minutes_query) -> dict:
        with _conn() as conn:
            return {"minutes": minutes, "runners": metric_series(conn, runner, minutes)}

    @app.get("/api/failures", dependencies=read)
    def get_failures(limit: int = Query(50, ge=1, le=1000)) -> dict:
        with _conn() as conn:
            return {"failures": latest_failures(conn, limit)}

    @app.get("/api/audits", dependencies=read)
    def get_audits(limit: int = Query(10, ge=1, le=500)) -> dict:
        with _conn() as conn:
            return {"audits": latest_audits(conn, limit)}

    @app.get("/api/replays", dependencies=read)
    def get_replays(limit: int = Query(10, ge=1, le=500)) -> dict:
        with _conn() as conn:
            return {"replays": latest_replays(conn, limit)}

    def _control(fn, *args) -> Any:
        try:
            with _conn() as conn:
                return fn(conn, *args)
        except ControlError as exc:
            code = 404 if str(exc).startswith("unknown ") else 422
            raise HTTPException(status_code=code, detail=str(exc)) from None

    @app.post("/api/adjust", dependencies=write)
    def post_adjust(body: Adjustment) -> dict:
        controls = _control(adjust, body.scope, body.name, body.changes)
        return {"scope": body.scope, "name": body.name, "controls": controls}

    @app.post("/api/pause", dependencies=write)
    def post_pause(body: Target) -> dict:
        _control(set_paused, body.scope, body.name, True)
        return {"scope": body.scope, "name": body.name, "paused": True}

    @app.post("/api/resume", dependencies=write)
    def post_resume(body: Target) -> dict:
        _control(set_paused, body.scope, body.name, False)
        return {"scope": body.scope, "name": body.name, "paused": False}

    @app.get("/api/catalog", dependencies=read)
    def get_catalog() -> dict:
        with _conn() as conn:
            return catalog_view(conn)

    def _switch(body: RuleName, enabled: bool) -> dict:
        # Deferred like the rest of the catalog: only the webserver serves this.
        from eventpush.catalog import CatalogError, NotFoundError, set_rule_enabled

        try:
            with _conn() as conn:
                return set_rule_enabled(conn, body.bus, body.name, enabled).to_json()
        except NotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        except CatalogError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None

    # The same write permission as pause and resume.
    @app.post("/api/rule/enable", dependencies=write)
    def post_rule_enable(body: RuleName) -> dict:
        return _switch(body, True)

    @app.post("/api/rule/disable", dependencies=write)
    def post_rule_disable(body: RuleName) -> dict:
        return _switch(body, False)

    @app.get("/api/dashboard", dependencies=read)
    def get_dashboard(minutes: int = minutes_query) -> dict:
        with _conn() as conn:
            html_ = render_live(conn, minutes)
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return {"minutes": minutes, "generated_at": now, "html": html_}

    @app.get("/dashboard", response_class=HTMLResponse, dependencies=read)
    def dashboard(minutes: int = minutes_query) -> str:
        with _conn() as conn:
            return render_dashboard(conn, minutes)

    return app
