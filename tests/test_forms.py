"""The replay and audit forms (issue 16): bounded by configuration, unknown fields refused,
naive times read as UTC. Pure checks first, then the real DAGs with ``dag.test()`` and the
real console script."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from eventpush.config import ConfigError
from eventpush.sparkjobs.forms import (
    FORM_FIELDS,
    FormError,
    audit_window,
    form_params,
    job_parser,
    rebalance_args,
    replay_limits,
    request_from_args,
)
from eventpush.sparkjobs.replay import (
    ReplayRequest,
    ReplayRequestError,
    check_bounds,
    job_args,
    request_from_form,
)
from tests.airflow_fixtures import REPO, airflow_conn_env, airflow_db

__all__ = ["airflow_conn_env", "airflow_db"]

NOW = datetime.now(UTC)


@pytest.mark.parametrize(
    "request_kw, message",
    [
        ({"what": "all"}, "what=all needs a window: give since"),
        ({"what": "all", "until": NOW}, "what=all needs a window"),
        (
            {"what": "all", "since": NOW - timedelta(days=30), "until": NOW},
            r"spans 720 hours, over the limit of 168 \(EVENTPUSH_REPLAY_MAX_WINDOW_HOURS\)",
        ),
        ({"max_count": 1_000_001}, r"over the limit of 1000000 \(EVENTPUSH_REPLAY_MAX_COUNT\)"),
        ({"rate_limit": 0.01}, r"at least 1 records per second \(EVENTPUSH_REPLAY_MIN_RATE\)"),
        ({"max_count": 1_000_000, "rate_limit": 10.0}, "longer than the job's timeout"),
        ({"message_ids": tuple(f"m{i}" for i in range(1001))}, "at most 1000 message ids"),
        ({"message_ids": ("ok", "x" * 129)}, "message id 2 is 129 characters long"),
    ],
)
def test_replay_bounds(request_kw, message):
    with pytest.raises(ReplayRequestError, match=message):
        check_bounds(ReplayRequest(**request_kw))


def test_replay_bounds_let_reasonable_requests_through():
    for req in (
        ReplayRequest(what="all", since=NOW - timedelta(hours=2)),
        ReplayRequest(what="all", everything=True, max_count=10, rate_limit=1.0),
        ReplayRequest(what="failed", since=NOW - timedelta(days=365)),  # only all is capped
        ReplayRequest(message_ids=tuple("x" * 128 for _ in range(1000))),
    ):
        check_bounds(req)


def test_replay_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("EVENTPUSH_REPLAY_MAX_WINDOW_HOURS", "1")
    monkeypatch.setenv("EVENTPUSH_REPLAY_MAX_COUNT", "50")
    monkeypatch.setenv("EVENTPUSH_REPLAY_MIN_RATE", "5")
    monkeypatch.setenv("EVENTPUSH_REPLAY_TIMEOUT_MINUTES", "10")
    limits = replay_limits()
    assert (limits.max_count, limits.min_rate) == (50, 5.0)
    assert (limits.max_window, limits.timeout) == (timedelta(hours=1), timedelta(minutes=10))
    with pytest.raises(ReplayRequestError, match="spans 2 hours, over the limit of 1"):
        check_bounds(ReplayRequest(what="all", since=NOW - timedelta(hours=2), until=NOW))
    with pytest.raises(ReplayRequestError, match="max count 51 is over the limit of 50"):
        check_bounds(ReplayRequest(max_count=51))
    monkeypatch.setenv("EVENTPUSH_REPLAY_MAX_COUNT", "lots")
    with pytest.raises(ConfigError, match="EVENTPUSH_REPLAY_MAX_COUNT must be a whole number"):
        replay_limits()
    monkeypatch.setenv("EVENTPUSH_REPLAY_MAX_COUNT", "0")
    with pytest.raises(ConfigError, match="must be at least 1"):
        replay_limits()


def test_replay_form_refuses_unknown_fields_in_one_line():
    with pytest.raises(ReplayRequestError) as exc:
        request_from_form({"what": "failed"}, conf={"frobnicate": 1})
    message = str(exc.value)
    assert message.startswith("unknown field 'frobnicate' in the request; known: what, bus")
    assert "\n" not in message
    with pytest.raises(ReplayRequestError, match="unknown fields 'a', 'b'"):
        request_from_form({"b": 1, "a": 2})


def test_replay_form_reads_naive_times_as_utc_and_passes_everything_on():
    req = request_from_form(
        {"what": "all", "since": "2026-01-01T10:00", "everything": True, "max_count": "7"}
    )
    assert req.since == datetime(2026, 1, 1, 10, tzinfo=UTC) and req.max_count == 7
    assert "--everything" in job_args(req)
    with pytest.raises(ReplayRequestError, match="rate_limit must be a number"):
        request_from_form({"rate_limit": "fast"})
    with pytest.raises(ReplayRequestError, match="since 'yesterday' is not an ISO 8601"):
        request_from_form({"since": "yesterday"})


def test_one_description_gives_the_argv_the_options_and_the_form():
    """The replay request's fields, written once (``forms.ReplayRequest``), make the job's
    arguments, which its parser reads back to the same request; the CLI's options and the
    DAG's form are the same fields."""
    from eventpush.cli.batch import replay

    full = ReplayRequest(
        what="all",
        bus="orders",
        rule="r",
        target="t",
        since=datetime(2026, 1, 1, tzinfo=UTC),
        until=datetime(2026, 1, 2, 3, tzinfo=UTC),
        message_ids=("a", "b"),
        max_count=7,
        rate_limit=2.5,
        dry_run=True,
        everything=True,
        pattern_version="current",
        label="run-1",
    )
    for req in (full, ReplayRequest()):
        assert request_from_args(job_parser().parse_args(job_args(req))) == req
    assert job_args(full)[:4] == ["--what", "all", "--bus", "orders"]
    assert job_args(full).count("--message-id") == 2
    assert job_args(ReplayRequest()) == []  # every field at its default
    options = {p.name for p in replay.params} - {"as_json"}
    assert options == set(ReplayRequest.__dataclass_fields__) - {"label"}
    assert list(form_params(replay_limits())) == list(FORM_FIELDS)
    assert "pattern_version" not in FORM_FIELDS and "label" not in FORM_FIELDS
    form = {k: v for k, v in full.to_json().items() if k in FORM_FIELDS}
    assert request_from_form(form, label="run-1") == replace(full, pattern_version="history")


