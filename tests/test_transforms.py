"""Target transforms: ORIGINAL, CONSTANT, JSONPATH and TEMPLATE (EventBridge input transformer)."""

from __future__ import annotations

import json

import pytest

from eventpush.rules.transforms import (
    MAX_INPUT_PATHS,
    InvalidTransformError,
    Transform,
    compile_transform,
)

EVENT = {
    "version": "0",
    "id": "7bf73129-1428-4cd3-a780-95db273d1602",
    "detail-type": "EC2 Instance State-change Notification",
    "source": "aws.ec2",
    "account": "123456789012",
    "time": "2015-11-11T21:29:54Z",
    "region": "us-east-1",
    "resources": ["arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"],
    "detail": {
        "instance-id": "i-0123456789",
        "state": "RUNNING",
        "count": 3,
        "ratio": 0.5,
        "ok": True,
        "none": None,
        "tags": ["a", "b"],
        "nested": {"k": "v"},
        "quote": 'say "hi"\\',
        "unicode": "héllo",
    },
}

PATHS = {
    "instance": "$.detail.instance-id",
    "state": "$.detail.state",
    "count": "$.detail.count",
    "ok": "$.detail.ok",
    "none": "$.detail.none",
    "tags": "$.detail.tags",
    "nested": "$.detail.nested",
    "quote": "$.detail.quote",
    "missing": "$.detail.nope",
    "type": "$.detail-type",
}


def template(text: str, paths: dict | None = None) -> Transform:
    return compile_transform(
        "TEMPLATE", {"InputPathsMap": PATHS if paths is None else paths, "InputTemplate": text}
    )


def test_original_is_the_event_as_json():
    body = compile_transform("ORIGINAL", None).apply(EVENT)
    assert json.loads(body) == EVENT
    assert "héllo".encode() in body  # UTF-8, not \u escapes


def test_constant_bodies():
    assert compile_transform("CONSTANT", "plain text").apply(EVENT) == b"plain text"
    assert compile_transform("CONSTANT", '{"a": 1}').apply(EVENT) == b'{"a": 1}'
    assert compile_transform("CONSTANT", {"a": [1, "x"]}).apply(EVENT) == b'{"a":[1,"x"]}'
    assert compile_transform("constant", 42).apply({}) == b"42"


@pytest.mark.parametrize(
    ("spec", "body"),
    [
        ("$.detail.state", b'"RUNNING"'),
        ("$.detail.count", b"3"),
        ("$.detail.tags", b'["a","b"]'),
        ("$.detail.tags[1]", b'"b"'),
        ("$.detail.tags[*]", b'["a","b"]'),
        ("$.detail.nested", b'{"k":"v"}'),
        ("$.detail-type", b'"EC2 Instance State-change Notification"'),
        ("$.detail.nope", b"null"),
        ({"path": "$.source"}, b'"aws.ec2"'),
    ],
)
def test_jsonpath_picks_one_value(spec, body):
    assert compile_transform("JSONPATH", spec).apply(EVENT) == body


def test_jsonpath_whole_event():
    assert json.loads(compile_transform("JSONPATH", "$").apply(EVENT)) == EVENT


def test_template_plain_text_inserts_raw_values():
    t = template("<instance> is in state <state>, count <count>, tags <tags>, <missing>.")
    assert t.apply(EVENT) == b'i-0123456789 is in state RUNNING, count 3, tags ["a","b"], .'


def test_template_documented_json_example():
    # the InputTemplate example from the EventBridge API reference
    t = template('{"myInstance": <instance>,"myStatus": "<instance> is in state \\"<state>\\""}')
    body = json.loads(t.apply(EVENT))
    assert body == {"myInstance": "i-0123456789", "myStatus": 'i-0123456789 is in state "RUNNING"'}


def test_template_json_quoting_rules():
    t = template(
        "{"
        '"a": <count>, "b": "<count>", "c": <ok>, "d": "<ok>", "e": <none>, "f": <tags>, '
        '"g": "<tags>", "h": <nested>, "i": <missing>, "j": "x<missing>y", "k": "<quote>", '
        '"l": <quote>, "m": "<type>"'
        "}"
    )
    body = json.loads(t.apply(EVENT))
    assert body == {
        "a": 3,
        "b": "3",
        "c": True,
        "d": "true",
        "e": None,
        "f": ["a", "b"],
        "g": '["a","b"]',
        "h": {"k": "v"},
        "i": None,
        "j": "xy",
        "k": 'say "hi"\\',
        "l": 'say "hi"\\',
        "m": "EC2 Instance State-change Notification",
    }


def test_template_json_array_and_escaped_quotes_outside_placeholders():
    t = template('[<state>, "a \\"<state>\\" b", "<<state>>"]')
    assert json.loads(t.apply(EVENT)) == ["RUNNING", 'a "RUNNING" b', "<RUNNING>"]


