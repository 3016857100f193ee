"""The event-pattern engine: the conformance corpus (tests/conformance), AWS-documented
cases, the rule index."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import json5
import pytest

from eventpush.rules.patterns import (
    CompiledPattern,
    InvalidPatternError,
    RuleIndex,
    compile_pattern,
)

CONFORMANCE_DIR = Path(
    os.environ.get(
        "EVENTPUSH_CONFORMANCE_DIR",
        Path(__file__).resolve().parent / "conformance" / "event-patterns",
    )
)
# A missing folder must fail the run, not quietly parametrise over nothing.
CASES = sorted(CONFORMANCE_DIR.glob("*.json5")) if CONFORMANCE_DIR.is_dir() else [None]


def test_conformance_folder_is_there():
    assert CONFORMANCE_DIR.is_dir(), f"conformance folder missing: {CONFORMANCE_DIR}"
    assert len(list(CONFORMANCE_DIR.glob("*.json5"))) > 0


@pytest.mark.parametrize("case_file", CASES, ids=lambda p: p.stem if p else "missing")
def test_conformance(case_file):
    assert case_file is not None, f"conformance folder missing: {CONFORMANCE_DIR}"
    case = json5.loads(case_file.read_text())
    name = case_file.stem
    if name.endswith("_EXC"):
        with pytest.raises(InvalidPatternError):
            compile_pattern(case["EventPattern"])
        # the JSON text form must be refused too
        with pytest.raises(InvalidPatternError):
            compile_pattern(json.dumps(case["EventPattern"]))
        return
    compiled = compile_pattern(case["EventPattern"])
    expected = not name.endswith("_NEG")
    assert compiled.matches(case["Event"]) is expected
    # and the same answer from the JSON text form and from a pickled copy
    assert compile_pattern(json.dumps(case["EventPattern"])).matches(case["Event"]) is expected
    assert pickle.loads(pickle.dumps(compiled)).matches(case["Event"]) is expected


EC2_EVENT = {
    "version": "0",
    "id": "6a7e8feb-b491-4cf7-a9f1-bf3703467718",
    "detail-type": "EC2 Instance State-change Notification",
    "source": "aws.ec2",
    "account": "111122223333",
    "time": "2017-12-22T18:43:48Z",
    "region": "us-west-1",
    "resources": ["arn:aws:ec2:us-west-1:123456789012:instance/i-1234567890abcdef0"],
    "detail": {"instance-id": "i-1234567890abcdef0", "state": "terminated"},
}


def ev(detail: dict, **top) -> dict:
    return {"source": "test", "detail-type": "t", **top, "detail": detail}


# (pattern, event, expected) built from the EventBridge user guide, beyond the conformance corpus.
DOC_CASES = [
    # matching values and arrays
    (
        {
            "source": ["aws.ec2"],
            "detail-type": ["EC2 Instance State-change Notification"],
            "detail": {"state": ["terminated"]},
        },
        EC2_EVENT,
        True,
    ),
    ({"source": ["aws.ec2", "aws.fargate"]}, EC2_EVENT, True),
    ({"source": ["aws.s3"]}, EC2_EVENT, False),
    ({"detail": {"state": ["running"]}}, EC2_EVENT, False),
    ({"detail": {"missing": ["x"]}}, EC2_EVENT, False),
    (
        {"resources": ["x", "arn:aws:ec2:us-west-1:123456789012:instance/i-1234567890abcdef0"]},
        EC2_EVENT,
        True,
    ),
    # values keep their JSON type; numbers compare as numbers
    ({"detail": {"n": [5]}}, ev({"n": 5.0}), True),
    ({"detail": {"n": [5.0]}}, ev({"n": 5}), True),
    ({"detail": {"n": [3.0e2]}}, ev({"n": 300}), True),
    ({"detail": {"n": ["5"]}}, ev({"n": 5}), False),
    ({"detail": {"n": [5]}}, ev({"n": "5"}), False),
    ({"detail": {"b": [True]}}, ev({"b": 1}), False),
    ({"detail": {"b": [1]}}, ev({"b": True}), False),
    ({"detail": {"b": [True]}}, ev({"b": True}), True),
    ({"detail": {"z": [0]}}, ev({"z": False}), False),
    # null and empty strings
    ({"detail": {"v": [None]}}, ev({"v": None}), True),
    ({"detail": {"v": [None]}}, ev({}), False),
    ({"detail": {"v": [None]}}, ev({"v": ""}), False),
    ({"detail": {"v": [""]}}, ev({"v": ""}), True),
    ({"detail": {"v": [""]}}, ev({"v": None}), False),
    # prefix / suffix, with and without case
    ({"time": [{"prefix": "2017-12-22"}]}, EC2_EVENT, True),
    ({"detail": {"n": [{"prefix": "1"}]}}, ev({"n": 123}), False),
    ({"detail": {"f": [{"suffix": ".png"}]}}, ev({"f": "a.png"}), True),
    ({"detail": {"f": [{"suffix": ".png"}]}}, ev({"f": "a.PNG"}), False),
    ({"detail": {"f": [{"suffix": {"equals-ignore-case": ".png"}}]}}, ev({"f": "a.PnG"}), True),
    (
        {"detail": {"s": [{"prefix": {"equals-ignore-case": "EventB"}}]}},
        ev({"s": "eventbridge"}),
        True,
    ),
    ({"detail": {"s": [{"prefix": {"equals-ignore-case": "EventB"}}]}}, ev({"s": "event"}), False),
    # anything-but
    ({"detail": {"state": [{"anything-but": "initializing"}]}}, ev({"state": "running"}), True),
    ({"detail": {"x": [{"anything-but": 123}]}}, ev({"x": 123.0}), False),
    ({"detail": {"x": [{"anything-but": 123}]}}, ev({"x": "123"}), True),
    ({"detail": {"x": [{"anything-but": [100, 200]}]}}, ev({"x": 200}), False),
    ({"detail": {"x": [{"anything-but": [100, 200]}]}}, ev({"x": True}), True),
    ({"detail": {"x": [{"anything-but": "a"}]}}, ev({"x": ["a", "b"]}), True),
    ({"detail": {"x": [{"anything-but": "a"}]}}, ev({"x": ["a", "a"]}), False),
    ({"detail": {"x": [{"anything-but": "a"}]}}, ev({"x": []}), False),
    ({"Region": [{"anything-but": {"prefix": "us-"}}]}, {"Region": "eu-west-1"}, True),
    ({"Region": [{"anything-but": {"prefix": "us-"}}]}, {"Region": "us-east-1"}, False),
    ({"F": [{"anything-but": {"suffix": ".png"}}]}, {"F": "a.jpg"}, True),
    ({"F": [{"anything-but": {"suffix": [".png", ".jpg"]}}]}, {"F": "a.jpg"}, False),
    ({"s": [{"anything-but": {"equals-ignore-case": ["a", "B"]}}]}, {"s": "b"}, False),
    ({"s": [{"anything-but": {"equals-ignore-case": ["a", "B"]}}]}, {"s": "c"}, True),
    ({"FilePath": [{"anything-but": {"wildcard": "*/lib/*"}}]}, {"FilePath": "/usr/lib/x"}, False),
    ({"FilePath": [{"anything-but": {"wildcard": "*/lib/*"}}]}, {"FilePath": "/usr/bin/x"}, True),
    # numeric
    ({"detail": {"c": [{"numeric": [">", 0, "<=", 5]}]}}, ev({"c": 5}), True),
    ({"detail": {"c": [{"numeric": [">", 0, "<=", 5]}]}}, ev({"c": 0}), False),
    ({"detail": {"c": [{"numeric": [">=", 0, "<", 5]}]}}, ev({"c": 0}), True),
    ({"detail": {"c": [{"numeric": [">=", 0, "<", 5]}]}}, ev({"c": 5}), False),
    ({"detail": {"c": [{"numeric": ["=", 301.8]}]}}, ev({"c": 3.018e2}), True),
    ({"detail": {"c": [{"numeric": ["<", 10]}]}}, ev({"c": "3"}), False),
    ({"detail": {"c": [{"numeric": ["<", 10]}]}}, ev({"c": True}), False),
    ({"detail": {"c": [{"numeric": ["<", 10]}]}}, ev({"c": [20, 3]}), True),
    ({"detail": {"c": [{"numeric": [">", -1e9, "<", 1e9]}]}}, ev({"c": -5}), True),
    # exists
    ({"detail": {"state": [{"exists": True}]}}, ev({"state": None}), True),
    ({"detail": {"state": [{"exists": False}]}}, ev({"other": 1}), True),
    ({"detail": {"state": [{"exists": False}]}}, ev({"state": "x"}), False),
    ({"detail": {"state": [{"exists": False}]}}, {"source": "no detail"}, True),
    # exists only works on leaves
    ({"detail": {"state": [{"exists": True}]}}, ev({"state": {"name": "x"}}), False),
    ({"detail": {"state": [{"exists": False}]}}, ev({"state": {"name": "x"}}), True),
    ({"detail": {"tags": [{"exists": False}]}}, ev({"tags": []}), True),
    # cidr
    ({"ip": [{"cidr": "10.0.0.0/24"}]}, {"ip": "10.0.0.255"}, True),
    ({"ip": [{"cidr": "10.0.0.0/24"}]}, {"ip": "10.0.1.0"}, False),
    ({"ip": [{"cidr": "10.0.0.0/24"}]}, {"ip": "not an ip"}, False),
    ({"ip": [{"cidr": "10.0.0.0/24"}]}, {"ip": "::ffff:10.0.0.1"}, False),
    ({"ip": [{"cidr": "2001:db8::/32"}]}, {"ip": "2001:DB8:0:0:1::1"}, True),
    ({"ip": [{"cidr": "2001:db8::/32"}]}, {"ip": "2001:db9::1"}, False),
    ({"ip": [{"cidr": "0.0.0.0/0"}]}, {"ip": "192.168.1.1"}, True),
    # wildcard
    ({"k": [{"wildcard": "dir/*.png"}]}, {"k": "dir/a/b.png"}, True),
    ({"k": [{"wildcard": "dir/*.png"}]}, {"k": "dir/.png"}, True),
    ({"k": [{"wildcard": "dir/*.png"}]}, {"k": "xdir/a.png"}, False),
    ({"k": [{"wildcard": "*Title*"}]}, {"k": "A Title here"}, True),
    ({"k": [{"wildcard": "a\\*b"}]}, {"k": "a*b"}, True),
    ({"k": [{"wildcard": "a\\*b"}]}, {"k": "axxb"}, False),
    ({"k": [{"wildcard": "a\\\\*"}]}, {"k": "a\\anything"}, True),
    ({"k": [{"wildcard": "a*b*c"}]}, {"k": "abc"}, True),
    ({"k": [{"wildcard": "a*b*c"}]}, {"k": "acb"}, False),
    ({"k": [{"wildcard": "*"}]}, {"k": ""}, True),
    ({"k": [{"wildcard": "*"}]}, {"k": 5}, False),
    ({"k": [{"wildcard": "ab"}]}, {"k": "ab"}, True),
    # equals-ignore-case
    ({"k": [{"equals-ignore-case": "ALICE"}]}, {"k": "alice"}, True),
    ({"k": [{"equals-ignore-case": "ALICE"}]}, {"k": "alicia"}, False),
    # $or
    ({"$or": [{"a": [1]}, {"b": [2]}]}, {"b": 2}, True),
    ({"$or": [{"a": [1]}, {"b": [2]}]}, {"b": 3}, False),
    ({"source": ["s"], "$or": [{"a": [1]}, {"b": [2]}]}, {"source": "s", "a": 1}, True),
    ({"source": ["s"], "$or": [{"a": [1]}, {"b": [2]}]}, {"source": "x", "a": 1}, False),
    (
        {"detail": {"$or": [{"c": [{"numeric": [">", 0, "<=", 5]}]}, {"d": [{"exists": False}]}]}},
        ev({"c": 10}),
        True,
    ),
    (
        {"$or": [{"$or": [{"a": [1]}, {"b": [1]}]}, {"c": [1]}]},
        {"b": 1},
        True,
    ),
    # several matchers for one field are ORed
    ({"k": ["x", {"prefix": "ab"}, {"numeric": [">", 10]}]}, {"k": 11}, True),
    ({"k": ["x", {"prefix": "ab"}, {"numeric": [">", 10]}]}, {"k": "abc"}, True),
    ({"k": ["x", {"prefix": "ab"}, {"numeric": [">", 10]}]}, {"k": "b"}, False),
    # nested arrays and arrays of objects
    ({"a": {"b": [1]}}, {"a": [{"b": 0}, {"b": [[2], [1]]}]}, True),
    ({"a": {"b": [1]}}, {"a": [[{"b": 3}], {"b": 2}]}, False),
    ({"a": [1]}, {"a": [[[1]]]}, True),
    # dotted keys join both ways
    ({"a.b": ["x"]}, {"a": {"b": "x"}}, True),
    ({"a": {"b": ["x"]}}, {"a.b": "x"}, True),
    ({"a": {"b.c": ["x"]}}, {"a": {"b": {"c": "x"}}}, True),
    ({"a.b.c": ["x"]}, {"a.b": {"c": "x"}}, True),
    ({"a.b": ["x"]}, {"a": {"b": {"x": 1}}}, False),
    # keys and values are case-sensitive
    ({"Source": ["aws.ec2"]}, EC2_EVENT, False),
    ({"source": ["AWS.EC2"]}, EC2_EVENT, False),
    # events that are not objects never match
    ({"a": [1]}, [1], False),
]


@pytest.mark.parametrize(("pattern", "event", "expected"), DOC_CASES)
def test_documented_semantics(pattern, event, expected):
    assert compile_pattern(pattern).matches(event) is expected


INVALID = [
    # (pattern, expected path, a word of the reason)
    ("not json", "", "JSON"),
    ("[1]", "", "object"),
    ({}, "", "at least one field"),
    ({"detail": {}}, "detail", "at least one field"),
    ({"a": "x"}, "a", "array"),
    ({"a": 5}, "a", "array"),
    ({"a": None}, "a", "array"),
    ({"a": []}, "a", "empty"),
    ({"a": [[1]]}, "a[0]", "array"),
    ({"detail": {"x-limit": [{"numeric": [">", 10, "<", 5]}]}}, "detail.x-limit[0]", "less"),
    ({"a": [1, {"numeric": ["<", "5"]}]}, "a[1]", "number"),
    ({"a": [{"numeric": ["<", True]}]}, "a[0]", "number"),
    ({"a": [{"numeric": ["==", 5]}]}, "a[0]", "operator"),
    ({"a": [{"numeric": ["=", 5, "<", 9]}]}, "a[0]", "range"),
    ({"a": [{"numeric": [">", 5, "<"]}]}, "a[0]", "numeric"),
    ({"a": [{"numeric": []}]}, "a[0]", "numeric"),
    ({"a": [{"prefix": 5}]}, "a[0]", "string"),
    ({"a": [{"prefix": {"equals-ignore-case": 5}}]}, "a[0]", "string"),
    ({"a": [{"prefix": {"bogus": "x"}}]}, "a[0]", "equals-ignore-case"),
    ({"a": [{"prefix": "x", "suffix": "y"}]}, "a[0]", "one key"),
    ({"a": [{}]}, "a[0]", "one key"),
    ({"a": [{"exists": "true"}]}, "a[0]", "true or false"),
    ({"a": [{"Prefix": "x"}]}, "a[0]", "unknown operator"),
    ({"a": [{"contains": "x"}]}, "a[0]", "unknown operator"),
    ({"a": [{"anything-but": None}]}, "a[0]", "null"),
    ({"a": [{"anything-but": True}]}, "a[0]", "boolean"),
    ({"a": [{"anything-but": []}]}, "a[0]", "empty"),
    ({"a": [{"anything-but": ["x", 1]}]}, "a[0]", "only strings or only numbers"),
    ({"a": [{"anything-but": [{"prefix": "x"}]}]}, "a[0]", "object"),
    ({"a": [{"anything-but": {"numeric": [">", 1]}}]}, "a[0]", "numeric"),
    ({"a": [{"anything-but": {"prefix": "x", "suffix": "y"}}]}, "a[0]", "one key"),
    ({"a": [{"anything-but": {"suffix": ""}}]}, "a[0]", "empty"),
    ({"a": [{"anything-but": {"equals-ignore-case": 5}}]}, "a[0]", "string"),
    ({"a": [{"anything-but": {"wildcard": "a**"}}]}, "a[0]", "consecutive"),
    ({"a": [{"wildcard": "a**b"}]}, "a[0]", "consecutive"),
    ({"a": [{"wildcard": "a\\b"}]}, "a[0]", "escape"),
    ({"a": [{"wildcard": "ab\\"}]}, "a[0]", "escape"),
    ({"a": [{"wildcard": "*a*b*c*d*e*"}]}, "a[0]", "complex"),
    ({"a": [{"cidr": "10.0.0.0"}]}, "a[0]", "'/'"),
    ({"a": [{"cidr": "10.0.0.0/33"}]}, "a[0]", "network"),
    ({"a": [{"cidr": "300.0.0.0/8"}]}, "a[0]", "network"),
    ({"a": [{"cidr": "2001:db8::/129"}]}, "a[0]", "network"),
    ({"a": [{"equals-ignore-case": None}]}, "a[0]", "string"),
    ({"$or": [{"a": [1]}]}, "$or", "two"),
    ({"$or": {"a": [1]}}, "$or", "two"),
    ({"$or": [{"a": [1]}, [1]]}, "$or[1]", "object"),
    ({"detail": {"$or": [{"a": [1]}, {"b": [{"numeric": [1]}]}]}}, "detail.$or[1].b[0]", "numeric"),
    ('{"a": [NaN]}', "", "NaN"),
    ({"a": [float("inf")]}, "a[0]", "finite"),
]


@pytest.mark.parametrize(("pattern", "path", "reason_word"), INVALID)
def test_invalid_patterns_name_where_and_why(pattern, path, reason_word):
    with pytest.raises(InvalidPatternError) as info:
        compile_pattern(pattern)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.path == path
    assert reason_word.lower() in err.reason.lower()
    message = str(err)
    assert "\n" not in message
    if path:
        assert f"at {path}:" in message


def test_error_message_shape():
    with pytest.raises(InvalidPatternError) as info:
        compile_pattern({"detail": {"x-limit": [{"numeric": [">", 10, "<", 5]}]}})
    assert str(info.value) == (
        "invalid event pattern at detail.x-limit[0]: numeric: range bottom 10 must be less "
        "than top 5"
    )


def test_valid_edge_forms():
    # forms EventBridge accepts that a careless validator might refuse
    for pattern in [
        {"a": [{"prefix": ""}]},
        {"a": [{"suffix": ""}]},
        {"a": [{"equals-ignore-case": ""}]},
        {"a": [{"wildcard": ""}]},
        {"a": [{"wildcard": "*a*b*c*d*"}]},
        {"a": [{"wildcard": "\\*\\*"}]},
        {"a": [{"anything-but": {"wildcard": ""}}]},
        {"a": [{"anything-but": 0}]},
        {"a": [{"anything-but": ""}]},
        {"a": [{"anything-but": {"prefix": ["x", "y"]}}]},
        {"a": [{"numeric": ["=", 0]}]},
        {"a": [{"numeric": [">=", -1.5, "<=", 1e9]}]},
        {"a": [{"cidr": "10.1.2.3/8"}]},
        {"a": [{"exists": False}, "x"]},
        {"$or": [{"a": [1]}, {"b": [2]}, {"c": {"d": [3]}}]},
        {"a.b": [1], "a": {"c": [2]}},
    ]:
        assert isinstance(compile_pattern(pattern), CompiledPattern), pattern


def test_compile_accepts_json_text_bytes_and_compiled():
    text = '{"source": ["aws.ec2"]}'
    compiled = compile_pattern(text)
    assert compiled.matches(EC2_EVENT)
    assert compile_pattern(text.encode()).matches(EC2_EVENT)
    assert compile_pattern(compiled) is compiled
    assert compiled.pattern == {"source": ["aws.ec2"]}


def test_source_json_recompiles_and_pickles():
    pattern = {"detail": {"state": [{"anything-but": ["a", "b"]}], "n": [{"numeric": [">", 1]}]}}
    compiled = compile_pattern(pattern)
    assert json.loads(compiled.source_json) == pattern
    again = compile_pattern(compiled.source_json)
    assert again == compiled and hash(again) == hash(compiled)
    clone = pickle.loads(pickle.dumps(compiled))
    event = ev({"state": "c", "n": 2})
    assert clone.matches(event) and compiled.matches(event)
    err = pickle.loads(pickle.dumps(InvalidPatternError("a[0]", "why")))
    assert (err.path, err.reason) == ("a[0]", "why")


def test_matching_does_not_modify_the_event():
    event = ev({"x": [1, {"y": 2}], "a.b": 3})
    snapshot = json.dumps(event, sort_keys=True)
    compile_pattern({"detail": {"x": [1], "a": {"b": [3]}}}).matches(event)
    assert json.dumps(event, sort_keys=True) == snapshot


# --------------------------------------------------------------------------- RuleIndex


def _corpus_rules():
    rules = []
    for case_file in CASES:
        if case_file is None or case_file.stem.endswith("_EXC"):
            continue
        rules.append((case_file.stem, json5.loads(case_file.read_text())))
    return rules


def test_rule_index_agrees_with_evaluating_every_rule_on_the_corpus():
    rules = _corpus_rules()
    assert rules, "no conformance cases"
    index = RuleIndex((name, case["EventPattern"]) for name, case in rules)
    compiled = [(name, compile_pattern(case["EventPattern"])) for name, case in rules]
    assert len(index) == len(rules)
    for _, case in rules:
        event = case["Event"]
        expected = [name for name, c in compiled if c.matches(event)]
        assert index.matching(event) == expected


def test_rule_index_buckets_and_fallback():
    index = RuleIndex()
    index.add("ec2", {"source": ["aws.ec2"], "detail": {"state": ["terminated"]}})
    index.add("ec2-or-s3", {"source": ["aws.ec2", "aws.s3"]})
    index.add("by-type", {"detail-type": [{"prefix": "EC2"}]})
    index.add("numeric-key", {"detail": {"n": [5]}})
    index.add("no-exact", {"detail": {"state": [{"anything-but": "running"}]}})
    index.add("or-only", {"$or": [{"source": ["x"]}, {"region": ["us-west-1"]}]})
    assert index.matching(EC2_EVENT) == ["ec2", "ec2-or-s3", "by-type", "no-exact", "or-only"]
    assert index.matching({"source": "aws.s3", "detail": {"n": 5.0}}) == [
        "ec2-or-s3",
        "numeric-key",
    ]
    assert index.matching({"source": ["aws.ec2", "aws.s3"]}) == ["ec2-or-s3"]
    assert index.matching({"detail": {"n": True}}) == []
    assert index.matching("not an event") == []
    index.remove("ec2-or-s3")
    index.add("ec2", {"source": ["nothing"]})  # replacing keeps one entry
    assert "ec2-or-s3" not in index and len(index) == 5
    assert index.matching(EC2_EVENT) == ["by-type", "no-exact", "or-only"]
    for rule_id in ["ec2", "by-type", "numeric-key", "no-exact", "or-only"]:
        index.remove(rule_id)
    assert len(index) == 0 and index.matching(EC2_EVENT) == []


def test_rule_index_refuses_invalid_patterns():
    index = RuleIndex()
    with pytest.raises(InvalidPatternError):
        index.add("bad", {"a": []})
    assert len(index) == 0


def test_public_names_stay_at_eventpush_patterns():
    """Scripts import the engine as ``eventpush.patterns``; the move to ``rules/`` kept that."""
    import eventpush.patterns as public

    assert public.compile_pattern is compile_pattern
    assert public.RuleIndex is RuleIndex
    assert issubclass(public.InvalidPatternError, ValueError)
    assert public.compile_pattern({"source": ["a"]}).matches({"source": "a"})
