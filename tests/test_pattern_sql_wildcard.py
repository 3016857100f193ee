"""Wildcards in Spark SQL (issue 16): the same answers as the Python engine, without a
backtracking regex, so a long run of one character against a many-star wildcard stays cheap."""

from __future__ import annotations

import itertools
import json

import pytest
from batch_support import spark  # noqa: F401

from eventpush.rules.patterns import MAX_WILDCARDS, compile_pattern
from eventpush.sparkjobs.pattern_sql import with_matching_runners

WILDCARDS = [
    "*",
    "a*",
    "*b",
    "a*b",
    "*a*",
    "a*b*c",
    "a*a*a*b",
    "ab*ba",
    "*.*",
    "x\\*y*",
    "a\\\\*",
    "é*ü",
    "*\n*",
    "ab",
]
STRINGS = [
    "",
    "a",
    "b",
    "ab",
    "aab",
    "aba",
    "abba",
    "abcabc",
    "aaab",
    "aaaab",
    "a.b",
    "x*yz",
    "xy",
    "a\\",
    "a\\b",
    "éxü",
    "line\nbreak",
    "c",
]


def _matching(spark, patterns, events):  # noqa: F811
    rows = [(i, 1, json.dumps(e)) for i, e in enumerate(events)]
    df = spark.createDataFrame(rows, "id INT, bus_id INT, body STRING")
    rules = [(k, 1, json.dumps(p)) for k, p in enumerate(patterns)]
    stats: dict = {}
    out = with_matching_runners(df, rules, stats=stats).select("id", "runner_ids").collect()
    assert stats["python"] == 0, stats  # wildcards run as SQL, not through the fallback
    return {(k, row["id"]) for row in out for k in row["runner_ids"]}


def test_wildcards_match_as_the_python_engine(spark):  # noqa: F811
    patterns = [{"k": [{"wildcard": w}]} for w in WILDCARDS]
    patterns += [{"k": [{"anything-but": {"wildcard": w}}]} for w in WILDCARDS]
    patterns.append({"k": [{"anything-but": {"wildcard": ["a*", "*c"]}}]})
    events = [{"k": s} for s in STRINGS] + [{"k": 5}, {"k": ["zz", "ab"]}]
    compiled = [compile_pattern(p) for p in patterns]
    expected = {
        (k, i)
        for (k, c), (i, e) in itertools.product(enumerate(compiled), enumerate(events))
        if c.matches(e)
    }
    assert len(expected) > 20  # the cases do match, not only refuse
    assert _matching(spark, patterns, events) == expected


@pytest.mark.timeout(300)  # backtracking would need hours here; the glob needs one pass
def test_many_star_wildcard_against_a_long_run(spark):  # noqa: F811
    text = "a*" * MAX_WILDCARDS + "b"
    run = "a" * 20_000
    patterns = [{"k": [{"wildcard": text}]}]
    events = [{"k": run}, {"k": run + "b"}, {"k": "a" * MAX_WILDCARDS + "b"}]
    assert _matching(spark, patterns, events) == {(0, 1), (0, 2)}
