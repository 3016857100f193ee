"""The dashboard in a real headless browser (Debian's chromium), served by the real Airflow API
server app over loopback HTTP, logged in with the UI's session cookie. The screenshot is kept
as artifacts/dashboard.png."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from ports import free_port
from support import rows

from eventpush import catalog
from eventpush.catalog import TargetSpec
from eventpush.demo.receiver import Receiver
from eventpush.publish import publish
from tests.airflow_fixtures import PASSWORDS, REPO, order_events, seed, wait_for

pytest_plugins = ["tests.airflow_fixtures"]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACT = REPO / "artifacts" / "dashboard.png"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="chromium is not installed (apt-get install -y chromium)",
)


@pytest.fixture(scope="module")
def api_server(airflow_db):
    """The Airflow API server app (with the plugin) under uvicorn on a loopback port."""
    import uvicorn
    from airflow.api_fastapi.app import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app("core"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="the API server")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


class Browser:
    """Headless chromium driven over the DevTools protocol (aiohttp websocket)."""

    def __init__(self, profile: str) -> None:
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helper processes too can be stopped as one group
        )
        port_file = Path(profile) / "DevToolsActivePort"
        wait_for(port_file.exists, timeout=30, what="chromium to start")
        wait_for(lambda: port_file.read_text().strip(), timeout=10, what="the DevTools port")
        self.port = int(port_file.read_text().split()[0])
        self.ids = iter(range(1, 1_000_000))

    def close(self) -> None:
        # The whole group: a helper process left behind still writes into the profile while
        # the test removes it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the last of the group is gone
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)

    async def session(self, run):
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
                target = await r.json()
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                events: list[dict] = []

                async def call(method: str, **params):
                    msg_id = next(self.ids)
                    await ws.send_json({"id": msg_id, "method": method, "params": params})
                    async for msg in ws:
                        data = json.loads(msg.data)
                        if data.get("id") == msg_id:
                            if "error" in data:
                                raise RuntimeError(f"{method}: {data['error']}")
                            return data.get("result", {})
                        events.append(data)
                    raise RuntimeError("DevTools connection closed")

                return await run(call, events)


def _fill(conn, url: str) -> None:
    """Real traffic through the engine (deliveries, a 410 failure), then a history of metric
    rows and an audit report so the charts have a past."""
    from eventpush.push import run_worker

    runners = seed(conn, f"{url}/ok")
    gone = catalog.create_target(
        conn, "orders", "orders-rule", TargetSpec(name="gone", url=f"{url}/gone", max_attempts=1)
    )
    catalog.assign(conn)
    publish(conn, "orders", order_events(40))
    for worker in ("w1", "w2"):
        run_worker(worker, until_idle=True, max_seconds=30)
    now = datetime.now(UTC)
    with conn.cursor() as cur:
        cur.execute("SELECT name, id, worker_id FROM event_target_runner")
        ids = {name: (rid, wid) for name, rid, wid in cur.fetchall()}
        rows = []
        for k, name in enumerate([*runners.values(), gone]):
            rid, wid = ids[name]
            delivered = 0
            for i in range(30):
                ts = now - timedelta(minutes=30 - i)
                rate = 40 + 25 * k + 15 * ((i * (k + 3)) % 7)
                delivered += rate * 60
                lag = max(0, int(800 * (1 + k) * (1 - i / 20)) + 30 * ((i * 5 + k) % 4))
                failed = i * k if name == gone else 0
                rows.append((ts, wid, rid, delivered, failed, lag, lag // 3, lag - lag // 3))
        cur.executemany(
            "INSERT INTO event_push_metric (ts, worker_id, runner_id, delivered, failed, lag, "
            "in_flight, waiting, p50_ms, p99_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 2, 9)",
            rows,
        )
        cur.execute(
            "INSERT INTO event_audit_report (bus, window_start, window_end, expected, delivered, "
            "failed, missing, pending, duplicates, runners) "
            "VALUES ('orders', %s, %s, 120, 80, 40, 0, 0, 0, %s)",
            (
                now - timedelta(hours=1),
                now,
                json.dumps(
                    [
                        {
                            "runner": n,
                            "expected": 40,
                            "delivered": 0 if n == gone else 40,
                            "failed": 40 if n == gone else 0,
                            "missing": 0,
                            "pending": 0,
                            "duplicates": 0,
                        }
                        for n in [*runners.values(), gone]
                    ]
                ),
            ),
        )
    conn.commit()


def test_dashboard_renders_charts_in_a_real_browser(api_server, conn, airflow_conn_env):
    from eventpush.airflow import queries

    queries._url_cache.clear()
    with Receiver() as rx:
        _fill(conn, rx.url)
    import httpx

    token = httpx.post(
        f"{api_server}/auth/token", json={"username": "viewer", "password": PASSWORDS["viewer"]}
    ).json()["access_token"]

    async def visit(call, events):
        await call("Network.enable")
        await call("Page.enable")
        await call("Network.setCookie", name="_token", value=token, url=api_server, httpOnly=True)
        await call(
            "Emulation.setDeviceMetricsOverride",
            width=1360,
            height=1200,
            deviceScaleFactor=1,
            mobile=False,
        )
        await call("Page.navigate", url=f"{api_server}/eventpush/dashboard")
        deadline = time.monotonic() + 20
        probe = (
            "JSON.stringify({ready: document.readyState, title: document.title,"
            " charts: document.querySelectorAll('svg.chart').length,"
            " lines: document.querySelectorAll('svg.chart polyline').length,"
            " text: document.body ? document.body.innerText : ''})"
        )
        while True:
            result = await call("Runtime.evaluate", expression=probe, returnByValue=True)
            page = json.loads(result["result"]["value"])
            if page["ready"] == "complete" and page["charts"]:
                break
            assert time.monotonic() < deadline, page
            await asyncio.sleep(0.2)
        # Live: a new audit with a gap shows up by polling, with no reload of the page. The
        # line is summed from the report's runners, so the gap is a runner's, as audits write.
        await call("Runtime.evaluate", expression="window.stayed = true")
        gap = {"runner": "orders/orders-rule/t0", "expected": 40, "delivered": 37}
        gap |= {"failed": 0, "missing": 3, "pending": 0, "duplicates": 0}
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO event_audit_report (bus, window_start, window_end, expected, "
                "delivered, failed, missing, pending, duplicates, runners) "
                "VALUES ('orders', now() - interval '1 hour', now(), 40, 37, 0, 3, 0, 0, %s)",
                (json.dumps([gap]),),
            )
        conn.commit()
        live = (
            "JSON.stringify({stayed: window.stayed === true,"
            " text: document.getElementById('live').innerText,"
            " charts: document.querySelectorAll('#live svg.chart').length})"
        )
        deadline = time.monotonic() + 20
        while True:
            result = await call("Runtime.evaluate", expression=live, returnByValue=True)
            updated = json.loads(result["result"]["value"])
            if "3 missing" in updated["text"]:
                break
            assert time.monotonic() < deadline, updated
            await asyncio.sleep(0.5)
        assert updated["stayed"] and updated["charts"] == 3
        shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        unauth = await call("Network.deleteCookies", name="_token", url=api_server)
        return page, base64.b64decode(shot["data"]), unauth

    with tempfile.TemporaryDirectory(prefix="eventpush-chromium-") as profile:
        browser = Browser(profile)
        try:
            page, png, _ = asyncio.run(browser.session(visit))
        finally:
            browser.close()
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_bytes(png)
    assert page["title"] == "eventpush"
    assert page["charts"] == 3
    assert page["lines"] >= 9  # three runners in each of the three charts
    text = page["text"]
    assert "orders/orders-rule/gone" in text and "Open failures" in text
    assert "410" in text  # the real failure the engine recorded
    assert "nothing missing" in text  # the last audit, before the live update
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def _rule_state(conn) -> tuple[str, int]:
    ((state, version),) = rows(
        conn, "SELECT state, version FROM event_rule WHERE name = %s", "orders-rule"
    )
    conn.commit()  # nothing held open while the server changes the rule
    return state, version


def test_a_rule_is_disabled_and_enabled_from_the_catalog_in_a_real_browser(
    api_server, conn, airflow_conn_env
):
    """An editor clicks the rule's button: the rule is DISABLED in the catalog (a new version)
    and the page says so without a reload; a second click enables it. A viewer's click is
    refused by the server, shown as the page's alert, and changes nothing."""
    import httpx

    from eventpush.airflow import queries

    queries._url_cache.clear()  # the plugin still knows the previous test's database
    seed(conn, "http://127.0.0.1:9/ok")
    tokens = {
        user: httpx.post(
            f"{api_server}/auth/token", json={"username": user, "password": PASSWORDS[user]}
        ).json()["access_token"]
        for user in ("editor", "viewer")
    }
    button = "document.querySelector('button[onclick^=\"ruleSwitch\"]')"
    probe = (
        f"JSON.stringify({{ready: document.readyState, button: {button} ? {button}.innerText : '',"
        " alerted: window.alerted || '', stayed: window.stayed === true})"
    )

    async def page_of(call) -> dict:
        result = await call("Runtime.evaluate", expression=probe, returnByValue=True)
        return json.loads(result["result"]["value"])

    async def until(call, predicate, what: str) -> dict:
        deadline = time.monotonic() + 20
        while True:
            page = await page_of(call)
            if predicate(page):
                return page
            assert time.monotonic() < deadline, f"{what}: {page}"
            await asyncio.sleep(0.2)

    async def as_user(user: str):
        async def visit(call, events):
            await call("Page.enable")
            await call("Network.enable")
            await call(
                "Network.setCookie",
                name="_token",
                value=tokens[user],
                url=api_server,
                httpOnly=True,
            )
            await call("Page.navigate", url=f"{api_server}/eventpush/dashboard")
            await until(call, lambda p: p["ready"] == "complete" and p["button"], "the page")
            # The page reports refusals with alert(): recorded instead of a blocking dialog.
            await call(
                "Runtime.evaluate",
                expression="window.alert = m => { window.alerted = String(m) }; "
                "window.stayed = true",
            )
            states = []
            for _ in range(2):
                before = (await page_of(call))["button"]
                await call("Runtime.evaluate", expression=f"{button}.click()")
                page = await until(
                    call,
                    lambda p, b=before: p["button"] != b or p["alerted"],
                    "the click's answer",
                )
                states.append((page["button"], page["alerted"], _rule_state(conn)))
                assert page["stayed"]  # updated in place, no reload
                if page["alerted"]:
                    break
            return states

        return await browser.session(visit)

    with tempfile.TemporaryDirectory(prefix="eventpush-chromium-") as profile:
        browser = Browser(profile)
        try:
            editor = asyncio.run(as_user("editor"))
            viewer = asyncio.run(as_user("viewer"))
        finally:
            browser.close()
    assert editor == [
        ("enable", "", ("DISABLED", 2)),
        ("disable", "", ("ENABLED", 3)),
    ]
    assert len(viewer) == 1
    label, alerted, state = viewer[0]
    assert label == "disable" and state == ("ENABLED", 3)
    assert "Forbidden" in alerted or "permission" in alerted.lower(), alerted


