"""A sink kind a third party adds: declared in a distribution's entry points (group
``eventpush.sinks``), found by its URL scheme, pushed to by the real engine; and the registry's
refusals (a scheme claimed twice, a built-in replaced, a scheme nobody provides)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sink_plugin

from eventpush import catalog, sinks
from eventpush.publish import publish
from eventpush.push import run_worker
from eventpush.push.targets import InvalidTargetUrlError, validate_url


def install(site: Path, dist: str, **schemes: str) -> None:
    """A distribution's metadata with entry points, as pip would leave it in site-packages."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in schemes.items())
    (info / "entry_points.txt").write_text(f"[eventpush.sinks]\n{lines}")
    # The registry reads entry points once per process; a new process would see these.
    sinks._entry_points.cache_clear()
    sinks.sink_kind.cache_clear()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path that plug-ins are installed into; the registry forgets them
    afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    sinks._entry_points.cache_clear()
    sinks.sink_kind.cache_clear()
    yield tmp_path
    sinks._entry_points.cache_clear()
    sinks.sink_kind.cache_clear()


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
