"""Every DAG in dags/ loads in the real DagBag, is documented and owned, and parses fast."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.airflow_fixtures import ENV, REPO

DAG_FILES = sorted((REPO / "dags").glob("*.py"))
# modules a DAG file must not pull in at parse time (heavy, or work that belongs in tasks)
HEAVY = ["great_expectations", "pandas", "pyspark", "psycopg2", "aiohttp", "eventpush.push"]


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert dagbag.dags, "no DAG found in dags/"


def test_every_dag_is_documented_tagged_and_owned(dagbag):
    for dag_id, dag in dagbag.dags.items():
        assert dag.doc_md and len(dag.doc_md.strip()) > 40, f"{dag_id}: no doc_md"
        assert dag.tags, f"{dag_id}: no tags"
        owners = {task.owner for task in dag.tasks}
        assert owners and "airflow" not in owners, f"{dag_id}: default owner {owners}"
        stem = os.path.splitext(os.path.basename(dag.fileloc))[0]
        assert dag_id == stem, f"{dag_id}: not named after its file {stem}.py"


def test_push_dag_shape(dagbag):
    from airflow.sdk.bases.sensor import BaseSensorOperator

    from eventpush.airflow.push_slice import PUSH_SLICES

    dag = dagbag.dags["eventpush_push"]
    # runs every window, two at a time: the next run's slice is ready before this one ends
    # (a continuous schedule allows one run at a time, which leaves a gap at each hand-over)
    assert type(dag.timetable).__name__ == "DeltaTriggerTimetable"
    assert dag.timetable.delta.total_seconds() == dag.params["slice_seconds"]
    assert dag.max_active_runs == 2
    assert dag.is_paused_upon_creation is False
    assert dag.catchup is False
    # nothing but the worker list between two slices: every task costs hand-over time
    assert {t.task_id for t in dag.tasks} == {"list_workers", "push"}
    push = dag.get_task("push")
    assert push.operator_class.__module__ == "eventpush.airflow.push_slice"  # not in dags/
    # a sensor to Airflow and its users (timeout, soft_fail, mode, the sensor views), whose
    # wait is deferred to the triggerer
    assert issubclass(push.operator_class, BaseSensorOperator)
    assert push.partial_kwargs["soft_fail"] is True
    assert push.upstream_task_ids == {"list_workers"}
    assert push.outlets == [PUSH_SLICES]


def test_push_checks_dag_is_scheduled_on_the_slices_the_push_dag_records(dagbag):
    from eventpush.airflow import alerts
    from eventpush.airflow.push_slice import PUSH_SLICES

    dag = dagbag.dags["eventpush_push_checks"]
    assert type(dag.timetable).__name__ == "AssetTriggeredTimetable"
    assert dag.timetable.asset_condition.objects == (PUSH_SLICES,)
    assert dag.is_paused_upon_creation is False
    assert {t.task_id for t in dag.tasks} == {"slices", "check"}
    assert dag.get_task("check").upstream_task_ids == {"slices"}
    assert dag.get_task("check").on_failure_callback is alerts.push_failed


PROBE = textwrap.dedent(
    """
    import importlib.util, json, os, sys, time
    import airflow.sdk  # the DAG processor has Airflow loaded already,
    import airflow.triggers.base
    import airflow.models.dagrun  # its models included (TriggerDagRunOperator needs them)
    for path in sys.argv[1:]:
        sys.stdout.flush()
        pid = os.fork()  # each file starts from the same warm interpreter, isolated
        if pid == 0:
            before = set(sys.modules)
            # CPU time of this process: the file's own parse cost, not the machine's load
            t = time.process_time()
            spec = importlib.util.spec_from_file_location("dag_under_test", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            print(json.dumps({"path": path, "seconds": time.process_time() - t,
                              "modules": sorted(set(sys.modules) - before)}), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    """
)


@pytest.fixture(scope="module")
def parse_probes() -> dict[str, dict]:
    import json

    out = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, DAG_FILES)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=120,
        check=True,
    )
    probes = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {os.path.basename(p["path"]): p for p in probes}


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_parses_fast_without_heavy_imports(path, parse_probes):
    probe = parse_probes.get(path.name)
    assert probe is not None, f"{path.name} failed to import in the probe"
    heavy = [m for m in probe["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert not heavy, f"{path.name} imports {heavy} at module level"
    assert probe["seconds"] < 1.0, f"{path.name} took {probe['seconds']:.2f}s to parse"
