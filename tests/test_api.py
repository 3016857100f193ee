"""The EventBridge-compatible API, through real boto3 (and the AWS CLI once) against the real
``eventpush api`` in a subprocess, with a real worker pushing to a loopback receiver.

One server and one database for the module (the server is the expensive part); tests use
buses of their own names so they do not see each other's.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import psycopg2
import pytest
from api_support import (
    EXE,
    ApiServer,
    error_code,
    make_key,
    send,
    signed_headers,
    signed_request,
    sockets_by_worker,
)
from auth_receiver_support import AuthReceiver
from botocore.exceptions import ClientError
from conftest import ADMIN_URL, RUN_ID, _admin, _drop, _server, run_cli

from eventpush import sources
from eventpush.api.protocol import LOG_BURST
from eventpush.demo.receiver import Receiver
from eventpush.rules.parse import MAX_JSON_DEPTH

ACCOUNT = "000000000000"


@pytest.fixture(scope="module")
def api_env(template_db):
    name = f"eventpush_test_{RUN_ID}_api_{uuid.uuid4().hex[:6]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    url = f"{_server(ADMIN_URL)}/{name}"
    env = {**os.environ, "EVENTPUSH_DATABASE_URL": url, "EVENTPUSH_API_CACHE_S": "0.2"}
    try:
        r = run_cli("db", "migrate", env=env)
        assert r.returncode == 0 and "bus default created" in r.stdout, r.stderr
        assert run_cli("worker", "create", "w1", env=env).returncode == 0
        yield env
    finally:
        _drop(name)


@pytest.fixture(scope="module")
def server(api_env):
    s = ApiServer(api_env)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def admin(api_env):
    return make_key(api_env, "admin", "admin")


@pytest.fixture(scope="module")
def events(server, admin):
    return server.client(admin)


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


def run_worker(env: dict) -> None:
    r = run_cli("worker", "run", "w1", "--until-idle", "--max-seconds", "60", env=env)
    assert r.returncode == 0, r.stderr


def code_of(exc_info) -> str:
    return exc_info.value.response["Error"]["Code"]


TRANSFORMER = {
    "InputPathsMap": {"order": "$.detail.order", "who": "$.detail.customer"},
    "InputTemplate": '{"text": "order <order> paid by <who>"}',
}
RETRY = {"MaximumRetryAttempts": 3, "MaximumEventAgeInSeconds": 600}


def test_rule_target_transformer_and_put_events_reach_the_receiver(api_env, events, receiver):
    bus = events.create_event_bus(Name="shop", Description="the shop's events")
    assert bus["EventBusArn"] == f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/shop"
    rule = events.put_rule(
        Name="paid",
        EventBusName="shop",
        EventPattern=json.dumps({"source": ["shop"], "detail": {"status": ["paid"]}}),
    )
    assert rule["RuleArn"] == f"arn:aws:events:us-east-1:{ACCOUNT}:rule/shop/paid"
    answer = events.put_targets(
        Rule="paid",
        EventBusName="shop",
        Targets=[
            {
                "Id": "crm",
                "Arn": receiver.url + "/ok/crm",
                "InputTransformer": TRANSFORMER,
                "RetryPolicy": RETRY,
            }
        ],
    )
    assert answer["FailedEntryCount"] == 0
    put = events.put_events(
        Entries=[
            {
                "Source": "shop",
                "DetailType": "order",
                "Detail": json.dumps({"status": "paid", "order": n, "customer": f"c{n}"}),
                "EventBusName": "shop",
            }
            for n in (1, 2)
        ]
        + [
            {
                "Source": "shop",
                "DetailType": "order",
                "Detail": json.dumps({"status": "open", "order": 3}),
                "EventBusName": f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/shop",
            }
        ]
    )
    assert put["FailedEntryCount"] == 0 and all("EventId" in e for e in put["Entries"])
    run_worker(api_env)
    bodies = sorted(json.loads(r.body)["text"] for r in receiver.state.delivered("/ok/crm"))
    assert bodies == ["order 1 paid by c1", "order 2 paid by c2"]
    targets = events.list_targets_by_rule(Rule="paid", EventBusName="shop")["Targets"]
    assert targets == [
        {
            "Id": "crm",
            "Arn": receiver.url + "/ok/crm",
            "InputTransformer": TRANSFORMER,
            "RetryPolicy": RETRY,
        }
    ]


def test_a_bus_arn_target_publishes_on_that_bus(api_env, events):
    events.create_event_bus(Name="origin")
    copies = events.create_event_bus(Name="copies")["EventBusArn"]
    events.put_rule(Name="all", EventBusName="origin", EventPattern='{"source": ["a"]}')
    events.put_targets(Rule="all", EventBusName="origin", Targets=[{"Id": "copy", "Arn": copies}])
    largest = {"Source": "a", "DetailType": "t", "EventBusName": "origin"}
    largest["Detail"] = _detail_of(256 * 1024 - 2, None)  # AWS's limit exactly
    answer = events.put_events(
        Entries=[{"Source": "a", "DetailType": "t", "Detail": "{}", "EventBusName": "origin"}] * 3
        + [largest]
    )
    assert answer["FailedEntryCount"] == 0, answer["Entries"][-1]
    run_worker(api_env)
    # The largest entry AWS takes is re-published on the other bus too (its stored form, with
    # the envelope, is larger than 256 KiB).
    assert events.describe_archive(ArchiveName="copies")["EventCount"] == 4
    [target] = events.list_targets_by_rule(Rule="all", EventBusName="origin")["Targets"]
    assert target["Arn"] == copies
    assert events.list_rule_names_by_target(TargetArn=copies, EventBusName="origin")[
        "RuleNames"
    ] == ["all"]


def test_put_events_on_a_nats_bus_answers_after_the_acknowledgements(api_env, events, nats_server):
    r = run_cli(
        "bus", "create", "onnats", "--queues", "1", "--source", nats_server.url, env=api_env
    )
    assert r.returncode == 0, r.stderr
    answer = events.put_events(
        Entries=[
            {
                "Source": "n",
                "DetailType": "t",
                "Detail": json.dumps({"n": n}),
                "EventBusName": "onnats",
            }
            for n in range(5)
        ]
    )
    assert answer["FailedEntryCount"] == 0
    conn = psycopg2.connect(api_env["EVENTPUSH_DATABASE_URL"])
    try:
        bus = sources.bus_named(conn, "onnats")
        stored = list(sources.kind_for(bus.source_url).read_range(conn, bus, 0, 0, 1000))
    finally:
        conn.close()
    assert sorted(json.loads(s.body)["detail"]["n"] for s in stored) == list(range(5))
    assert {s.message_id for s in stored} == {e["EventId"] for e in answer["Entries"]}
    # The stream's messages of the bus's queues (none was given for a broker's bus before).
    assert events.describe_archive(ArchiveName="onnats")["EventCount"] == 5
    # A message another producer put there that is not a JSON object is counted (what the
    # stream holds, counted without reading it: docs/OPERATIONS.md) though readers skip it.
    asyncio.run(_publish_raw(nats_server.url, "onnats.0", b"not json"))
    assert events.describe_archive(ArchiveName="onnats")["EventCount"] == 6
    conn = psycopg2.connect(api_env["EVENTPUSH_DATABASE_URL"])
    try:
        assert len(list(sources.kind_for(bus.source_url).read_range(conn, bus, 0, 0, 1000))) == 5
    finally:
        conn.close()


async def _publish_raw(url: str, subject: str, data: bytes) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(subject, data)
    finally:
        await nc.close()


def _long_pattern(length: int) -> str:
    """A valid event pattern exactly ``length`` characters long."""
    head = '{"source": ["'
    return head + "x" * (length - len(head) - 3) + '"]}'


def test_every_bus_rule_and_target_operation(events, receiver):
    made = events.create_event_bus(Name="ops")
    described = events.describe_event_bus(Name="ops")
    assert described["Name"] == "ops" and described["Arn"].endswith(":event-bus/ops")
    assert events.describe_event_bus()["Name"] == "default"
    listed = events.list_event_buses(NamePrefix="op")["EventBuses"]
    assert [b["Name"] for b in listed] == ["ops"]
    # As AWS: a description never given is left out, not answered as ""
    assert all("Description" not in shape for shape in (made, described, *listed))
    for n in range(3):
        events.put_rule(
            Name=f"r{n}", EventBusName="ops", EventPattern='{"source": ["x"]}', State="DISABLED"
        )
    seen, token = [], None
    while True:
        page = events.list_rules(
            EventBusName="ops", Limit=2, **({"NextToken": token} if token else {})
        )
        seen += [r["Name"] for r in page["Rules"]]
        token = page.get("NextToken")
        if not token:
            break
    assert seen == ["r0", "r1", "r2"]
    assert [r["Name"] for r in events.list_rules(EventBusName="ops", NamePrefix="r1")["Rules"]] == [
        "r1"
    ]
    assert events.describe_rule(Name="r0", EventBusName="ops")["State"] == "DISABLED"
    events.enable_rule(Name="r0", EventBusName="ops")
    assert events.describe_rule(Name="r0", EventBusName="ops")["State"] == "ENABLED"
    events.disable_rule(Name="r0", EventBusName="ops")
    assert events.describe_rule(Name="r0", EventBusName="ops")["State"] == "DISABLED"
    events.put_rule(
        Name="r0", EventBusName="ops", EventPattern='{"source": ["y"]}', Description="first"
    )
    rule = events.describe_rule(Name="r0", EventBusName="ops")
    assert json.loads(rule["EventPattern"]) == {"source": ["y"]} and rule["Description"] == "first"
    # As AWS, PutRule replaces the rule whole: what it omits is reset, not kept (the rule was
    # DISABLED and described), and without EventPattern there is nothing to replace it with.
    assert rule["State"] == "ENABLED"
    events.disable_rule(Name="r0", EventBusName="ops")
    events.put_rule(Name="r0", EventBusName="ops", EventPattern='{"source": ["y"]}')
    rule = events.describe_rule(Name="r0", EventBusName="ops")
    assert rule["State"] == "ENABLED" and "Description" not in rule
    events.disable_rule(Name="r0", EventBusName="ops")
    with pytest.raises(ClientError) as refused:
        events.put_rule(Name="r0", EventBusName="ops", State="ENABLED")
    assert code_of(refused) == "ValidationException"
    assert events.describe_rule(Name="r0", EventBusName="ops")["State"] == "DISABLED"
    # AWS's length limits, named in the message; nothing written.
    for member, value in (("Description", "d" * 513), ("EventPattern", _long_pattern(4097))):
        with pytest.raises(ClientError) as refused:
            events.put_rule(**{"Name": "r0", "EventBusName": "ops", **{member: value}})
        assert code_of(refused) == "ValidationException", member
        assert f"member '{member}' must be at most" in str(refused.value)
    events.put_rule(
        Name="r0", EventBusName="ops", EventPattern=_long_pattern(4096), Description="d" * 512
    )
    events.put_rule(Name="r0", EventBusName="ops", EventPattern='{"source": ["y"]}')
    url = receiver.url + "/ok/ops"
    answer = events.put_targets(
        Rule="r0",
        EventBusName="ops",
        Targets=[
            {"Id": "a", "Arn": url, "Input": '{"fixed": true}'},
            {"Id": "b", "Arn": url, "InputPath": "$.detail"},
            {"Id": "c", "Arn": "gopher://nowhere"},
        ],
    )
    assert answer["FailedEntryCount"] == 1
    assert answer["FailedEntries"][0]["TargetId"] == "c"
    shapes = events.list_targets_by_rule(Rule="r0", EventBusName="ops")["Targets"]
    assert [(t["Id"], t.get("Input"), t.get("InputPath")) for t in shapes] == [
        ("a", '{"fixed": true}', None),
        ("b", None, "$.detail"),
    ]
    assert events.list_rule_names_by_target(TargetArn=url, EventBusName="ops")["RuleNames"] == [
        "r0"
    ]
    with pytest.raises(ClientError) as refused:
        events.delete_rule(Name="r0", EventBusName="ops")
    assert code_of(refused) == "ValidationException"
    removed = events.remove_targets(Rule="r0", EventBusName="ops", Ids=["a", "b", "zz"])
    assert removed["FailedEntryCount"] == 1 and removed["FailedEntries"][0]["TargetId"] == "zz"
    for n in range(3):
        events.delete_rule(Name=f"r{n}", EventBusName="ops")
    assert events.list_rules(EventBusName="ops")["Rules"] == []
    events.delete_event_bus(Name="ops")
    with pytest.raises(events.exceptions.ResourceNotFoundException):
        events.describe_event_bus(Name="ops")


def test_archives_test_event_pattern_and_replays_without_airflow(events):
    events.create_event_bus(Name="kept")
    events.put_events(
        Entries=[{"Source": "k", "DetailType": "t", "Detail": "{}", "EventBusName": "kept"}]
    )
    archive = events.describe_archive(ArchiveName="kept")
    assert archive["EventCount"] == 1 and archive["State"] == "ENABLED"
    # The bus's retention (the configured default, 7 days) and its partitions' size on disk.
    assert archive["RetentionDays"] == 7 and archive["SizeBytes"] > 0
    assert archive["EventSourceArn"].endswith(":event-bus/kept")
    listed = events.list_archives(NamePrefix="kep")["Archives"]
    assert [a["ArchiveName"] for a in listed] == ["kept"]
    event = {
        "id": "1",
        "account": ACCOUNT,
        "source": "shop",
        "time": "2026-01-01T00:00:00Z",
        "region": "us-east-1",
        "detail-type": "t",
        "detail": {"n": 5},
    }
    pattern = json.dumps({"detail": {"n": [{"numeric": [">", 3]}]}})
    assert events.test_event_pattern(EventPattern=pattern, Event=json.dumps(event))["Result"]
    event["detail"]["n"] = 1
    assert not events.test_event_pattern(EventPattern=pattern, Event=json.dumps(event))["Result"]
    with pytest.raises(events.exceptions.InvalidEventPatternException):
        events.test_event_pattern(EventPattern='{"a": 1}', Event=json.dumps(event))
    with pytest.raises(events.exceptions.OperationDisabledException) as refused:
        events.start_replay(
            ReplayName="again",
            EventSourceArn=archive["ArchiveArn"],
            EventStartTime=0,
            EventEndTime=time.time(),
            Destination={"Arn": archive["EventSourceArn"]},
        )
    assert "--airflow-url" in str(refused.value)
    for call in (events.list_replays, lambda: events.describe_replay(ReplayName="again")):
        with pytest.raises(events.exceptions.OperationDisabledException):
            call()


def test_put_events_answers_each_entry(events):
    with pytest.raises(ClientError) as too_many:
        events.put_events(Entries=[{"Source": "s", "DetailType": "t", "Detail": "{}"}] * 11)
    assert code_of(too_many) == "ValidationException"
    answer = events.put_events(
        Entries=[
            {"Source": "s", "DetailType": "t", "Detail": "{}"},
            {"Source": "s", "DetailType": "t", "Detail": "{not json"},
            {"DetailType": "t", "Detail": "{}"},
            {"Source": "s", "DetailType": "t", "Detail": "{}", "EventBusName": "nope"},
            {"Source": "s", "DetailType": "t", "Detail": json.dumps({"x": "y" * 300_000})},
        ]
    )
    codes = [e.get("ErrorCode") for e in answer["Entries"]]
    assert codes == [
        None,
        "MalformedDetail",
        "InvalidArgument",
        "ResourceNotFoundException",
        "InvalidArgument",
    ]
    assert answer["FailedEntryCount"] == 4
    assert all("\n" not in e.get("ErrorMessage", "") for e in answer["Entries"])
    assert events.describe_archive(ArchiveName="default")["EventCount"] >= 1


def test_authentication_and_roles(server, api_env, admin, events):
    events.create_event_bus(Name="mine")
    producer = make_key(api_env, "producer", "producer", "mine")
    as_producer = server.client(producer)
    ok = as_producer.put_events(
        Entries=[{"Source": "p", "DetailType": "t", "Detail": "{}", "EventBusName": "mine"}]
    )
    assert ok["FailedEntryCount"] == 0
    assert as_producer.test_event_pattern(
        EventPattern='{"source": ["p"]}',
        Event=json.dumps(
            {
                "id": "1",
                "account": ACCOUNT,
                "source": "p",
                "time": "2026-01-01T00:00:00Z",
                "region": "us-east-1",
                "detail-type": "t",
                "detail": {},
            }
        ),
    )["Result"]
    before = events.describe_archive(ArchiveName="mine")["EventCount"]
    with pytest.raises(ClientError) as denied:
        as_producer.put_events(
            Entries=[
                {"Source": "p", "DetailType": "t", "Detail": "{}", "EventBusName": "mine"},
                {"Source": "p", "DetailType": "t", "Detail": "{}"},  # default: not its bus
            ]
        )
    assert code_of(denied) == "AccessDeniedException"
    assert events.describe_archive(ArchiveName="mine")["EventCount"] == before  # nothing stored
    for call in (as_producer.list_event_buses, lambda: as_producer.create_event_bus(Name="x")):
        with pytest.raises(ClientError) as denied:
            call()
        assert code_of(denied) == "AccessDeniedException"
    with pytest.raises(ClientError) as unknown:
        server.client(("EPAKAAAAAAAAAAAAAAAA", "x" * 40)).list_event_buses()
    assert code_of(unknown) == "UnrecognizedClientException"
    with pytest.raises(ClientError) as wrong:
        server.client((admin[0], "y" * 40)).list_event_buses()
    assert code_of(wrong) == "InvalidSignatureException"
    with pytest.raises(ClientError) as region:
        server.client(admin, region="eu-west-1").list_event_buses()
    assert code_of(region) == "InvalidSignatureException"
    body = b'{"Entries": [{"Source": "s", "DetailType": "t", "Detail": "{}"}]}'
    request = signed_request(server.url, "PutEvents", body, admin)
    assert send(request).status_code == 200
    changed = send(request, body.replace(b'"s"', b'"z"'))
    assert changed.status_code == 400 and error_code(changed) == "InvalidSignatureException"
    stale = send(signed_request(server.url, "ListEventBuses", b"{}", admin, when=time.time() - 400))
    assert error_code(stale) == "InvalidSignatureException" and "expired" in stale.json()["message"]
    unsigned = httpx.post(
        server.url + "/", content=b"{}", headers={"X-Amz-Target": "AWSEvents.ListEventBuses"}
    )
    assert (
        unsigned.status_code == 403
        and error_code(unsigned) == "MissingAuthenticationTokenException"
    )
    # Deleting a key refuses it (within the cache's 0.2 s here).
    assert run_cli("key", "delete", "producer", env=api_env).returncode == 0
    time.sleep(0.5)
    with pytest.raises(ClientError) as deleted:
        as_producer.put_events(
            Entries=[{"Source": "p", "DetailType": "t", "Detail": "{}", "EventBusName": "mine"}]
        )
    assert code_of(deleted) == "UnrecognizedClientException"
    listed = run_cli("key", "list", "--json", env=api_env)
    assert producer[1] not in listed.stdout and admin[1] not in listed.stdout
    assert [k["name"] for k in json.loads(listed.stdout)["keys"]] == ["admin"]


def test_bad_input_is_refused_with_aws_codes_and_nothing_written(server, admin, events):
    def raw(operation: str, body: bytes) -> httpx.Response:
        return send(signed_request(server.url, operation, body, admin))

    buses_before = events.list_event_buses()["EventBuses"]
    assert error_code(raw("CreateEventBus", b"{not json")) == "SerializationException"
    assert error_code(raw("CreateEventBus", b"[]")) == "SerializationException"
    missing = raw("CreateEventBus", b"{}")
    assert error_code(missing) == "ValidationException" and "'Name'" in missing.json()["message"]
    assert error_code(raw("CreateEventBus", b'{"Name": 5}')) == "ValidationException"
    with pytest.raises(ClientError) as bad_name:
        events.create_event_bus(Name="no spaces allowed")
    assert code_of(bad_name) == "ValidationException"
    with pytest.raises(events.exceptions.InvalidEventPatternException):
        events.put_rule(Name="bad", EventPattern='{"source": "not-a-list"}')
    with pytest.raises(events.exceptions.ResourceAlreadyExistsException):
        events.create_event_bus(Name="default")
    with pytest.raises(events.exceptions.ResourceNotFoundException):
        events.describe_rule(Name="none")
    with pytest.raises(ClientError) as other_account:
        events.describe_event_bus(Name="arn:aws:events:us-east-1:123456789012:event-bus/default")
    assert code_of(other_account) == "AccessDeniedException"
    with pytest.raises(ClientError) as unknown:
        events.list_partner_event_sources(NamePrefix="aws.partner")
    assert code_of(unknown) == "UnknownOperationException"
    big = raw("PutEvents", b"{" + b" " * (5 * 1024 * 1024) + b"}")
    assert big.status_code == 413
    assert events.list_event_buses()["EventBuses"] == buses_before
    assert events.list_rules()["Rules"] == []
    for r in (missing, big):
        assert "\n" not in r.json()["message"]


def test_a_body_that_is_not_utf8_is_a_serialization_error_not_a_traceback(server, admin):
    """A body that is not UTF-8 is SerializationException, in every operation, and the log
    has no traceback for it (msgspec raised UnicodeDecodeError: an InternalException)."""
    logged = server.log.seek(0, os.SEEK_END)
    for operation, body in (
        ("CreateEventBus", b'{"Name": "\xff"}'),
        ("PutEvents", b'{"Entries": [{"Source": "a\xe9", "DetailType": "t", "Detail": "{}"}]}'),
        ("ListEventBuses", b"\xfe\xff{}"),
    ):
        refused = send(signed_request(server.url, operation, body, admin))
        assert error_code(refused) == "SerializationException", (operation, refused.text)
    server.log.seek(logged)
    assert "Traceback" not in server.log.read()


def _raw_listing(server, admin, target: str, host: str, extra: str = "") -> tuple[bytes, dict]:
    """The status line and JSON answer of a ListEventBuses signed for ``/``, sent on a socket
    of its own to ``target`` (a path) with ``Host: host``, the signed headers, then ``extra``
    (header lines, each ending in CRLF)."""
    signed = signed_request(server.url, "ListEventBuses", b"{}", admin)
    head = "".join(f"{k}: {v}\r\n" for k, v in signed_headers(signed).items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            f"POST {target} HTTP/1.1\r\nHost: {host}\r\n{head}{extra}Content-Length: 2\r\n"
            "Connection: close\r\n\r\n{}".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    return status, json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_host_header_that_makes_no_url_is_a_signature_error_not_a_traceback(server, admin):
    """With a query string the signature is botocore's, which splits the URL made of the Host
    header: a Host such as '[' made urlsplit raise ValueError, an InternalException and a
    traceback in the log. It is InvalidSignatureException, in one line."""
    logged = server.log.seek(0, os.SEEK_END)
    for host in ("[", "]", "[::1"):
        status, got = _raw_listing(server, admin, "/?a=b", host)
        assert status.startswith(b"HTTP/1.1 400 "), (host, status, got)
        assert got["__type"] == "InvalidSignatureException", (host, got)
    server.log.seek(logged)
    assert "Traceback" not in server.log.read()


def test_a_repeated_header_is_signed_with_all_its_values(server, admin):
    """SigV4 signs a repeated header's values joined with commas: a second X-Amz-Target,
    X-Amz-Date or Authorization added to a signed request fails it (the server read only the
    first and ran the signed operation, the other unseen by it and seen by anything between
    that reads the last)."""
    for extra, code in (
        ("X-Amz-Target: AWSEvents.DeleteEventBus", "InvalidSignatureException"),
        ("X-Amz-Date: 20000101T000000Z", "IncompleteSignatureException"),
        ("Authorization: AWS4-HMAC-SHA256 x", "IncompleteSignatureException"),
        ("Host: 127.0.0.2", "InvalidSignatureException"),
        ("User-Agent: unsigned\r\nUser-Agent: so it may repeat", None),
    ):
        status, got = _raw_listing(server, admin, "/", f"127.0.0.1:{server.port}", f"{extra}\r\n")
        assert got.get("__type") == code, (extra, status, got)


def test_a_body_past_the_limit_without_a_length_is_refused_while_it_is_sent(server, api_env):
    """A chunked body (no Content-Length to refuse it by) gets its 413 once it passes the
    limit (4 MiB), while the client is still sending: the server does not wait for the
    64 MiB offered, and stores nothing."""

    def stored_events() -> int:
        with psycopg2.connect(api_env["EVENTPUSH_DATABASE_URL"]) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM bus_event")
            return cur.fetchone()[0]

    before = stored_events()
    chunk = b"x" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    offered, sent = 64 * 2**20, 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:

        def more() -> bytes:
            data = sock.recv(65536)
            assert data, "the server closed the connection without an answer"
            return data

        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/x-amz-json-1.1\r\n"
            b"X-Amz-Target: AWSEvents.PutEvents\r\n\r\n"
        )
        while sent < offered and not select.select([sock], [], [], 0)[0]:
            sock.sendall(framed)
            sent += len(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += more()
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
        while len(body) < length:
            body += more()
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]
    assert json.loads(body)["__type"] == "RequestEntityTooLargeException"
    assert sent < offered // 2, f"answered only after {sent:,} bytes of {offered:,}"
    assert stored_events() == before


def test_a_body_refused_by_its_length_is_not_read_on_for_ever(server):
    """A Content-Length past the limit is answered 413 at once; the server reads and drops
    what follows only up to MAX_DROPPED bytes, then closes the connection (it read on for as
    long as the client sent: 10 GB in 5 s)."""
    offered, sent = 2**30, 0
    chunk = b"x" * 2**20
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n"
            b"X-Amz-Target: AWSEvents.PutEvents\r\n\r\n" % offered
        )
        answer = b""
        while not answer.endswith(b'limit"}'):
            more = sock.recv(65536)
            assert more, f"closed without an answer: {answer!r}"
            answer += more
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        try:
            while sent < offered:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent < offered // 4, f"read and dropped {sent:,} bytes after the 413"


def test_warnings_about_bad_connections_are_bounded_and_carry_no_request_bytes(server):
    """Each connection with a malformed request was one warning line, so a scanner filled the
    log: LOG_BURST of them a minute are logged, a line says the rest are counted, and none
    holds a byte of the request (here a signature)."""
    logged = server.log.seek(0, os.SEEK_END)
    secret = "Signature=" + uuid.uuid4().hex
    for _ in range(50):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(f"NOT HTTP\r\nAuthorization: AWS4-HMAC-SHA256 {secret}\r\n\r\n".encode())
            assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")  # the worker's log is written
    server.log.seek(logged)
    since = server.log.read()
    server.log.seek(0)
    whole = server.log.read()
    assert 0 < since.count("Invalid HTTP request received.") <= LOG_BURST, since[-2000:]
    assert "warnings about clients in the next" in whole
    assert secret not in whole


def test_put_targets_leaves_nothing_written_by_a_refused_request(server, admin, events):
    """A PutTargets entry that is not a target (not a structure, no Id) refuses the request
    whole, so no target before it may be left written; an unknown API destination fails its
    own entry only, beside the targets that were put."""
    events.create_event_bus(Name="half")
    events.put_rule(Name="r", EventBusName="half", EventPattern='{"source": ["x"]}')
    good = {"Id": "good", "Arn": "http://127.0.0.1:9/x"}
    for bad in (1, {"Arn": "http://127.0.0.1:9/y"}):
        body = json.dumps({"Rule": "r", "EventBusName": "half", "Targets": [good, bad]})
        refused = send(signed_request(server.url, "PutTargets", body.encode(), admin))
        assert error_code(refused) == "ValidationException", refused.json()
        assert events.list_targets_by_rule(Rule="r", EventBusName="half")["Targets"] == []
    nowhere = f"arn:aws:events:us-east-1:{ACCOUNT}:api-destination/nowhere"
    answer = events.put_targets(
        Rule="r", EventBusName="half", Targets=[good, {"Id": "api", "Arn": nowhere}]
    )
    assert answer["FailedEntryCount"] == 1
    [failed] = answer["FailedEntries"]
    assert (failed["TargetId"], failed["ErrorCode"]) == ("api", "ResourceNotFoundException")
    listed = events.list_targets_by_rule(Rule="r", EventBusName="half")["Targets"]
    assert [t["Id"] for t in listed] == ["good"]


def test_retry_policy_takes_aws_bounds_and_refuses_past_them(server, admin, events):
    """AWS documents MaximumRetryAttempts 0-185 and MaximumEventAgeInSeconds 60-86400: 185
    retries (186 attempts here) are kept and answered back; a target past a bound fails as
    its own entry (ValidationException naming the member), and is not written."""
    events.create_event_bus(Name="tries")
    events.put_rule(Name="r", EventBusName="tries", EventPattern='{"source": ["x"]}')
    most = {"MaximumRetryAttempts": 185, "MaximumEventAgeInSeconds": 86_400}
    target = {"Id": "t", "Arn": "http://127.0.0.1:9/x", "RetryPolicy": most}
    answer = events.put_targets(Rule="r", EventBusName="tries", Targets=[target])
    assert answer["FailedEntryCount"] == 0
    [listed] = events.list_targets_by_rule(Rule="r", EventBusName="tries")["Targets"]
    assert listed["RetryPolicy"] == most
    for member, value in (
        ("MaximumRetryAttempts", 186),
        ("MaximumEventAgeInSeconds", 59),  # botocore itself refuses it: sent signed by hand
        ("MaximumEventAgeInSeconds", 86_401),
    ):
        other = {"Id": "u", "Arn": "http://127.0.0.1:9/y", "RetryPolicy": {member: value}}
        body = json.dumps({"Rule": "r", "EventBusName": "tries", "Targets": [other]})
        answer = send(signed_request(server.url, "PutTargets", body.encode(), admin)).json()
        assert answer["FailedEntryCount"] == 1, answer
        [failed] = answer["FailedEntries"]
        assert (failed["TargetId"], failed["ErrorCode"]) == ("u", "ValidationException")
        assert f"RetryPolicy.{member}" in failed["ErrorMessage"]
        listed = events.list_targets_by_rule(Rule="r", EventBusName="tries")["Targets"]
        assert [t["Id"] for t in listed] == ["t"]


def test_remove_targets_with_an_id_that_is_not_a_string_removes_nothing(server, admin, events):
    """Ids are checked before any target goes: one that is not a string (or none, or over
    AWS's 100) refuses the request whole, and the target named beside it stays."""
    events.create_event_bus(Name="keep")
    events.put_rule(Name="r", EventBusName="keep", EventPattern='{"source": ["x"]}')
    events.put_targets(
        Rule="r", EventBusName="keep", Targets=[{"Id": "t", "Arn": "http://127.0.0.1:9/x"}]
    )
    for ids in (["t", 5], [], ["t"] * 101):
        body = json.dumps({"Rule": "r", "EventBusName": "keep", "Ids": ids})
        refused = send(signed_request(server.url, "RemoveTargets", body.encode(), admin))
        assert error_code(refused) == "ValidationException", refused.json()
        listed = events.list_targets_by_rule(Rule="r", EventBusName="keep")["Targets"]
        assert [t["Id"] for t in listed] == ["t"]


def test_a_pattern_nested_too_deep_is_an_invalid_pattern(events):
    """A pattern nested deeper than the parser can follow is InvalidEventPatternException,
    for PutRule (no rule made) and TestEventPattern, not an InternalException."""
    event = json.dumps(
        {
            "id": "1",
            "account": ACCOUNT,
            "source": "s",
            "time": "2026-01-01T00:00:00Z",
            "region": "us-east-1",
            "detail-type": "t",
            "detail": {},
        }
    )
    # As deep as 4,096 characters (AWS's length limit for EventPattern) can nest.
    for deep in ("[" * 4096, '{"a":' * 680 + "[1]" + "}" * 680):
        assert len(deep) <= 4096
        with pytest.raises(events.exceptions.InvalidEventPatternException) as refused:
            events.put_rule(Name="deep", EventPattern=deep)
        assert "\n" not in refused.value.response["Error"]["Message"]
        with pytest.raises(events.exceptions.InvalidEventPatternException):
            events.test_event_pattern(EventPattern=deep, Event=event)
    assert "deep" not in [r["Name"] for r in events.list_rules()["Rules"]]


def test_a_pattern_past_the_depth_limit_is_refused_before_it_is_compiled(events):
    """Compiling costs about the cube of a pattern's depth (seconds at a few hundred levels,
    which the parser follows), and TestEventPattern is open to producer keys: past
    ``MAX_JSON_DEPTH`` levels a pattern is refused; at it, it is evaluated."""
    event = json.dumps(
        {
            "id": "1",
            "account": ACCOUNT,
            "source": "s",
            "time": "2026-01-01T00:00:00Z",
            "region": "us-east-1",
            "detail-type": "t",
            "detail": {},
        }
    )

    def nested(objects: int) -> str:  # ``objects`` objects around a list: one level more
        return '{"a":' * objects + '["x"]' + "}" * objects

    at_limit = nested(MAX_JSON_DEPTH - 1)
    assert events.test_event_pattern(EventPattern=at_limit, Event=event)["Result"] is False
    for past in (nested(MAX_JSON_DEPTH), nested(300)):
        with pytest.raises(events.exceptions.InvalidEventPatternException) as refused:
            events.test_event_pattern(EventPattern=past, Event=event)
        assert f"more than {MAX_JSON_DEPTH} levels deep" in str(refused.value)


def test_delete_rule_succeeds_again_as_on_aws(events):
    """AWS: "If you call delete rule multiple times for the same rule, all calls will
    succeed"; a bus that does not exist is still ResourceNotFoundException."""
    events.create_event_bus(Name="twice")
    events.put_rule(Name="r", EventBusName="twice", EventPattern='{"source": ["x"]}')
    events.delete_rule(Name="r", EventBusName="twice")
    events.delete_rule(Name="r", EventBusName="twice")
    events.delete_rule(Name="never", EventBusName="twice")
    assert events.list_rules(EventBusName="twice")["Rules"] == []
    with pytest.raises(events.exceptions.ResourceNotFoundException):
        events.delete_rule(Name="r", EventBusName="no-such-bus")


def test_a_target_arn_of_another_account_or_region_is_refused(events):
    """This server holds one account's buses in one region: a target ARN naming a bus of
    another account or region is refused (AccessDeniedException), never taken as the local
    bus of that name; the targets beside it are put."""
    events.create_event_bus(Name="home")
    events.create_event_bus(Name="away")
    events.put_rule(Name="r", EventBusName="home", EventPattern='{"source": ["x"]}')
    ours = f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/away"
    theirs = [
        "arn:aws:events:us-east-1:123456789012:event-bus/away",
        f"arn:aws:events:eu-west-1:{ACCOUNT}:event-bus/away",
    ]
    answer = events.put_targets(
        Rule="r",
        EventBusName="home",
        Targets=[{"Id": "ours", "Arn": ours}]
        + [{"Id": f"theirs{i}", "Arn": arn} for i, arn in enumerate(theirs)],
    )
    assert answer["FailedEntryCount"] == 2
    assert [(f["TargetId"], f["ErrorCode"]) for f in answer["FailedEntries"]] == [
        ("theirs0", "AccessDeniedException"),
        ("theirs1", "AccessDeniedException"),
    ]
    listed = events.list_targets_by_rule(Rule="r", EventBusName="home")["Targets"]
    assert [(t["Id"], t["Arn"]) for t in listed] == [("ours", ours)]
    for arn in theirs:
        with pytest.raises(ClientError) as denied:
            events.list_rule_names_by_target(TargetArn=arn, EventBusName="home")
        assert code_of(denied) == "AccessDeniedException"


def test_wrongly_typed_members_deep_in_a_request_are_validation_errors(server, admin, events):
    """A member of the wrong type inside a structure (an OAuth body parameter that is not a
    Key/Value structure, a replay time past any date) is ValidationException naming it,
    not an InternalException; nothing is made."""

    def raw(operation: str, doc: dict) -> httpx.Response:
        return send(signed_request(server.url, operation, json.dumps(doc).encode(), admin))

    oauth = {
        "AuthorizationEndpoint": "https://auth.example/token",
        "HttpMethod": "POST",
        "ClientParameters": {"ClientID": "id", "ClientSecret": "s3cr3t-value"},
        "OAuthHttpParameters": {"BodyParameters": [1]},
    }
    refused = raw(
        "CreateConnection",
        {
            "Name": "typed",
            "AuthorizationType": "OAUTH_CLIENT_CREDENTIALS",
            "AuthParameters": {"OAuthParameters": oauth},
        },
    )
    assert error_code(refused) == "ValidationException", refused.json()
    assert "BodyParameters" in refused.json()["message"]
    assert "s3cr3t-value" not in refused.text
    assert events.list_connections(NamePrefix="typed")["Connections"] == []
    events.create_event_bus(Name="replayed")
    bus = f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/replayed"
    for start in (1e20, -1e20):
        refused = raw(
            "StartReplay",
            {
                "ReplayName": "typed",
                "EventSourceArn": f"arn:aws:events:us-east-1:{ACCOUNT}:archive/replayed",
                "EventStartTime": start,
                "EventEndTime": 2,
                "Destination": {"Arn": bus},
            },
        )
        assert error_code(refused) == "ValidationException", refused.json()
        assert "EventStartTime" in refused.json()["message"]


def test_an_oauth_body_parameter_marked_secret_is_never_answered(events):
    """An OAuth BodyParameters entry with IsValueSecret true would be kept unsealed and
    answered by DescribeConnection: it is refused, as a secret invocation parameter is."""
    with pytest.raises(ClientError) as refused:
        events.create_connection(
            Name="oauth-secret",
            AuthorizationType="OAUTH_CLIENT_CREDENTIALS",
            AuthParameters={
                "OAuthParameters": {
                    "AuthorizationEndpoint": "https://auth.example/token",
                    "HttpMethod": "POST",
                    "ClientParameters": {"ClientID": "id", "ClientSecret": "client-secret"},
                    "OAuthHttpParameters": {
                        "BodyParameters": [
                            {"Key": "assertion", "Value": "body-s3cr3t", "IsValueSecret": True}
                        ]
                    },
                }
            },
        )
    assert code_of(refused) == "ValidationException"
    assert "body-s3cr3t" not in str(refused.value)
    assert events.list_connections(NamePrefix="oauth-secret")["Connections"] == []


def test_a_tampered_next_token_is_refused(events):
    """A NextToken that is not one this server gave (characters outside its alphabet, or
    nothing at all once decoded) is ValidationException, not the first page again."""
    events.create_event_bus(Name="paged")
    for n in range(3):
        events.put_rule(Name=f"p{n}", EventBusName="paged", EventPattern='{"source": ["x"]}')
    token = events.list_rules(EventBusName="paged", Limit=1)["NextToken"]
    for tampered in ("!!!", token + "!", "====", "*" + token):
        with pytest.raises(ClientError) as refused:
            events.list_rules(EventBusName="paged", Limit=1, NextToken=tampered)
        assert code_of(refused) == "ValidationException", tampered
    second = events.list_rules(EventBusName="paged", Limit=1, NextToken=token)["Rules"]
    assert [r["Name"] for r in second] == ["p1"]


def test_a_connection_or_destination_arn_of_another_account_is_refused(events):
    """A connection or API destination ARN naming another account or region is refused
    (AccessDeniedException), never taken as ours of the same name: not as an API
    destination's connection, nor as a target, nor to describe or delete one."""
    made = events.create_connection(
        Name="shared",
        AuthorizationType="API_KEY",
        AuthParameters={"ApiKeyAuthParameters": {"ApiKeyName": "X-Key", "ApiKeyValue": "v"}},
    )
    dest = events.create_api_destination(
        Name="shared-api",
        ConnectionArn=made["ConnectionArn"],
        InvocationEndpoint="https://api.example/in",
        HttpMethod="POST",
    )
    assert "Description" not in events.describe_connection(Name="shared")
    assert "Description" not in events.describe_api_destination(Name="shared-api")
    for place in ("us-east-1:123456789012", f"eu-west-1:{ACCOUNT}"):
        theirs = made["ConnectionArn"].replace(f"us-east-1:{ACCOUNT}", place)
        with pytest.raises(ClientError) as denied:
            events.create_api_destination(
                Name="linked",
                ConnectionArn=theirs,
                InvocationEndpoint="https://api.example/in",
                HttpMethod="POST",
            )
        assert code_of(denied) == "AccessDeniedException"
        for call, member in (
            (events.describe_connection, "Name"),
            (events.delete_connection, "Name"),
            (events.list_api_destinations, "ConnectionArn"),
        ):
            with pytest.raises(ClientError) as denied:
                call(**{member: theirs})
            assert code_of(denied) == "AccessDeniedException"
    assert [d["Name"] for d in events.list_api_destinations()["ApiDestinations"]] == ["shared-api"]
    events.create_event_bus(Name="calls")
    events.put_rule(Name="r", EventBusName="calls", EventPattern='{"source": ["x"]}')
    theirs = dest["ApiDestinationArn"].replace(ACCOUNT, "123456789012")
    answer = events.put_targets(
        Rule="r", EventBusName="calls", Targets=[{"Id": "api", "Arn": theirs}]
    )
    assert [(f["TargetId"], f["ErrorCode"]) for f in answer["FailedEntries"]] == [
        ("api", "AccessDeniedException")
    ]
    assert events.list_targets_by_rule(Rule="r", EventBusName="calls")["Targets"] == []
    with pytest.raises(ClientError) as denied:
        events.delete_api_destination(Name=theirs)
    assert code_of(denied) == "AccessDeniedException"
    events.delete_api_destination(Name="shared-api")  # still there: delete it as ours
    events.delete_connection(Name="shared")


def test_a_replay_of_another_accounts_archive_is_refused(events):
    """StartReplay naming an archive, destination bus or rule of another account or region
    is refused (AccessDeniedException) before anything is asked of Airflow, never taken as
    ours of the same name."""
    events.create_event_bus(Name="kept2")
    ours = f"us-east-1:{ACCOUNT}"
    archive = f"arn:aws:events:{ours}:archive/kept2"
    bus = f"arn:aws:events:{ours}:event-bus/kept2"
    rule = f"arn:aws:events:{ours}:rule/kept2/r"
    for place in ("us-east-1:123456789012", f"eu-west-1:{ACCOUNT}"):
        for source, destination in (
            (archive.replace(ours, place), {"Arn": bus}),
            (archive, {"Arn": bus.replace(ours, place)}),
            (archive, {"Arn": bus, "FilterArns": [rule.replace(ours, place)]}),
        ):
            with pytest.raises(ClientError) as denied:
                events.start_replay(
                    ReplayName="theirs",
                    EventSourceArn=source,
                    EventStartTime=0,
                    EventEndTime=time.time(),
                    Destination=destination,
                )
            assert code_of(denied) == "AccessDeniedException", (source, destination)


def test_airflow_down_or_not_airflow_is_one_line_for_every_replay_operation(
    api_env, admin, tmp_path
):
    """The replay operations depend on Airflow, which can be down while the API is up, or be
    something else at that address (a proxy's HTML page). Each operation answers
    InternalException saying which, in one line, and the server logs one line: no
    traceback, no token."""
    from http.server import BaseHTTPRequestHandler

    from ports import free_port

    class NotAirflow(BaseHTTPRequestHandler):
        def answer(self):
            _reply(self, b"<html><body>502 Bad Gateway</body></html>", "text/html")

        do_GET = do_POST = do_PATCH = answer

        def log_message(self, *args):
            pass

    def each_operation_says(api: ApiServer, said: str, logged: str) -> None:
        events = api.client(admin)
        for call in (
            events.list_replays,
            lambda: events.describe_replay(ReplayName="r1"),
            lambda: events.cancel_replay(ReplayName="r1"),
            lambda: events.start_replay(
                ReplayName="r1",
                EventSourceArn=f"arn:aws:events:us-east-1:{ACCOUNT}:archive/default",
                EventStartTime=0,
                EventEndTime=1,
                Destination={"Arn": f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/default"},
            ),
        ):
            with pytest.raises(ClientError) as failed:
                call()
            assert code_of(failed) == "InternalException"
            message = failed.value.response["Error"]["Message"]
            assert message.startswith(said) and "\n" not in message, message
        api.log.seek(0)
        log = api.log.read()
        assert "Traceback" not in log and "t0ken" not in log, log[-2000:]
        assert log.count(logged) == 4, log[-2000:]

    not_airflow, server = _served_with_airflow(api_env, tmp_path, NotAirflow)
    try:
        each_operation_says(
            server,
            "Airflow answered 200 to the replay request with no JSON",
            "Airflow answered a replay request with no JSON object",
        )
    finally:
        server.stop()
        not_airflow.shutdown()
    down = ApiServer(  # nothing listens at the address: Airflow is down
        api_env,
        "--airflow-url",
        f"http://127.0.0.1:{free_port()}",
        "--airflow-token-file",
        str(tmp_path / "airflow-token"),
    )
    try:
        each_operation_says(
            down,
            "Airflow did not answer the replay request: ",
            "Airflow did not answer a replay request: ",
        )
    finally:
        down.stop()


def test_a_replay_name_never_reaches_elsewhere_in_airflow(api_env, admin, tmp_path):
    """A ReplayName is part of the Airflow URL (``dagRuns/replay-NAME``): one outside AWS's
    pattern (``[.-_A-Za-z0-9]{1,64}``) such as ``x/../../other/dagRuns/run`` would have the
    server fetch or fail another DAG's run with its token. It is ValidationException and
    Airflow hears nothing; a good name still reaches the replay's own run."""
    from http.server import BaseHTTPRequestHandler

    heard = []

    class FakeAirflow(BaseHTTPRequestHandler):
        def answer(self):
            heard.append((self.command, self.path))
            run = {
                "dag_run_id": "replay-good",
                "state": "running",
                "conf": {
                    "bus": "default",
                    "since": "2026-01-01T00:00:00+00:00",
                    "until": "2026-01-02T00:00:00+00:00",
                },
            }
            _reply(self, json.dumps(run).encode())

        do_GET = do_POST = do_PATCH = answer

        def log_message(self, *args):
            pass

    airflow, server = _served_with_airflow(api_env, tmp_path, FakeAirflow)
    try:
        events = server.client(admin)
        archive = f"arn:aws:events:us-east-1:{ACCOUNT}:archive/default"
        bus = f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/default"
        for bad in ("x/../../../other/dagRuns/run", "x?state=failed", "a b", "x" * 65):
            for call in (
                lambda name: events.describe_replay(ReplayName=name),
                lambda name: events.cancel_replay(ReplayName=name),
                lambda name: events.start_replay(
                    ReplayName=name,
                    EventSourceArn=archive,
                    EventStartTime=0,
                    EventEndTime=1,
                    Destination={"Arn": bus},
                ),
            ):
                with pytest.raises(ClientError) as refused:
                    call(bad)
                assert code_of(refused) == "ValidationException", bad
        assert heard == []
        assert events.describe_replay(ReplayName="good")["State"] == "RUNNING"
        assert heard == [("GET", "/api/v2/dags/eventpush_replay/dagRuns/replay-good")]
    finally:
        server.stop()
        airflow.shutdown()


def test_rule_names_by_an_api_destination_target(events):
    """ListRuleNamesByTarget takes every ARN PutTargets takes: an API destination's ARN
    answers the rules with a target sending through it (not ValidationException), and a
    plain URL target to the same endpoint is not one of them."""
    conn = events.create_connection(
        Name="by-target",
        AuthorizationType="API_KEY",
        AuthParameters={"ApiKeyAuthParameters": {"ApiKeyName": "X-Key", "ApiKeyValue": "v"}},
    )["ConnectionArn"]
    dest = events.create_api_destination(
        Name="by-target-api",
        ConnectionArn=conn,
        InvocationEndpoint="https://api.example/by-target",
        HttpMethod="POST",
    )["ApiDestinationArn"]
    events.create_event_bus(Name="bytarget")
    for rule, arn in (("via-dest", dest), ("via-url", "https://api.example/by-target")):
        events.put_rule(Name=rule, EventBusName="bytarget", EventPattern='{"source": ["x"]}')
        answer = events.put_targets(
            Rule=rule, EventBusName="bytarget", Targets=[{"Id": "t", "Arn": arn}]
        )
        assert answer["FailedEntryCount"] == 0, answer
    for arn, rule in ((dest, "via-dest"), ("https://api.example/by-target", "via-url")):
        names = events.list_rule_names_by_target(TargetArn=arn, EventBusName="bytarget")
        assert names["RuleNames"] == [rule]
    for rule in ("via-dest", "via-url"):
        events.remove_targets(Rule=rule, EventBusName="bytarget", Ids=["t"])
    events.delete_api_destination(Name="by-target-api")
    events.delete_connection(Name="by-target")


def test_list_archives_by_a_source_of_another_account_lists_none(events):
    """ListArchives' EventSourceArn filter matches the whole ARN: our bus's archive is not
    an archive of another account's or region's bus of the same name."""
    events.create_event_bus(Name="sourced")
    ours = f"arn:aws:events:us-east-1:{ACCOUNT}:event-bus/sourced"
    listed = events.list_archives(EventSourceArn=ours)["Archives"]
    assert [a["ArchiveName"] for a in listed] == ["sourced"]
    for place in ("us-east-1:123456789012", f"eu-west-1:{ACCOUNT}"):
        theirs = ours.replace(f"us-east-1:{ACCOUNT}", place)
        assert events.list_archives(EventSourceArn=theirs)["Archives"] == []


def test_a_next_token_of_another_operation_is_refused(events):
    """A NextToken is good for the operation that gave it: ListEventBuses' token handed to
    ListRules (or ListRules' to ListTargetsByRule) is ValidationException, not a page that
    silently starts after whatever name the token held."""
    events.create_event_bus(Name="tokens")
    for n in range(2):
        events.put_rule(Name=f"t{n}", EventBusName="tokens", EventPattern='{"source": ["x"]}')
        events.put_targets(
            Rule="t0", EventBusName="tokens", Targets=[{"Id": f"x{n}", "Arn": f"http://h/{n}"}]
        )
    bus_token = events.list_event_buses(Limit=1)["NextToken"]
    rule_token = events.list_rules(EventBusName="tokens", Limit=1)["NextToken"]
    for call in (
        lambda: events.list_rules(EventBusName="tokens", NextToken=bus_token),
        lambda: events.list_targets_by_rule(Rule="t0", EventBusName="tokens", NextToken=rule_token),
        lambda: events.list_connections(NextToken=rule_token),
    ):
        with pytest.raises(ClientError) as refused:
            call()
        assert code_of(refused) == "ValidationException"
    second = events.list_rules(EventBusName="tokens", Limit=1, NextToken=rule_token)["Rules"]
    assert [r["Name"] for r in second] == ["t1"]
    events.remove_targets(Rule="t0", EventBusName="tokens", Ids=["x0", "x1"])


def test_list_replays_reads_every_page_of_airflows_runs(api_env, admin, tmp_path):
    """Airflow answers a DAG's runs a page at a time (50 unless asked for more, at most
    100): ListReplays lists every replay, not only Airflow's first page; and its
    NamePrefix is a prefix, though Airflow's run_id_pattern is a LIKE pattern; a run with no
    window in its conf is listed and described too."""
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import parse_qs, urlsplit

    names = [f"r{n:03}" for n in range(130)]

    class FakeAirflow(BaseHTTPRequestHandler):
        def do_GET(self):
            query = parse_qs(urlsplit(self.path).query)
            limit = min(int(query.get("limit", ["50"])[0]), 100)
            offset = int(query.get("offset", ["0"])[0])

            def conf_of(run_id: str) -> dict:
                if run_id == "replay-r007":  # started from the Airflow UI's form: no window
                    return {"what": "failed", "target": "crm"}
                return {
                    "bus": "default",
                    "since": "2026-01-01T00:00:00+00:00",
                    "until": "2026-01-02T00:00:00+00:00",
                }

            # run_id_pattern is SQL LIKE: '_' is any one character, '%' any run of them.
            like = query.get("run_id_pattern", ["%"])[0]
            matching = re.compile("".join({"%": ".*", "_": "."}.get(c, re.escape(c)) for c in like))
            ids = [f"replay-{name}" for name in names]
            ids = [i for i in ids if matching.fullmatch(i)]
            runs = [
                {"dag_run_id": i, "state": "success", "conf": conf_of(i)}
                for i in ids[offset : offset + limit]
            ]
            doc = {"dag_runs": runs, "total_entries": len(ids)}
            one = urlsplit(self.path).path.partition("/dagRuns/")[2]
            if one:
                doc = {"dag_run_id": one, "state": "running", "conf": conf_of(one)}
            _reply(self, json.dumps(doc).encode())

        def log_message(self, *args):
            pass

    airflow, server = _served_with_airflow(api_env, tmp_path, FakeAirflow)
    try:
        events, listed, more = server.client(admin), [], {}
        while True:
            page = events.list_replays(**more)
            listed += [r["ReplayName"] for r in page["Replays"]]
            if "NextToken" not in page:
                break
            more = {"NextToken": page["NextToken"]}
        assert listed == names
        # NamePrefix is a prefix, not a LIKE pattern: '_' is no wildcard.
        for prefix, wanted in (("r01", names[10:20]), ("r0_1", []), ("r_", [])):
            replays = events.list_replays(NamePrefix=prefix)["Replays"]
            assert [r["ReplayName"] for r in replays] == wanted, prefix
        # A run with no window in its conf (not started through StartReplay) is described
        # without the members it cannot give, not an InternalException.
        windowless = events.describe_replay(ReplayName="r007")
        assert windowless["State"] == "RUNNING"
        assert "EventStartTime" not in windowless and "EventEndTime" not in windowless
        assert "EventStartTime" in events.describe_replay(ReplayName="r008")
    finally:
        server.stop()
        airflow.shutdown()


def test_health_metrics_and_loopback_only(server, events):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    events.list_event_buses()
    text = httpx.get(server.url + "/metrics").text
    assert 'eventpush_api_requests_total{code="OK",operation="ListEventBuses"}' in text
    assert "eventpush_api_commits_total" in text
    assert "eventpush_api_commit_seconds_total" in text
    with pytest.raises(httpx.ConnectError):  # bound to 127.0.0.1 only, by default
        httpx.get(f"http://127.0.0.2:{server.port}/healthz", timeout=2)


@pytest.mark.skipif(shutil.which("aws", path=str(Path(EXE).parent)) is None, reason="no awscli")
def test_the_aws_cli_publishes_and_lists(server, admin, events):
    aws = str(Path(EXE).with_name("aws"))
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": admin[0],
        "AWS_SECRET_ACCESS_KEY": admin[1],
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    entries = json.dumps([{"Source": "cli", "DetailType": "t", "Detail": '{"from": "aws"}'}])
    before = events.describe_archive(ArchiveName="default")["EventCount"]
    r = subprocess.run(
        [aws, "events", "put-events", "--entries", entries, "--endpoint-url", server.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["FailedEntryCount"] == 0
    assert events.describe_archive(ArchiveName="default")["EventCount"] == before + 1
    r = subprocess.run(
        [aws, "events", "describe-event-bus", "--name", "nope", "--endpoint-url", server.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0 and "ResourceNotFoundException" in r.stderr


def test_each_worker_listens_on_a_socket_of_its_own(api_env):
    """With ``--workers 2`` each worker listens on its own socket of one SO_REUSEPORT group:
    connections reach both, a SIGKILLed worker is replaced by one listening again while the
    other answers, and a second server on the port stops with one line instead of joining."""
    server = ApiServer(api_env, "--workers", "2")

    def held(status: str) -> dict[int, int]:
        return sockets_by_worker(server.proc.pid, server.port, status)

    clients = [httpx.Client(timeout=10) for _ in range(32)]
    try:
        deadline = time.monotonic() + 60  # the server answered: one worker, maybe not both
        while len(listening := held(psutil.CONN_LISTEN)) < 2:
            assert time.monotonic() < deadline, f"two workers never listened: {listening}"
            time.sleep(0.1)
        assert sorted(listening.values()) == [1, 1], listening
        for client in clients:  # 32 connections, kept open
            assert client.get(server.url + "/healthz").status_code == 200
        established = held(psutil.CONN_ESTABLISHED)
        # Hashed across two sockets, 32 connections all land on one worker once in 2**31.
        assert len(established) == 2 and sum(established.values()) == 32, established
        victim = next(iter(listening))
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            with httpx.Client(timeout=10) as fresh:  # a new connection: the survivor answers
                assert fresh.get(server.url + "/healthz").status_code == 200
            now = held(psutil.CONN_LISTEN)
            if len(now) == 2 and victim not in now:
                break
            assert time.monotonic() < deadline, f"no worker replaced {victim}: {now}"
            time.sleep(0.2)
        second = subprocess.run(
            [EXE, "api", "--port", str(server.port), "--workers", "2"],
            env=api_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        assert f"cannot listen on 127.0.0.1:{server.port}" in second.stderr, second.stderr
        assert sorted(held(psutil.CONN_LISTEN).values()) == [1, 1]
    finally:
        for client in clients:
            client.close()
        server.stop()


LOAD_EVENTS = 3000


def _group_commits(metrics: str) -> tuple[float, float]:
    """(group commits, events stored) so far, from the server's ``/metrics``."""
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(("eventpush_api_commits_total", "eventpush_api_events_stored_total"))
    }
    return values["eventpush_api_commits_total"], values["eventpush_api_events_stored_total"]


def test_sigkill_under_load_loses_no_acknowledged_event(api_env, admin):
    """16 clients put events while the server is SIGKILLed: every event it acknowledged is
    stored; concurrent requests shared commits. The clients replay one signed request over
    kept-alive connections: boto3's own CPU a call, in threads of one process, let fewer
    requests arrive during a commit than a crowd of real clients would."""
    server = ApiServer(api_env)
    acknowledged: list[str] = []
    refused: list[str] = []
    stop = threading.Event()
    body = json.dumps(
        {"Entries": [{"Source": "load", "DetailType": "t", "Detail": '{"n": 1}'}] * 10}
    ).encode()
    request = signed_request(server.url, "PutEvents", body, admin)
    headers = signed_headers(request)

    def client_loop() -> None:
        with httpx.Client(timeout=httpx.Timeout(30, connect=5)) as client:
            while not stop.is_set():
                try:
                    answer = client.post(request.url, content=body, headers=headers)
                except httpx.HTTPError:
                    continue  # no answer: slow or killed; the loop ends once it is killed
                if answer.status_code != 200:
                    refused.append(answer.text)
                    return
                acknowledged.extend(
                    e["EventId"] for e in answer.json()["Entries"] if "EventId" in e
                )

    threads = [threading.Thread(target=client_loop) for _ in range(16)]
    for t in threads:
        t.start()
    try:
        # Killed once under load: a few thousand events stored (a loaded machine takes
        # longer to get there than a quiet one, so the load is judged by what it did).
        deadline = time.monotonic() + 60
        while True:
            time.sleep(0.2)
            commits, stored = _group_commits(httpx.get(server.url + "/metrics").text)
            if stored >= LOAD_EVENTS or refused or time.monotonic() > deadline:
                break
        server.kill()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        server.stop()
    assert not refused, refused[0]
    assert stored >= LOAD_EVENTS, f"only {stored} events stored in 60 s: no load"
    assert stored / commits > 20, f"{stored} events in {commits} commits: no group commit"
    assert len(acknowledged) > 500
    conn = psycopg2.connect(api_env["EVENTPUSH_DATABASE_URL"])
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT message_id FROM bus_event WHERE message_id = ANY(%s)", (acknowledged,)
            )
            found = {row[0] for row in cur.fetchall()}
    finally:
        conn.close()
    assert set(acknowledged) <= found, f"{len(set(acknowledged) - found)} acknowledged lost"


def test_connections_and_api_destinations_through_the_api(api_env, events):
    """CreateConnection, CreateApiDestination and a PutTargets entry naming the destination's
    ARN: the worker sends with the connection's API key and the target's headers; describe
    and list never answer the secret; deletes are refused while used."""
    with AuthReceiver() as ar:
        key = ar.state.api_key
        made = events.create_connection(
            Name="partner",
            AuthorizationType="API_KEY",
            AuthParameters={
                "ApiKeyAuthParameters": {"ApiKeyName": "X-Api-Key", "ApiKeyValue": key},
                "InvocationHttpParameters": {
                    "QueryStringParameters": [{"Key": "tenant", "Value": "t1"}]
                },
            },
        )
        assert made["ConnectionArn"].endswith(":connection/partner")
        described = events.describe_connection(Name="partner")
        assert described["AuthParameters"]["ApiKeyAuthParameters"] == {"ApiKeyName": "X-Api-Key"}
        listed = events.list_connections(NamePrefix="part")["Connections"]
        assert [c["AuthorizationType"] for c in listed] == ["API_KEY"]
        assert key not in json.dumps(described, default=str) + json.dumps(listed, default=str)
        dest = events.create_api_destination(
            Name="partner-api",
            ConnectionArn=made["ConnectionArn"],
            InvocationEndpoint=ar.url + "/apikey",
            HttpMethod="PUT",
            InvocationRateLimitPerSecond=20,
        )
        shown = events.describe_api_destination(Name="partner-api")
        assert (shown["HttpMethod"], shown["InvocationRateLimitPerSecond"]) == ("PUT", 20)
        events.create_event_bus(Name="dest")
        events.put_rule(Name="r", EventBusName="dest", EventPattern='{"source": ["shop"]}')
        answer = events.put_targets(
            Rule="r",
            EventBusName="dest",
            Targets=[
                {
                    "Id": "api",
                    "Arn": dest["ApiDestinationArn"],
                    "HttpParameters": {"HeaderParameters": {"X-From": "api"}},
                }
            ],
        )
        assert answer["FailedEntryCount"] == 0, answer
        [shape] = events.list_targets_by_rule(Rule="r", EventBusName="dest")["Targets"]
        assert shape["Arn"] == dest["ApiDestinationArn"]
        events.put_events(
            Entries=[{"EventBusName": "dest", "Source": "shop", "DetailType": "o", "Detail": "{}"}]
        )
        run_worker(api_env)
        [seen] = ar.state.delivered("/apikey")
        assert (seen.method, seen.query, seen.headers["x-from"]) == ("PUT", {"tenant": "t1"}, "api")
        with pytest.raises(ClientError) as used:
            events.delete_connection(Name="partner")
        assert code_of(used) == "ConcurrentModificationException"
        with pytest.raises(ClientError) as bad:
            events.create_connection(
                Name="bad",
                AuthorizationType="BASIC",
                AuthParameters={"BasicAuthParameters": {"Username": "a:b", "Password": "pw"}},
            )
        assert code_of(bad) == "ValidationException" and "pw" not in str(bad.value)
        events.remove_targets(Rule="r", EventBusName="dest", Ids=["api"])
        events.delete_api_destination(Name="partner-api")
        assert events.delete_connection(Name="partner")["ConnectionState"] == "DELETING"
        assert events.list_api_destinations()["ApiDestinations"] == []


def test_the_recomputed_signature_is_botocores():
    """auth.expected_signature hands botocore's SigV4Auth a light request object in place of
    an AWSRequest (cheaper): it must still be botocore's signature, query string and a header
    with runs of spaces included, and any change to a signed part must refuse it."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from eventpush.api import auth
    from eventpush.api.errors import ApiError

    secret = "s" * 40
    body = b'{"Entries": [{"Source": "s", "DetailType": "t", "Detail": "{}"}]}'
    url = "http://127.0.0.1:9/?b=2&a=1"
    request = AWSRequest(
        method="POST",
        url=url,
        data=body,
        headers={
            "Host": "127.0.0.1:9",
            "X-Amz-Target": "AWSEvents.PutEvents",
            "X-Custom": "  one   two  ",
        },
    )
    SigV4Auth(Credentials("EPAKTESTTESTTESTTEST", secret), "events", "us-east-1").add_auth(request)
    headers = {k.lower(): v for k, v in request.headers.items()}
    claim = auth.parse_authorization(headers["authorization"])
    assert "x-custom" in claim.signed_headers
    amz_date = headers["x-amz-date"]
    auth.verify(auth.Received("POST", url, headers, body), claim, amz_date, secret, "us-east-1")
    for changed in (
        auth.Received("POST", url, headers, body + b" "),
        auth.Received("POST", url.replace("a=1", "a=3"), headers, body),
        auth.Received("POST", url, {**headers, "x-custom": "one two three"}, body),
    ):
        with pytest.raises(ApiError) as refused:
            auth.verify(changed, claim, amz_date, secret, "us-east-1")
        assert refused.value.code == "InvalidSignatureException"


@pytest.mark.parametrize(
    ("url", "extra", "body"),
    [
        ("http://127.0.0.1:9/", {}, b'{"Entries": []}'),
        ("https://events.example.test/", {"X-Custom": "  one \t two  "}, b"{}"),
        ("http://127.0.0.1:9/", {"Content-Type": "application/x-amz-json-1.1"}, b""),
        ("http://127.0.0.1:9/", {"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"}, b"{}"),
        ("http://127.0.0.1:9/", {"X-Amz-Content-SHA256": "e3b0c44298fc1c14"}, b"{}"),
        ("http://127.0.0.1:9/", {"X-B": "2", "X-A": "1", "X-C": ""}, b'{"a": "\\u00e9"}'),
        ("http://127.0.0.1:9/?a=1", {}, b"{}"),
        ("http://127.0.0.1:9/a/../", {}, b"{}"),
    ],
)
def test_the_short_road_to_a_signature_is_botocores(url, extra, body):
    """auth.expected_signature computes the signature of a request to ``/`` without botocore's
    general code: for every shape of signed headers and payload it must give what botocore's
    signer gives (the client's signature) and what botocore's road on the server gives, and a
    changed signed header must be refused on it as on that road."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from eventpush.api import auth
    from eventpush.api.errors import ApiError

    secret = "k" * 40
    host = url.split("/")[2]
    headers = {"Host": host, "X-Amz-Target": "AWSEvents.PutEvents", **extra}
    request = AWSRequest(method="POST", url=url, data=body, headers=headers)
    SigV4Auth(Credentials("EPAKTESTTESTTESTTEST", secret), "events", "us-east-1").add_auth(request)
    sent = {k.lower(): v for k, v in request.headers.items()}
    claim = auth.parse_authorization(sent["authorization"])
    amz_date = sent["x-amz-date"]
    received = auth.Received("POST", url, sent, body)
    ours = auth.expected_signature(received, claim, amz_date, secret, "us-east-1")
    assert ours == claim.signature
    assert ours == auth.botocore_signature(received, claim, amz_date, secret, "us-east-1")
    # A header botocore never signs, listed as signed anyway (another client's doing): both
    # roads leave it out alike.
    listed = auth.SignedBy(
        claim.access_key_id,
        claim.date,
        claim.region,
        claim.service,
        (*claim.signed_headers, "user-agent"),
        claim.signature,
    )
    with_agent = auth.Received("POST", url, {**sent, "user-agent": "x"}, body)
    assert auth.expected_signature(
        with_agent, listed, amz_date, secret, "us-east-1"
    ) == auth.botocore_signature(with_agent, listed, amz_date, secret, "us-east-1")
    changed = auth.Received("POST", url, {**sent, "x-amz-target": "AWSEvents.ListRules"}, body)
    with pytest.raises(ApiError) as refused:
        auth.verify(changed, claim, amz_date, secret, "us-east-1")
    assert refused.value.code == "InvalidSignatureException"
    del sent["x-amz-target"]
    without = auth.Received("POST", url, sent, body)
    for road in (auth.expected_signature, auth.botocore_signature):
        with pytest.raises(ApiError) as missing:
            road(without, claim, amz_date, secret, "us-east-1")
        assert missing.value.code == "IncompleteSignatureException"


def test_an_entrys_detail_is_stored_as_spelled_or_the_long_way():
    """entry_event splices a one-line Detail into the envelope as the client spelled it; a
    detail over several lines is stored compact (a stored body is one line), an escaped NUL
    is refused (jsonb has none), anything but one JSON object is MalformedDetail, and every
    stored body decodes to the event the long way would have built."""
    from types import SimpleNamespace

    from eventpush.api.events import _MalformedDetail, entry_event
    from eventpush.api.service import BusView
    from eventpush.publish import MAX_EVENT_BYTES, MalformedEventError

    bus = BusView(SimpleNamespace(account=ACCOUNT, region="us-east-1"), None)
    now = "2026-11-27T00:00:00Z"

    def stored(detail: str, **more) -> tuple[str, dict]:
        entry = {"Source": "shop", "DetailType": "t", "Detail": detail, **more}
        prepared = entry_event(entry, bus, "entry 1", now, 3, "id-1")
        assert "\n" not in prepared.body
        assert prepared.size == len(prepared.body.encode())
        assert (prepared.queue_id, prepared.message_id, prepared.source) == (3, "id-1", "shop")
        return prepared.body, json.loads(prepared.body)

    spelled = ' { "a": [1, 2], "b": {"c": "é"} } '
    body, event = stored(spelled, Resources=["r1"], Time="2026-11-26T10:00:00Z")
    assert body.endswith('"detail":{ "a": [1, 2], "b": {"c": "é"} }}')
    assert event == {
        "version": "0",
        "id": "id-1",
        "detail-type": "t",
        "source": "shop",
        "account": ACCOUNT,
        "time": "2026-11-26T10:00:00Z",
        "region": "us-east-1",
        "resources": ["r1"],
        "detail": {"a": [1, 2], "b": {"c": "é"}},
    }
    body, event = stored(json.dumps({"a": 1, "b": [2]}, indent=2))
    assert body.endswith('"detail":{"a":1,"b":[2]}}')
    assert event["detail"] == {"a": 1, "b": [2]} and event["time"] == now
    body, event = stored(json.dumps({"path": "C:\\u0000"}))  # a backslash, then "u0000"
    assert event["detail"] == {"path": "C:\\u0000"}
    for detail in ('{"n": "a\\u0000"}', '{"n": 1}'):
        source = "a\x00b" if detail == '{"n": 1}' else "shop"
        with pytest.raises(MalformedEventError, match="NUL"):
            entry_event(
                {"Source": source, "DetailType": "t", "Detail": detail}, bus, "e", now, 0, "i"
            )
    # Names that JSON must escape (quotes, backslashes, control characters) or keeps as they
    # are (non-ASCII) come back as sent.
    for name in ('say "hi"', "back\\slash", "tab\tand\x01", "ünï 💡", "</script>"):
        entry = {"Source": name, "DetailType": name, "Detail": "{}", "Resources": [name]}
        event = json.loads(entry_event(entry, bus, "e", now, 0, "i").body)
        assert event["source"] == event["detail-type"] == event["resources"][0] == name
    for detail in ("[1]", '"text"', "1", "{not json", '{"a": 1} {"b": 2}', '{"a": 1,}'):
        with pytest.raises(_MalformedDetail):
            entry_event({"Source": "s", "DetailType": "t", "Detail": detail}, bus, "e", now, 0, "i")
    with pytest.raises(MalformedEventError, match="byte limit") as big:
        stored(json.dumps({"x": "y" * MAX_EVENT_BYTES}))
    assert not isinstance(big.value, _MalformedDetail)
    # 256 KiB counted as AWS counts an entry (14 for a Time, Source, DetailType, Detail and
    # Resources), not on the stored envelope: an entry at the limit is stored, one byte more
    # is refused, with a Time or without, one line or several.
    for more, room in (({}, 0), ({"Time": "2026-11-26T10:00:00Z", "Resources": ["r1"]}, 16)):
        for indent in (None, 1):
            padding = MAX_EVENT_BYTES - len("shop") - len("t") - room
            detail = _detail_of(padding, indent)
            assert len(detail) == padding
            body, event = stored(detail, **more)
            assert len(body.encode()) > MAX_EVENT_BYTES and event["detail"]["x"][0] == "y"
            with pytest.raises(MalformedEventError, match="262144-byte limit"):
                stored(_detail_of(padding + 1, indent), **more)


def _detail_of(length: int, indent: int | None) -> str:
    """A Detail of exactly ``length`` characters; over several lines with ``indent``."""
    text = json.dumps({"x": ""}, indent=indent)
    return text.replace('""', '"' + "y" * (length - len(text)) + '"')


def _reply(handler, body: bytes, content_type: str = "application/json") -> None:
    """A stand-in Airflow's 200 answer of ``body``."""
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _served_with_airflow(api_env, tmp_path, handler):
    """A stand-in Airflow REST API on loopback (``handler``, a BaseHTTPRequestHandler) and an
    API server pointed at it with a token file: (the stand-in, the server)."""
    from http.server import ThreadingHTTPServer

    airflow = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=airflow.serve_forever, daemon=True).start()
    token = tmp_path / "airflow-token"
    token.write_text("t0ken")
    server = ApiServer(
        api_env,
        "--airflow-url",
        f"http://127.0.0.1:{airflow.server_address[1]}",
        "--airflow-token-file",
        str(token),
    )
    return airflow, server
