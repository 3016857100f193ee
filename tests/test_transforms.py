"""Target transforms: ORIGINAL, CONSTANT, JSONPATH and TEMPLATE (EventBridge input transformer).

Every TEMPLATE test asserts the exact body bytes. Two sources of truth:

- AWS's user guide, "Amazon EventBridge input transformation" (eb-transform-target-input.md in
  awsdocs/amazon-eventbridge-user-guide, revision of 2023-02-01) and the InputTransformer API
  reference: the EC2 event, its Input Path and the template/output table ("guide" below).
- Bodies that EventBridge itself delivered to SQS for a template, path map and event, as
  recorded against AWS in LocalStack's validated snapshots
  (localstack/localstack tests/aws/services/events/test_events_inputs.snapshot.json,
  TestInputTransformer, recorded 2024-06-11 and 2024-12-13; "recorded" below).
"""

from __future__ import annotations

import json

import pytest

from eventpush.rules.transforms import (
    DEFAULT_ACCOUNT,
    DEFAULT_REGION,
    MAX_INPUT_PATHS,
    InvalidTransformError,
    Transform,
    UndeliverableBodyError,
    compile_transform,
    rule_arn_for,
)

# The guide's example Amazon EC2 event.
EC2_EVENT = {
    "version": "0",
    "id": "7bf73129-1428-4cd3-a780-95db273d1602",
    "detail-type": "EC2 Instance State-change Notification",
    "source": "aws.ec2",
    "account": "123456789012",
    "time": "2015-11-11T21:29:54Z",
    "region": "us-east-1",
    "resources": ["arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"],
    "detail": {"instance-id": "i-0123456789", "state": "RUNNING"},
}
# The guide's Input Path.
EC2_PATHS = {
    "timestamp": "$.time",
    "instance": "$.detail.instance-id",
    "state": "$.detail.state",
    "resource": "$.resources[0]",
}

# The event the recorded bodies came from (SPECIAL_EVENT_DETAIL), as publish stores it: no
# account or region of its own, so the bus's settings fill them in.
RECORDED_EVENT = {
    "source": "core.update-account-command",
    "detail-type": "core.update-account-command",
    "detail": {
        "command": "update-account",
        "payload": {"acc_id": "0a787ecb-4015", "sf_id": "baz"},
        "listsingle": ["HIGH"],
        "listmulti": ["ACTIVE", "INACTIVE"],
        "valid": True,
    },
    "id": "0d2a1b6e-5d0c-4b7e-9f57-0a1c2d3e4f50",
    "time": "2024-12-13T18:03:12Z",
    "resources": [],
    "version": "0",
}
RECORDED_PATHS = {
    "userId": "$.detail.payload.acc_id",
    "payload": "$.detail.payload",
    "systemstring": "$.detail.awsAccountId",  # matches nothing
    "listsingle": "$.detail.listsingle",
    "listmulti": "$.detail.listmulti",
    "valid": "$.detail.valid",
}


def template(text: str, paths: dict | None = None) -> Transform:
    spec = {"InputTemplate": text}
    if paths:
        spec["InputPathsMap"] = paths
    return compile_transform("TEMPLATE", spec)


def ec2(text: str, **context) -> bytes:
    return template(text, EC2_PATHS).apply(EC2_EVENT, **context)


def recorded(text: str) -> bytes:
    return template(text, RECORDED_PATHS).apply(RECORDED_EVENT, "r", bus="b")


# --------------------------------------------------------------------------- ORIGINAL etc.


def test_original_is_the_event_as_json():
    event = {**EC2_EVENT, "detail": {"unicode": "héllo"}}
    body = compile_transform("ORIGINAL", None).apply(event)
    assert body == json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
    assert "héllo".encode() in body  # UTF-8, not \u escapes


def test_constant_bodies():
    assert compile_transform("CONSTANT", "plain text").apply(EC2_EVENT) == b"plain text"
    assert compile_transform("CONSTANT", '{"a": 1}').apply(EC2_EVENT) == b'{"a": 1}'
    assert compile_transform("CONSTANT", {"a": [1, "x"]}).apply(EC2_EVENT) == b'{"a":[1,"x"]}'
    assert compile_transform("constant", 42).apply({}) == b"42"


