"""The batch DAGs on Airflow's CeleryExecutor with Spark on a standalone cluster, for real.

One cluster for the module (``scripts/cluster.sh up``: a Spark master and two workers from
pyspark's own ``spark-class``, Airflow's API server, scheduler, DAG processor, triggerer and
two Celery workers on the machine's Redis), on ports, a queue, an AIRFLOW_HOME and a metadata
database of its own. A demo-sized catalog is made once and copied twice: the cluster works on
one copy, Spark local mode (``local[2]``, in process through the CLI) on the other, and each
DAG's result must equal local mode's. The Spark workers run with a PATH whose python3 is not
the checkout's venv; the executors report the interpreter they run, which must be the packed
environment shipped with the job. Last, a Celery worker is killed with SIGKILL in the middle
of a push slice: the slice is retried on the other worker and nothing is lost.

The cluster's slow one-time setup (packed executor environment, metadata database) starts in
the background when collection ends (tests/cluster_support.py). It runs no schedules: only the
runs the tests trigger, the audit's and the rebalance's side by side (one Spark core each).
Part of ``./dev test``; ``-m cluster`` selects these alone, ``-m 'not cluster'`` leaves them
out (a few minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import cluster_support
import httpx
import psycopg2
import pytest
from batch_support import events, make_runner, publish_lines, simulate_push
from cluster_support import PASSWORD, REPO, VENV
from conftest import ADMIN_URL, RUN_ID, _admin, _drop, _server
from ports import free_port_base
from receiver_support import receiver

from eventpush import catalog
from eventpush.catalog import TargetSpec
from eventpush.sparkjobs.session import EXECUTOR_PYTHON_MARK

__all__ = ["receiver"]  # the fixture, one for the module (receiver_support)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]

SINCE = datetime.now(UTC) - timedelta(hours=1)
UNTIL = datetime.now(UTC) + timedelta(hours=1)
AUDIT_CONF = {"since": SINCE.isoformat(), "until": UNTIL.isoformat()}
# The rebalance's load window, given to both sides: the default (15 minutes) is shorter than a
# loaded run of this module, and deliveries older than the window weigh nothing, which changes
# the result (by count instead of by load). A day holds every delivery made here.
LOAD_WINDOW_MINUTES = 24 * 60


def _make_dataset(url: str, receiver_url: str) -> None:
    """Three runners on one bus, all first given to w1 (w2 comes later: rebalancing has work);
    2000 events pushed by ``simulate_push`` with failures, then two delivery rows removed so
    the audit finds a gap."""
    conn = psycopg2.connect(url)
    try:
        catalog.create_worker(conn, "w1")
        runners = [
            make_runner(
                conn, "orders", "all", name, {"source": ["app.orders"]}, url=f"{receiver_url}/ok"
            )
            for name in ("crm", "erp")
        ]
        runners.append(
            make_runner(
                conn,
                "orders",
                "big",
                "warehouse",
                {"source": ["app.orders"], "detail": {"n": [{"numeric": [">=", 1500]}]}},
                url=f"{receiver_url}/ok/warehouse",
            )
        )
        catalog.assign(conn)
        catalog.create_worker(conn, "w2")
        publish_lines(conn, "orders", events(2000))
        for i, runner in enumerate(runners):
            simulate_push(conn, runner, fail=set(range(i, 2000, 97)))
        with conn.cursor() as cur:
            cur.execute(
                "DELETE FROM event_push_delivery WHERE id IN "
                "(SELECT id FROM event_push_delivery ORDER BY id LIMIT 2)"
            )
        conn.commit()
    finally:
        conn.close()


def _clone(template: str, name: str) -> str:
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return f"{_server(ADMIN_URL)}/{name}"


def _cli(url: str, *args: str) -> dict:
    """The eventpush CLI in Spark local mode on ``url``; its JSON output."""
    env = {
        **os.environ,
        "EVENTPUSH_DATABASE_URL": url,
        "EVENTPUSH_SPARK_MASTER": "local[2]",
        "PYTHONPATH": str(REPO / "include"),
    }
    done = subprocess.run(
        [str(VENV / "bin" / "eventpush"), *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


class Cluster:
    def __init__(self, env: dict[str, str], directory: Path, base: int) -> None:
        self.env = env
        self.dir = directory
        self.api = f"http://127.0.0.1:{base}"
        self._token: str | None = None

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(REPO / "scripts" / "cluster.sh"), *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def script(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "scripts" / "cluster.sh"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pid(self, service: str) -> int:
        return int((self.dir / "pids" / f"{service}.pid").read_text())

    def http(self) -> httpx.Client:
        if self._token is None:
            r = httpx.post(
                f"{self.api}/auth/token", json={"username": "admin", "password": PASSWORD}
            )
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return httpx.Client(
            base_url=f"{self.api}/api/v2",
            headers={"Authorization": f"Bearer {self._token}"},
            timeout=30,
        )

    def trigger(self, dag_id: str, conf: dict) -> str:
        with self.http() as h:
            # A logical date, as the UI's trigger form gives: eventpush_audit's window task
            # reads the data interval, which a run without one does not have.
            when = datetime.now(UTC).isoformat()
            r = h.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": when, "conf": conf})
            assert r.status_code == 200, r.text
            return r.json()["dag_run_id"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        with self.http() as h:
            r = h.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
            r.raise_for_status()
        return {
            ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""): ti["state"]
            for ti in r.json()["task_instances"]
        }

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 420) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.http() as h:
                state = h.get(f"/dags/{dag_id}/dagRuns/{run_id}").json()["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(1)
        raise AssertionError(
            f"{dag_id} {run_id} not done in {timeout}s: "
            f"{self.task_states(dag_id, run_id)}; logs in {self.dir}/logs"
        )

    def failures(self, dag_id: str, run_id: str) -> str:
        """The task states of a run and the last lines of each failed task's log."""
        states = self.task_states(dag_id, run_id)
        text = [json.dumps(states)]
        run_dir = self.dir / "airflow" / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
        for log in sorted(run_dir.glob("task_id=*/**/*.log")):
            lines = log.read_text(errors="replace").splitlines()
            if any('"level":"error"' in line for line in lines):
                text.append(f"--- {log.relative_to(run_dir)}")
                text.extend(line[:400] for line in lines[-15:])
        return "\n".join(text)

    def task_log(self, dag_id: str, run_id: str, task_id: str, attempt: int = 1) -> str:
        path = (
            self.dir
            / "airflow"
            / "logs"
            / f"dag_id={dag_id}"
            / f"run_id={run_id}"
            / f"task_id={task_id}"
            / f"attempt={attempt}.log"
        )
        return path.read_text()


