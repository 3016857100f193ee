"""Helpers the test modules share, in one place instead of a copy in each.

- ``rx``: a function-scoped receiver (``eventpush.demo.receiver``) on loopback; a module takes
  it with ``from support import rx`` (not in conftest: modules with a receiver of another
  scope or host name theirs differently, see receiver_support.py).
- ``events(n)``: n shop order events as JSON text, ``detail.n`` numbering them.
- ``rows(conn, sql, *params)``: every row of a parameterised query.
- ``wait_until(check, timeout, what)``: poll ``check`` until it answers something true; fail
  with ``what`` past the timeout.
- ``free_port`` is ``ports.free_port`` (below the ephemeral range).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from ports import free_port

from eventpush.demo.receiver import Receiver

__all__ = ["events", "free_port", "rows", "rx", "wait_until"]


@pytest.fixture
def rx() -> Iterator[Receiver]:
    with Receiver() as receiver:
        yield receiver


def events(n: int) -> list[str]:
    return [
        json.dumps({"source": "shop", "detail-type": "Order", "detail": {"n": i}}) for i in range(n)
    ]


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def wait_until(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
