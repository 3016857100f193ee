"""Archives and replays. Every bus keeps its events for its retention (``RetentionDays``,
rounded up to whole days), so each bus is also an archive named after it
(``DescribeArchive``, ``ListArchives``; created and deleted with its bus, so
``CreateArchive`` and ``DeleteArchive`` are not served). A replay (``StartReplay``,
``DescribeReplay``, ``ListReplays``, ``CancelReplay``) is a run of the ``eventpush_replay``
DAG (``what=all`` over the window, on the archive's bus, narrowed to one rule by
``Destination.FilterArns``), triggered through Airflow's REST API when the server was given
an Airflow URL and a token file (``eventpush api --airflow-url URL --airflow-token-file F``);
the DAG run is ``replay-NAME`` and its state is the replay's. Without Airflow, every replay
operation is refused with ``OperationDisabledException`` saying so.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from eventpush.api.errors import ApiError, not_found, validation
from eventpush.api.service import Call
from eventpush.api.shapes import (
    archive_arn,
    bus_arn,
    check_owner,
    optional,
    page,
    parse_bus_arn,
    replay_arn,
    required,
    timestamp,
)
from eventpush.config import redact
from eventpush.errors import first_line

log = logging.getLogger("eventpush.api")

DAG = "eventpush_replay"
AIRFLOW_PAGE = 100  # Airflow's largest page of a list by default (maximum_page_limit)
RUN_PREFIX = "replay-"
CANCELLED_NOTE = "cancelled by CancelReplay"
ARCHIVE_ARN_RE = re.compile(
    r"arn:aws:events:(?P<region>[a-z0-9-]+):(?P<account>[0-9]{12}):archive/(?P<name>.+)"
)
RULE_ARN_RE = re.compile(
    r"arn:aws:events:(?P<region>[a-z0-9-]+):(?P<account>[0-9]{12}):"
    r"rule/(?:(?P<bus>[^/]+)/)?(?P<rule>.+)"
)
# AWS's ReplayName pattern; the name is also a segment of Airflow URLs (dagRuns/replay-NAME),
# where a '/', '?' or '..' would reach another DAG's runs with the server's token.
REPLAY_NAME_RE = re.compile(r"[.\-_A-Za-z0-9]{1,64}")
# Airflow's DAG run states onto EventBridge's replay states.
STATES = {
    "queued": "STARTING",
    "running": "RUNNING",
    "success": "COMPLETED",
    "failed": "FAILED",
}


def _archive_figures(conn, name: str) -> tuple[int | None, int]:
    """(events the bus holds, bytes its events take on disk). The count is what the store
    still holds from where the bus began (the source kind's ``count``: in PostgreSQL from
    each queue's first kept offset to its head, on NATS the stream's count of the queues'
    subjects, messages that are not JSON objects included: docs/OPERATIONS.md); the sum of
    the heads counted the events retention had dropped. None when the kind gives no count
    or its broker does not answer (AWS leaves out what it has not got).
    The size is that of the bus's partitions of ``bus_event`` with their indexes (0 for a
    broker's bus: the stream holds its events)."""
    from eventpush.partitions import bus_table
    from eventpush.sources import SourceError, SourceUnavailableError, bus_named, kind_for

    bus = bus_named(conn, name)
    kind = kind_for(bus.source_url)
    count = None
    if kind.count is not None:
        try:
            count = kind.count(conn, bus)
        except (SourceError, SourceUnavailableError) as exc:
            log.warning("archive %s: no event count: %s", name, exc)
    if bus.source_url is not None:
        return count, 0
    with conn.cursor() as cur:
        cur.execute(
            "SELECT coalesce(sum(pg_total_relation_size(relid)), 0) "
            "FROM pg_partition_tree(to_regclass(%s))",
            (bus_table(bus.id),),
        )
        size = int(cur.fetchone()[0])
    conn.rollback()
    return count, size