@pytest.fixture(scope="module")
def dbs(template_db, receiver):
    """(cluster database URL, local-mode database URL): two copies of one dataset. The
    cluster's has the name its Airflow was given at start (cluster_support)."""
    setup = cluster_support.begin(ADMIN_URL, RUN_ID, background=False)
    seed = f"eventpush_test_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    local = f"eventpush_test_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    try:
        _make_dataset(_clone(template_db, seed), receiver.url)
        yield _clone(seed, setup.db_name), _clone(seed, local)
    finally:
        for name in (seed, setup.db_name, local):
            _drop(name)


@pytest.fixture(scope="module")
def local_results(dbs):
    """Audit, then replay of the failed records, then rebalance, in Spark local mode."""
    _, local = dbs
    window = ["--since", SINCE.isoformat(), "--until", UNTIL.isoformat()]
    return {
        "audit": _cli(local, "audit", *window),
        "replay": _cli(local, "replay", "--what", "failed", "--bus", "orders"),
        "rebalance": _cli(local, "rebalance", "--window-minutes", str(LOAD_WINDOW_MINUTES)),
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    if not cluster_support.redis_up():
        pytest.skip("no Redis on 127.0.0.1:6379: the CeleryExecutor needs one")
    # Begun when collection ended (conftest): its `prepare` has usually finished by now.
    setup = cluster_support.begin(ADMIN_URL, RUN_ID)
    directory = setup.directory
    kept = tmp_path_factory.mktemp("cluster-logs")
    base = free_port_base(11)
    env = {**setup.env, "EVENTPUSH_CLUSTER_PORT_BASE": str(base)}
    c = Cluster(env, directory, base)
    up = None
    try:
        setup.prepared()
        up = c.start("up")
        # The dataset and the local-mode results are made while the cluster starts: Airflow
        # needs the eventpush database only when the first task runs.
        request.getfixturevalue("dbs")
        request.getfixturevalue("local_results")
        out, err = up.communicate(timeout=600)
        assert up.returncode == 0, out + err
        _wait_for_dags(c)
        yield c
    finally:
        if up is not None and up.poll() is None:  # local mode failed first: stop the start
            up.terminate()
            up.wait(60)
        for logs in (directory / "logs", directory / "airflow" / "logs"):
            if logs.is_dir():  # kept for reading after a failure; the rest is purged
                shutil.copytree(logs, kept / logs.relative_to(directory), dirs_exist_ok=True)
        if setup.log.is_file():
            shutil.copy(setup.log, kept / setup.log.name)
        down = c.script("down", "--purge")
        setup.down = down.returncode == 0
        leftovers = subprocess.run(
            ["pgrep", "-f", str(directory)], capture_output=True, text=True
        ).stdout.split()
        assert down.returncode == 0, down.stderr
        assert not leftovers, f"processes left behind: {leftovers}"
        import redis

        redis.Redis("127.0.0.1", 6379).delete(env["EVENTPUSH_CLUSTER_QUEUE"])


@pytest.fixture(scope="module")
def first_runs(cluster, dbs) -> dict[str, str]:
    """The audit and the rebalance, triggered together (each job on a core of its own): the
    rebalance reads the runners, the workers and the live deliveries, which the audit does not
    change. The replay, which adds deliveries the audit would count, waits for the audit, as
    in local mode. Returns {dag_id: run id}."""
    return {
        "eventpush_audit": cluster.trigger("eventpush_audit", AUDIT_CONF),
        "eventpush_rebalance": cluster.trigger(
            "eventpush_rebalance", {"window_minutes": LOAD_WINDOW_MINUTES}
        ),
    }


def _wait_for_dags(c: Cluster, timeout: float = 240) -> None:
    wanted = {"eventpush_audit", "eventpush_replay", "eventpush_rebalance", "eventpush_push"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with c.http() as h:
            got = {d["dag_id"] for d in h.get("/dags").json().get("dags", [])}
        if wanted <= got:
            return
        time.sleep(1)
    raise AssertionError(f"DAGs not parsed in {timeout}s: {got}")


def _executor_pythons(log: str) -> list[dict]:
    for line in log.splitlines():
        if EXECUTOR_PYTHON_MARK in line:
            event = json.loads(line).get("event", line)
            doc = event.split(EXECUTOR_PYTHON_MARK, 1)[1].strip()
            return json.loads(doc)
    raise AssertionError("the job did not report its executors' Python")


def _by_runner(rows: list[dict]) -> dict[str, dict]:
    keys = ("expected", "delivered", "failed", "missing", "pending", "duplicates")
    return {r["runner"]: {k: r[k] for k in keys} for r in rows}


def test_audit_dag_on_the_cluster_equals_local_mode(cluster, dbs, local_results, first_runs):
    url, _ = dbs
    run_id = first_runs["eventpush_audit"]
    state = cluster.wait_run("eventpush_audit", run_id)
    states = cluster.task_states("eventpush_audit", run_id)
    # the two deleted deliveries are missing: the job succeeds, the check fails the run
    assert state == "failed" and states["audit_job"] == "success", cluster.failures(
        "eventpush_audit", run_id
    )
    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT runners FROM event_audit_report WHERE window_start = %s "
            "ORDER BY id DESC LIMIT 1",
            (SINCE,),
        )
        (runners,) = cur.fetchone()
    expected = _by_runner(local_results["audit"]["runners"])
    assert _by_runner(runners) == expected
    assert sum(r["missing"] for r in expected.values()) == 2

    pythons = _executor_pythons(cluster.task_log("eventpush_audit", run_id, "audit_job"))
    driver_version = ".".join(map(str, sys.version_info[:3]))
    assert pythons, "no executor reported"
    for p in pythons:
        # the packed environment unpacked in the executor's directory on a Spark worker
        assert str(cluster.dir / "spark") in p["executable"], p
        assert p["executable"].endswith("/pyenv/bin/python"), p
        assert not p["executable"].startswith(str(VENV)) and p["prefix"] != str(VENV), p
        assert p["version"] == driver_version, p


def test_replay_dag_on_the_cluster_equals_local_mode(cluster, dbs, local_results, first_runs):
    url, local = dbs
    cluster.wait_run("eventpush_audit", first_runs["eventpush_audit"])  # local mode's order
    run_id = cluster.trigger("eventpush_replay", {"what": "failed", "bus": "orders"})
    state = cluster.wait_run("eventpush_replay", run_id)
    assert state == "success", cluster.failures("eventpush_replay", run_id)

    def outcome(db: str) -> tuple:
        with psycopg2.connect(db) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT selected, delivered, failed FROM event_replay_run "
                "WHERE status = 'succeeded' ORDER BY id DESC LIMIT 1"
            )
            counts = cur.fetchone()
            cur.execute(
                'SELECT r.name, f.queue_id, f."offset", f.status FROM event_push_failure f '
                "JOIN event_target_runner r ON r.id = f.runner_id ORDER BY 1, 2, 3"
            )
            return counts, cur.fetchall()

    cluster_counts, cluster_failures = outcome(url)
    local_counts, local_failures = outcome(local)
    want = local_results["replay"]
    assert local_counts == (want["selected"], want["delivered"], want["failed"])
    assert cluster_counts == local_counts and cluster_failures == local_failures
    assert want["selected"] > 0 and {f[3] for f in cluster_failures} == {"replayed"}


