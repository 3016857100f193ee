"""A source kind defined in the tests folder (tests/plugin_source.py) is found through the
``eventpush.sources`` entry-point group, as a third party's would be: the test writes a
``*.dist-info`` with an ``entry_points.txt`` into a tmp directory on ``sys.path`` (no
importlib patching), then creates a bus on it, publishes and pushes with a real worker."""

from __future__ import annotations

import importlib
import json

import pytest

from eventpush import catalog, sources
from eventpush.demo.receiver import Receiver
from eventpush.plugins import PluginConflictError
from eventpush.publish import publish
from eventpush.push import run_worker


@pytest.fixture
def jsonl_plugin(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "eventpush_jsonl_source-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: eventpush-jsonl-source\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[eventpush.sources]\njsonl = plugin_source:KIND\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    sources.REGISTRY.forget()
    yield f"jsonl://local{tmp_path}/store"
    sources.REGISTRY.forget()


def test_unknown_scheme_names_the_known_kinds():
    with pytest.raises(sources.SourceError, match="no source kind for scheme 'jsonl'"):
        sources.kind_for("jsonl://local/tmp/x")


def test_a_plugged_in_source_is_pushed_like_any_bus(conn, jsonl_plugin):
    import plugin_source

    assert sources.kind_for(jsonl_plugin) is plugin_source.KIND
    with Receiver(keep_bodies=True) as rx:
        catalog.create_bus(conn, "orders", 2, source=jsonl_plugin)
        catalog.create_rule(conn, "orders", "even", {"detail": {"even": [True]}})
        catalog.create_target(conn, "orders", "even", catalog.TargetSpec(name="t", url=rx.url))
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        lines = [
            json.dumps({"source": "s", "detail-type": "d", "detail": {"n": i, "even": i % 2 == 0}})
            for i in range(600)
        ]
        result = publish(conn, "orders", lines)
        assert result.count == 600
        report = run_worker("w1", until_idle=True, max_seconds=60)
        got = sorted(json.loads(r.body)["detail"]["n"] for r in rx.state.requests)
    # Positions step by 10: the 300 lines of each queue span 3000 positions, many windows.
    assert result.offsets == {0: (0, 2990), 1: (0, 2990)}
    assert got == list(range(0, 600, 2))
    assert (report.delivered, report.filtered) == (300, 300)
    with conn.cursor() as cur:
        cur.execute('SELECT queue_id, "offset", broker_name FROM event_push_offset ORDER BY 1')
        assert cur.fetchall() == [(0, 2991, "jsonl"), (1, 2991, "jsonl")]


def _declare(site, dist: str, line: str) -> None:
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[eventpush.sources]\n{line}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    sources.REGISTRY.forget()
    yield tmp_path
    sources.REGISTRY.forget()


def test_a_scheme_claimed_twice_is_refused_naming_both(site):
    _declare(site, "one_source", "jsonl = plugin_source:KIND")
    _declare(site, "other_source", "jsonl = other_module:KIND")
    with pytest.raises(PluginConflictError) as info:
        sources.kind_named("jsonl")
    assert "plugin_source:KIND" in str(info.value)
    assert "other_module:KIND" in str(info.value)


def test_a_plugin_may_not_replace_the_builtin_store(site):
    _declare(site, "sneaky_source", "postgres = plugin_source:KIND")
    with pytest.raises(PluginConflictError, match="'postgres' is built in"):
        sources.kind_for(None)


def test_an_entry_point_that_is_not_a_source_kind_is_refused(site):
    _declare(site, "wrong_source", "jsonl = plugin_source:JsonlReader")
    with pytest.raises(sources.SourceError, match="jsonl = plugin_source:JsonlReader .* not a"):
        sources.kind_named("jsonl")
