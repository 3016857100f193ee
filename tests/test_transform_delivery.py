"""The input transformer end to end: bus account/region settings, refusals at ``target
create``, and records whose filled template EventBridge would not deliver, recorded as failed
by the push engine and by replay's delivery path. Real PostgreSQL, a real receiver on loopback;
every delivered body is checked byte for byte.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import run_worker, store
from eventpush.rules.transforms import DEFAULT_ACCOUNT, DEFAULT_REGION
from eventpush.sinks import Sinks, contract

TEMPLATE = {
    "InputPathsMap": {"n": "$.detail.n", "p": "$.detail.p"},
    "InputTemplate": '{"n": <n>, "p": "<p>", "event": <aws.events.event>, '
    '"arn": <aws.events.rule-arn>}',
}


@pytest.fixture
def rx():
    with Receiver() as receiver:
        yield receiver


def event(n: int, **detail) -> str:
    return json.dumps(
        {
            "id": f"id-{n}",
            "source": "shop",
            "detail-type": "Order",
            "time": "2026-11-23T10:00:00Z",
            "detail": {"n": n, **detail},
        }
    )


def body(n: int, p: str) -> bytes:
    """The body EventBridge would deliver for ``event(n, p=...)`` on bus orders of account
    111111111111 in eu-west-1."""
    return (
        f'{{"n": {n}, "p": "{p}", "event": {{"version":"0","id":"id-{n}","detailType":"Order",'
        '"source":"shop","account":"111111111111","time":"2026-11-23T10:00:00Z",'
        '"region":"eu-west-1","resources":[]}, '
        '"arn": "arn:aws:events:eu-west-1:111111111111:rule/orders/r"}'
    ).encode()


def setup(conn, rx) -> None:
    catalog.create_bus(conn, "orders", 1, account="111111111111", region="eu-west-1")
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    spec = catalog.TargetSpec(
        name="t", url=rx.url + "/ok", transform_kind="TEMPLATE", transform_spec=TEMPLATE
    )
    catalog.create_target(conn, "orders", "r", spec)


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


OBJECT_ERROR = (
    "transform failed: TEMPLATE <p> is an object inside a quoted string, so the filled body "
    "is not valid JSON; EventBridge does not deliver it"
)
QUOTE_ERROR = (
    "transform failed: TEMPLATE <p> put quotes, backslashes or control characters inside a "
    "quoted string (EventBridge does not escape them), so the filled body is not valid JSON "
    "(Expecting ',' delimiter at position 20); EventBridge does not deliver it"
)


def test_engine_delivers_eventbridge_bodies_and_records_undeliverable_ones(conn, rx):
    setup(conn, rx)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    publish(
        conn,
        "orders",
        [
            event(0, p="fine"),
            event(1, p={"k": "v"}),  # an object inside quotes: AWS does not deliver it
            event(2, p='say "hi"'),  # unescaped quotes break the JSON: nor this
            event(3),  # no p at all: nothing inside the quotes
        ],
    )
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (2, 2)
    assert sorted(r.body for r in rx.state.delivered("/ok")) == [body(0, "fine"), body(3, "")]
    assert rx.state.count["/ok"] == 2  # nothing else was sent, not even once
    assert rows(
        conn,
        'SELECT "offset", message_id, attempts, http_status, last_error, status '
        'FROM event_push_failure ORDER BY "offset"',
    ) == [
        (1, "id-1", 1, None, OBJECT_ERROR, "failed"),
        (2, "id-2", 1, None, QUOTE_ERROR, "failed"),
    ]
    assert rows(conn, 'SELECT "offset" FROM event_push_delivery ORDER BY 1') == [(0,), (3,)]
    assert rows(conn, 'SELECT "offset" FROM event_push_offset') == [(4,)]


def test_replay_delivery_path_records_undeliverable_records_as_final(conn, rx):
    """Replay pushes through ``Sinks.deliver`` with targets from ``load_targets``: the same
    transform, the bus's account and region, and a final outcome instead of a crash."""
    setup(conn, rx)
    with conn.cursor() as cur:
        [target] = store.load_targets(cur)
    assert (target.bus_account, target.bus_region) == ("111111111111", "eu-west-1")
    from eventpush.rules.transforms import compile_transform

    transform = compile_transform(target.transform_kind, target.transform_spec)

    async def push(raw: str) -> contract.Outcome:
        record = contract.Record(0, 0, json.loads(raw)["id"], json.loads(raw), raw)
        async with Sinks() as sinks:
            outcome = await sinks.deliver(target, [record], transform)
        assert record.attempts == 1
        return outcome

    bad = asyncio.run(push(event(1, p={"k": "v"})))
    assert (bad.kind, bad.http_status, bad.error) == (contract.FINAL, None, OBJECT_ERROR)
    assert rx.state.requests == []
    good = asyncio.run(push(event(0, p="fine")))
    assert (good.kind, good.http_status) == (contract.DELIVERED, 200)
    assert [r.body for r in rx.state.requests] == [body(0, "fine")]