@pytest.mark.parametrize(
    ("spec", "body"),
    [
        ("$.detail.state", b'"RUNNING"'),
        ("$.detail", b'{"instance-id":"i-0123456789","state":"RUNNING"}'),
        ("$.resources[0]", b'"arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"'),
        ("$.resources", b'["arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"]'),
        ("$.detail-type", b'"EC2 Instance State-change Notification"'),
        ("$.detail.nope", b"null"),
        ({"path": "$.source"}, b'"aws.ec2"'),
    ],
)
def test_jsonpath_picks_one_value(spec, body):
    assert compile_transform("JSONPATH", spec).apply(EC2_EVENT) == body


def test_jsonpath_several_matches_are_an_array():
    event = {"detail": {"tags": ["a", "b"]}}
    assert compile_transform("JSONPATH", "$.detail.tags[*]").apply(event) == b'["a","b"]'


# --------------------------------------------------------------------------- the user guide


@pytest.mark.parametrize(
    ("text", "body"),
    [
        # "Simple string"
        ('"instance <instance> is in <state>"', b'"instance i-0123456789 is in RUNNING"'),
        # "String with escaped quotes" (the console's behaviour, which the guide shows)
        (
            '"instance \\"<instance>\\" is in <state>"',
            b'"instance \\"i-0123456789\\" is in RUNNING"',
        ),
        # "Simple JSON"
        (
            '{\n  "instance" : <instance>,\n  "state": <state>\n}',
            b'{\n  "instance" : "i-0123456789",\n  "state": "RUNNING"\n}',
        ),
        # "JSON with strings and variables"
        (
            '{\n "instance" : <instance>,\n "state": "<state>",\n'
            ' "instanceStatus": "instance \\"<instance>\\" is in <state>"\n}',
            b'{\n "instance" : "i-0123456789",\n "state": "RUNNING",\n'
            b' "instanceStatus": "instance \\"i-0123456789\\" is in RUNNING"\n}',
        ),
        # "JSON with a mix of variables and static information" (the guide pretty-prints the
        # output; the bytes keep the template's own layout)
        (
            '{\n  "instance" : <instance>,\n  "state": [ 9, <state>, true ],\n'
            '  "Transformed" : "Yes"\n}',
            b'{\n  "instance" : "i-0123456789",\n  "state": [ 9, "RUNNING", true ],\n'
            b'  "Transformed" : "Yes"\n}',
        ),
        # the Input Path's array index
        (
            '{"resource": <resource>}',
            b'{"resource": "arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"}',
        ),
    ],
)
def test_user_guide_examples(text, body):
    assert ec2(text) == body


def test_user_guide_reserved_variables_in_json():
    """Guide, "Including reserved variables in JSON": rule "example" on the default bus of
    account 123456789012 in us-east-2 (the guide's ARN)."""
    text = (
        '{\n  "instance" : <instance>,\n  "state": <state>,\n'
        '  "ruleArn" : <aws.events.rule-arn>,\n  "ruleName" : <aws.events.rule-name>,\n'
        '  "originalEvent" : <aws.events.event.json>\n}'
    )
    body = ec2(text, rule_name="example", bus="default", account="123456789012", region="us-east-2")
    assert body == (
        b'{\n  "instance" : "i-0123456789",\n  "state": "RUNNING",\n'
        b'  "ruleArn" : "arn:aws:events:us-east-2:123456789012:rule/example",\n'
        b'  "ruleName" : "example",\n  "originalEvent" : '
        + json.dumps(EC2_EVENT, separators=(",", ":")).encode()
        + b"\n}"
    )


def test_user_guide_reserved_variable_in_a_string():
    """Guide, "Including reserved variables in a string"."""
    assert ec2('"<aws.events.rule-name> triggered"', rule_name="example") == b'"example triggered"'


def test_api_reference_example():
    """InputTransformer API reference: variables in quotes and out, with escaped quotes."""
    t = template(
        '{"myInstance": <instance>,"myStatus": "<instance> is in state \\"<status>\\""}',
        {"instance": "$.detail.instance-id", "status": "$.detail.state"},
    )
    assert t.apply(EC2_EVENT) == (
        b'{"myInstance": "i-0123456789","myStatus": "i-0123456789 is in state \\"RUNNING\\""}'
    )


