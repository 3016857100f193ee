"""The Airflow path as a new user takes it: ``scripts/airflow-standalone.sh`` (what ``./dev
airflow`` runs) on a fresh AIRFLOW_HOME and a database of its own, started once for the module:
the real API server and UI, scheduler, DAG processor and triggerer, tasks under the
LocalExecutor, and every Spark job a real ``spark-submit`` in local mode through the
``spark_default`` connection the script sets.

- The REST API: a replay triggered with a conf, polled to success, its counts read from the
  ``report`` task's XCom; a value the form schema refuses is answered 400 at once.
- A real browser (Playwright driving Debian's headless chromium, no browser download): log in,
  fill and trigger the ``eventpush_replay`` form, see the run succeed and its result on the
  eventpush dashboard, then a second run with an unknown target and the error a person reads
  in its log. Screenshots of each step go to ``artifacts/airflow-ui/``.
- The batch DAGs are active from the start: the scheduled audit and rebalance run and succeed
  with nobody unpausing them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg2
import pytest
from batch_support import events, make_runner, publish_lines, simulate_push
from conftest import ADMIN_URL, _admin
from ports import free_port
from receiver_support import receiver

from eventpush import catalog
from tests.airflow_fixtures import REPO

__all__ = ["receiver"]  # the fixture, one for the module (receiver_support)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = REPO / "artifacts" / "airflow-ui"
START_TIMEOUT_S = 600.0  # first start on a busy 2-core machine: imports, metadata DB, parse
RUN_TIMEOUT_S = 900.0  # a Spark DAG run (three task processes, a spark-submit JVM), busy machine
BATCH_DAGS = ("eventpush_audit", "eventpush_rebalance", "eventpush_replay")

# Ceilings for a machine shared with other work, not the expected times: setup (one Airflow
# start) is charged to the first test, and each run is a real Spark job.
pytestmark = pytest.mark.timeout(2400)


@dataclass
class Platform:
    """The running standalone Airflow and what a user knows about it."""

    base: str
    password: str
    db_url: str
    log: Path
    home: Path

    def token(self) -> str:
        r = httpx.post(
            f"{self.base}/auth/token",
            json={"username": "admin", "password": self.password},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        return r.json()["access_token"]

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token()}"}
        return httpx.request(
            method, f"{self.base}/api/v2/{path}", headers=headers, timeout=60, **kw
        )

    def run_path(self, dag_id: str, run_id: str) -> str:
        return f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}"

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        r = self.api("GET", f"{self.run_path(dag_id, run_id)}/taskInstances")
        return {t["task_id"]: t["state"] for t in r.json()["task_instances"]}

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = RUN_TIMEOUT_S) -> dict:
        """The run once it has finished (success or failed)."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.api("GET", self.run_path(dag_id, run_id)).json()
            if run.get("state") in ("success", "failed"):
                return run
            assert time.monotonic() < deadline, (
                f"{dag_id} {run_id} still {run.get('state')}: "
                f"{self.task_states(dag_id, run_id)}\n{self.log_tail()}"
            )
            time.sleep(2)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _seed(url: str, receiver_url: str) -> None:
    """A bus with two targets whose earlier pushes left failure records (crm: 2, billing: 3),
    and one enabled worker for the rebalance to place their runners on."""
    conn = psycopg2.connect(url)
    try:
        pattern = {"source": ["app.orders"]}
        crm = make_runner(conn, "orders", "all", "crm", pattern, url=f"{receiver_url}/ok/crm")
        billing = make_runner(
            conn, "orders", "all", "billing", pattern, url=f"{receiver_url}/ok/billing"
        )
        catalog.create_worker(conn, "w1")
        publish_lines(conn, "orders", events(6))
        simulate_push(conn, crm, fail={0, 1})
        simulate_push(conn, billing, fail={2, 3, 4})
    finally:
        conn.close()


