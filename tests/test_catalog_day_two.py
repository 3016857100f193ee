"""The day-two catalog functions against the real PostgreSQL: reading, changing, versions,
conflicts, deletes that keep the books, sealed secrets and key rotation."""

import datetime as dt
import json

import pytest

from eventpush import catalog, sealed

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECRET2 = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldY"


def spec(name: str = "t", **kw) -> catalog.TargetSpec:
    return catalog.TargetSpec(name=name, url=kw.pop("url", "http://127.0.0.1:9/x"), **kw)


@pytest.fixture
def orders(conn):
    catalog.create_bus(conn, "orders", 2, "shop events")
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_target(conn, "orders", "r", spec(secret=SECRET))
    return "orders"


def test_show_and_list_agree_and_hold_no_secret(conn, orders):
    bus = catalog.get_bus(conn, "orders")
    assert (bus.name, bus.queues, bus.description, bus.rules) == ("orders", 2, "shop events", 1)
    assert [b.to_json() for b in catalog.list_buses(conn)] == [bus.to_json()]
    assert catalog.list_buses(conn, name_prefix="x") == []
    rule = catalog.get_rule(conn, "orders", "r")
    assert (rule.state, rule.version, rule.targets) == ("ENABLED", 1, 1)
    assert rule.pattern == {"source": ["shop"]}
    assert [r.to_json() for r in catalog.list_rules(conn, "orders")] == [rule.to_json()]
    target = catalog.get_target(conn, "orders", "r", "t")
    assert target.secret_set and target.secret_fingerprint == sealed.fingerprint(SECRET)
    assert [t.to_json() for t in catalog.list_targets(conn, "orders", "r")] == [target.to_json()]
    text = json.dumps(target.to_json())
    assert "whsec_" not in text and SECRET[6:] not in text
    with pytest.raises(catalog.NotFoundError, match="^unknown bus 'nope'$"):
        catalog.get_bus(conn, "nope")
    with pytest.raises(catalog.NotFoundError, match="^unknown target 'x' on rule orders/r$"):
        catalog.get_target(conn, "orders", "r", "x")


def test_secret_is_sealed_at_rest(conn, orders):
    with conn.cursor() as cur:
        cur.execute("SELECT secret FROM event_target")
        (token,) = cur.fetchone()
    assert token.startswith(sealed.TOKEN_PREFIX) and "whsec_" not in token
    assert sealed.unseal(token) == SECRET


def test_rule_updates_move_the_version_and_a_stale_one_conflicts(conn, orders):
    new = catalog.update_rule(conn, "orders", "r", pattern='{"source": ["b"]}', expected_version=1)
    assert (new.version, new.pattern) == (2, {"source": ["b"]})
    with pytest.raises(catalog.ConflictError, match="at version 2, not 1"):
        catalog.update_rule(conn, "orders", "r", description="x", expected_version=1)
    assert catalog.get_rule(conn, "orders", "r").description == ""
    off = catalog.set_rule_enabled(conn, "orders", "r", False)
    assert (off.state, off.version) == ("DISABLED", 3)
    assert catalog.set_rule_enabled(conn, "orders", "r", False).version == 3  # no change
    with pytest.raises(catalog.CatalogError, match="invalid pattern"):
        catalog.update_rule(conn, "orders", "r", pattern={"source": "notalist"})
    assert catalog.get_rule(conn, "orders", "r").version == 3


def test_target_update_keeps_what_it_is_not_told(conn, orders):
    t = catalog.update_target(conn, "orders", "r", "t", timeout_ms=900, expected_version=1)
    assert (t.timeout_ms, t.version, t.secret_set, t.url) == (900, 2, True, "http://127.0.0.1:9/x")
    with pytest.raises(catalog.ConflictError):
        catalog.update_target(conn, "orders", "r", "t", timeout_ms=901, expected_version=1)
    with pytest.raises(catalog.CatalogError, match="--timeout-ms must be between"):
        catalog.update_target(conn, "orders", "r", "t", timeout_ms=0)
    with pytest.raises(catalog.CatalogError, match="needs a new --secret"):
        catalog.update_target(conn, "orders", "r", "t", keep_old_secret=dt.timedelta(hours=1))
    t = catalog.update_target(
        conn, "orders", "r", "t", secret=SECRET2, keep_old_secret=dt.timedelta(hours=24)
    )
    assert t.secret_fingerprint == sealed.fingerprint(SECRET2) and t.old_secret_until
    with conn.cursor() as cur:
        cur.execute("SELECT secret_old FROM event_target")
        assert sealed.unseal(cur.fetchone()[0]) == SECRET