# --------------------------------------------------------------------------- recorded bodies


@pytest.mark.parametrize(
    ("text", "body"),
    [
        # point 1: objects and arrays in text carry no quotes at all
        ('"<listsingle> single list item"', b'"[HIGH] single list item"'),
        ('"<listmulti> multiple list items"', b'"[ACTIVE,INACTIVE] multiple list items"'),
        (
            '"<listsingle> single list item <listmulti> multiple list items <systemstring> '
            'system account id <payload> payload <userId> user id"',
            b'"[HIGH] single list item [ACTIVE,INACTIVE] multiple list items  system account '
            b'id {acc_id:0a787ecb-4015,sf_id:baz} payload 0a787ecb-4015 user id"',
        ),
        (
            '"Payload of <payload> with path users-service/users/<userId> and <userId>"',
            b'"Payload of {acc_id:0a787ecb-4015,sf_id:baz} with path '
            b'users-service/users/0a787ecb-4015 and 0a787ecb-4015"',
        ),
        ('"Command is <valid>!"', b'"Command is true!"'),
        # outside quotes in a JSON template: the value as JSON
        ('{"singlelistitem": <listsingle>}', b'{"singlelistitem": ["HIGH"]}'),
        ('{"id" : <userId>}', b'{"id" : "0a787ecb-4015"}'),
        ('{"id" : "<userId>"}', b'{"id" : "0a787ecb-4015"}'),
        (
            '{"method": "PUT", "path": "users-service/users/<userId>", "bod": <payload>}',
            b'{"method": "PUT", "path": "users-service/users/0a787ecb-4015", '
            b'"bod": {"acc_id":"0a787ecb-4015","sf_id":"baz"}}',
        ),
        (
            '{"method": "PUT", "path": "users-service/users/<userId>", "bod": [<userId>, '
            '"hardcoded"]}',
            b'{"method": "PUT", "path": "users-service/users/0a787ecb-4015", '
            b'"bod": ["0a787ecb-4015", "hardcoded"]}',
        ),
        (
            '{"method": "PUT", "nested": {"level1": {"level2": {"level3": '
            '"users-service/users/<userId>"} } }, "bod": "<userId>"}',
            b'{"method": "PUT", "nested": {"level1": {"level2": {"level3": '
            b'"users-service/users/0a787ecb-4015"} } }, "bod": "0a787ecb-4015"}',
        ),
        (
            '{"multi_replacement": "users/<userId>/second/<userId>"}',
            b'{"multi_replacement": "users/0a787ecb-4015/second/0a787ecb-4015"}',
        ),
        # a string template that merely starts with JSON-looking characters
        (
            '"{[/Check with special starting characters for event of <userId> type"',
            b'"{[/Check with special starting characters for event of 0a787ecb-4015 type"',
        ),
    ],
)
def test_recorded_bodies(text, body):
    assert recorded(text) == body


def test_missing_path_is_an_empty_string_outside_quotes_and_nothing_inside():
    """Point 2. Recorded: test_put_events_with_input_transformer_input_template_json and
    _string, "custom-variables-not-match-all" (the command path matches nothing)."""
    paths = {"detail-type": "$.detail-type", "timestamp": "$.time", "command": "$.detail.nope"}
    json_t = template(
        '{"detailType": <detail-type>,  "time": <timestamp>, "command": <command>}', paths
    )
    assert json_t.apply(RECORDED_EVENT) == (
        b'{"detailType": "core.update-account-command",  "time": "2024-12-13T18:03:12Z", '
        b'"command": ""}'
    )
    text_t = template(
        '"Event of <detail-type> type, at time <timestamp>, info extracted from detail <command>"',
        paths,
    )
    assert text_t.apply(RECORDED_EVENT) == (
        b'"Event of core.update-account-command type, at time 2024-12-13T18:03:12Z, '
        b'info extracted from detail "'
    )
    assert template('{"a": "x<command>y"}', paths).apply(RECORDED_EVENT) == b'{"a": "xy"}'


