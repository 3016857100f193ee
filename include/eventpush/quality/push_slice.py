"""Great Expectations check of what one push slice wrote (the push DAG's guard).

The DAG takes a ``snapshot`` of a worker's runners before and after the slice; the check
compares them with the rows the slice wrote and the engine's report:

- offsets: no committed offset of the worker's runners moved backwards, none passed its
  queue's end;
- deliveries: every live delivery row written during the slice for one of the worker's runners
  (found by ``runner_id`` or by ``consumer_group``, so a row re-pointed elsewhere is still
  seen) belongs to a runner of this worker, names that runner, points at an event that exists
  with the same message id, and that event matches the runner's rule;
- failures: every failure row written or updated during the slice carries an error and a
  runner of this worker;
- counts: delivery rows == report's delivered, failure rows == report's failed, the runners'
  delivered/failed totals grew by the same amounts, and read >= delivered + failed + filtered.

GX 1.x runs from our own code with an ephemeral context over pandas dataframes; every result
is saved to ``event_check_result`` and a failure raises ``CheckFailed`` naming what broke.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from eventpush.db import Connection, connection, transaction
from eventpush.quality.batch import CheckFailed, CheckResult, record
from eventpush.rules.patterns import compile_pattern

__all__ = ["CheckFailed", "check_push_slice", "snapshot"]

SUITE = "eventpush_push_slice"
log = logging.getLogger(__name__)

RUNNERS_SQL = """
SELECT r.id, r.name, r.delivered_total, r.failed_total
FROM event_target_runner r JOIN event_push_worker w ON w.id = r.worker_id
WHERE w.name = %s ORDER BY r.id
"""

OFFSETS_SQL = """
SELECT o.runner_id, o.queue_id, o."offset", q.next_offset
FROM event_push_offset o
JOIN event_target_runner r ON r.id = o.runner_id
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus_queue q ON q.bus_id = ru.bus_id AND q.queue_id = o.queue_id
WHERE o.runner_id = ANY(%s)
"""


def snapshot(conn: Connection, worker: str) -> dict:
    """A JSON-able picture of ``worker``'s runners: offsets, totals, and where the delivery log
    ends, taken in one transaction (repeatable read)."""
    with transaction(conn) as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur.execute("SELECT now(), coalesce((SELECT max(id) FROM event_push_delivery), 0)")
        now, max_delivery_id = cur.fetchone()
        cur.execute(RUNNERS_SQL, (worker,))
        runners = {str(rid): [name, d, f] for rid, name, d, f in cur.fetchall()}
        cur.execute(OFFSETS_SQL, ([int(r) for r in runners],))
        offsets = [list(row) for row in cur.fetchall()]
    return {
        "worker": worker,
        "taken_at": now.isoformat(),
        "max_delivery_id": max_delivery_id,
        "runners": runners,
        "offsets": offsets,
    }


def _frames(conn: Connection, before: dict, after: dict, report: dict) -> dict[str, Any]:
    # Deferred: pandas is loaded only by the suites that hand it a frame.
    import pandas as pd

    runners = {int(k): v[0] for k, v in {**before["runners"], **after["runners"]}.items()}
    names = list(runners.values())
    ids = list(runners)
    with transaction(conn) as cur:
        cur.execute(
            'SELECT d.id, d.runner_id, d.consumer_group, d.topic_name, d.queue_id, d."offset", '
            "d.message_id, r.name, e.message_id, e.body::text, ru.pattern::text "
            "FROM event_push_delivery d "
            "LEFT JOIN event_target_runner r ON r.id = d.runner_id "
            "LEFT JOIN event_target t ON t.id = r.target_id "
            "LEFT JOIN event_rule ru ON ru.id = t.rule_id "
            "LEFT JOIN event_bus b ON b.name = d.topic_name "
            "LEFT JOIN bus_event e ON e.bus_id = b.id AND e.queue_id = d.queue_id "
            'AND e."offset" = d."offset" '
            "WHERE d.id > %s AND d.id <= %s AND d.origin = 'live' "
            "AND (d.runner_id = ANY(%s) OR d.consumer_group = ANY(%s)) ORDER BY d.id",
            (before["max_delivery_id"], after["max_delivery_id"], ids, names),
        )
        delivery_rows = cur.fetchall()
        cur.execute(
            "SELECT f.id, f.runner_id, f.consumer_group, f.last_error FROM event_push_failure f "
            "WHERE f.mtime > %s AND f.mtime <= %s AND f.replay_id IS NULL "
            "AND (f.runner_id = ANY(%s) OR f.consumer_group = ANY(%s))",
            (before["taken_at"], after["taken_at"], ids, names),
        )
        failure_rows = cur.fetchall()

    compiled: dict[str, Any] = {}
    deliveries = []
    for did, rid, group, _bus, queue, offset, mid, rname, emid, body, pattern in delivery_rows:
        matches = False
        if body is not None and pattern is not None:
            rule = compiled.get(pattern) or compiled.setdefault(
                pattern, compile_pattern(json.loads(pattern))
            )
            matches = bool(rule.matches(json.loads(body)))
        deliveries.append(
            {
                "delivery": f"id {did} ({group} q{queue}@{offset})",
                "runner_id": rid,
                "names_its_runner": rname is not None and rname == group,
                "event_found": emid is not None and emid == mid,
                "matches_rule": matches,
            }
        )
    failures = [
        {"failure": f"id {fid} ({group})", "runner_id": rid, "last_error": err or ""}
        for fid, rid, group, err in failure_rows
    ]
    old = {(r, q): off for r, q, off, _ in before["offsets"]}
    offsets = [
        {
            "position": f"{runners.get(r, r)} q{q}",
            "before": old[(r, q)],
            "after": off,
            "queue_end": end,
        }
        for r, q, off, end in after["offsets"]
        if (r, q) in old
    ]
    grew = {"delivered": 0, "failed": 0}
    for rid, (_, d, f) in after["runners"].items():
        if rid in before["runners"]:
            grew["delivered"] += d - before["runners"][rid][1]
            grew["failed"] += f - before["runners"][rid][2]
    counts = [
        {"count": "delivery rows vs report.delivered", "actual": len(deliveries)},
        {"count": "failure rows vs report.failed", "actual": len(failures)},
        {"count": "delivered_total growth vs report.delivered", "actual": grew["delivered"]},
        {"count": "failed_total growth vs report.failed", "actual": grew["failed"]},
    ]
    for row, key in zip(counts, ("delivered", "failed", "delivered", "failed"), strict=True):
        row["expected"] = int(report.get(key, 0))
    finished = sum(int(report.get(k, 0)) for k in ("delivered", "failed", "filtered"))
    coverage = [{"count": "read vs delivered+failed+filtered", "read": int(report.get("read", 0))}]
    coverage[0]["finished"] = finished

    def frame(rows: list[dict], columns: list[str]):
        return pd.DataFrame(rows, columns=columns)

    return {
        "ids": ids,
        "offsets": frame(offsets, ["position", "before", "after", "queue_end"]),
        "deliveries": frame(
            deliveries,
            ["delivery", "runner_id", "names_its_runner", "event_found", "matches_rule"],
        ),
        "failures": frame(failures, ["failure", "runner_id", "last_error"]),
        "counts": frame(counts, ["count", "actual", "expected"]),
        "coverage": frame(coverage, ["count", "read", "finished"]),
    }


def _suites(ids: list[int]) -> dict[str, list]:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    e = gx.expectations
    return {
        "offsets": [
            e.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="after", column_B="before", or_equal=True
            ),
            e.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="queue_end", column_B="after", or_equal=True
            ),
        ],
        "deliveries": [
            e.ExpectColumnValuesToBeInSet(column="runner_id", value_set=ids),
            e.ExpectColumnValuesToBeInSet(column="names_its_runner", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="event_found", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="matches_rule", value_set=[True]),
        ],
        "failures": [
            e.ExpectColumnValuesToBeInSet(column="runner_id", value_set=ids),
            e.ExpectColumnValueLengthsToBeBetween(column="last_error", min_value=1),
        ],
        "counts": [e.ExpectColumnPairValuesToBeEqual(column_A="actual", column_B="expected")],
        "coverage": [
            e.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="read", column_B="finished", or_equal=True
            )
        ],
    }


IDENTIFY_BY = {
    "offsets": "position",
    "deliveries": "delivery",
    "failures": "failure",
    "counts": "count",
    "coverage": "count",
}


def _describe(frame_name: str, frame, exp_result) -> dict:
    """One failed expectation in words, with the rows it names."""
    cfg = exp_result.expectation_config
    kwargs = {k: v for k, v in cfg.kwargs.items() if k not in ("batch_id",)}
    result = exp_result.result or {}
    idx = result.get("partial_unexpected_index_list") or []
    ident = IDENTIFY_BY.get(frame_name)
    examples: list = []
    if ident and idx and ident in frame.columns:
        examples = [str(frame.loc[i, ident]) for i in idx[:5] if i in frame.index]
    if not examples:
        examples = [str(v) for v in (result.get("partial_unexpected_list") or [])[:5]]
    column = kwargs.get("column") or f"{kwargs.get('column_A')} vs {kwargs.get('column_B')}"
    return {
        "frame": frame_name,
        "expectation": cfg.type,
        "column": column,
        "unexpected": int(result.get("unexpected_count") or 0),
        "rows": int(result.get("element_count") or len(frame)),
        "examples": examples,
        "exception": (exp_result.exception_info or {}).get("exception_message"),
    }


def _validate(frames: dict[str, Any]) -> tuple[dict, list[dict]]:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    context = gx.get_context(mode="ephemeral")
    source = context.data_sources.add_pandas("push_slice")
    stats = {"evaluated": 0, "successful": 0}
    failures: list[dict] = []
    for name, expectations in _suites(frames["ids"]).items():
        frame = frames[name]
        batch = (
            source.add_dataframe_asset(name=name)
            .add_batch_definition_whole_dataframe(name)
            .get_batch(batch_parameters={"dataframe": frame})
        )
        suite = context.suites.add(gx.ExpectationSuite(name=f"{SUITE}.{name}"))
        for exp in expectations:
            suite.add_expectation(exp)
        result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
        for exp_result in result.results:
            stats["evaluated"] += 1
            if exp_result.success:
                stats["successful"] += 1
            else:
                failures.append(_describe(name, frame, exp_result))
        stats[f"{name}_rows"] = len(frame)
    return stats, failures


def message(worker: str, failures: list[dict]) -> str:
    parts = []
    for f in failures:
        what = f"{f['frame']}: {f['expectation']} on {f['column']}"
        if f["exception"]:
            parts.append(f"{what} raised {f['exception']}")
        else:
            parts.append(
                f"{what}: {f['unexpected']} of {f['rows']} rows broke it, e.g. "
                + ", ".join(f["examples"])
            )
    return f"push check failed for worker {worker!r}: " + "; ".join(parts)


def check_push_slice(url: str, before: dict, after: dict, report: dict, run_label: str) -> dict:
    """Run the suite over one slice, save the result to ``event_check_result``, raise
    ``PushCheckFailed`` (a ``quality.CheckFailed``) naming what broke when it fails."""

    worker = before["worker"]
    with connection(url) as conn:
        frames = _frames(conn, before, after, report)
    stats, failures = _validate(frames)
    for f in failures:
        f["summary"] = message(worker, [f]).split(": ", 1)[1]
    result = CheckResult(SUITE, run_label, not failures, stats, failures)
    result.id = record(result, url)
    if failures:
        raise PushCheckFailed(result, message(worker, failures))
    log.info("push check passed for worker %r: %s", worker, stats)
    return {"success": True, "statistics": stats, "failures": [], "id": result.id}


class PushCheckFailed(CheckFailed):
    """The push-slice suite failed; the message names each broken expectation and its rows."""

    def __init__(self, result: CheckResult, text: str) -> None:
        super().__init__(result)
        self.args = (text,)
