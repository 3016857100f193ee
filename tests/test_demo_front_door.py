"""The demo's front door (eventpush.demo.front_door): the real ``eventpush api`` in its own
process, the demo's own events published with boto3's PutEvents under a producer key, every
accepted entry stored on the bus and nothing else."""

from __future__ import annotations

import json

import pytest
from ports import free_port

from eventpush import access_keys, catalog
from eventpush.demo.front_door import ApiProcess, put_events
from eventpush.demo.story import events


def test_the_demo_publishes_its_shop_through_the_api(conn, db_url):
    catalog.create_bus(conn, "commerce", 4)
    catalog.create_bus(conn, "other", 1)
    shop = access_keys.create_key(conn, "demo-shop", "producer", ["commerce"])
    key = (shop.info.access_key_id, shop.secret_access_key)
    details = events(95)  # ten calls, the last one with five entries
    api = ApiProcess(free_port(), db_url)
    try:
        assert put_events(api.url, key, "commerce", details, threads=4) == 95
        # The producer key names only commerce: a call on another bus fails loudly.
        with pytest.raises(Exception, match="AccessDenied|not allowed|may not"):
            put_events(api.url, key, "other", details[:1], threads=1)
    finally:
        api.stop()
    assert api.proc.returncode is not None
    with conn.cursor() as cur:
        cur.execute(
            "SELECT b.name, e.source, e.detail_type, e.body->'detail' FROM bus_event e "
            "JOIN event_bus b ON b.id = e.bus_id"
        )
        stored = cur.fetchall()
    published = [("commerce", d["source"], d["detail-type"], d["detail"]) for d in details]
    assert sorted(map(_canonical, stored)) == sorted(map(_canonical, published))


def _canonical(row: tuple) -> str:
    return json.dumps(row, sort_keys=True)
