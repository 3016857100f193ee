"""Catalog rules against the real PostgreSQL: names, duplicates, URLs, assignment."""

import pytest

from eventpush import catalog
from eventpush.push import controls

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def target(name: str = "t", **kw) -> catalog.TargetSpec:
    return catalog.TargetSpec(name=name, url=kw.pop("url", "http://127.0.0.1:9/x"), **kw)


@pytest.fixture
def bus(conn):
    catalog.create_bus(conn, "orders", 3)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    return "orders"


def count(conn, table: str) -> int:
    with conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {table}")
        return cur.fetchone()[0]


def test_duplicates_and_unknowns_are_refused_clearly(conn, bus):
    with pytest.raises(catalog.CatalogError, match="^bus 'orders' already exists$"):
        catalog.create_bus(conn, "orders", 1)
    with pytest.raises(catalog.CatalogError, match="^rule 'r' already exists on bus 'orders'$"):
        catalog.create_rule(conn, "orders", "r", {"source": ["x"]})
    with pytest.raises(catalog.CatalogError, match="^unknown bus 'nope'$"):
        catalog.create_rule(conn, "nope", "r2", {"source": ["x"]})
    with pytest.raises(catalog.CatalogError, match="^unknown rule 'zz' on bus 'orders'$"):
        catalog.create_target(conn, "orders", "zz", target())
    catalog.create_target(conn, "orders", "r", target())
    with pytest.raises(catalog.CatalogError, match="already exists on rule orders/r"):
        catalog.create_target(conn, "orders", "r", target())
    with pytest.raises(catalog.CatalogError, match="bus name 'a b' is invalid"):
        catalog.create_bus(conn, "a b", 1)
    with pytest.raises(catalog.CatalogError, match="--queues must be between 1 and 1024"):
        catalog.create_bus(conn, "b2", 0)


def test_invalid_pattern_is_refused_and_nothing_written(conn, bus):
    with pytest.raises(catalog.CatalogError, match=r"rule 'bad': invalid pattern: .*detail\.n"):
        catalog.create_rule(conn, "orders", "bad", {"detail": {"n": [{"numeric": [">", "x"]}]}})
    with pytest.raises(catalog.CatalogError, match="pattern is not valid JSON"):
        catalog.create_rule(conn, "orders", "bad", "{nope")
    assert count(conn, "event_rule") == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (target(url="ftp://x/y"), "must use http or https"),
        (target(url="http://169.254.169.254/"), "denied range"),
        (target(secret="hunter2"), "whsec_"),
        (target(max_attempts=0), "--max-attempts must be between 1 and 186"),
        (target(batch_size=5000), "--batch-size must be between 1 and 1000"),
        (target(timeout_ms=-1), "--timeout-ms"),
        (target(transform_kind="NOPE"), "transform must be one of"),
        (target(transform_kind="JSONPATH", transform_spec="not a path ["), "invalid transform"),
    ],
)
def test_bad_targets_are_refused_and_nothing_written(conn, bus, spec, message):
    with pytest.raises(catalog.CatalogError, match=message) as info:
        catalog.create_target(conn, "orders", "r", spec)
    assert "hunter2" not in str(info.value)
    assert count(conn, "event_target") == 0
    assert count(conn, "event_target_runner") == 0


def test_new_runner_starts_at_the_bus_end(conn, bus):
    from eventpush.publish import publish

    publish(conn, "orders", ['{"source": "shop", "detail-type": "x"}'] * 7)
    runner = catalog.create_target(conn, "orders", "r", target(secret=SECRET))
    assert runner == "orders/r/t"
    with conn.cursor() as cur:
        cur.execute(
            'SELECT sum("offset"), sum(start_offset), count(*) FROM event_push_offset '
            "WHERE consumer_group = %s",
            (runner,),
        )
        assert cur.fetchone() == (7, 7, 3)


def test_assign_is_even_by_capacity_and_sticky(conn, bus):
    catalog.create_worker(conn, "w1", capacity=100)
    catalog.create_worker(conn, "w2", capacity=100)
    catalog.create_worker(conn, "big", capacity=200)
    for i in range(8):
        catalog.create_target(conn, "orders", "r", target(f"t{i}"))
    assert catalog.assign(conn) == 8
    placed = _placement(conn)
    assert sorted(placed.values()).count("big") == 4
    assert sorted(placed.values()).count("w1") == 2
    assert catalog.assign(conn) == 0
    catalog.create_target(conn, "orders", "r", target("t8"))
    assert catalog.assign(conn) == 1
    after = _placement(conn)
    assert {k: v for k, v in after.items() if k in placed} == placed, "assigned runners stay"


def test_disabling_a_worker_hands_its_runners_to_others(conn, bus):
    catalog.create_worker(conn, "w1")
    catalog.create_worker(conn, "w2")
    for i in range(4):
        catalog.create_target(conn, "orders", "r", target(f"t{i}"))
    catalog.assign(conn)
    moved = catalog.set_worker_enabled(conn, "w1", False)
    assert moved == 2
    assert set(_placement(conn).values()) == {"w2"}
    with pytest.raises(catalog.CatalogError, match="unknown worker 'w9'"):
        catalog.set_worker_enabled(conn, "w9", False)


def _placement(conn) -> dict[str, str]:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT r.name, w.name FROM event_target_runner r "
            "JOIN event_push_worker w ON w.id = r.worker_id"
        )
        return dict(cur.fetchall())


def test_controls_refuse_impossible_adjustments(conn, bus):
    catalog.create_worker(conn, "w1")
    runner = catalog.create_target(conn, "orders", "r", target())
    with pytest.raises(controls.ControlError, match=r"pool_core \(300\) must not exceed pool_max"):
        controls.adjust(conn, "worker", "w1", {"pool_core": 300})
    with pytest.raises(controls.ControlError, match="pool_max must be an integer from 1"):
        controls.adjust(conn, "worker", "w1", {"pool_max": 0})
    with pytest.raises(controls.ControlError, match="unknown worker 'ghost'"):
        controls.adjust(conn, "worker", "ghost", {"pool_max": 10})
    with pytest.raises(controls.ControlError, match="runner setting 'pool_max' is unknown"):
        controls.adjust(conn, "runner", runner, {"pool_max": 10})
    assert count(conn, "event_runtime_control") == 0
    assert controls.adjust(conn, "worker", "w1", {"pool_max": 32, "pool_core": 8}) == {
        "pool_max": 32,
        "pool_core": 8,
    }
    with pytest.raises(controls.ControlError, match="must not exceed"):
        controls.adjust(conn, "worker", "w1", {"pool_max": 4})
    settings = controls.worker_settings(controls.read_controls(conn, "worker", "w1"))
    assert (settings.pool_core, settings.pool_max) == (8, 32)
