"""The ASGI app: ``POST /`` speaks Amazon EventBridge's wire protocol (AWS JSON 1.1, the
operation in ``X-Amz-Target: AWSEvents.<Operation>``), beside ``GET /healthz`` and the
Prometheus ``GET /metrics``.

A request goes: body read (refused past ``max_body`` before it is read whole), Signature
Version 4 checked (eventpush.api.auth), the operation looked up (``UnknownOperationException``
for one we do not serve), the key's role checked (a producer only ``PutEvents`` and
``TestEventPattern``), the JSON parsed (``SerializationException``), then the operation's
handler. Every refusal is AWS's error shape (eventpush.api.errors); an unexpected error is an
``InternalException`` whose message says nothing about the cause (the log does).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from datetime import UTC, datetime

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from eventpush.api import archives, auth, buses, destinations, events, rules, targets
from eventpush.api.errors import CONTENT_TYPE, ApiError, error_parts
from eventpush.api.service import Call, Service, Settings
from eventpush.publish import new_id

log = logging.getLogger("eventpush.api")

TARGET_PREFIX = "AWSEvents."
OPERATIONS = {
    **events.OPERATIONS,
    **buses.OPERATIONS,
    **rules.OPERATIONS,
    **targets.OPERATIONS,
    **archives.OPERATIONS,
    **destinations.OPERATIONS,
}
PRODUCER_OPERATIONS = frozenset({"PutEvents", "TestEventPattern"})
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
GC_YOUNG_THRESHOLD = 10_000
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class ApiMetrics:
    """This process's figures (each uvicorn worker serves its own)."""

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "eventpush_api_requests",
            "API requests answered, by operation and AWS error code (OK for success)",
            ["operation", "code"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "eventpush_api_request_duration_seconds",
            "Time from the request's arrival to its answer",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_GroupCommitCollector(service))
        self._children: dict[tuple[str, str], tuple] = {}

    def observe(self, operation: str, code: str, seconds: float) -> None:
        """One answered request; each label set's children looked up once (``labels()``
        costs more than the increment)."""
        children = self._children.get((operation, code))
        if children is None:
            children = (
                self.requests.labels(operation, code),
                self.duration.labels(operation),
            )
            self._children[(operation, code)] = children
        children[0].inc()
        children[1].observe(seconds)