def test_predefined_variables_in_a_string():
    """Recorded: test_input_transformer_predefined_variables, string template (rule on a
    custom bus: its name is part of the ARN)."""
    t = template(
        '"Message containing all pre defined variables <aws.events.rule-arn> '
        '<aws.events.rule-name> <aws.events.event.ingestion-time>"'
    )
    body = t.apply(
        RECORDED_EVENT, "rule-1", bus="bus-1", account="111111111111", region="eu-west-1"
    )
    assert body == (
        b'"Message containing all pre defined variables '
        b'arn:aws:events:eu-west-1:111111111111:rule/bus-1/rule-1 rule-1 2024-12-13T18:03:12Z"'
    )
    stamped = t.apply(RECORDED_EVENT, "rule-1", ingestion_time="2024-12-13T18:03:13Z")
    assert stamped.endswith(b' rule-1 2024-12-13T18:03:13Z"')


def test_aws_events_event_is_eventbridges_form_with_the_bus_account_and_region():
    """Point 3. Recorded: test_input_transformer_predefined_variables, JSON template:
    ``detailType``, no ``detail``, account and region present."""
    t = template(
        '{"originalEvent": <aws.events.event>, "originalEventJson": <aws.events.event.json>}'
    )
    body = t.apply(RECORDED_EVENT, "r", bus="b", account="111111111111", region="eu-west-1")
    assert body == (
        b'{"originalEvent": {"version":"0","id":"0d2a1b6e-5d0c-4b7e-9f57-0a1c2d3e4f50",'
        b'"detailType":"core.update-account-command","source":"core.update-account-command",'
        b'"account":"111111111111","time":"2024-12-13T18:03:12Z","region":"eu-west-1",'
        b'"resources":[]}, "originalEventJson": '
        + json.dumps(RECORDED_EVENT, separators=(",", ":")).encode()
        + b"}"
    )


def test_aws_events_event_defaults_and_the_events_own_account():
    t = template('{"e": <aws.events.event>}')
    assert t.apply({"id": "1", "source": "s", "detail-type": "d", "time": "t"}) == (
        b'{"e": {"version":"0","id":"1","detailType":"d","source":"s",'
        b'"account":"' + DEFAULT_ACCOUNT.encode() + b'","time":"t",'
        b'"region":"' + DEFAULT_REGION.encode() + b'","resources":[]}}'
    )
    # An event that carries its own account and region (forwarded from another account)
    # keeps them, as EventBridge keeps the source account across buses.
    assert t.apply(EC2_EVENT, account="111111111111", region="eu-west-1") == (
        b'{"e": {"version":"0","id":"7bf73129-1428-4cd3-a780-95db273d1602",'
        b'"detailType":"EC2 Instance State-change Notification","source":"aws.ec2",'
        b'"account":"123456789012","time":"2015-11-11T21:29:54Z","region":"us-east-1",'
        b'"resources":["arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"]}}'
    )


def test_rule_arn():
    assert rule_arn_for("r") == f"arn:aws:events:{DEFAULT_REGION}:{DEFAULT_ACCOUNT}:rule/r"
    assert (
        rule_arn_for("r", "default") == f"arn:aws:events:{DEFAULT_REGION}:{DEFAULT_ACCOUNT}:rule/r"
    )
    assert rule_arn_for("r", "orders", "111111111111", "eu-west-1") == (
        "arn:aws:events:eu-west-1:111111111111:rule/orders/r"
    )
    given = template('"<aws.events.rule-arn>"').apply({}, "r", rule_arn="arn:x")
    assert given == b'"arn:x"'


# --------------------------------------------------------------------------- undeliverable


@pytest.mark.parametrize(
    ("text", "name", "kind"),
    [
        # Recorded: test_input_transformer_nested_keys_replacement_not_valid, not delivered.
        ('{"payload": "<payload>"}', "payload", "an object"),
        ('{"singlelistitem": "<listsingle>"}', "listsingle", "an array"),
        (
            '{"not_valid": "users-service/users/<payload>", "bod": <payload>}',
            "payload",
            "an object",
        ),
    ],
)
def test_object_or_array_inside_quotes_is_undeliverable(text, name, kind):
    """Point 5: AWS does not deliver these; the record fails with this one line."""
    t = template(text, RECORDED_PATHS)  # the paths do not make it certain: accepted up front
    with pytest.raises(UndeliverableBodyError) as info:
        t.apply(RECORDED_EVENT)
    assert str(info.value) == (
        f"TEMPLATE <{name}> is {kind} inside a quoted string, so the filled body is not "
        "valid JSON; EventBridge does not deliver it"
    )


