"""Spark SQL evaluation of event patterns equals the Python engine: on every case of the
conformance corpus (tests/conformance), on the corpus's patterns crossed with all its events, and on
cases built to stress the parts SQL finds hard (dotted keys, arrays, types)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import json5
import pytest
from batch_support import spark  # noqa: F401

from eventpush.rules.patterns import InvalidPatternError, compile_pattern
from eventpush.sparkjobs.pattern_sql import compile_pattern_sql, with_matching_runners

CONFORMANCE_DIR = Path(
    os.environ.get(
        "EVENTPUSH_CONFORMANCE_DIR",
        Path(__file__).resolve().parent / "conformance" / "event-patterns",
    )
)


def corpus() -> list[tuple[str, dict, dict]]:
    assert CONFORMANCE_DIR.is_dir(), f"conformance folder missing: {CONFORMANCE_DIR}"
    cases = []
    for path in sorted(CONFORMANCE_DIR.glob("*.json5")):
        case = json5.loads(path.read_text())
        cases.append((path.stem, case["EventPattern"], case["Event"]))
    assert cases
    return cases


EXTRA = [
    ({"a.b": [1]}, {"a": {"b": 1}}),
    ({"a.b": [1]}, {"a.b": 1}),
    ({"a": {"b": [1]}}, {"a.b": 1}),
    ({"a": {"b": [1]}}, {"a": [{"b": 2}, {"b": [3, 1]}]}),
    ({"a": {"b": [1]}}, {"a": [[{"b": 1}]]}),  # nested arrays: the Python path
    ({"a": ["5"]}, {"a": 5}),
    ({"a": [5]}, {"a": 5.0}),
    ({"a": [True]}, {"a": 1}),
    ({"a": [None]}, {"a": None}),
    ({"a": [{"exists": True}]}, {"a": None}),
    ({"a": [{"exists": True}]}, {"a": []}),
    ({"a": [{"exists": False}]}, {"a": {"b": 1}}),
    ({"a": [{"anything-but": "x"}]}, {"a": ["x", "y"]}),
    ({"a": [{"anything-but": "x"}]}, {"a": True}),
    ({"a": [{"anything-but": [1, 2]}]}, {"a": 1.0}),
    ({"a": [{"anything-but": {"prefix": "in"}}]}, {"a": 3}),
    ({"a": [{"wildcard": "a*b.c*"}]}, {"a": "aXXb.cYY"}),
    ({"a": [{"wildcard": "a*b.c"}]}, {"a": "aXXbxc"}),
    ({"a": [{"wildcard": "x\\*y"}]}, {"a": "x*y"}),
    ({"a": [{"wildcard": "*\n*"}]}, {"a": "line\nbreak"}),
    ({"a": [{"numeric": [">", 0, "<=", 5]}]}, {"a": [9, 5]}),
    ({"a": [{"numeric": ["=", 3]}]}, {"a": "3"}),
    ({"a": [{"cidr": "10.0.0.0/8"}]}, {"a": "10.1.2.3"}),  # the Python path
    ({"a": [{"prefix": {"equals-ignore-case": "AB"}}]}, {"a": "abc"}),
    ({"a": [{"equals-ignore-case": "ÄB"}]}, {"a": "äb"}),
    ({"$or": [{"a": [1]}, {"b": [2]}], "c": [3]}, {"b": 2, "c": 3}),
    ({"a": [1]}, {"a": "text with , [ inside"}),
    ({"x": {"y": {"z": ["v"]}}}, {"x.y": {"z": "v"}}),
]


def evaluate(spark, patterns: list, events: list[dict], stats=None):  # noqa: F811
    """{(pattern index, event index)} the Spark evaluation says match."""
    rows = [(i, 1, json.dumps(e)) for i, e in enumerate(events)]
    df = spark.createDataFrame(rows, "id INT, bus_id INT, body STRING")
    rules = [(k, 1, json.dumps(p)) for k, p in enumerate(patterns)]
    out = with_matching_runners(df, rules, stats=stats).select("id", "runner_ids").collect()
    return {(k, row["id"]) for row in out for k in row["runner_ids"]}


def python_truth(patterns, events):
    compiled = [compile_pattern(p) for p in patterns]
    return {(k, i) for k, c in enumerate(compiled) for i, e in enumerate(events) if c.matches(e)}


def test_every_conformance_case_matches_the_python_engine(spark):  # noqa: F811
    valid = [(name, p, e) for name, p, e in corpus() if not name.endswith("_EXC")]
    patterns = [p for _, p, _ in valid]
    events = [e for _, _, e in valid]
    stats: dict = {}
    got = evaluate(spark, patterns, events, stats)
    # nearly all of the corpus runs as Spark SQL, not through the Python fallback
    assert stats["sql"] >= 0.9 * len(valid), stats
    # each case against its own event: the corpus's verdict
    for k, (name, _, _) in enumerate(valid):
        assert ((k, k) in got) is (not name.endswith("_NEG")), name
    # and every pattern against every event: the Python engine's verdict
    assert got == python_truth(patterns, events)


def test_invalid_corpus_patterns_are_refused():
    from pyspark.sql import functions as F

    for name, pattern, _ in corpus():
        if name.endswith("_EXC"):
            with pytest.raises(InvalidPatternError):
                compile_pattern_sql(pattern, F.col("_ev"))


def test_hard_cases_match_the_python_engine(spark):  # noqa: F811
    patterns = [p for p, _ in EXTRA]
    events = [e for _, e in EXTRA]
    assert evaluate(spark, patterns, events) == python_truth(patterns, events)


def test_rules_only_match_events_of_their_bus(spark):  # noqa: F811
    df = spark.createDataFrame(
        [(1, 1, '{"source": "s"}'), (2, 2, '{"source": "s"}')], "id INT, bus_id INT, body STRING"
    )
    rules = [(10, 1, '{"source": ["s"]}'), (20, 2, '{"source": [{"cidr": "10.0.0.0/8"}]}')]
    got = {r["id"]: r["runner_ids"] for r in with_matching_runners(df, rules).collect()}
    assert got == {1: [10], 2: []}
