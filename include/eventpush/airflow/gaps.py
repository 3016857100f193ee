"""The audit-to-replay loop, the Airflow 3 way: audit gaps as asset events, and their replay.

``eventpush_audit`` emits an event on the asset ``GAPS_URI`` whenever a report has missing
records (never otherwise), with the counts in the event's ``extra`` (``gap_extra``).
``eventpush_replay_gaps`` is scheduled on that asset and replays the gaps (``what=missing``,
the events' window and bus) when the operator has turned the loop on, or when the audit run
itself asked for it (its form's ``replay_missing``).

The switch is the Airflow Variable ``eventpush_replay_gaps`` (``true``/``false``, default off),
read when the gap DAG runs, not when it is parsed: it is an orchestration decision, so it lives
with Airflow (UI, ``airflow variables set``, the REST API, audited there) rather than in
eventpush's runtime controls, which steer workers. Pausing the gap DAG would be no switch:
asset events queue while a DAG is paused and would all fire when it is resumed.

Light on purpose: the DAG files import it at parse time.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

GAPS_URI = "eventpush://audit/gaps"
SWITCH = "eventpush_replay_gaps"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


def gap_extra(report: dict, replay_requested: bool) -> dict:
    """The asset event's extra for an audit report: window, bus, totals and the runners that
    miss records, with how many each: a list of id, name and count, not an object keyed by
    name (a deleted target's runner and a live one re-created with its names share one;
    ``runner_id`` is None for a report saved before ids were recorded)."""
    runners = [
        {
            "runner_id": r.get("runner_id"),
            "runner": r["runner"],
            "missing": int(r["missing"]) + int(r.get("absent") or 0),
        }
        for r in report["runners"]
        if r["missing"] or r.get("absent")
    ]
    return {
        "report_id": report["report_id"],
        "bus": report["bus"],
        "since": report["since"],
        "until": report["until"],
        # Absent records (delivered in the books, not at a readable destination) are gaps
        # too: a ``missing`` replay reads the destinations back and re-pushes them.
        "missing": int(report["missing"]) + int(report.get("absent") or 0),
        "runners": runners,
        "replay_requested": bool(replay_requested),
    }


def switch_on(value: object) -> bool:
    """The switch Variable's value as a boolean; anything unclear is refused, not guessed."""
    if isinstance(value, bool):
        return value
    text = "" if value is None else str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"Airflow Variable {SWITCH} must be true or false, got {value!r}")


def replay_form(extras: Iterable[dict], switch: bool) -> dict | None:
    """The replay form (``eventpush_replay``'s fields) for the gap events to replay: those
    asked for, or all when the switch is on. One window covers them all (a ``missing``
    replay re-pushes only real gaps, so a wider window costs reading, never extra pushes);
    the bus is theirs when they share one. None when nothing is to be replayed."""
    chosen = [e for e in extras if e.get("missing") and (switch or e.get("replay_requested"))]
    if not chosen:
        return None
    buses = {e.get("bus") for e in chosen}
    since = min(chosen, key=lambda e: _utc(e, "since"))["since"]
    until = max(chosen, key=lambda e: _utc(e, "until"))["until"]
    return {
        "what": "missing",
        "bus": buses.pop() if len(buses) == 1 else None,
        "since": since,
        "until": until,
    }


def _utc(extra: dict, key: str) -> datetime:
    """A gap event's ``since`` or ``until`` (naive is UTC, as in the forms). An asset event
    can also be made by hand (the UI's "Create Asset Event", the REST API) with any extra:
    one without a usable window is refused in one line (ValueError), not a KeyError."""
    value = extra.get(key)
    try:
        parsed = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"gap event of audit report {extra.get('report_id')!r}: {key} {value!r} is not "
            "an ISO 8601 time"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