def test_template_reserved_variables():
    t = compile_transform(
        "TEMPLATE",
        {
            "InputTemplate": '{"rule": "<aws.events.rule-name>", "arn": "<aws.events.rule-arn>", '
            '"at": "<aws.events.event.ingestion-time>", "event": <aws.events.event>, '
            '"full": <aws.events.event.json>}'
        },
    )
    body = json.loads(t.apply(EVENT, "my-rule", rule_arn="arn:x"))
    assert body["rule"] == "my-rule"
    assert body["arn"] == "arn:x"
    assert body["at"] == EVENT["time"]
    assert body["full"] == EVENT
    assert body["event"] == {k: v for k, v in EVENT.items() if k != "detail"}
    stamped = json.loads(t.apply(EVENT, "r", ingestion_time="2024-01-01T00:00:00Z"))
    assert stamped["at"] == "2024-01-01T00:00:00Z"


def test_template_reserved_event_in_plain_text():
    t = compile_transform(
        "TEMPLATE", {"InputTemplate": "rule <aws.events.rule-name>: <aws.events.event.json>"}
    )
    body = t.apply({"source": "s"}, "r1")
    assert body == b'rule r1: {"source":"s"}'


def test_template_leaves_unknown_placeholders_alone():
    assert template("<b>bold</b> <state>").apply(EVENT) == b"<b>bold</b> RUNNING"


def test_template_spec_as_json_text_and_compile_once_apply_many():
    spec = json.dumps({"InputPathsMap": {"s": "$.source"}, "InputTemplate": '{"src": <s>}'})
    t = compile_transform("TEMPLATE", spec)
    for source in ["a", "b", "c"]:
        assert json.loads(t.apply({"source": source})) == {"src": source}


def test_max_input_paths():
    paths = {f"v{i}": f"$.detail.f{i}" for i in range(MAX_INPUT_PATHS)}
    compile_transform("TEMPLATE", {"InputPathsMap": paths, "InputTemplate": "<v0>"})
    paths["one-too-many"] = "$.x"
    with pytest.raises(InvalidTransformError, match="at most 100"):
        compile_transform("TEMPLATE", {"InputPathsMap": paths, "InputTemplate": "<v0>"})


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        ("SOMETHING", None, "unknown transform kind"),
        (None, None, "unknown transform kind"),
        ("ORIGINAL", "x", "no spec"),
        ("CONSTANT", None, "needs a spec"),
        ("CONSTANT", {"a": {1, 2}}, "serialisable"),
        ("JSONPATH", None, "non-empty string"),
        ("JSONPATH", "", "non-empty string"),
        ("JSONPATH", "detail.x", "must start with '$'"),
        ("JSONPATH", "$.detail[", "invalid"),
        ("JSONPATH", {"path": "$.a", "x": 1}, "'path'"),
        ("TEMPLATE", None, "object"),
        ("TEMPLATE", "{not json", "not valid JSON"),
        ("TEMPLATE", {"InputPathsMap": {"a": "$.a"}}, "InputTemplate"),
        ("TEMPLATE", {"InputTemplate": ""}, "InputTemplate"),
        ("TEMPLATE", {"InputTemplate": "x", "Extra": 1}, "unknown keys"),
        ("TEMPLATE", {"InputPathsMap": ["$.a"], "InputTemplate": "x"}, "InputPathsMap"),
        ("TEMPLATE", {"InputPathsMap": {"a": "$.["}, "InputTemplate": "<a>"}, "'a'"),
        ("TEMPLATE", {"InputPathsMap": {"a": 5}, "InputTemplate": "<a>"}, "'a'"),
        ("TEMPLATE", {"InputPathsMap": {"a b": "$.a"}, "InputTemplate": "x"}, "names use"),
        ("TEMPLATE", {"InputPathsMap": {"aws.events.x": "$.a"}, "InputTemplate": "x"}, "reserved"),
        ("TEMPLATE", {"InputPathsMap": {"a": "$.a"}, "InputTemplate": "{<a>: 1}"}, "object keys"),
        (
            "TEMPLATE",
            {"InputPathsMap": {"a": "$.a"}, "InputTemplate": '{"x": <a>'},
            "not valid JSON",
        ),
        ("TEMPLATE", {"InputTemplate": '{"x": "<aws.events.event>"}'}, "quoted string"),
        ("TEMPLATE", {"InputTemplate": "x" * 9000}, "at most"),
    ],
)
def test_invalid_specs_are_refused_with_one_line(kind, spec, words):
    with pytest.raises(InvalidTransformError) as info:
        compile_transform(kind, spec)
    assert isinstance(info.value, ValueError)
    assert words.lower() in str(info.value).lower()
    assert "\n" not in str(info.value)


def test_kind_names_are_case_insensitive_and_kept():
    t = compile_transform(" jsonpath ", "$.source")
    assert t.kind == "JSONPATH"
    assert t.apply(EVENT) == b'"aws.ec2"'