def test_audit_form_reads_naive_times_as_utc():
    start, end = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 1, tzinfo=UTC)
    since, until, bus = audit_window(
        {"since": "2026-01-01T00:30:00", "until": None, "bus": ""}, {}, start, end
    )
    assert (since, until, bus) == (datetime(2026, 1, 1, 0, 30, tzinfo=UTC), end, None)
    with pytest.raises(FormError, match=r"^until \(2026-01-01T01:00:00\+00:00\) must be after"):
        audit_window({"since": "2026-01-01T02:00:00"}, None, start, end)
    with pytest.raises(FormError, match="^unknown field 'frobnicate' in the request; known: bus"):
        audit_window({}, {"frobnicate": 1}, start, end)
    with pytest.raises(FormError, match="since 'noon' is not an ISO 8601 time"):
        audit_window({"since": "noon"}, None, start, end)


def test_audit_form_without_a_data_interval_audits_the_hour_before_now():
    """A run triggered with ``"logical_date": null`` has no data interval."""
    now = datetime(2026, 3, 1, 12, tzinfo=UTC)
    since, until, _ = audit_window({}, None, None, None, now=now)
    assert (since, until) == (datetime(2026, 3, 1, 11, tzinfo=UTC), now)
    since, until, _ = audit_window({"since": "2026-03-01T00:00:00"}, None, None, None, now=now)
    assert (since, until) == (datetime(2026, 3, 1, tzinfo=UTC), now)