def test_bus_account_and_region_defaults_and_checks(conn):
    catalog.create_bus(conn, "plain", 1)
    catalog.create_bus(conn, "eu", 1, account="111111111111", region="eu-west-1")
    assert rows(conn, "SELECT name, account, region FROM event_bus ORDER BY name") == [
        ("eu", "111111111111", "eu-west-1"),
        ("plain", DEFAULT_ACCOUNT, DEFAULT_REGION),
    ]
    with pytest.raises(catalog.CatalogError) as info:
        catalog.create_bus(conn, "x", 1, account="12345")
    assert str(info.value) == "--account must be a 12-digit AWS account id, got '12345'"
    with pytest.raises(catalog.CatalogError, match="12-digit"):
        catalog.create_bus(conn, "x", 1, account="111111111111\n")
    with pytest.raises(catalog.CatalogError) as info:
        catalog.create_bus(conn, "x", 1, region="Mars")
    assert str(info.value) == "--region must look like an AWS region (us-east-1), got 'Mars'"


def test_target_create_refuses_templates_eventbridge_refuses(conn, cli):
    catalog.create_bus(conn, "orders", 1)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    certain = {"InputPathsMap": {"d": "$.detail"}, "InputTemplate": '{"d": "<d>"}'}
    with pytest.raises(catalog.CatalogError) as info:
        catalog.create_target(
            conn,
            "orders",
            "r",
            catalog.TargetSpec(
                name="t",
                url="http://127.0.0.1:9/x",
                transform_kind="TEMPLATE",
                transform_spec=certain,
            ),
        )
    assert str(info.value) == (
        "target 't': invalid transform: TEMPLATE <d> sits inside a quoted string but its path "
        "$.detail always selects an object: the filled body would not be valid JSON and "
        "EventBridge does not deliver it; put <d> outside quotes"
    )
    undefined = {
        "InputPathsMap": {"n": "$.detail.n"},
        "InputTemplate": '"Event <n>, with not defined key <notdefinedkey>"',
    }
    r = cli(
        "target", "create", "--bus", "orders", "--rule", "r", "--name", "t",
        "--url", "http://127.0.0.1:9/x", "--transform", "TEMPLATE",
        "--transform-spec", json.dumps(undefined),
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr == (
        "error: target 't': invalid transform: TEMPLATE InputTemplate contains invalid "
        "placeholder notdefinedkey: it is neither in InputPathsMap nor a reserved aws.events "
        "variable\n"
    )
    assert rows(conn, "SELECT count(*) FROM event_target") == [(0,)]
    r = cli("bus", "create", "eu", "--account", "111111111111", "--region", "eu-west-1")
    assert r.returncode == 0, r.stderr
    assert rows(conn, "SELECT account, region FROM event_bus WHERE name = 'eu'") == [
        ("111111111111", "eu-west-1")
    ]
