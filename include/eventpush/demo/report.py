"""The demo's HTML report: what happened, as tables and inline-SVG charts."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape
from pathlib import Path

from eventpush.charts import bar_chart

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 980px; color: #1f2937; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #d1d5db; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.ok { color: #16a34a; } .bad { color: #dc2626; }
section { margin-bottom: 2.5em; }
"""

AUDIT_KEYS = ("expected", "delivered", "failed", "missing", "pending", "duplicates")


def _table(rows: list[dict], keys: tuple[str, ...]) -> str:
    head = "".join(f"<th>{escape(k)}</th>" for k in keys)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{escape(f'{r[k]:,}' if isinstance(r[k], int) else str(r[k] or '-'))}</td>"
            for k in keys
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(
    path: Path,
    runners: list[dict],
    first_audit: dict,
    second_audit: dict,
    timings: dict[str, float],
    receiver_stats: dict,
    published: int,
) -> Path:
    labels = [r["runner"] for r in runners]
    delivery_chart = bar_chart(
        "Deliveries per runner",
        labels,
        {
            "delivered (live and replayed)": [r["delivered"] for r in runners],
            "of which replayed": [r["replayed"] for r in runners],
            "failed": [r["failed"] for r in runners],
        },
    )
    audit_labels = [r["runner"] for r in first_audit["runners"]]
    audit_chart = bar_chart(
        "Audit: failed and missing, before and after the replay",
        audit_labels,
        {
            "failed, audit 1": [r["failed"] for r in first_audit["runners"]],
            "still failed, audit 2": [r["failed"] for r in second_audit["runners"]],
            "missing, audit 2": [r["missing"] for r in second_audit["runners"]],
        },
    )
    timing_chart = bar_chart(
        "Seconds per DAG run", list(timings), {"seconds": list(timings.values())}
    )
    clean = second_audit["missing"] == 0
    verdict = (
        '<p class="ok">Audit 2 is clean: every event reached every target it should have, '
        "or sits in the failure store for a target that refuses it for good.</p>"
        if clean
        else f'<p class="bad">Audit 2 still finds {second_audit["missing"]} missing.</p>'
    )
    html = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>eventpush demo report</title>
<style>{STYLE}</style></head><body>
<h1>eventpush demo</h1>
<p>{published:,} events published to bus <b>commerce</b>; pushed by the Airflow DAG
<code>eventpush_push</code>, audited and repaired by the Spark jobs behind
<code>eventpush_audit</code> and <code>eventpush_replay</code>, rebalanced by
<code>eventpush_rebalance</code>. Written {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC.</p>
<section><h2>Runners</h2>{delivery_chart}
<p>As <code>eventpush status</code> and the audit count them: <b>delivered</b> live and by
replay (<b>replayed</b> is the part by replay), <b>failed</b> what stands failed now,
<b>open</b> the failures a replay may still take.</p>
{_table(runners, ("runner", "worker", "delivered", "replayed", "failed", "open"))}</section>
<section><h2>Audits</h2>{verdict}{audit_chart}
<h3>Audit 1 (after the push)</h3>{_table(first_audit["runners"], ("runner", *AUDIT_KEYS))}
<h3>Audit 2 (after the replay)</h3>{_table(second_audit["runners"], ("runner", *AUDIT_KEYS))}
</section>
<section><h2>Runs</h2>{timing_chart}
<p>Requests seen by the demo receiver, per path:</p>
{
        _table(
            [{"path": k, "requests": v} for k, v in sorted(receiver_stats["count"].items())],
            ("path", "requests"),
        )
    }</section>
</body></html>"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path
