"""The control plugin's web app: a JSON API and a dashboard, mounted in Airflow's API server.
The routes are here; what they read in ``eventpush.airflow.queries``, the page in
``eventpush.airflow.web``.

Routes (under the plugin's ``/eventpush`` prefix):

| route | does | who |
| --- | --- | --- |
| ``GET api/status`` | workers and runners: progress, lag, controls, latest metrics | reader |
| ``GET api/metrics?runner=R&minutes=M`` | one runner's metric series | reader |
| ``GET openapi.json`` | this API's description | reader |
| ``GET api/failures?limit=N`` | latest open failures | reader |
| ``GET api/audits?limit=N`` | latest audit reports | reader |
| ``GET api/replays?limit=N`` | latest replays: what was asked, outcome and counts | reader |
| ``POST api/adjust`` ``{"scope", "name", "changes"}`` | validated runtime adjustment | editor |
| ``POST api/pause`` / ``api/resume`` ``{"scope", "name"}`` | pause or resume | editor |
| ``GET api/catalog`` | buses, rules and targets (URL redacted, no secret) | reader |
| ``POST api/rule/enable`` / ``api/rule/disable`` ``{"bus", "name"}`` | switch a rule | editor |
| ``GET dashboard`` | charts of lag and throughput, failures, the last audit, replays | reader |
| ``GET api/dashboard?minutes=M`` | the dashboard's live part as JSON (polled every 5 s) | reader |

Authentication is Airflow's own (``airflow.api_fastapi.core_api.security``): a JWT bearer
token or the UI's session cookie. Readers need read access to the ``eventpush_push`` DAG,
editors edit access to it; anyone else gets 401 (no credentials) or 403; the API's own
description too (FastAPI's public ``/docs`` and ``/redoc`` are off). Refused adjustments
answer 422 with the reason. Target URLs and secrets are never shown. A database that is
down, read-only or misconfigured answers 503 (another database error 500) with its one line,
redacted, as ``detail`` (the page: as a line of HTML), never a traceback; so does a secrets
key that does not open the stored secrets.

``minutes`` is at most ``EVENTPUSH_DASHBOARD_MAX_MINUTES`` (1440), and a series is averaged
down in SQL to at most ``EVENTPUSH_DASHBOARD_POINTS`` (240) points per runner, so neither the
database nor the page pays for a long range. Metric rows older than
``EVENTPUSH_METRIC_RETENTION_HOURS`` are pruned by the workers' heartbeats
(``eventpush.push.store.heartbeat``).
"""

from __future__ import annotations

import html
import logging
from datetime import UTC, datetime
from typing import Any, Literal

import psycopg2
from pydantic import BaseModel, Field

from eventpush.airflow.queries import (
    _conn,
    catalog_view,
    destination_view,
    latest_audits,
    latest_failures,
    latest_replays,
    max_minutes,
    metric_series,
    progress,
)
from eventpush.airflow.web import render_dashboard, render_live
from eventpush.config import ConfigError, redact
from eventpush.db import StoreError, is_transient
from eventpush.errors import first_line
from eventpush.push.controls import ControlError, adjust, set_paused
from eventpush.sealed import SecretKeyError

DAG_ID = "eventpush_push"
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- app


class Target(BaseModel):
    scope: Literal["worker", "runner"]
    name: str = Field(min_length=1, max_length=200)


class RuleName(BaseModel):
    bus: str = Field(min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=64)


class Adjustment(Target):
    changes: dict[str, Any]


SERVICE_ERRORS = (StoreError, ConfigError, psycopg2.Error, SecretKeyError)
KEY_TROUBLE = (
    "eventpush: the stored target secrets do not open on this API server: check its "
    "EVENTPUSH_SECRET_KEY_FILE"
)


def service_trouble(exc: Exception) -> tuple[int, str]:
    """The status and one line for what a route cannot serve: 503 when waiting may help (the
    database down, read-only after a failover), the connection is misconfigured or the
    secrets' key is wrong here, else 500. Redacted: a psycopg2 message may quote a URL."""
    if isinstance(exc, SecretKeyError):
        # The catalog opens sealed secrets for their fingerprints; the key file's path is for
        # the log, not for every reader of the page.
        return 503, KEY_TROUBLE
    if isinstance(exc, ConfigError):  # e.g. the connection eventpush_db not of type postgres
        return 503, "eventpush: " + redact(first_line(exc))
    return (503 if is_transient(exc) else 500), "eventpush database: " + redact(first_line(exc))