class _GroupCommitCollector:
    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self):
        stats = self.service.publisher.stats
        for name, doc, value in (
            ("eventpush_api_commits", "Group commits of PutEvents", stats.commits),
            ("eventpush_api_events_stored", "Events committed by PutEvents", stats.events),
            ("eventpush_api_commit_failures", "Group commits that failed", stats.failures),
            (
                "eventpush_api_commit_seconds",
                "Seconds group commits held their connection, the append's start to its "
                "commit (over eventpush_api_commits_total: a commit's mean time)",
                stats.seconds,
            ),
            (
                "eventpush_api_wakeups",
                "Statements that woke the workers, each for every bus committed since the one "
                "before (at most one every 10 ms a process)",
                stats.wakeups,
            ),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class _Http:
    """One ``POST /`` as ASGI hands it: headers with lower-case names (a repeated one's values
    joined with commas, as SigV4 signs them: a second ``X-Amz-Target`` or ``X-Amz-Date`` left
    out of the signature is no longer dropped unseen, it fails the signature), and the pieces
    of the URL the signature covers."""

    __slots__ = ("headers", "url")

    def __init__(self, scope: dict) -> None:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1")
            if key not in headers:
                headers[key] = value.decode("latin-1")
            else:
                headers[key] += "," + value.decode("latin-1")
        self.headers = headers
        query = scope.get("query_string", b"").decode("latin-1")
        self.url = f"{scope.get('scheme', 'http')}://{headers.get('host', '')}{scope['path']}" + (
            f"?{query}" if query else ""
        )


async def _read_body(receive, headers: dict[str, str], limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass ``limit``."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        "RequestEntityTooLargeException", f"request body is over the {limit}-byte limit"
    )


class _Gone(Exception):
    """The client went away before its body arrived: nobody to answer."""


async def _authenticate(request: _Http, service: Service, body: bytes) -> Call:
    headers = request.headers
    claim = auth.parse_authorization(headers.get("authorization"))
    if headers.get("x-amz-security-token"):
        raise ApiError(
            "UnrecognizedClientException",
            "temporary credentials (X-Amz-Security-Token) are not issued by this server",
        )
    amz_date = headers.get("x-amz-date")
    auth.request_time(amz_date, datetime.now(UTC))
    auth.check_scope(claim, amz_date, service.settings.region)
    found = await service.key(claim.access_key_id)
    if found is None:
        raise ApiError(
            "UnrecognizedClientException", "The security token included in the request is invalid"
        )
    key, secret = found
    received = auth.Received("POST", request.url, headers, body)
    auth.verify(received, claim, amz_date, secret, service.settings.region)
    return Call(service, key)


def _operation(headers: dict[str, str]) -> str:
    target = headers.get("x-amz-target", "")
    operation = target.removeprefix(TARGET_PREFIX)
    if not target.startswith(TARGET_PREFIX) or operation not in OPERATIONS:
        raise ApiError(
            "UnknownOperationException",
            f"operation {target[:100]!r} is not served here (see README, "
            "'Publishing from any language')",
        )
    return operation


def _document(body: bytes) -> dict:
    try:
        doc = _decode(body) if body.strip() else {}
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # the last: not UTF-8
        raise ApiError("SerializationException", "the request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise ApiError("SerializationException", "the request body must be a JSON object")
    return doc


async def handle(scope: dict, receive, send, service: Service, metrics: ApiMetrics) -> None:
    """``POST /``, in plain ASGI: the hot path of every SDK call, so no routing and no
    Request or Response objects (they cost as much as the SigV4 check)."""
    started = time.perf_counter()
    operation, code = "unknown", "OK"
    request = _Http(scope)
    try:
        body = await _read_body(receive, request.headers, service.settings.max_body)
        call = await _authenticate(request, service, body)
        operation = _operation(request.headers)
        if call.key.role != "admin" and operation not in PRODUCER_OPERATIONS:
            raise ApiError(
                "AccessDeniedException",
                f"key {call.key.name} (producer) is not authorized to perform events:{operation}",
            )
        result = await OPERATIONS[operation](call, _document(body))
        status, payload, headers = 200, _encode(result), []
    except _Gone:
        return
    except ApiError as exc:
        code = exc.code
        status, payload, headers = error_parts(exc)
    except Exception:
        log.exception("API operation %s failed", operation)
        code = "InternalException"
        status, payload, headers = error_parts(
            ApiError(code, "an internal error occurred; see the log")
        )
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", _CONTENT_TYPE),
                (b"content-length", str(len(payload)).encode()),
                (b"x-amzn-requestid", new_id().encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
    metrics.observe(operation, code, time.perf_counter() - started)


_CONTENT_TYPE = CONTENT_TYPE.encode()


async def healthz(request: Request) -> Response:
    """200 when the database answers, 503 when it does not."""
    service: Service = request.app.state.service
    try:
        await service.db.call(lambda conn: conn.cursor().execute("SELECT 1"))
    except ApiError:
        return JSONResponse({"status": "database unreachable"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics_endpoint(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")


class EventsApp:
    """``POST /`` served straight from ASGI (:func:`handle`); everything else (lifespan,
    ``/healthz``, ``/metrics``, a wrong method on ``/``) by Starlette."""

    def __init__(self, starlette: Starlette) -> None:
        self.starlette = starlette

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/" and scope["method"] == "POST":
            state = self.starlette.state
            await handle(scope, receive, send, state.service, state.metrics)
        else:
            await self.starlette(scope, receive, send)


async def _served_by_events_app(request: Request) -> Response:
    """Never called (EventsApp answers ``POST /`` first): the route is there so that Starlette
    answers another method on ``/`` with 405."""
    raise AssertionError("POST / reached Starlette")


def _tune_collector() -> None:
    """With Python's default (a young collection every 700 net allocations) the collector ran
    every few requests while 64 requests were in flight, 16 ms of CPU per 1,000 requests
    (in-process, the real group commit); a request's objects are freed by reference counting
    and cycles are rare (an exception's traceback), so a young collection every
    ``GC_YOUNG_THRESHOLD`` allocations is ample, and what start-up built is frozen out of the
    older generations' scans."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def create_app(settings: Settings) -> EventsApp:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service = Service(settings)
        await service.start()
        app.state.service = service
        app.state.metrics = ApiMetrics(service)
        _tune_collector()
        try:
            yield
        finally:
            await service.close()

    return EventsApp(
        Starlette(
            routes=[
                Route("/", _served_by_events_app, methods=["POST"]),
                Route("/healthz", healthz, methods=["GET"]),
                Route("/metrics", metrics_endpoint, methods=["GET"]),
            ],
            lifespan=lifespan,
        )
    )


def app_from_env() -> EventsApp:
    """The app uvicorn imports in each worker (``--workers N``): settings from the
    environment ``eventpush api`` set."""
    from eventpush.config import database_url

    return create_app(Settings.from_env(database_url()))