async def _archive_shape(call: Call, info) -> dict:
    from eventpush.config import retention_seconds

    count, size = await call.db(_archive_figures, info.name)
    days = -(-retention_seconds(info.retention, "retention") // 86400)  # whole days, up
    shape = {
        "ArchiveName": info.name,
        "EventSourceArn": bus_arn(info.account, info.region, info.name),
        "State": "ENABLED",
        "RetentionDays": days,
        "SizeBytes": size,
        "CreationTime": timestamp(info.created_at),
    }
    if count is not None:
        shape["EventCount"] = count
    return shape


async def describe_archive(call: Call, body: dict) -> dict:
    name = required(body, "ArchiveName")
    bus = await call.bus(name, fresh=True)
    shape = await _archive_shape(call, bus.info)
    return {
        **shape,
        "ArchiveArn": archive_arn(bus.account, bus.region, name),
        "Description": f"every event of bus {name}",
        "EventPattern": "",
    }


async def list_archives(call: Call, body: dict) -> dict:
    from eventpush import catalog

    prefix = optional(body, "NamePrefix")
    source = optional(body, "EventSourceArn")
    infos = await call.db(catalog.list_buses, name_prefix=prefix or None)
    if source:
        parsed = parse_bus_arn(source)
        infos = [
            info for info in infos if parsed and parsed == (info.region, info.account, info.name)
        ]
    chunk, token = page(infos, body, key=lambda info: info.name, scope="Archives")
    answer: dict = {"Archives": [await _archive_shape(call, info) for info in chunk]}
    if token:
        answer["NextToken"] = token
    return answer


# --- replays through Airflow -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _airflow(call: Call) -> AsyncIterator:
    """An httpx client on Airflow's REST API, or the refusal when the server has none. Airflow
    not answering (refused, reset, timed out) is one line, in the answer and the log, never a
    traceback: the replay operations depend on it, and it can be down while the API is up."""
    import httpx

    async with _airflow_client(call) as client:
        try:
            yield client
        except httpx.HTTPError as exc:  # no answer; an answer's status is _check's
            why = redact(first_line(exc) or type(exc).__name__, call.settings.airflow_url)
            log.warning("Airflow did not answer a replay request: %s", why)
            raise ApiError(
                "InternalException", f"Airflow did not answer the replay request: {why}"
            ) from None


def _airflow_client(call: Call):
    import httpx

    settings = call.settings
    if not settings.airflow_url or settings.airflow_token_file is None:
        raise ApiError(
            "OperationDisabledException",
            "replays run on Airflow: start `eventpush api` with --airflow-url and "
            "--airflow-token-file",
        )
    try:
        token = settings.airflow_token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ApiError(
            "InternalException", f"Airflow token file is unreadable: {exc.strerror}"
        ) from None
    return httpx.AsyncClient(
        base_url=settings.airflow_url.rstrip("/") + "/api/v2",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def _replay_name(body: dict) -> str:
    name = required(body, "ReplayName")
    if not REPLAY_NAME_RE.fullmatch(name):
        raise validation("member 'ReplayName' must be 1-64 letters, digits, '.', '-' or '_'")
    return name


def _epoch_iso(value: object, member: str) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, UTC).isoformat()
        except (OverflowError, OSError, ValueError):
            raise validation(f"member '{member}' is out of range: {value!r}") from None
    raise validation(f"member '{member}' must be a timestamp")


def _run_shape(call: Call, run: dict) -> dict:
    conf = run.get("conf") or {}
    state = STATES.get(run.get("state") or "", "STARTING")
    if state == "FAILED" and run.get("note") == CANCELLED_NOTE:
        state = "CANCELLED"
    name = str(run.get("dag_run_id") or "").removeprefix(RUN_PREFIX)
    account, region = call.settings.account, call.settings.region
    shape = {
        "ReplayName": name,
        "EventSourceArn": archive_arn(account, region, str(conf.get("bus") or "")),
        "State": state,
    }
    # A run of that name started elsewhere (the Airflow UI's form, the CLI) may carry no
    # window or one in another form: the members it cannot give are left out, as AWS leaves
    # out what a replay has not got.
    for member, value in (
        ("EventStartTime", conf.get("since")),
        ("EventEndTime", conf.get("until")),
        ("ReplayStartTime", run.get("start_date")),
        ("ReplayEndTime", run.get("end_date")),
    ):
        when = _iso_epoch(value)
        if when is not None:
            shape[member] = when
    return shape


def _iso_epoch(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


async def _get_run(client, name: str) -> dict:
    answer = await client.get(f"/dags/{DAG}/dagRuns/{RUN_PREFIX}{name}")
    if answer.status_code == 404:
        raise not_found(f"Replay {name} does not exist.")
    return _doc(answer)


def _check(answer) -> None:
    if answer.status_code >= 400:
        raise ApiError(
            "InternalException", f"Airflow answered {answer.status_code} to the replay request"
        )


def _doc(answer) -> dict:
    """Airflow's answer as the JSON object its REST API gives, or one line saying it was not
    (a proxy's error page, a wrong URL that answers HTML)."""
    _check(answer)
    try:
        doc = answer.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        log.warning("Airflow answered a replay request with no JSON object")
        raise ApiError(
            "InternalException",
            f"Airflow answered {answer.status_code} to the replay request with no JSON object: "
            "is --airflow-url Airflow's own address?",
        )
    return doc


async def start_replay(call: Call, body: dict) -> dict:
    name = _replay_name(body)
    source = required(body, "EventSourceArn")
    found = ARCHIVE_ARN_RE.fullmatch(source)
    if found is None:
        raise validation(f"member 'EventSourceArn' is not an archive ARN: {source[:200]!r}")
    bus = await call.bus(found["name"], fresh=True)
    # ARNs of another account or region are refused, never read as ours of that name.
    check_owner((found["account"], found["region"]), bus.account, bus.region, "the archive")
    destination = required(body, "Destination", dict)
    target_bus = parse_bus_arn(required(destination, "Arn"))
    if target_bus is None or target_bus[2] != bus.name:
        raise validation("Destination.Arn must be the archive's own event bus")
    check_owner((target_bus[1], target_bus[0]), bus.account, bus.region, "Destination.Arn")
    conf = {
        "what": "all",
        "bus": bus.name,
        "since": _epoch_iso(required(body, "EventStartTime", object), "EventStartTime"),
        "until": _epoch_iso(required(body, "EventEndTime", object), "EventEndTime"),
    }
    filters = optional(destination, "FilterArns", list) or []
    if len(filters) > 1:
        raise validation("Destination.FilterArns may name one rule here (one replay per rule)")
    if filters:
        rule = RULE_ARN_RE.fullmatch(str(filters[0]))
        if rule is None or (rule["bus"] or "default") != bus.name:
            raise validation("Destination.FilterArns must name a rule of the archive's bus")
        check_owner((rule["account"], rule["region"]), bus.account, bus.region, "the rule")
        conf["rule"] = rule["rule"]
    async with _airflow(call) as client:
        answer = await client.post(
            f"/dags/{DAG}/dagRuns",
            json={"dag_run_id": RUN_PREFIX + name, "logical_date": None, "conf": conf},
        )
        if answer.status_code == 409:
            raise ApiError("ResourceAlreadyExistsException", f"Replay {name} already exists.")
        run = _doc(answer)
    shape = _run_shape(call, run)
    return {
        "ReplayArn": replay_arn(bus.account, bus.region, name),
        "State": shape["State"],
        "ReplayStartTime": shape.get("ReplayStartTime", timestamp(datetime.now(UTC))),
    }


async def describe_replay(call: Call, body: dict) -> dict:
    name = _replay_name(body)
    async with _airflow(call) as client:
        run = await _get_run(client, name)
    shape = _run_shape(call, run)
    account, region = call.settings.account, call.settings.region
    return {**shape, "ReplayArn": replay_arn(account, region, name)}


async def list_replays(call: Call, body: dict) -> dict:
    prefix = optional(body, "NamePrefix") or ""
    runs: list = []
    async with _airflow(call) as client:
        while True:  # Airflow answers a page at a time (50 unless asked for more)
            answer = await client.get(
                f"/dags/{DAG}/dagRuns",
                params={
                    "run_id_pattern": f"{RUN_PREFIX}{prefix}%",
                    "limit": AIRFLOW_PAGE,
                    "offset": len(runs),
                },
            )
            doc = _doc(answer)
            found = [run for run in doc.get("dag_runs") or [] if isinstance(run, dict)]
            runs += found
            if not found or len(runs) >= doc.get("total_entries", 0):
                break
    # run_id_pattern is SQL LIKE, where '_' (in names) matches any character: the prefix
    # is checked again here.
    shapes = [_run_shape(call, run) for run in runs]
    shapes = [shape for shape in shapes if shape["ReplayName"].startswith(prefix)]
    state = optional(body, "State")
    if state:
        shapes = [s for s in shapes if s["State"] == state]
    chunk, token = page(shapes, body, key=lambda s: s["ReplayName"], scope="Replays")
    answer_doc: dict = {"Replays": chunk}
    if token:
        answer_doc["NextToken"] = token
    return answer_doc


async def cancel_replay(call: Call, body: dict) -> dict:
    name = _replay_name(body)
    async with _airflow(call) as client:
        run = await _get_run(client, name)
        if run.get("state") not in ("queued", "running"):
            raise ApiError("IllegalStatusException", f"Replay {name} is not running.")
        answer = await client.patch(
            f"/dags/{DAG}/dagRuns/{RUN_PREFIX}{name}",
            json={"state": "failed", "note": CANCELLED_NOTE},
        )
        _check(answer)
    account, region = call.settings.account, call.settings.region
    return {"ReplayArn": replay_arn(account, region, name), "State": "CANCELLING"}


OPERATIONS = {
    "DescribeArchive": describe_archive,
    "ListArchives": list_archives,
    "StartReplay": start_replay,
    "DescribeReplay": describe_replay,
    "ListReplays": list_replays,
    "CancelReplay": cancel_replay,
}