@pytest.fixture(scope="module")
def standalone(template_db, receiver):
    """``scripts/airflow-standalone.sh`` as ``./dev airflow`` runs it, on its own database,
    AIRFLOW_HOME and ports; stopped (the whole process group) afterwards."""
    name = f"eventpush_test_ui_{uuid.uuid4().hex[:8]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    db_url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    home = Path(tempfile.mkdtemp(prefix="eventpush-standalone-"))
    SHOTS.mkdir(parents=True, exist_ok=True)
    log = SHOTS / "standalone.log"
    proc = None
    try:
        _seed(db_url, receiver.url)
        port = free_port()
        # Nothing of the test session's own Airflow setup leaks in: the script alone decides.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.pop("EVENTPUSH_SPARK_MASTER", None)
        env.update(
            EVENTPUSH_DATABASE_URL=db_url,
            EVENTPUSH_AIRFLOW_HOME=str(home),
            EVENTPUSH_AIRFLOW_PORT=str(port),
            EVENTPUSH_VENV=sys.prefix,
            # the log servers' fixed default ports may be taken by another Airflow here
            AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(free_port()),
            AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(free_port()),
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(REPO / "scripts" / "airflow-standalone.sh")],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        passwords = home / "simple_auth_manager_passwords.json.generated"
        deadline = time.monotonic() + START_TIMEOUT_S
        standalone = None
        while True:
            assert proc.poll() is None, f"the script exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"Airflow did not come up:\n{log.read_text()}"
            time.sleep(2)
            if standalone is None:
                try:
                    up = httpx.get(f"{base}/api/v2/monitor/health", timeout=10).status_code
                except httpx.HTTPError:
                    continue
                if up != 200 or not passwords.exists():
                    continue
                password = json.loads(passwords.read_text())["admin"]
                standalone = Platform(base, password, db_url, log, home)
            dags = standalone.api("GET", "dags", params={"dag_id_pattern": "eventpush"}).json()
            if {d["dag_id"] for d in dags.get("dags", [])} >= {"eventpush_push", *BATCH_DAGS}:
                break
        yield standalone
    finally:
        if proc is not None:
            _stop(proc)
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(home, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C as a user would, then the whole session (tasks and spark-submit included)."""
    proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(3)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def test_the_banner_says_what_runs_where(standalone):
    deadline = time.monotonic() + 60
    while "eventpush on Airflow standalone" not in standalone.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, standalone.log_tail()
        time.sleep(1)
    text = standalone.log.read_text(errors="replace")
    assert f"Airflow UI           {standalone.base}/" in text
    assert f"{standalone.base}/plugin/eventpush" in text
    assert "spark_default  local[*]" in text and "Spark jobs (spark_default): local[*]" in text
    assert "eventpush_replay     on demand only" in text
    assert "first start" in text
    dags = standalone.api("GET", "dags", params={"dag_id_pattern": "eventpush"}).json()["dags"]
    assert {d["dag_id"]: d["is_paused"] for d in dags} == {
        "eventpush_push": False,
        "eventpush_push_checks": False,
        "eventpush_audit": False,
        "eventpush_rebalance": False,
        "eventpush_replay": False,
        "eventpush_replay_gaps": False,  # runs, but replays only when its Variable says so
        "eventpush_retention": False,
    }
    assert "eventpush_retention  daily at 00:05" in text


def test_scheduled_audit_and_rebalance_run_without_unpausing(standalone):
    """Active on creation: the scheduler starts each one's latest interval by itself. Runs
    before the replays so that their Spark jobs do not share the machine with these."""
    for dag_id in ("eventpush_audit", "eventpush_rebalance"):
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            runs = standalone.api(
                "GET", f"dags/{dag_id}/dagRuns", params={"run_type": "scheduled"}
            ).json()["dag_runs"]
            if runs:
                break
            assert time.monotonic() < deadline, (
                f"no scheduled {dag_id} run\n{standalone.log_tail()}"
            )
            time.sleep(2)
        run = standalone.wait_for_run(dag_id, runs[0]["dag_run_id"])
        assert run["state"] == "success", standalone.task_states(dag_id, run["dag_run_id"])
    with psycopg2.connect(standalone.db_url) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT count(*) FILTER (WHERE worker_id IS NOT NULL), count(*) "
            "FROM event_target_runner"
        )
        assert cur.fetchone() == (2, 2)  # the rebalance placed both runners on w1
        cur.execute("SELECT missing FROM event_audit_report")
        missing = [m for (m,) in cur.fetchall()]
        assert missing and set(missing) == {0}  # nothing was lost in the audited hour


def test_replay_through_the_rest_api(standalone, receiver):
    refused = standalone.api(
        "POST",
        "dags/eventpush_replay/dagRuns",
        json={"logical_date": None, "conf": {"max_count": -5}},
    )
    assert refused.status_code == 400, refused.text
    assert "-5 is less than the minimum of 1" in refused.json()["detail"]

    r = standalone.api(
        "POST",
        "dags/eventpush_replay/dagRuns",
        json={"logical_date": None, "conf": {"what": "failed", "target": "crm"}},
    )
    assert r.status_code == 200, r.text
    run_id = r.json()["dag_run_id"]
    run = standalone.wait_for_run("eventpush_replay", run_id)
    assert run["state"] == "success", (
        standalone.task_states("eventpush_replay", run_id),
        standalone.log_tail(),
    )
    xcom = standalone.api(
        "GET",
        f"{standalone.run_path('eventpush_replay', run_id)}"
        "/taskInstances/report/xcomEntries/return_value",
    )
    assert xcom.status_code == 200, xcom.text
    result = xcom.json()["value"]
    assert {k: result[k] for k in ("status", "selected", "delivered", "failed", "dry_run")} == {
        "status": "succeeded",
        "selected": 2,
        "delivered": 2,
        "failed": 0,
        "dry_run": False,
    }
    assert len(receiver.state.delivered("/ok/crm")) == 2  # really pushed, by the Spark executors
    assert receiver.state.delivered("/ok/billing") == []  # out of the request's scope
    with psycopg2.connect(standalone.db_url) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT f.status, count(*) FROM event_push_failure f JOIN event_target_runner r "
            "ON r.id = f.runner_id WHERE r.name LIKE %s GROUP BY 1",
            ("%/crm",),
        )
        assert cur.fetchall() == [("replayed", 2)]


def test_replay_from_the_ui_in_a_real_browser(standalone, receiver):
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    good_run = f"ui-replay-billing-{uuid.uuid4().hex[:6]}"
    bad_run = f"ui-replay-unknown-target-{uuid.uuid4().hex[:6]}"
    base = standalone.base
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-quic"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)  # a busy machine renders the UI slowly

            def shot(name: str, **kw) -> None:
                page.screenshot(path=str(SHOTS / f"{name}.png"), **kw)

            page.goto(f"{base}/")
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(standalone.password)
            shot("01-login")
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url(f"{base}/")

            def trigger(target: str, run_id: str, step: str) -> None:
                page.goto(f"{base}/dags/eventpush_replay")
                page.get_by_role("button", name="Trigger").first.click()
                dialog = page.get_by_role("dialog")
                dialog.get_by_text("Maximum count").wait_for()
                dialog.locator("#element_target").fill(target)
                shot(f"{step}-form")
                # a run id of our own, to find the run again (the accordion shows one section)
                dialog.get_by_role("button", name="Advanced Options").click()
                dialog.locator("input[name=dagRunId]").fill(run_id)
                shot(f"{step}-form-run-id")
                dialog.get_by_role("button", name="Trigger", exact=True).click()
                dialog.wait_for(state="hidden")

            trigger("billing", good_run, "02")
            run = standalone.wait_for_run("eventpush_replay", good_run)
            assert run["conf"]["target"] == "billing" and run["conf"]["what"] == "failed"
            assert run["state"] == "success", standalone.task_states("eventpush_replay", good_run)
            page.goto(f"{base}/dags/eventpush_replay/runs/{good_run}")
            page.get_by_text("Success").first.wait_for()
            shot("03-run-succeeded")

            page.goto(f"{base}/plugin/eventpush")  # Browse > Event push
            dashboard = page.frame_locator("iframe").first
            row = dashboard.locator("tr", has_text=good_run)
            row.wait_for()
            row.scroll_into_view_if_needed()
            shot("04-dashboard-replay")
            cells = [c.strip() for c in row.locator("td").all_inner_texts()]
            # replay, run, what, scope, status, selected, delivered, failed, started, error
            assert cells[1:8] == [good_run, "failed", "target billing", "succeeded", "3", "3", "0"]
            assert len(receiver.state.delivered("/ok/billing")) == 3

            trigger("no-such-target", bad_run, "05")
            run = standalone.wait_for_run("eventpush_replay", bad_run)
            assert run["state"] == "failed"
            assert standalone.task_states("eventpush_replay", bad_run)["check_request"] == "failed"
            page.goto(f"{base}/dags/eventpush_replay/runs/{bad_run}/tasks/check_request")
            message = "replay request refused: unknown target 'no-such-target'"
            page.get_by_text(message).first.wait_for()
            shot("06-bad-run-error")
        finally:
            browser.close()


def test_replays_through_the_eventbridge_api_run_on_airflow(standalone, receiver, tmp_path):
    """``eventpush api --airflow-url --airflow-token-file`` on this Airflow: StartReplay with
    boto3 triggers the replay DAG (every event of the archive's bus in the window, narrowed to
    one rule), DescribeReplay follows it to COMPLETED and ListReplays lists it; a second
    StartReplay of that name and a CancelReplay of a finished replay are refused with AWS's
    codes."""
    from datetime import UTC, datetime, timedelta

    from api_support import ApiServer
    from botocore.exceptions import ClientError

    from eventpush import access_keys

    with psycopg2.connect(standalone.db_url) as conn:
        made = access_keys.create_key(conn, "ops", "admin")
    token_file = tmp_path / "airflow.token"
    token_file.write_text(standalone.token())
    token_file.chmod(0o600)
    env = {**os.environ, "EVENTPUSH_DATABASE_URL": standalone.db_url}
    server = ApiServer(
        env, "--airflow-url", standalone.base, "--airflow-token-file", str(token_file)
    )
    before = {path: len(receiver.state.delivered(path)) for path in ("/ok/crm", "/ok/billing")}
    try:
        events_api = server.client((made.info.access_key_id, made.secret_access_key))
        archive = events_api.describe_archive(ArchiveName="orders")
        rule = events_api.describe_rule(Name="all", EventBusName="orders")
        now = datetime.now(UTC)
        request = {
            "ReplayName": "all-again",
            "EventSourceArn": archive["ArchiveArn"],
            "EventStartTime": now - timedelta(days=1),
            "EventEndTime": now + timedelta(hours=1),
            "Destination": {"Arn": archive["EventSourceArn"], "FilterArns": [rule["Arn"]]},
        }
        started = events_api.start_replay(**request)
        assert started["State"] in ("STARTING", "RUNNING"), started
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            replay = events_api.describe_replay(ReplayName="all-again")
            if replay["State"] in ("COMPLETED", "FAILED"):
                break
            assert time.monotonic() < deadline, replay
            time.sleep(2)
        assert replay["State"] == "COMPLETED", (
            standalone.task_states("eventpush_replay", "replay-all-again"),
            standalone.log_tail(),
        )
        listed = events_api.list_replays(NamePrefix="all-")["Replays"]
        assert [(r["ReplayName"], r["State"]) for r in listed] == [("all-again", "COMPLETED")]
        for call, code in (
            (lambda: events_api.start_replay(**request), "ResourceAlreadyExistsException"),
            (lambda: events_api.cancel_replay(ReplayName="all-again"), "IllegalStatusException"),
            (lambda: events_api.describe_replay(ReplayName="nope"), "ResourceNotFoundException"),
        ):
            with pytest.raises(ClientError) as refused:
                call()
            assert refused.value.response["Error"]["Code"] == code
    finally:
        server.stop()
    # what=all: the bus's six events went again to both of the rule's targets.
    after = {path: len(receiver.state.delivered(path)) for path in before}
    assert {path: after[path] - before[path] for path in before} == {
        "/ok/crm": 6,
        "/ok/billing": 6,
    }