def test_string_values_are_not_escaped_inside_quotes():
    """Guide, common issues: "EventBridge doesn't escape values extracted by Input Path". A
    value that stays valid JSON goes as it is; one that breaks the JSON is undeliverable."""
    t = template('{"a": "<v>", "b": <v>}', {"v": "$.detail.v"})
    assert t.apply({"detail": {"v": "C:\\new"}}) == b'{"a": "C:\\new", "b": "C:\\\\new"}'
    assert (
        t.apply({"detail": {"v": "h\u00e9llo"}})
        == '{"a": "h\u00e9llo", "b": "h\u00e9llo"}'.encode()
    )
    with pytest.raises(UndeliverableBodyError) as info:
        t.apply({"detail": {"v": 'say "hi"'}})
    assert str(info.value) == (
        "TEMPLATE <v> put quotes, backslashes or control characters inside a quoted string "
        "(EventBridge does not escape them), so the filled body is not valid JSON "
        "(Expecting ',' delimiter at position 12); EventBridge does not deliver it"
    )
    with pytest.raises(UndeliverableBodyError):
        t.apply({"detail": {"v": "two\nlines"}})


def test_scalars_inside_quotes_are_their_json_text():
    t = template('{"n": "<n>", "f": "<f>", "b": "<b>", "z": "<z>"}', {k: f"$.{k}" for k in "nfbz"})
    assert t.apply({"n": 3, "f": 0.5, "b": False, "z": None}) == (
        b'{"n": "3", "f": "0.5", "b": "false", "z": "null"}'
    )


# --------------------------------------------------------------------------- refused up front


def test_undefined_placeholder_is_refused():
    """Point 4. Recorded: test_put_events_with_input_transformer_missing_keys, AWS answers
    "InputTemplate for target <id> contains invalid placeholder notdefinedkey."."""
    with pytest.raises(InvalidTransformError) as info:
        template('"Event of <userId> type, with not defined key <notdefinedkey>"', RECORDED_PATHS)
    assert str(info.value) == (
        "TEMPLATE InputTemplate contains invalid placeholder notdefinedkey: it is neither in "
        "InputPathsMap nor a reserved aws.events variable"
    )


@pytest.mark.parametrize(
    ("path", "kind"), [("$.detail", "an object"), ("$", "an object"), ("$.resources", "an array")]
)
def test_container_certain_inside_quotes_is_refused(path, kind):
    """Point 5, certain from the path map: every event's detail is an object, resources an array."""
    with pytest.raises(InvalidTransformError) as info:
        template('{"payload": "x <d>"}', {"d": path})
    assert str(info.value) == (
        f"TEMPLATE <d> sits inside a quoted string but its path {path} always selects {kind}: "
        "the filled body would not be valid JSON and EventBridge does not deliver it; put <d> "
        "outside quotes"
    )
    assert template('{"payload": <d>}', {"d": path})  # outside quotes it is fine


@pytest.mark.parametrize(
    "text",
    [
        '{"x": "<aws.events.event>"}',
        '{"x": "a <aws.events.event.json>"}',
        "rule <aws.events.rule-name>: <aws.events.event.json>",
        '"<aws.events.event>"',
    ],
)
def test_whole_event_variables_only_as_a_json_field_value(text):
    """Guide: they "can only be used as a value for a JSON field, as [their] contents are not
    escaped"."""
    with pytest.raises(InvalidTransformError, match="can only be the value of a JSON field"):
        template(text)


def test_spec_as_json_text_and_compile_once_apply_many():
    spec = json.dumps({"InputPathsMap": {"s": "$.source"}, "InputTemplate": '{"src": <s>}'})
    t = compile_transform("TEMPLATE", spec)
    assert [t.apply({"source": s}) for s in "abc"] == [
        b'{"src": "a"}',
        b'{"src": "b"}',
        b'{"src": "c"}',
    ]


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
        ("TEMPLATE", {"InputTemplate": "<b>bold</b>"}, "invalid placeholder b"),
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
    assert t.apply(EC2_EVENT) == b'"aws.ec2"'
