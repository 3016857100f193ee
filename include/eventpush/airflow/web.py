"""The control plugin's dashboard page: HTML of charts and tables, its ``#live`` part
re-read every ``POLL_S`` from ``api/dashboard``. Its figures come from
``eventpush.airflow.queries``; the routes serving it are in ``eventpush.airflow.routes``."""

from __future__ import annotations

import html
import json
from datetime import UTC, datetime
from typing import Any

from eventpush.airflow.queries import (
    catalog_view,
    destination_view,
    latest_audits,
    latest_failures,
    latest_replays,
    metric_series,
    progress,
)
from eventpush.charts import line_chart

POLL_S = 5  # how often the dashboard re-reads its figures


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
// A refusal's words: ours are a string; FastAPI's own (a 422 of request validation) a list
// of {loc, msg}, which alert() would show as "[object Object]".
function refusal(detail) {
  if (Array.isArray(detail)) {
    return detail.map(d => {
      if (!d || typeof d.msg !== 'string') return JSON.stringify(d);
      const where = Array.isArray(d.loc) ? d.loc.filter(p => p !== 'body').join('.') : '';
      return where ? where + ': ' + d.msg : d.msg;
    }).join('\\n');
  }
  return detail && typeof detail === 'object' ? JSON.stringify(detail) : detail;
}
async function post(path, body) {
  const r = await fetch('api/' + path, {method: 'POST',
    headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});
  if (!r.ok) {
    let detail = null;
    try { detail = (await r.json()).detail; } catch (e) { /* not JSON: a proxy's page */ }
    alert(refusal(detail) || r.statusText || 'HTTP ' + r.status);
    return;
  }
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


def _limit(value: float | None) -> str:
    return "none" if value is None else f"{value:g}/s"


def render_destinations(destinations: list[dict]) -> str:
    """Per API destination: its rate limit (and what the workers enforce while a change is
    under way), invocations per second, seconds throttled, and each adaptive target's
    concurrency limit now (from the alive workers' heartbeats)."""
    rows = []
    for d in destinations:
        limit = _limit(d["rate_limit"])
        enforced = [e for e in d["enforced"] if e != d["rate_limit"]]
        if enforced:
            limit += " (workers: " + ", ".join(_limit(e) for e in enforced) + ")"
        throttled = "-" if d["throttled_s"] is None else f"{d['throttled_s']:.1f}"
        if d["waiting"]:
            throttled = f'<span class="bad">{html.escape(throttled)} (waiting)</span>'
        else:
            throttled = html.escape(throttled)
        rate = d["invocations_per_s"]
        rows.append(
            [
                d["destination"] or "(no destination)",
                limit,
                "-" if rate is None else f"{rate:.1f}",
                throttled,
                ", ".join(f"{a['runner']}: {a['concurrency']}" for a in d["auto"]) or "-",
            ]
        )
    if not rows:
        return '<h2>Destinations</h2><p class="muted">none</p>'
    return (
        '<h2>Destinations</h2><p class="muted">invocations/s and throttled seconds: summed '
        "over the alive workers' last heartbeats; concurrency: each adaptive target's limit "
        "now</p>"
        + _table(
            ["destination", "rate limit", "invocations/s", "throttled s", "auto concurrency"],
            rows,
            {3},
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
        # The id beside the name: a deleted target's runner and a live one re-created with its
        # names share the name ("-": a report saved before ids were recorded).
        rows = [
            [r.get("runner"), r.get("runner_id") or "-", *(r.get(k) or 0 for k in audit_keys)]
            for r in a["runners"] or []
        ]
        # The line says what the table shows, summed from its very rows: they cannot disagree.
        missing = sum(row[5] for row in rows)
        verdict = (
            f'<span class="bad">{missing} missing</span>'
            if missing
            else '<span class="ok">nothing missing</span>'
            if rows
            else '<span class="muted">no runner in its scope</span>'
        )
        audit_html = (
            f"<p>{html.escape(str(a['created_at'])[:19])} · bus {html.escape(a['bus'] or 'all')}"
            f" · {verdict}</p>" + _table(["runner", "id", *audit_keys], rows)
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
{render_destinations(destination_view(conn, status))}
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