def test_deletes_keep_the_books_and_names_can_be_reused(conn, orders):
    with pytest.raises(catalog.ConflictError, match="has 1 targets"):
        catalog.delete_rule(conn, "orders", "r")
    with pytest.raises(catalog.ConflictError, match="has 1 rules"):
        catalog.delete_bus(conn, "orders")
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM event_target_runner")
        (old_runner,) = cur.fetchone()
    catalog.delete_target(conn, "orders", "r", "t")
    assert catalog.list_targets(conn) == []
    catalog.create_target(conn, "orders", "r", spec())
    with conn.cursor() as cur:
        cur.execute(
            "SELECT id, deleted_at IS NOT NULL, worker_id FROM event_target_runner ORDER BY id"
        )
        rows = cur.fetchall()
    assert rows[0] == (old_runner, True, None) and rows[1][0] != old_runner and not rows[1][1]
    assert catalog.delete_bus(conn, "orders", force=True) == {"rules": 1, "targets": 1}
    assert catalog.list_buses(conn) == []
    catalog.create_bus(conn, "orders", 1)  # the name is free again, a new bus id
    assert catalog.get_bus(conn, "orders").rules == 0


def test_worker_delete_refused_while_it_holds_runners(conn, orders):
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)
    [w] = catalog.list_workers(conn)
    assert (w.name, w.runners, w.enabled) == ("w1", 1, True)
    with pytest.raises(catalog.ConflictError, match="holds 1 runners"):
        catalog.delete_worker(conn, "w1")
    catalog.delete_target(conn, "orders", "r", "t")
    catalog.delete_worker(conn, "w1")
    assert catalog.list_workers(conn) == []


def test_rule_names_by_target_url(conn, orders):
    assert catalog.rule_names_by_target_url(conn, "orders", "http://127.0.0.1:9/x") == ["r"]
    assert catalog.rule_names_by_target_url(conn, "orders", "http://127.0.0.1:9/y") == []


def test_rotate_key_reencrypts_every_sealed_column(conn, orders, tmp_path, monkeypatch):
    catalog.update_target(
        conn, "orders", "r", "t", secret=SECRET2, keep_old_secret=dt.timedelta(hours=1)
    )
    new_key = tmp_path / "new.key"
    sealed.write_key_file(new_key)
    assert sealed.rotate_key(conn, new_key) == 2
    monkeypatch.setenv(sealed.KEY_FILE_ENV, str(new_key))
    assert catalog.get_target(conn, "orders", "r", "t").secret_fingerprint == sealed.fingerprint(
        SECRET2
    )
    other = tmp_path / "other.key"
    sealed.write_key_file(other)
    monkeypatch.setenv(sealed.KEY_FILE_ENV, str(other))
    with pytest.raises(sealed.SecretKeyError, match="does not open with the key"):
        catalog.get_target(conn, "orders", "r", "t")


def test_migrate_seals_plain_text_secrets_once(empty_db_url):
    import psycopg2
    from alembic import command

    from eventpush.schema import _alembic_config, migrate

    command.upgrade(_alembic_config(empty_db_url), "0004_delivery_status_any_sink")
    c = psycopg2.connect(empty_db_url)
    try:
        with c.cursor() as cur:
            cur.execute("INSERT INTO event_bus (name, queues) VALUES ('b', 1) RETURNING id;")
            bus_id = cur.fetchone()[0]
            cur.execute(
                "INSERT INTO event_rule (bus_id, name, pattern) VALUES (%s, 'r', '{}') "
                "RETURNING id",
                (bus_id,),
            )
            cur.execute(
                "INSERT INTO event_target (rule_id, name, url, secret) "
                "VALUES (%s, 't', 'http://127.0.0.1:9/', %s)",
                (cur.fetchone()[0], SECRET),
            )
        c.commit()
        migrate(empty_db_url)
        migrate(empty_db_url)  # idempotent: sealed once, never twice
        with c.cursor() as cur:
            cur.execute("SELECT secret FROM event_target")
            (token,) = cur.fetchone()
            cur.execute("SELECT count(*) FROM event_runner_version")
            assert cur.fetchone()[0] == 0  # a target without runner has no history
    finally:
        c.close()
    assert token.startswith(sealed.TOKEN_PREFIX) and sealed.unseal(token) == SECRET
