"""Great Expectations checks that guard the batch jobs, run from our own code.

One function per suite builds its expectations; ``run_suite`` runs any list of expectations on
a pandas DataFrame in an ephemeral GX context, stores the result in ``event_check_result``
(where the dashboard and the operator see it) and raises ``CheckFailed`` when it fails. To
add a suite, write ``<name>_expectations(...)`` and a ``check_<name>(...)`` that shapes its
data into a DataFrame and calls ``run_suite``.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass, field

from eventpush.db import connection, transaction

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

_lock = threading.Lock()
_context = None


class CheckFailed(RuntimeError):
    """A suite failed; ``result`` says which expectations and what they saw."""

    def __init__(self, result: CheckResult) -> None:
        self.result = result
        what = "; ".join(f["summary"] for f in result.failures) or "see statistics"
        super().__init__(f"check {result.suite} failed ({result.run_label}): {what}")


@dataclass
class CheckResult:
    suite: str
    run_label: str
    success: bool
    statistics: dict
    failures: list[dict] = field(default_factory=list)
    id: int | None = None


def _gx():
    """The process's ephemeral GX context (slow to create, so made once)."""
    global _context
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    with _lock:
        if _context is None:
            _context = gx.get_context(mode="ephemeral")
            _context.data_sources.add_pandas("eventpush")
    return gx, _context


def gx_context():
    """The process's GX context, made now when it is not yet: a process about to run suites
    may start it ahead (the demo's Airflow process, while the demo publishes)."""
    return _gx()[1]


def _summary(expectation_type: str, kwargs: dict, result: dict) -> str:
    column = kwargs.get("column") or kwargs.get("column_A") or kwargs.get("column_list") or ""
    seen = result.get("observed_value")
    if seen is None and result.get("unexpected_count") is not None:
        examples = result.get("partial_unexpected_list", [])[:5]
        seen = f"{result['unexpected_count']} unexpected, e.g. {examples}"
    return f"{expectation_type}({column}): {seen}"


def run_suite(
    suite: str,
    df,
    expectations: list,
    run_label: str,
    db_url: str | None = None,
    raise_on_failure: bool = True,
) -> CheckResult:
    """Validate ``df`` against ``expectations``; record the result; raise when it failed."""
    gx, ctx = _gx()
    unique = f"{suite}-{uuid.uuid4().hex[:12]}"
    with _lock:
        source = ctx.data_sources.get("eventpush")
        asset = source.add_dataframe_asset(name=unique)
        batch = asset.add_batch_definition_whole_dataframe("all")
        gx_suite = ctx.suites.add(gx.ExpectationSuite(name=unique))
        for expectation in expectations:
            gx_suite.add_expectation(expectation)
        definition = ctx.validation_definitions.add(
            gx.ValidationDefinition(name=unique, data=batch, suite=gx_suite)
        )
    try:
        outcome = definition.run(batch_parameters={"dataframe": df})
    finally:
        with _lock:  # keep the long-lived context from growing run after run
            ctx.validation_definitions.delete(unique)
            ctx.suites.delete(unique)
            source.delete_asset(unique)
    failures = []
    for r in outcome.results:
        if r.success:
            continue
        config = r.expectation_config
        kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
        result = {
            k: v
            for k, v in (r.result or {}).items()
            if k in ("observed_value", "unexpected_count", "partial_unexpected_list")
        }
        failures.append(
            {
                "expectation": config.type,
                "kwargs": kwargs,
                "result": result,
                "summary": _summary(config.type, kwargs, result),
            }
        )
    check = CheckResult(
        suite=suite,
        run_label=run_label,
        success=bool(outcome.success),
        statistics=dict(outcome.statistics),
        failures=failures,
    )
    check.id = record(check, db_url)
    if raise_on_failure and not check.success:
        raise CheckFailed(check)
    return check


def record(check: CheckResult, db_url: str | None = None) -> int:
    with connection(db_url) as conn, transaction(conn) as cur:
        cur.execute(
            "INSERT INTO event_check_result (suite, run_label, success, statistics, failures) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING id",
            (
                check.suite,
                check.run_label,
                check.success,
                json.dumps(check.statistics, default=str),
                json.dumps(check.failures, default=str),
            ),
        )
        return cur.fetchone()[0]


# --------------------------------------------------------------------------- audit


def audit_expectations() -> list:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    E = gx.expectations
    return [
        E.ExpectColumnValuesToBeUnique(column="runner_id"),
        E.ExpectColumnValuesToBeBetween(column="missing", min_value=0, max_value=0),
        E.ExpectColumnValuesToBeBetween(column="absent", min_value=0, max_value=0),
        E.ExpectColumnPairValuesToBeEqual(column_A="expected", column_B="accounted"),
    ]


def check_audit(runners, run_label: str, db_url: str | None = None, **kw) -> CheckResult:
    """No runner has a missing record nor one absent from its destination, and every expected
    record is accounted for once. ``runners``: RunnerAudit objects or dicts with the audit's
    keys (``absent`` 0 when the report did not verify sinks). Each runner once, by id: a
    deleted target's runner and a live one re-created with its names share a name (a report
    saved before ids were recorded is told apart by name)."""
    # Deferred: pandas is loaded only by the suites that hand it a frame.
    import pandas as pd

    rows = [r if isinstance(r, dict) else r.__dict__ for r in runners]
    columns = ["runner", "expected", "delivered", "failed", "missing", "pending", "duplicates"]
    df = pd.DataFrame(rows, columns=[*columns, "absent", "runner_id"])
    df["absent"] = df["absent"].fillna(0).astype("int64")
    df["runner_id"] = [
        f"id {rid:.0f}" if pd.notna(rid) else f"name {name}"
        for rid, name in zip(df["runner_id"], df["runner"], strict=True)
    ]
    df["accounted"] = df["delivered"] + df["failed"] + df["missing"] + df["pending"]
    return run_suite("audit", df, audit_expectations(), run_label, db_url, **kw)


