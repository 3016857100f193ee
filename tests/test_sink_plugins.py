"""A sink kind a third party adds: declared in a distribution's entry points (group
``eventpush.sinks``), found by its URL scheme, pushed to by the real engine; and the registry's
refusals (a scheme claimed twice, a built-in replaced, a scheme nobody provides)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import sink_plugin

from eventpush import catalog, sinks
from eventpush.addresses import InvalidTargetUrlError
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.sinks import validate_url


def install(site: Path, dist: str, **schemes: str) -> None:
    """A distribution's metadata with entry points, as pip would leave it in site-packages."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in schemes.items())
    (info / "entry_points.txt").write_text(f"[eventpush.sinks]\n{lines}")
    # The registry reads entry points once per process; a new process would see these.
    sinks.REGISTRY.forget()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path that plug-ins are installed into; the registry forgets them
    afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    sinks.REGISTRY.forget()
    yield tmp_path
    sinks.REGISTRY.forget()


def test_a_plugged_in_sink_is_found_by_scheme_and_pushed_to(conn, site):
    with pytest.raises(InvalidTargetUrlError, match="must use http or https"):
        validate_url("memory://box")  # nothing provides the scheme yet
    install(site, "eventpush_memory_sink", memory="sink_plugin:MemorySink")
    assert "memory" in sinks.schemes()
    assert sinks.sink_kind("memory") is sink_plugin.MemorySink
    with pytest.raises(InvalidTargetUrlError, match="must be memory://BOX"):
        validate_url("memory://not a box")  # the kind checks its own URLs

    sink_plugin.SENT.clear()
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
    catalog.create_target(
        conn, "orders", "all", catalog.TargetSpec(name="box", url="memory://box", batch_size=5)
    )
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    lines = [
        json.dumps(
            {"id": f"e{i}", "source": "shop", "detail-type": "o", "detail": {"refuse": i == 7}}
        )
        for i in range(20)
    ]
    publish(conn, "orders", lines, partition_key="id")
    report = run_worker("w1", until_idle=True, max_seconds=60)
    sent = sorted(mid for _, mids, _ in sink_plugin.SENT for mid in mids)
    refused_batch = 20 - len(sent)
    assert 1 <= refused_batch <= 5  # the batch holding e7 failed whole
    assert "e7" not in sent
    assert (report.delivered, report.failed) == (len(sent), refused_batch)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*), count(http_status) FROM event_push_delivery")
        assert cur.fetchone() == (len(sent), 0)
        cur.execute("SELECT DISTINCT last_error FROM event_push_failure")
        assert cur.fetchall() == [("refused by the box",)]


def test_a_scheme_claimed_twice_is_refused_naming_both(site):
    install(site, "one_sink", memory="sink_plugin:MemorySink")
    install(site, "other_sink", memory="other_module:OtherSink")
    with pytest.raises(sinks.SinkConflictError) as info:
        sinks.sink_kind("memory")
    assert "sink_plugin:MemorySink" in str(info.value)
    assert "other_module:OtherSink" in str(info.value)


def test_a_plugin_may_not_replace_a_builtin(site):
    install(site, "sneaky_sink", http="sink_plugin:MemorySink")
    with pytest.raises(sinks.SinkConflictError, match="'http' is built in"):
        sinks.sink_kind("http")


def test_builtins_are_found_without_metadata(site):
    from eventpush.sinks.http import HttpSink
    from eventpush.sinks.nats import NatsSink

    assert sinks.sink_kind("https") is HttpSink
    assert sinks.sink_kind("nats") is NatsSink
    with pytest.raises(InvalidTargetUrlError, match="no sink for URL scheme 'gopher'"):
        sinks.sink_kind("gopher")


def _answering_events(n: int) -> list[str]:
    return [
        json.dumps(
            {
                "id": f"e{i}",
                "source": "shop",
                "detail-type": "o",
                "detail": {"refuse": i % 9 == 4, "busy": 1 if i % 5 == 2 else 0},
            }
        )
        for i in range(n)
    ]


def test_records_answered_one_by_one_settle_on_their_own_answers(conn, site):
    # A batch whose records are answered one by one: the refused one fails alone, the busy
    # ones are sent again alone, and the rest are delivered once (not failed or resent with
    # their neighbours).
    install(site, "eventpush_answering_sink", answering="sink_plugin:AnsweringSink")
    sink_plugin.SENT.clear()
    sink_plugin.TRACED.clear()
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "all", {"source": ["shop"]})
    spec = catalog.TargetSpec(name="box", url="answering://box", batch_size=6, backoff_ms=10)
    catalog.create_target(conn, "orders", "all", spec)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    publish(conn, "orders", _answering_events(40), partition_key="id")
    report = run_worker("w1", until_idle=True, max_seconds=60)
    refused = {f"e{i}" for i in range(40) if i % 9 == 4}
    sent = [mid for _, mids, _ in sink_plugin.SENT for mid in mids]
    assert sorted(sent) == sorted({f"e{i}" for i in range(40)} - refused)  # each once
    assert (report.delivered, report.failed) == (40 - len(refused), len(refused))
    with conn.cursor() as cur:
        cur.execute("SELECT message_id, attempts, last_error FROM event_push_failure")
        assert sorted(cur.fetchall()) == sorted((m, 1, "refused by the box") for m in refused)
        cur.execute("SELECT message_id, attempts FROM event_push_delivery")
        attempts = dict(cur.fetchall())
    assert {m for m, a in attempts.items() if a == 2} == {
        f"e{i}" for i in range(40) if i % 5 == 2 and f"e{i}" not in refused
    }
    assert_traced_apart(sink_plugin.TRACED)


def assert_traced_apart(traced: list[tuple[list[str], str | None]]) -> None:
    """Every send was handed a W3C traceparent of its own (a span per attempt)."""
    assert traced
    spans = set()
    for _, traceparent in traced:
        assert re.fullmatch(r"00-[0-9a-f]{32}-([0-9a-f]{16})-0[01]", traceparent), traceparent
        spans.add(traceparent.split("-")[2])
    assert len(spans) == len(traced)


def test_inline_retries_resend_only_the_records_answered_retry(site):
    # As replay retries: the busy records alone go again; the outcome keeps every record's
    # own last answer.
    import asyncio

    from eventpush.sinks.contract import DELIVERED, FINAL, Record, Target

    install(site, "eventpush_answering_sink", answering="sink_plugin:AnsweringSink")
    sink_plugin.SENT.clear()
    sink_plugin.TRACED.clear()
    target = Target(1, "b/r/box", "b", 1, "r", "{}", "box", "answering://box", backoff_ms=1)
    records = [
        Record(0, i, f"e{i}", json.loads(raw), raw) for i, raw in enumerate(_answering_events(6))
    ]

    async def deliver():
        async with sinks.Sinks() as s:
            return await s.deliver(target, records, None)

    outcome = asyncio.run(deliver())
    assert outcome.per_record == [
        (DELIVERED, None),
        (DELIVERED, None),
        (DELIVERED, None),
        (DELIVERED, None),
        (FINAL, "refused by the box"),
        (DELIVERED, None),
    ]
    assert [r.attempts for r in records] == [1, 1, 2, 1, 1, 1]
    assert sorted(m for _, mids, _ in sink_plugin.SENT for m in mids) == [
        "e0",
        "e1",
        "e2",
        "e3",
        "e5",
    ]
    assert [mids for mids, _ in sink_plugin.TRACED] == [[f"e{i}" for i in range(6)], ["e2"]]
    assert_traced_apart(sink_plugin.TRACED)
