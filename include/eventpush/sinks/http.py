"""HTTP and HTTPS targets as a sink: the request, the Standard Webhooks headers, the guarded
connections and the classification of the answer (:mod:`eventpush.sinks.retry`).

Used by the push engine, which schedules retries itself in a low-priority lane, and by replay,
which retries inline (``eventpush.sinks.Sinks.deliver``). Classification follows
docs/ARCHITECTURE.md: 2xx delivered; 5xx, 408, 429, timeouts and connection errors retried;
any other status final.

Targets are treated as adversaries: a redirect is an answer (final, never followed), a body is
read up to ``BODY_CAP`` bytes and the connection dropped past that, ``Retry-After`` is clamped
to finite bounds, every address is checked against the address policy and the client pinned
to it before it connects (:class:`Session`), and every error text passes
:func:`eventpush.config.redact` before it leaves this module.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from pyreqwest.client import Client, ClientBuilder
from pyreqwest.exceptions import PyreqwestError, RequestTimeoutError
from pyreqwest.http import Url

from eventpush.addresses import (
    AddressPolicy,
    InvalidTargetUrlError,
    RefusedAddressError,
    address_policy,
    check_host,
    split_url,
)
from eventpush.config import redact, redact_url
from eventpush.errors import first_line
from eventpush.policy import LIMITS
from eventpush.sinks import transform_failed
from eventpush.sinks.contract import (
    API_KEY,
    BASIC,
    DELIVERED,
    FINAL,
    OAUTH,
    RETRY,
    Auth,
    Outcome,
    Record,
    Target,
    Tls,
)
from eventpush.sinks.oauth import TokenError, Tokens, parse_token, token_request
from eventpush.sinks.request import build_request
from eventpush.sinks.retry import classify, parse_retry_after

BODY_CAP = 64 * 1024  # what we read of an answer; a target may send more, we never hold it
URL_CACHE = 10_000  # parsed target URLs kept (a replay may meet many)
PIN_TTL_S = 60.0  # how long a checked address stays pinned before the name is resolved again
# A re-pinned client is closed once no send can still be using it: past the longest timeout.
RETIRED_CLOSE_S = LIMITS["timeout_ms"][1] / 1000 + 30


def validate_url(url: str, policy: AddressPolicy | None = None) -> str:
    """An http(s) target URL, checked; raises InvalidTargetUrlError saying what is wrong."""
    url, parts, port, where = split_url(url, "target URL")
    host = parts.hostname
    if not host:
        raise InvalidTargetUrlError(f"target URL {where!r} has no host")
    if parts.username or parts.password:
        raise InvalidTargetUrlError(
            "target URL must not carry credentials: give the target a --secret instead"
        )
    if port == 0:
        raise InvalidTargetUrlError(f"target URL {where!r} has port 0")
    return check_host(url, host, where, policy)


class Session:
    """The pooled HTTP client of a worker or a replay partition (``async with`` closes it).

    Requests go through ``pyreqwest`` (reqwest, hyper and tokio underneath): the HTTP work
    runs on tokio's thread, off the event loop. reqwest would resolve names itself, after our
    checks, so this class does the resolving: per scheme, host and port it resolves the name,
    refuses it when any address is denied (a name mixing a public and a private address is a
    rebinding trick, not a target), and builds a client whose only route to that name is the
    checked address (``resolve(domain, ip, port)``), for ``PIN_TTL_S``. Every connection thus
    goes to an address the policy passed, and a name cannot be rebound between the check and
    the connect. IP-literal URLs are checked the same way."""

    def __init__(self, limit: int = 0, policy: AddressPolicy | None = None) -> None:
        self._policy = policy if policy is not None else address_policy()
        self._limit = limit
        self._routes: dict[str, _Route] = {}  # target URL -> its pinned client
        self._timeouts: dict[int, timedelta] = {}
        self._urls: dict[str, Url] = {}  # target URL -> parsed once (a str is parsed per request)
        self._retired: list[tuple[Client, float]] = []  # re-pinned clients, when retired

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        clients = {id(r.client): r.client for r in self._routes.values()}
        clients.update((id(c), c) for c, _ in self._retired)
        self._routes.clear()
        self._retired.clear()
        for client in clients.values():
            with contextlib.suppress(Exception):  # a client that will not close stops nothing
                await client.close()

    def url(self, url: str) -> Url:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= URL_CACHE:
                self._urls.clear()
            parsed = self._urls[url] = Url(url)
        return parsed

    def timeout(self, ms: int) -> timedelta:
        td = self._timeouts.get(ms)
        if td is None:
            td = self._timeouts[ms] = timedelta(milliseconds=ms)
        return td

    def pinned(self, url: str, tls: Tls | None = None) -> Client | None:
        """The client pinned to ``url`` (with the TLS files ``tls``) while its pin is fresh
        (no await on the hot path)."""
        route = self._routes.get(url if tls is None else (url, tls))
        if route is not None and route.expires > time.monotonic():
            return route.client
        return None

    async def client_for(self, url: str, tls: Tls | None = None) -> Client:
        """The client pinned to ``url``'s checked address, presenting and trusting the
        certificates of ``tls``; raises RefusedAddressError for a denied address,
        InvalidTargetUrlError for a URL that cannot be sent to, OSError when the name does
        not resolve or a TLS file cannot be read."""
        client = self.pinned(url, tls)
        if client is not None:
            return client
        key = url if tls is None else (url, tls)
        route = self._routes.get(key)
        now = time.monotonic()
        origin = _origin(url)
        addresses = await self._checked_addresses(origin[1], origin[2])
        if route is not None and route.address in addresses:  # the pin still holds
            route.expires = now + PIN_TTL_S
            return route.client
        for other in self._routes.values():  # another target's fresh route to that origin
            if (
                other.origin == origin
                and other.tls == tls
                and other.address in addresses
                and other.expires > now
            ):
                self._routes[key] = other
                return other.client
        if route is not None:
            self._retire(route.client, now)
        client = self._build(origin, addresses[0], tls)
        route = self._routes[key] = _Route(client, origin, addresses[0], tls)
        route.expires = now + PIN_TTL_S
        return route.client

    def _build(self, origin: tuple[str, str, int], address: str, tls: Tls | None = None) -> Client:
        _, host, port = origin
        builder = (
            ClientBuilder()
            .follow_redirects(False)  # a 3xx is the target's answer
            .no_proxy()  # no proxy from the environment between us and the policy
            .gzip(False)  # we never look inside a body: no decompression bombs
            .brotli(False)
            .zstd(False)
            .deflate(False)
            .referer(False)
        )
        if self._limit:
            builder = builder.max_connections(self._limit)
        if address != host:  # a name: its one route is the address we checked
            builder = builder.resolve(host, address, port)
        if tls is not None:
            if tls.client_cert_file is not None:  # reqwest wants the key and chain in one PEM
                identity = _read(tls.client_key_file) + b"\n" + _read(tls.client_cert_file)
                builder = builder.identity_pem(identity)
            if tls.ca_file is not None:
                builder = builder.add_root_certificate_pem(_read(tls.ca_file))
        return builder.build()

    def _retire(self, client: Client, now: float) -> None:
        """A client whose pin moved: closed once no send can still be using it."""
        due = [c for c, at in self._retired if now - at > RETIRED_CLOSE_S]
        self._retired = [(c, at) for c, at in self._retired if now - at <= RETIRED_CLOSE_S]
        self._retired.append((client, now))
        for old in due:
            asyncio.get_running_loop().create_task(old.close())

    async def _checked_addresses(self, host: str, port: int) -> list[str]:
        """Every address of ``host`` (itself for an IP literal), each passed by the policy."""
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
            addresses = list(dict.fromkeys(info[4][0] for info in infos))
        else:
            addresses = [host]
        if not addresses:
            raise OSError(f"{host} resolves to no address")
        for address in addresses:
            self._policy.check(address)
        return addresses


@dataclass(slots=True)
class _Route:
    client: Client
    origin: tuple[str, str, int]  # scheme, host, port
    address: str
    tls: Tls | None = None
    expires: float = 0.0


def _read(path: str) -> bytes:
    """A TLS file's bytes; OSError naming it (never its contents) when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"TLS file {path}: {exc.strerror or exc}") from None