def create_app():
    """The FastAPI app the plugin mounts at ``/eventpush``."""
    # Deferred: Airflow's SDK is loaded only when an Airflow process calls this.
    from airflow.api_fastapi.core_api.security import requires_access_dag

    # Deferred: FastAPI is loaded only by the webserver that mounts the plugin's app.
    from fastapi import Depends, FastAPI, HTTPException, Query, Request
    from fastapi.responses import HTMLResponse, JSONResponse

    read = [Depends(requires_access_dag("GET", param_dag_id=DAG_ID))]
    write = [Depends(requires_access_dag("PUT", param_dag_id=DAG_ID))]
    # FastAPI serves its description and docs to anyone; they are turned off and the
    # description is served below behind the same check as every read.
    app = FastAPI(
        title="eventpush",
        description="Progress and runtime controls of the eventpush push workers.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    minutes_query = Query(60, ge=1, le=max_minutes())

    # Without this a database that is down or read-only is Starlette's bare 500 (a traceback
    # in the log, "Internal Server Error" on the page and in the dashboard's alert).
    async def on_service_error(request: Request, exc: Exception):
        status, line = service_trouble(exc)
        log.warning("%s %s: %s", request.method, request.url.path, redact(first_line(exc)))
        if request.url.path.endswith("/dashboard") and "/api/" not in request.url.path:
            page = f'<!doctype html><meta charset="utf-8"><p>{html.escape(line)}</p>'
            return HTMLResponse(page, status_code=status)
        return JSONResponse({"detail": line}, status_code=status)

    for error in SERVICE_ERRORS:
        app.add_exception_handler(error, on_service_error)

    @app.get("/openapi.json", dependencies=read, include_in_schema=False)
    def get_openapi() -> dict:
        return app.openapi()

    @app.get("/api/status", dependencies=read)
    def get_status() -> dict:
        with _conn() as conn:
            return progress(conn)

    @app.get("/api/destinations", dependencies=read)
    def get_destinations() -> dict:
        with _conn() as conn:
            return {"destinations": destination_view(conn, progress(conn))}

    @app.get("/api/metrics", dependencies=read)
    def get_metrics(runner: str | None = None, minutes: int = minutes_query) -> dict:
        with _conn() as conn:
            return {"minutes": minutes, "runners": metric_series(conn, runner, minutes)}

    @app.get("/api/failures", dependencies=read)
    def get_failures(limit: int = Query(50, ge=1, le=1000)) -> dict:
        with _conn() as conn:
            return {"failures": latest_failures(conn, limit)}

    @app.get("/api/audits", dependencies=read)
    def get_audits(limit: int = Query(10, ge=1, le=500)) -> dict:
        with _conn() as conn:
            return {"audits": latest_audits(conn, limit)}

    @app.get("/api/replays", dependencies=read)
    def get_replays(limit: int = Query(10, ge=1, le=500)) -> dict:
        with _conn() as conn:
            return {"replays": latest_replays(conn, limit)}

    def _control(fn, *args) -> Any:
        try:
            with _conn() as conn:
                return fn(conn, *args)
        except ControlError as exc:
            code = 404 if str(exc).startswith("unknown ") else 422
            raise HTTPException(status_code=code, detail=str(exc)) from None

    @app.post("/api/adjust", dependencies=write)
    def post_adjust(body: Adjustment) -> dict:
        controls = _control(adjust, body.scope, body.name, body.changes)
        return {"scope": body.scope, "name": body.name, "controls": controls}

    @app.post("/api/pause", dependencies=write)
    def post_pause(body: Target) -> dict:
        _control(set_paused, body.scope, body.name, True)
        return {"scope": body.scope, "name": body.name, "paused": True}

    @app.post("/api/resume", dependencies=write)
    def post_resume(body: Target) -> dict:
        _control(set_paused, body.scope, body.name, False)
        return {"scope": body.scope, "name": body.name, "paused": False}

    @app.get("/api/catalog", dependencies=read)
    def get_catalog() -> dict:
        with _conn() as conn:
            return catalog_view(conn)

    def _switch(body: RuleName, enabled: bool) -> dict:
        # Deferred like the rest of the catalog: only the webserver serves this.
        from eventpush.catalog import CatalogError, NotFoundError, set_rule_enabled

        try:
            with _conn() as conn:
                return set_rule_enabled(conn, body.bus, body.name, enabled).to_json()
        except NotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        except CatalogError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None

    # The same write permission as pause and resume.
    @app.post("/api/rule/enable", dependencies=write)
    def post_rule_enable(body: RuleName) -> dict:
        return _switch(body, True)

    @app.post("/api/rule/disable", dependencies=write)
    def post_rule_disable(body: RuleName) -> dict:
        return _switch(body, False)

    @app.get("/api/dashboard", dependencies=read)
    def get_dashboard(minutes: int = minutes_query) -> dict:
        with _conn() as conn:
            html_ = render_live(conn, minutes)
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return {"minutes": minutes, "generated_at": now, "html": html_}

    @app.get("/dashboard", response_class=HTMLResponse, dependencies=read)
    def dashboard(minutes: int = minutes_query) -> str:
        with _conn() as conn:
            return render_dashboard(conn, minutes)

    return app