def test_a_refusal_with_a_list_of_reasons_is_said_in_words_in_a_real_browser(
    api_server, conn, airflow_conn_env
):
    """FastAPI's own refusals (422 of request validation) carry ``detail`` as a list of
    objects: the page's alert says their messages, not "[object Object]"; eventpush's own
    one-line refusals are shown as they were."""
    import httpx

    from eventpush.airflow import queries

    queries._url_cache.clear()  # the plugin still knows the previous test's database
    seed(conn, "http://127.0.0.1:9/ok")
    token = httpx.post(
        f"{api_server}/auth/token", json={"username": "editor", "password": PASSWORDS["editor"]}
    ).json()["access_token"]

    async def visit(call, events):
        await call("Page.enable")
        await call("Network.setCookie", name="_token", value=token, url=api_server, httpOnly=True)
        await call("Page.navigate", url=f"{api_server}/eventpush/dashboard")
        deadline = time.monotonic() + 20
        ready = "document.readyState === 'complete' && typeof control === 'function'"
        while not (await call("Runtime.evaluate", expression=ready))["result"]["value"]:
            assert time.monotonic() < deadline, "the page did not load"
            await asyncio.sleep(0.2)
        said = []
        # The page's own calls, as its buttons make them; alert() recorded, not a dialog.
        for args in ("'pause', 'galaxy', 'w1'", "'pause', 'worker', 'nobody'"):
            expression = (
                "window.alerted = null; window.alert = m => { window.alerted = String(m) }; "
                f"control({args}).then(() => window.alerted)"
            )
            result = await call(
                "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
            )
            said.append(result["result"]["value"])
        return said

    with tempfile.TemporaryDirectory(prefix="eventpush-chromium-") as profile:
        browser = Browser(profile)
        try:
            invalid, unknown = asyncio.run(browser.session(visit))
        finally:
            browser.close()
    assert "[object Object]" not in invalid
    assert invalid.startswith("scope: Input should be 'worker' or 'runner'"), invalid
    assert unknown == "unknown worker 'nobody'"
