"""The Great Expectations suites: results recorded in event_check_result, failures raised."""

from __future__ import annotations

import pandas as pd
import pytest

from eventpush.quality import batch as quality


def rows(conn):
    with conn.cursor() as cur:
        cur.execute(
            "SELECT suite, run_label, success, failures FROM event_check_result ORDER BY id"
        )
        out = cur.fetchall()
    conn.rollback()
    return out


def audit_row(**kw):
    base = {
        "runner": "b/r/t",
        "expected": 10,
        "delivered": 8,
        "failed": 1,
        "missing": 0,
        "pending": 1,
        "duplicates": 0,
    }
    return {**base, **kw}


def test_audit_suite_passes_clean_and_fails_on_missing(db_url, conn):
    ok = quality.check_audit([audit_row()], "clean", db_url)
    assert ok.success and ok.id
    with pytest.raises(quality.CheckFailed, match="missing") as caught:
        quality.check_audit([audit_row(delivered=6, missing=2)], "dirty", db_url)
    assert caught.value.result.failures[0]["result"]["unexpected_count"] == 1
    # counts that do not add up are caught too
    bad = quality.check_audit([audit_row(expected=11)], "sum", db_url, raise_on_failure=False)
    assert not bad.success
    got = rows(conn)
    assert [(s, label, ok) for s, label, ok, _ in got] == [
        ("audit", "clean", True),
        ("audit", "dirty", False),
        ("audit", "sum", False),
    ]
    assert got[1][3][0]["expectation"] == "expect_column_values_to_be_between"


def test_audit_suite_fails_on_records_absent_from_their_destination(db_url):
    # delivered in the books (so the counts add up), not in the stream: a loss all the same
    with pytest.raises(quality.CheckFailed, match="absent"):
        quality.check_audit([audit_row(absent=3, expired=2)], "absent", db_url)


def test_audit_suite_tells_runners_of_one_name_apart_by_id(db_url):
    """A deleted target's runner and the live one re-created with its names share a name:
    each appears once by id, which passes; one id twice is still refused, and a report saved
    before ids were recorded is told apart by name."""
    ok = quality.check_audit([audit_row(runner_id=3), audit_row(runner_id=4)], "same name", db_url)
    assert ok.success
    twice = quality.check_audit(
        [audit_row(runner_id=3), audit_row(runner_id=3)], "twice", db_url, raise_on_failure=False
    )
    assert not twice.success
    assert twice.failures[0]["expectation"] == "expect_column_values_to_be_unique"
    before = [audit_row(), audit_row(runner="b/r/u")]
    assert quality.check_audit(before, "before ids", db_url).success
    assert not quality.check_audit(
        [audit_row(), audit_row()], "names twice", db_url, raise_on_failure=False
    ).success


def test_replay_suites(db_url, conn):
    selection = pd.DataFrame(
        {
            "runner_id": [1, 1, 2],
            "queue_id": [0, 0, 1],
            "offset": [5, 6, 5],
            "message_id": ["a", "b", "c"],
        }
    )
    assert quality.check_replay_selection(selection, [1, 2], 3, "sel", db_url).success
    with pytest.raises(quality.CheckFailed):  # over the max count, and a foreign runner
        quality.check_replay_selection(selection, [1], 2, "sel2", db_url)
    duplicate = pd.concat([selection, selection.head(1)])
    with pytest.raises(quality.CheckFailed, match="compound"):
        quality.check_replay_selection(duplicate, [1, 2], None, "dup", db_url)
    assert quality.check_replay_result(3, 2, 1, 0, "res", db_url).success
    with pytest.raises(quality.CheckFailed):
        quality.check_replay_result(3, 1, 1, 0, "res2", db_url)


def test_rebalance_suite(db_url):
    bound = {"count_spread": 1.0, "max_count_spread": 1.5}
    good = quality.check_rebalance(
        {1: 10, 2: 11}, [1, 2], [10, 11], 1.0, 2, 1.5, 2, "ok", db_url, **bound
    )
    assert good.success
    for assignment, workers, spread, count_spread, moves in [
        ({1: 10}, [10, 11], 1.0, 1.0, 1),  # a runner left out
        ({1: 10, 2: 99}, [10, 11], 1.0, 1.0, 1),  # a disabled or unknown worker
        ({1: 10, 2: None}, [10, 11], 1.0, 1.0, 1),  # unplaced
        ({1: 10, 2: 11}, [10, 11], 2.0, 1.0, 1),  # load spread out of bound
        ({1: 10, 2: 10}, [10, 11], 1.0, 2.0, 1),  # count spread out of bound
        ({1: 10, 2: 11}, [10, 11], 1.0, 1.0, 9),  # too many moves
    ]:
        with pytest.raises(quality.CheckFailed):
            quality.check_rebalance(
                assignment,
                [1, 2],
                workers,
                spread,
                moves,
                1.5,
                2,
                "x",
                db_url,
                count_spread=count_spread,
                max_count_spread=1.5,
            )
    empty = quality.check_rebalance({}, [], [10], 1.0, 0, 1.5, 0, "empty", db_url, **bound)
    assert empty.success