def _origin(url: str) -> tuple[str, str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidTargetUrlError(f"target URL is malformed: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidTargetUrlError("target URL must be http or https with a host")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def new_session(limit: int = 0, policy: AddressPolicy | None = None) -> Session:
    """A pooled HTTP session; ``limit`` caps the requests in flight per origin (0: no cap).
    ``policy`` is the address policy (default: the environment's, read now so a bad range
    fails at start)."""
    return Session(limit, policy)


def attempt(
    session: Session,
    target: Target,
    body: bytes,
    headers: dict[str, str],
    traceparent: str | None = None,
) -> Awaitable[Outcome]:
    """One POST with the target's timeout (the client's own: no timer of ours), carrying
    ``traceparent`` (the attempt's trace context) when given. Never raises for network
    trouble. Returns the request coroutine itself: no frame of its own on the hot path."""
    if traceparent is not None:  # the span of this attempt, so the receiver can join it
        headers = {**headers, "traceparent": traceparent}
    return post(session, target, body, headers)


async def post(session: Session, target: Target, body: bytes, headers: dict[str, str]) -> Outcome:
    """One POST of ``body`` with exactly ``headers``: :func:`attempt` without the trace
    context. Once the status line is in, it is the answer: trouble with the body after it
    changes nothing.

    The answer's body is never handed to Python: the client reads at most ``BODY_CAP`` of it
    before the status is returned (its streamed read buffer), and leaving the context drops
    whatever is left, with the connection when the body was longer. A short answer has been
    read to its end by then, so its connection goes back to the pool."""
    started = time.perf_counter()
    status: int | None = None
    retry_after = location = None
    try:
        url, tls = target.url, target.tls
        client = session.pinned(url, tls) or await session.client_for(url, tls)
        if target.method == "POST":
            builder = client.post(session.url(url))
        else:
            builder = client.request(target.method, session.url(url))
        if target.query:
            builder = builder.query(target.query)
        request = (
            builder.headers(headers)
            .body_bytes(body)
            .timeout(session.timeout(target.timeout_ms))
            .streamed_read_buffer_limit(BODY_CAP)
            .build_streamed()
        )
        async with request as resp:
            status = resp.status
            if status >= 300:  # what only a refusal's handling reads (two calls saved on a 2xx)
                retry_after = resp.get_header("retry-after")
                location = resp.get_header("location")
    except (RefusedAddressError, InvalidTargetUrlError) as exc:
        refused = _outcome(target, FINAL, None, f"refused address: {exc}", started)
        refused.reached = False
        return refused
    except RequestTimeoutError:
        if status is None:
            return _outcome(target, RETRY, None, f"timed out after {target.timeout_ms} ms", started)
    except (PyreqwestError, OSError, ValueError) as exc:
        # ValueError: a URL the client cannot send to (a final condition).
        if status is None:
            kind = FINAL if isinstance(exc, ValueError) else RETRY
            return _outcome(
                target, kind, None, f"connection failed: {first_line(exc)[:300]}", started
            )
    kind = classify(status)
    if kind == DELIVERED:
        error = None
    elif 300 <= status < 400:
        where = f" to {redact_url(location)}" if location else ""
        error = f"HTTP {status}: redirect{where} not followed"
    else:
        error = f"HTTP {status}"
    outcome = _outcome(target, kind, status, error, started)
    if status in (429, 503):
        outcome.retry_after_s = parse_retry_after(retry_after)
    return outcome


def _outcome(
    target: Target, kind: str, status: int | None, error: str | None, started: float
) -> Outcome:
    if error is not None:
        error = redact(error, target.url)
    return Outcome(kind, status, error, (time.perf_counter() - started) * 1000)


class HttpSink:
    """One pooled HTTP session for every http(s) target of the process, and the OAuth2
    tokens of their connections (:mod:`eventpush.sinks.oauth`)."""

    validate_url = staticmethod(validate_url)

    def __init__(self, policy: AddressPolicy) -> None:
        self.session = new_session(policy=policy)
        self.tokens = Tokens()

    def send(
        self, target: Target, records: list[Record], transform, traceparent: str | None = None
    ) -> Awaitable[Outcome]:
        """The attempt's awaitable: the request coroutine itself, so a send costs no
        coroutine frame of this adapter on the engine's hot path. The headers carry the
        attempt's ``traceparent``, put in as they are built rather than copied in after."""
        try:
            body, headers = build_request(target, records, transform, traceparent=traceparent)
        except Exception as exc:
            return _ready(transform_failed(exc))
        auth = target.auth
        if auth is None:
            return post(self.session, target, body, headers)
        if auth.kind == OAUTH:
            return self._send_with_token(target, body, headers)
        name, value = credential_header(auth)
        headers[name] = value
        return post(self.session, target, body, headers)

    async def _send_with_token(
        self, target: Target, body: bytes, headers: dict[str, str]
    ) -> Outcome:
        """The send with the connection's bearer token; answered 401, the token is refreshed
        once and the send made again. No token (the endpoint failed) is a retry."""
        auth = target.auth
        started = time.perf_counter()

        def fetch(auth: Auth) -> Awaitable[tuple[str, float | None]]:
            return self.fetch_token(auth, target)

        try:
            token = self.tokens.fresh(auth) or await self.tokens.get(auth, fetch)
            outcome = await post(self.session, target, body, _bearer(headers, token))
            if outcome.http_status != 401:
                return outcome
            self.tokens.refused(auth, token)
            token = await self.tokens.get(auth, fetch)
        except TokenError as exc:
            error = f"connection {auth.connection}: no OAuth token: {exc}"
            outcome = _outcome(target, RETRY, None, error, started)
            outcome.reached = False
            return outcome
        return await post(self.session, target, body, _bearer(headers, token))

    async def fetch_token(self, auth: Auth, target: Target) -> tuple[str, float | None]:
        """One token request to the connection's token URL, through the session (the address
        policy at connect time) with the target's timeout; TokenError says why it gave none."""
        where = redact_url(auth.token_url)
        body, headers = token_request(auth)
        try:
            client = await self.session.client_for(auth.token_url)
            request = (
                client.post(self.session.url(auth.token_url))
                .headers(headers)
                .body_bytes(body)
                .timeout(self.session.timeout(target.timeout_ms))
                .streamed_read_buffer_limit(BODY_CAP)
                .build_streamed()
            )
            async with request as resp:
                status, answer = resp.status, await _read_capped(resp)
        except (RefusedAddressError, InvalidTargetUrlError) as exc:
            raise TokenError(f"token URL {where}: refused address: {exc}") from None
        except RequestTimeoutError:
            raise TokenError(f"token URL {where}: timed out after {target.timeout_ms} ms") from None
        except (PyreqwestError, OSError, ValueError) as exc:
            why = redact(first_line(exc)[:300], auth.token_url)
            raise TokenError(f"token URL {where}: connection failed: {why}") from None
        try:
            return parse_token(status, answer)
        except TokenError as exc:
            raise TokenError(f"token URL {where} answered {exc}") from None

    async def close(self) -> None:
        await self.session.close()


async def _ready(outcome: Outcome) -> Outcome:
    return outcome


def _bearer(headers: dict[str, str], token: str) -> dict[str, str]:
    return {**headers, "authorization": f"Bearer {token}"}


def credential_header(auth: Auth) -> tuple[str, str]:
    """The header an API-key or Basic connection adds to each request."""
    if auth.kind == API_KEY:
        return auth.name.lower(), auth.secret
    if auth.kind == BASIC:
        basic = base64.b64encode(f"{auth.name}:{auth.secret}".encode()).decode()
        return "authorization", f"Basic {basic}"
    raise ValueError(f"connection {auth.connection}: no header for auth kind {auth.kind!r}")


async def _read_capped(resp) -> bytes:
    """At most ``BODY_CAP`` bytes of an answer's body."""
    chunks, size = [], 0
    while size < BODY_CAP:
        chunk = await resp.body_reader.read_chunk()
        if chunk is None:
            break
        chunks.append(bytes(chunk))
        size += len(chunk)
    return b"".join(chunks)[:BODY_CAP]