def test_rebalance_dag_on_the_cluster_equals_local_mode(cluster, dbs, local_results, first_runs):
    url, local = dbs
    run_id = first_runs["eventpush_rebalance"]
    state = cluster.wait_run("eventpush_rebalance", run_id)
    assert state == "success", cluster.failures("eventpush_rebalance", run_id)

    def outcome(db: str) -> tuple:
        with psycopg2.connect(db) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT r.name, w.name FROM event_target_runner r "
                "LEFT JOIN event_push_worker w ON w.id = r.worker_id WHERE r.name LIKE 'orders/%'"
            )
            assignment = dict(cur.fetchall())
            # the weights it balanced (spread, load ratio, each worker's load), as recorded
            cur.execute("SELECT moves, details FROM event_assignment ORDER BY generation")
            return assignment, cur.fetchall()

    assignment, generations = outcome(url)
    local_assignment, local_generations = outcome(local)
    expected = local_results["rebalance"]["assignment"]
    assert local_assignment == expected
    assert assignment == expected and generations == local_generations
    assert set(expected.values()) == {"w1", "w2"}  # it had work to do: w2 started empty
    # Balanced by load, which the window held: w1 shed its heaviest runner (most live
    # deliveries), where equal weights (no load read) would have moved the lowest id.
    with psycopg2.connect(local) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT r.name FROM event_push_delivery d JOIN event_target_runner r "
            "ON r.id = d.runner_id WHERE d.origin = 'live' AND r.name LIKE 'orders/%' "
            "GROUP BY r.name ORDER BY count(*) DESC, r.name LIMIT 1"
        )
        (heaviest,) = cur.fetchone()
    assert [m["runner"] for m in local_results["rebalance"]["moved"]] == [heaviest]