def test_audit_window_is_bounded_as_the_replay_window_is(monkeypatch):
    """An audit reads every event of its window, as a ``what=all`` replay does: a window
    longer than EVENTPUSH_AUDIT_MAX_WINDOW_HOURS (168) is refused in one line."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    week = {"since": start.isoformat(), "until": (start + timedelta(hours=168)).isoformat()}
    assert audit_window(week, None, None, None)[:2] == (start, start + timedelta(hours=168))
    month = {"since": start.isoformat(), "until": (start + timedelta(days=30)).isoformat()}
    with pytest.raises(FormError) as exc:
        audit_window(month, None, None, None)
    assert str(exc.value) == (
        "the audit window spans 720 hours, over the limit of 168 "
        "(EVENTPUSH_AUDIT_MAX_WINDOW_HOURS): audit it as shorter windows"
    )
    # an open end is bounded too: since far back, until the run's data interval end
    with pytest.raises(FormError, match="spans 8761 hours"):
        audit_window({"since": "2025-01-01T00:00:00"}, None, start, start + timedelta(hours=1))
    monkeypatch.setenv("EVENTPUSH_AUDIT_MAX_WINDOW_HOURS", "1")
    with pytest.raises(FormError, match=r"spans 2 hours, over the limit of 1 \("):
        audit_window({"since": "2026-01-01T00:00:00"}, None, start, start + timedelta(hours=2))
    monkeypatch.setenv("EVENTPUSH_AUDIT_MAX_WINDOW_HOURS", "0")
    with pytest.raises(ConfigError, match="EVENTPUSH_AUDIT_MAX_WINDOW_HOURS must be at least 1"):
        audit_window({}, None, start, start + timedelta(hours=1))


def test_cli_replay_refuses_all_without_a_window_before_spark(cli):
    r = cli("replay", "--what", "all", env={"EVENTPUSH_DATABASE_URL": ""})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: what=all needs a window")
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("replay", "--rate-limit", "0.001", env={"EVENTPUSH_DATABASE_URL": ""})
    assert r.returncode == 2 and "EVENTPUSH_REPLAY_MIN_RATE" in r.stderr


# The real DAGs: refused in their first task, nothing else runs.


@pytest.fixture(scope="module")
def bag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert not bag.import_errors, bag.import_errors
    return bag


def _states(run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


def test_replay_job_has_an_execution_timeout(bag):
    dag = bag.dags["eventpush_replay"]
    assert dag.get_task("replay_job").execution_timeout == timedelta(minutes=240)
    assert dag.params.get_param("everything").value is False
    schema = dag.params.get_param("message_ids").schema
    assert schema["maxItems"] == 1000 and schema["items"]["maxLength"] == 128


@pytest.mark.parametrize(
    "conf",
    [{"frobnicate": 1}, {"what": "all"}],
    ids=["unknown-field", "all-without-window"],
)
def test_replay_dag_refuses_in_its_first_task(bag, airflow_conn_env, conf):
    run = bag.dags["eventpush_replay"].test(run_conf=conf)
    got = _states(run)
    assert str(run.state) == "failed" and got["check_request"] == "failed", got
    assert got["replay_job"] != "success"


def test_audit_dag_window_task(bag, airflow_conn_env, capfd):
    """The audit's first task alone: a naive since is UTC, an unknown field is refused."""
    dag = bag.dags["eventpush_audit"].partial_subset("window", include_downstream=False)
    # A naive since against the run's (aware) data interval end: the TypeError of old.
    since = (datetime.now(UTC) - timedelta(hours=3)).replace(tzinfo=None, microsecond=0)
    run = dag.test(run_conf={"since": since.isoformat()})
    assert str(run.state) == "success", _states(run)
    [ti] = run.get_task_instances()
    spec = ti.xcom_pull(task_ids="window")
    assert spec["since"] == since.replace(tzinfo=UTC).isoformat(), spec
    assert datetime.fromisoformat(spec["until"]).tzinfo is not None
    assert spec["args"][:4] == ["--since", spec["since"], "--until", spec["until"]]
    run = dag.test(run_conf={"frobnicate": 1})
    assert str(run.state) == "failed", json.dumps(_states(run))
    # a window longer than EVENTPUSH_AUDIT_MAX_WINDOW_HOURS: refused before any Spark job
    since = datetime.now(UTC) - timedelta(days=30)
    capfd.readouterr()
    run = dag.test(run_conf={"since": since.isoformat()})
    assert str(run.state) == "failed", json.dumps(_states(run))
    said = capfd.readouterr().out
    assert "AirflowFailException: audit request refused: the audit window spans " in said
    assert "over the limit of 168 (EVENTPUSH_AUDIT_MAX_WINDOW_HOURS)" in said


def test_rebalance_form_refuses_unknown_fields_and_odd_windows():
    """A mistyped ``dry_run`` through the REST API is refused, not a real rebalance."""
    with pytest.raises(FormError) as exc:
        rebalance_args({"window_minutes": 15, "dry_run": False}, {"dryrun": True}, "r1")
    assert str(exc.value) == (
        "unknown field 'dryrun' in the request; known: window_minutes, dry_run"
    )
    for minutes in (15.5, 0, True, "15", None, float("nan"), float("inf")):
        with pytest.raises(FormError, match="^window_minutes must be a whole number from 1"):
            rebalance_args({"window_minutes": minutes, "dry_run": False}, None, "r1")
    # JSON's 15.0 passes the form's integer schema; the job's parser wants "15"
    args = rebalance_args({"window_minutes": 15.0, "dry_run": True}, {}, "r1")
    assert args == ["--label", "r1", "--window-minutes", "15", "--dry-run"]


def test_rebalance_dag_refuses_a_mistyped_dry_run_in_its_first_task(bag, airflow_conn_env):
    dag = bag.dags["eventpush_rebalance"].partial_subset("check_inputs", include_downstream=False)
    run = dag.test(run_conf={"dryrun": True})
    assert str(run.state) == "failed", _states(run)
    assert str(dag.test(run_conf={"dry_run": True}).state) == "success"


def test_retention_dag_refuses_a_conf_before_it_drops_anything(bag, airflow_conn_env, conn):
    """The retention DAG has no form: a conf asking for a dry run must not drop partitions."""
    from eventpush import catalog

    catalog.create_bus(conn, "orders", 1, retention="1d")

    def partitions() -> set[str]:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT inhrelid::regclass::text FROM pg_inherits")
            return {name for (name,) in cur.fetchall()}

    before = partitions()
    run = bag.dags["eventpush_retention"].test(run_conf={"dry_run": True})
    got = _states(run)
    assert str(run.state) == "failed" and got["maintain"] == "failed", got
    assert got["check"] != "success"
    assert partitions() == before