# --------------------------------------------------------------------------- retention


def retention_expectations(ahead_days: int) -> list:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    E = gx.expectations
    return [
        E.ExpectColumnValuesToBeUnique(column="table"),
        E.ExpectColumnValuesToBeBetween(column="ahead", min_value=ahead_days),
        E.ExpectColumnValuesToBeBetween(column="behind", min_value=0, max_value=0),
    ]


def check_retention(layout: list[dict], run_label: str, db_url: str | None = None, **kw):
    """After maintenance: every partitioned table has its days made ``ahead`` and no
    partition left behind its retention. ``layout``: eventpush.partitions.layout's rows."""
    # Deferred: pandas is loaded only by the suites that hand it a frame.
    import pandas as pd

    from eventpush.config import partitions_ahead_days

    df = pd.DataFrame(layout, columns=["table", "ahead", "behind"])
    expectations = retention_expectations(partitions_ahead_days())
    return run_suite("retention", df, expectations, run_label, db_url, **kw)


# --------------------------------------------------------------------------- replay


def replay_selection_expectations(runner_ids: list[int], max_count: int | None) -> list:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    E = gx.expectations
    checks = [
        E.ExpectCompoundColumnsToBeUnique(column_list=["runner_id", "queue_id", "offset"]),
        E.ExpectColumnValuesToBeInSet(column="runner_id", value_set=sorted(runner_ids)),
        E.ExpectColumnValuesToNotBeNull(column="message_id"),
        E.ExpectColumnValuesToBeBetween(column="offset", min_value=0),
    ]
    if max_count is not None:
        checks.append(E.ExpectTableRowCountToBeBetween(min_value=0, max_value=max_count))
    return checks


def check_replay_selection(
    selection, runner_ids: list[int], max_count: int | None, run_label: str, db_url=None, **kw
) -> CheckResult:
    """Selected records are distinct, of the requested runners, and within the max count.
    ``selection``: a pandas DataFrame with runner_id, queue_id, offset, message_id."""
    return run_suite(
        "replay_selection",
        selection,
        replay_selection_expectations(runner_ids, max_count),
        run_label,
        db_url,
        **kw,
    )


def replay_result_expectations() -> list:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    E = gx.expectations
    return [
        E.ExpectColumnPairValuesToBeEqual(column_A="selected", column_B="accounted"),
        E.ExpectColumnValuesToBeBetween(column="delivered", min_value=0),
        E.ExpectColumnValuesToBeBetween(column="failed", min_value=0),
    ]


def check_replay_result(
    selected: int, delivered: int, failed: int, skipped: int, run_label: str, db_url=None, **kw
) -> CheckResult:
    """Every selected record ended delivered, failed again, or skipped (already delivered)."""
    # Deferred: pandas is loaded only by the suites that hand it a frame.
    import pandas as pd

    df = pd.DataFrame(
        [{"selected": selected, "delivered": delivered, "failed": failed, "skipped": skipped}]
    )
    df["accounted"] = df["delivered"] + df["failed"] + df["skipped"]
    return run_suite("replay_result", df, replay_result_expectations(), run_label, db_url, **kw)


# --------------------------------------------------------------------------- rebalance


def rebalance_expectations(
    runner_ids: list[int],
    worker_ids: list[int],
    max_spread: float,
    max_count_spread: float,
    max_moves: int,
) -> list:
    # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
    import great_expectations as gx

    E = gx.expectations
    return [
        E.ExpectTableRowCountToEqual(value=len(runner_ids)),
        E.ExpectColumnValuesToBeUnique(column="runner_id"),
        E.ExpectColumnValuesToBeInSet(column="runner_id", value_set=sorted(runner_ids)),
        E.ExpectColumnValuesToNotBeNull(column="worker_id"),
        E.ExpectColumnValuesToBeInSet(column="worker_id", value_set=sorted(worker_ids)),
        E.ExpectColumnMaxToBeBetween(column="spread", max_value=max_spread),
        E.ExpectColumnMaxToBeBetween(column="count_spread", max_value=max_count_spread),
        E.ExpectColumnMaxToBeBetween(column="moves", max_value=max_moves),
    ]


def check_rebalance(
    assignment: dict[int, int | None],
    runner_ids: list[int],
    worker_ids: list[int],
    spread: float,
    moves: int,
    max_spread: float,
    max_moves: int,
    run_label: str,
    db_url=None,
    *,
    count_spread: float,
    max_count_spread: float,
    **kw,
) -> CheckResult:
    """Every enabled runner exactly once, on an enabled worker; load spread, count spread
    (both relative to capacity) and moves in bound.
    ``assignment``: runner id -> worker id of the proposal."""
    # Deferred: pandas is loaded only by the suites that hand it a frame.
    import pandas as pd

    df = pd.DataFrame(
        {
            "runner_id": list(assignment),
            "worker_id": pd.array(list(assignment.values()), dtype="Int64"),
        }
    )
    df["spread"] = float(spread)
    df["count_spread"] = float(count_spread)
    df["moves"] = int(moves)
    if assignment:
        expectations = rebalance_expectations(
            runner_ids, worker_ids, max_spread, max_count_spread, max_moves
        )
    else:  # nothing to place: only "every runner exactly once" applies
        # Deferred: Great Expectations takes seconds to import: only a suite run loads it.
        import great_expectations as gx

        expectations = [gx.expectations.ExpectTableRowCountToEqual(value=len(runner_ids))]
    return run_suite(
        "rebalance",
        df,
        expectations,
        run_label,
        db_url,
        **kw,
    )