def _push_task_of(cluster: Cluster, run_id: str, worker: str) -> dict | None:
    """The mapped ``push`` task instance of ``worker`` in a push run, once it exists: found by
    its rendered ``worker`` field, else by its place in ``list_workers``' result."""
    with cluster.http() as h:
        tis = h.get(
            f"/dags/eventpush_push/dagRuns/{run_id}/taskInstances", params={"task_id": "push"}
        ).json()["task_instances"]
        for ti in tis:
            if (ti.get("rendered_fields") or {}).get("worker") == worker:
                return ti
        r = h.get(
            f"/dags/eventpush_push/dagRuns/{run_id}/taskInstances/list_workers"
            "/xcomEntries/return_value"
        )
    listed = r.json().get("value") if r.status_code == 200 else None
    if isinstance(listed, list) and worker in listed:
        index = listed.index(worker)
        return next((ti for ti in tis if ti["map_index"] == index), None)
    return None


def _celery_worker_of(cluster: Cluster, pid: int) -> str | None:
    """Which Celery worker ``pid`` (a task's process) runs under: Airflow's supervisor puts
    the task in a process group of its own, so it is found among the worker's descendants."""
    import psutil

    try:
        ancestors = {p.pid for p in psutil.Process(pid).parents()}
    except psutil.NoSuchProcess:
        return None
    for name in ("celery-worker-1", "celery-worker-2"):
        if cluster.pid(name) in ancestors:
            return name
    return None


