"""Targets as adversaries, against real PostgreSQL and real HTTP receivers on loopback.

Every forbidden address is played by 127.0.0.2, which the suite's policy denies (conftest
allows 127.0.0.1 only): no packet leaves loopback, and a second receiver there proves that
nothing reached it. After each hostile answer nothing is lost: every matching event is in
the delivery log or in event_push_failure, and the offsets are committed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest

from eventpush import catalog
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from eventpush.push import run_worker

DENIED_HOST = "127.0.0.2"


@pytest.fixture
def rx():
    with Receiver() as receiver:
        yield receiver


@pytest.fixture
def denied_rx():
    """A receiver on the denied loopback address: it must never see a request."""
    with Receiver(host=DENIED_HOST) as receiver:
        yield receiver


def events(n: int) -> list[str]:
    return [
        json.dumps({"source": "shop", "detail-type": "Order", "detail": {"n": i}}) for i in range(n)
    ]


def setup_runner(conn, url: str, **spec) -> None:
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_target(conn, "orders", "r", catalog.TargetSpec(name="t", url=url, **spec))
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def set_url(conn, url: str) -> None:
    """Point the target somewhere catalog.create_target refuses: a target made before the
    policy changed, or written into the database directly. The engine must still refuse."""
    with conn.cursor() as cur:
        cur.execute("UPDATE event_target SET url = %s", (url,))
    conn.commit()


def rows(conn, sql: str, *params):
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def assert_nothing_lost(conn, n: int) -> None:
    [(accounted,)] = rows(
        conn,
        'SELECT count(*) FROM (SELECT queue_id, "offset" FROM event_push_delivery '
        'UNION SELECT queue_id, "offset" FROM event_push_failure) x',
    )
    assert accounted == n
    [(lag,)] = rows(
        conn,
        'SELECT coalesce(sum(q.next_offset - o."offset"), 0) FROM event_push_offset o '
        "JOIN event_bus_queue q ON q.queue_id = o.queue_id",
    )
    assert lag == 0


FAR_FUTURE = format_datetime(datetime(9999, 12, 31, tzinfo=UTC), usegmt=True)
PAST = format_datetime(datetime.now(UTC) - timedelta(days=2), usegmt=True)


@pytest.mark.parametrize("ordered", [False, True], ids=["lanes", "ordered"])
@pytest.mark.parametrize(
    "value", ["nan", "inf", "-5", "1e308", "99999999999999999999", "garbage", PAST, FAR_FUTURE]
)
def test_any_retry_after_lets_the_runner_complete(conn, rx, value, ordered):
    # First attempt of each event: 503 with the hostile Retry-After; the second gets a 200.
    # A delay past max_age_s means the record fails at once (recorded, replayable).
    setup_runner(
        conn,
        f"{rx.url}/retryafter?value={quote(value)}",
        backoff_ms=5,
        max_age_s=30,
        ordered=ordered,
    )
    publish(conn, "orders", events(6))
    started = time.monotonic()
    report = run_worker("w1", until_idle=True, max_seconds=40)
    assert time.monotonic() - started < 20, "the runner froze"
    assert report.delivered + report.failed == 6
    statuses = rows(conn, "SELECT DISTINCT http_status, last_error FROM event_push_failure")
    assert statuses in ([], [(503, "HTTP 503")])
    assert_nothing_lost(conn, 6)


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_to_a_denied_address_is_an_answer_not_followed(conn, rx, denied_rx, code):
    location = f"{denied_rx.url}/ok?token=REDIRSECRET"
    setup_runner(
        conn,
        f"{rx.url}/redirect?code={code}&to={quote(location, safe='')}",
        secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    )
    publish(conn, "orders", events(4))
    report = run_worker("w1", until_idle=True, max_seconds=30)
    assert (report.delivered, report.failed) == (0, 4)
    assert sum(denied_rx.state.count.values()) == 0, "no request may reach the Location"
    [(attempts, status, error)] = rows(
        conn, "SELECT DISTINCT attempts, http_status, last_error FROM event_push_failure"
    )
    assert (attempts, status) == (1, code)
    assert error == f"HTTP {code}: redirect to {denied_rx.url}/ok?*** not followed"
    assert_nothing_lost(conn, 4)


def test_a_redirect_to_an_allowed_address_is_not_followed_either(conn, rx):
    setup_runner(conn, f"{rx.url}/redirect?code=307&to={quote(rx.url + '/ok', safe='')}")
    publish(conn, "orders", events(3))
    report = run_worker("w1", until_idle=True, max_seconds=30)
    assert report.failed == 3 and rx.state.count["/ok"] == 0
    assert_nothing_lost(conn, 3)


def test_an_ip_literal_target_is_checked_at_connect_time(conn, rx, denied_rx):
    setup_runner(conn, f"{rx.url}/ok")
    set_url(conn, f"{denied_rx.url}/ok")
    publish(conn, "orders", events(5))
    report = run_worker("w1", until_idle=True, max_seconds=30)
    assert (report.delivered, report.failed) == (0, 5)
    assert sum(denied_rx.state.count.values()) == 0
    [(attempts, status, error)] = rows(
        conn, "SELECT DISTINCT attempts, http_status, last_error FROM event_push_failure"
    )
    assert (attempts, status) == (1, None)
    assert error.startswith("refused address: address 127.0.0.2 is in the denied range")
    assert_nothing_lost(conn, 5)


def test_a_name_resolving_to_a_denied_address_is_refused(conn, rx, monkeypatch):
    port = rx.url.rsplit(":", 1)[1]
    setup_runner(conn, f"http://localhost:{port}/ok")  # a name: checked when connecting
    # localhost resolves to 127.0.0.1 (allowed) and maybe ::1: deny both by configuration.
    monkeypatch.setenv("EVENTPUSH_DENY_CIDRS", "127.0.0.1/32,::1/128")
    publish(conn, "orders", events(3))
    report = run_worker("w1", until_idle=True, max_seconds=30)
    assert report.failed == 3 and rx.state.count["/ok"] == 0
    [(error,)] = rows(conn, "SELECT DISTINCT last_error FROM event_push_failure")
    assert "refused address" in error and "EVENTPUSH_DENY_CIDRS" in error


def test_a_huge_body_is_not_read(conn, rx):
    """A 256 MiB answer per request: the worker (a process of its own) stays small."""
    setup_runner(conn, f"{rx.url}/huge?mib=256", concurrency=4)
    publish(conn, "orders", events(8))
    exe = str(Path(sys.executable).with_name("eventpush"))
    proc = subprocess.Popen(
        [exe, "worker", "run", "w1", "--until-idle", "--max-seconds", "60", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watched = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out)["delivered"] == 8
    assert rx.state.count["/huge"] == 8
    assert peak < 300 * 2**20, f"worker peak RSS {peak / 2**20:.0f} MiB"
    assert_nothing_lost(conn, 8)


SECRETS = ("TOKENSECRET", "PASSSECRET", "USERSECRET", "FRAGSECRET")


def secret_url(base: str, path: str) -> str:
    host = base.split("://", 1)[1]
    return f"http://USERSECRET:PASSSECRET@{host}{path}?token=TOKENSECRET&x=1#FRAGSECRET"


@pytest.mark.parametrize("path", ["/reset", "/gone", "/redirect-loop", "/closed-port", "/denied"])
def test_secrets_in_a_target_url_never_reach_a_row_a_log_or_the_status(
    conn, rx, denied_rx, cli, caplog, path
):
    setup_runner(conn, f"{rx.url}/ok", max_attempts=2, backoff_ms=5, timeout_ms=300)
    if path == "/closed-port":
        url = secret_url("http://127.0.0.1:9", "/hook")  # discard port: nothing listens
    elif path == "/denied":
        url = secret_url(denied_rx.url, "/ok")
    elif path == "/redirect-loop":  # followed, this ends in aiohttp's TooManyRedirects
        url = secret_url(rx.url, "/redirect").replace("?token=", "?code=307&token=")
    else:
        url = secret_url(rx.url, path)
    set_url(conn, url)
    publish(conn, "orders", events(3))
    caplog.set_level(logging.DEBUG)
    report = run_worker("w1", until_idle=True, max_seconds=30)
    assert report.failed == 3
    assert sum(denied_rx.state.count.values()) == 0
    errors = [e for (e,) in rows(conn, "SELECT last_error FROM event_push_failure")]
    shown = [
        *errors,
        caplog.text,
        cli("status", "--json").stdout,
        cli("status").stdout,
    ]
    for text in shown:
        for secret in SECRETS:
            assert secret not in text
    assert_nothing_lost(conn, 3)


@pytest.mark.parametrize("host", [DENIED_HOST, "[::ffff:127.0.0.2]", "[::127.0.0.2]"])
def test_the_delivery_client_refuses_before_connecting(denied_rx, host):
    """The client alone (as engine and replay use it): a denied address, in IPv4 or an
    embedded IPv6 form, is refused before its socket connects, and says it never got there."""
    import asyncio

    from eventpush.sinks import contract, http

    port = denied_rx.url.rsplit(":", 1)[1]
    target = contract.Target(
        1, "b/r/t", "b", 1, "r", "{}", "t", f"http://{host}:{port}/ok?token=TOKENSECRET"
    )

    async def send():
        async with http.new_session() as session:
            return await http.attempt(session, target, b"{}", {})

    outcome = asyncio.run(send())
    assert (outcome.kind, outcome.http_status, outcome.reached) == (contract.FINAL, None, False)
    assert outcome.error.startswith("refused address: address ")
    assert "TOKENSECRET" not in outcome.error
    assert sum(denied_rx.state.count.values()) == 0