def _kill_celery_worker(cluster: Cluster, name: str) -> None:
    """SIGKILL a Celery worker and every process under it, as when its host dies: a signal to
    the worker's process group alone would miss its tasks' own groups."""
    import psutil

    root = psutil.Process(cluster.pid(name))
    for p in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root.pid, signal.SIGKILL)


def _logged(conn, runner: str) -> int:
    """How many distinct records ``runner``'s delivery log holds (committed deliveries)."""
    with conn.cursor() as cur:
        cur.execute(
            'SELECT count(DISTINCT (d.queue_id, d."offset")) FROM event_push_delivery d '
            "JOIN event_target_runner r ON r.id = d.runner_id WHERE r.name = %s",
            (runner,),
        )
        count = cur.fetchone()[0]
    conn.commit()
    return count


def _received(receiver, path: str) -> list[int]:
    """The events (their ``detail.n``) that reached ``path``, one per request, in order."""
    with receiver.state.lock:
        bodies = [r.body for r in receiver.state.requests if r.path == path]
    return [json.loads(body)["detail"]["n"] for body in bodies]


def test_a_celery_worker_killed_mid_slice_loses_nothing(cluster, dbs, receiver, first_runs):
    url, _ = dbs
    for dag_id, first in first_runs.items():  # a new worker and bus would change their inputs
        cluster.wait_run(dag_id, first)
    conn = psycopg2.connect(url)
    run_id = None
    try:
        catalog.create_worker(conn, "wk")
        catalog.create_bus(conn, "kill", 2)
        catalog.create_rule(conn, "kill", "all", {"source": ["app.orders"]})
        runner = catalog.create_target(
            conn,
            "kill",
            "all",
            TargetSpec(
                name="slow", url=f"{receiver.url}/slow/kill?ms=60", concurrency=4, batch_size=1
            ),
        )
        catalog.assign(conn)
        with conn.cursor() as cur:
            cur.execute(
                "SELECT w.name FROM event_target_runner r JOIN event_push_worker w "
                "ON w.id = r.worker_id WHERE r.name = %s",
                (runner,),
            )
            assert cur.fetchone() == ("wk",)
        conn.commit()

        # A push round (the test cluster runs no schedules: the continuous one is started by
        # hand), with a window long enough for the killed slice's retry to finish within it.
        # wk has nothing to push yet: its task defers to the trigger, waiting for work.
        run_id = cluster.trigger("eventpush_push", {"slice_seconds": 900})
        deadline = time.monotonic() + 180
        ti = None
        while time.monotonic() < deadline:
            ti = _push_task_of(cluster, run_id, "wk")
            if ti and ti["state"] in ("deferred", "running"):
                break
            time.sleep(1)
        else:
            raise AssertionError(f"no push round waiting for wk's work: {run_id} {ti}")
        index = ti["map_index"]

        def wk_push() -> dict:
            with cluster.http() as h:
                r = h.get(f"/dags/eventpush_push/dagRuns/{run_id}/taskInstances/push/{index}")
                r.raise_for_status()
                return r.json()

        n = 300
        publish_lines(conn, "kill", events(n))
        path = "/slow/kill"

        # Wait until wk's push slice is delivering, then kill its Celery worker outright.
        deadline = time.monotonic() + 240
        victim = None
        while time.monotonic() < deadline:
            if receiver.state.count[path] >= 60:
                ti = wk_push()
                if ti["state"] == "running" and ti.get("pid"):
                    victim = _celery_worker_of(cluster, ti["pid"])
                if victim:
                    break
            time.sleep(0.2)
        assert victim, f"wk's push slice never ran: {cluster.task_states('eventpush_push', run_id)}"
        killed_try = ti["try_number"]
        _kill_celery_worker(cluster, victim)
        time.sleep(1)  # what was in flight has landed or died with the process
        seen_at_kill = set(_received(receiver, path))
        committed_at_kill = _logged(conn, runner)
        assert committed_at_kill < n, "the slice had finished before the kill"

        def done() -> bool:
            with conn.cursor() as cur:
                cur.execute(
                    'SELECT coalesce(sum(q.next_offset - o."offset"), -1) FROM event_push_offset o '
                    "JOIN event_target_runner r ON r.id = o.runner_id "
                    "JOIN event_bus b ON b.name = 'kill' "
                    "JOIN event_bus_queue q ON q.bus_id = b.id AND q.queue_id = o.queue_id "
                    "WHERE r.name = %s",
                    (runner,),
                )
                lag = cur.fetchone()[0]
            conn.commit()
            return lag == 0

        deadline = time.monotonic() + 300
        while not done():
            states = cluster.task_states("eventpush_push", run_id)
            assert time.monotonic() < deadline, f"the slice was not finished elsewhere: {states}"
            time.sleep(2)

        ti = wk_push()
        assert ti["try_number"] > killed_try, ti
        survivor = {"celery-worker-1": "celery-worker-2", "celery-worker-2": "celery-worker-1"}[
            victim
        ]
        log = (cluster.dir / "logs" / f"{survivor}.log").read_text()
        # A line naming the task instance's fields (the workload it was given): wk's push
        # task in this run, a later try than the killed one.
        retry_here = [
            line
            for line in log.splitlines()
            if f"run_id='{run_id}'" in line
            and "task_id='push'" in line
            and re.search(rf"\bmap_index={index}\b", line)
            and int((re.search(r"\btry_number=(\d+)", line) or [0, 0])[1]) > killed_try
        ]
        assert retry_here, "the retry did not run on the surviving worker"

        got = _received(receiver, path)
        logged = _logged(conn, runner)
        copies = Counter(got)
        duplicates = sum(c - 1 for c in copies.values())
        in_flight = len(seen_at_kill) - committed_at_kill
        assert len(copies) == n and logged == n  # nothing lost
        assert duplicates <= in_flight, (duplicates, in_flight)
    finally:
        conn.close()
        if run_id:  # end the round: its tasks stop now, not at the window's end during `down`
            with cluster.http() as h:
                h.patch(f"/dags/eventpush_push/dagRuns/{run_id}", json={"state": "success"})
