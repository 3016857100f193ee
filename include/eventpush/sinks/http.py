"""HTTP and HTTPS targets as a sink: the request, the Standard Webhooks headers, the guarded
connections and the classification of the answer (:mod:`eventpush.sinks.retry`).

Requests go through libcurl (pycurl), driven by the event loop itself
(:mod:`eventpush.sinks.transfers`).

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
import ipaddress
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from threading import get_ident
from urllib.parse import urlencode, urlsplit

import certifi
import pycurl

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
from eventpush.sinks.transfers import Transfers, socket_opened

BODY_CAP = 64 * 1024  # what we read of an answer; a target may send more, we never hold it
URL_CACHE = 10_000  # target URLs with their query parameters, built once (a replay may meet many)
PIN_TTL_S = 60.0  # how long a checked address stays pinned before the name is resolved again
IDLE_HANDLES = 256  # reusable request handles kept per route (more are closed when done)
# libcurl's codes this module tells apart (every other one is a connection that failed).
TIMED_OUT = pycurl.E_OPERATION_TIMEDOUT
UNSENDABLE = (pycurl.E_URL_MALFORMAT, pycurl.E_UNSUPPORTED_PROTOCOL)  # final: never sendable


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
    """The pooled HTTP connections of a worker or a replay partition (``async with`` closes
    them).

    Requests go through libcurl on the event loop (:class:`~eventpush.sinks.transfers.Transfers`,
    one per loop, made on first use). libcurl would resolve names itself, after our checks, so
    this class does the resolving: per scheme, host and port (and TLS files) it resolves the
    name, refuses it when any address is denied (a name mixing a public and a private address
    is a rebinding trick, not a target), and pins the route to the checked address
    (``CONNECT_TO``) for ``PIN_TTL_S``. Every socket libcurl opens is checked once more, on
    the address it is about to connect to (``OPENSOCKETFUNCTION``): a name cannot be rebound
    between the check and the connect, and nothing reaches a denied address whatever
    libcurl resolved. IP-literal URLs are checked the same way."""

    def __init__(self, limit: int = 0, policy: AddressPolicy | None = None) -> None:
        self._policy = policy if policy is not None else address_policy()
        self._limit = limit
        self._routes: dict[str | tuple[str, Tls], _Route] = {}  # target URL -> its pinned route
        # When each URL last had its route looked up here (a route shared with a URL still in
        # use stays fresh without it), and when URLs not looked up for long were last
        # forgotten (see _forget_unused).
        self._pinned_at: dict[str | tuple[str, Tls], float] = {}
        self._swept = time.monotonic()
        self._urls: dict[tuple[str, tuple], str] = {}  # (URL, query) -> the URL sent
        self._transfers: Transfers | None = None

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._transfers is not None:
            self._transfers.close()
            self._transfers = None
        for route in self._routes.values():
            route.close()
        self._routes.clear()
        self._pinned_at.clear()

    def transfers(self) -> Transfers:
        """The running loop's transfers (a session used from a new loop starts afresh)."""
        transfers = self._transfers
        # One loop runs in a thread at a time: a running loop of this thread is the running
        # loop, known without asking asyncio, whose check is a getpid() system call a request.
        if (
            transfers is not None
            and transfers.thread == get_ident()
            and transfers.loop.is_running()
        ):
            return transfers
        loop = asyncio.get_running_loop()
        if transfers is None or transfers.loop is not loop:
            if transfers is not None:
                transfers.close()
            transfers = self._transfers = Transfers(loop, self._limit)
        return transfers

    async def run(self, handle: _Handle) -> tuple[int, str | None]:
        """Run one prepared request to its end: libcurl's ``(code, message)``, 0 when it
        completed (the hot path, :func:`post`, does the same inline)."""
        transfers = self.transfers()
        future = transfers.start(handle.curl)
        try:
            return await future
        except asyncio.CancelledError:
            _abandon(transfers, handle)
            raise

    def url(self, url: str, query: tuple = ()) -> str:
        """``url`` with the target's query parameters (``((name, value), ...)``) added."""
        key = (url, query)
        sent = self._urls.get(key)
        if sent is None:
            if len(self._urls) >= URL_CACHE:
                self._urls.clear()
            sent = url
            if query:
                sent += ("&" if urlsplit(url).query else "?") + urlencode(query)
            self._urls[key] = sent
        return sent

    def pinned(self, url: str, tls: Tls | None = None) -> _Route | None:
        """The route pinned for ``url`` (with the TLS files ``tls``) while its pin is fresh
        (no await on the hot path)."""
        route = self._routes.get(url if tls is None else (url, tls))
        if route is not None and route.expires > time.monotonic():
            return route
        return None

    async def route_for(self, url: str, tls: Tls | None = None) -> _Route:
        """The route pinned to ``url``'s checked address, presenting and trusting the
        certificates of ``tls``; raises RefusedAddressError for a denied address,
        InvalidTargetUrlError for a URL that cannot be sent to, OSError when the name does
        not resolve or a TLS file cannot be read."""
        route = self.pinned(url, tls)
        if route is not None:
            return route
        key = url if tls is None else (url, tls)
        now = time.monotonic()
        if now - self._swept >= PIN_TTL_S:
            self._swept = now
            self._forget_unused(now)
        route = self._routes.get(key)
        origin = _origin(url)
        addresses = await self._checked_addresses(origin[1], origin[2])
        self._pinned_at[key] = now
        if route is not None and route.address in addresses:  # the pin still holds
            route.expires = now + PIN_TTL_S
            return route
        for other in self._routes.values():  # another target's fresh route to that origin
            if (
                other.origin == origin
                and other.tls == tls
                and other.address in addresses
                and other.expires > now
            ):
                self._routes[key] = other
                return other
        # Re-pinned: the old route is not closed, since another target's key may share it (a
        # closed route pools no handle); its handles go with it once nothing refers to it.
        route = self._routes[key] = _route(origin, addresses[0], tls, self._policy)
        route.expires = now + PIN_TTL_S
        return route

    def _forget_unused(self, now: float) -> None:
        """Forget the URLs whose route was not looked up for two pins' time (a URL in use
        looks its route up again at its first send past its pin, or shares one another URL
        keeps fresh), and close the routes no URL holds any more. Without this every target
        URL ever sent to (targets deleted, URLs changed, TLS files rotated) kept its entry,
        and its route its idle handles, for the process's life: a worker runs for weeks. A
        URL sent to again is resolved and pinned anew, as it would be at its pin's end."""
        stale = now - 2 * PIN_TTL_S
        forgotten = [k for k, at in self._pinned_at.items() if at < stale]
        gone = []
        for key in forgotten:
            del self._pinned_at[key]
            gone.append(self._routes.pop(key, None))  # None: its route was never made
        held = {id(r) for r in self._routes.values()}
        for route in gone:
            if route is not None and id(route) not in held:
                route.close()

    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of the name ``host``, as the system's resolver gives them."""
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(info[4][0] for info in infos))

    async def _checked_addresses(self, host: str, port: int) -> list[str]:
        """Every address of ``host`` (itself for an IP literal), each passed by the policy."""
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            addresses = await self.resolve(host, port)
        else:
            addresses = [host]
        if not addresses:
            raise OSError(f"{host} resolves to no address")
        for address in addresses:
            self._policy.check(address)
        return addresses


class _Answer:
    """What one request's answer told: the final status once its headers are complete, the
    two headers a refusal's handling reads, and the size of the body (read up to
    ``BODY_CAP``, kept only when asked). Bound to one libcurl handle's callbacks."""

    __slots__ = (
        "status",
        "seen",
        "retry_after",
        "location",
        "size",
        "body",
        "refused",
        "policy",
    )

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy
        self.reset(False)

    def reset(self, keep_body: bool) -> None:
        self.status = self.seen = None
        self.retry_after = self.location = self.refused = None
        self.size = 0
        self.body = [] if keep_body else None

    def header(self, line: bytes) -> None:
        """``HEADERFUNCTION``: one header line (the status line, a header, the blank line)."""
        if line == b"\r\n" or line == b"\n":
            if self.seen is not None and self.seen >= 200:  # a 1xx is not the answer
                self.status = self.seen
            return
        if not line:
            return
        # The first byte as an int: ``b"x" in b"rRlL"`` tries its operand as an int first,
        # and raises and clears a TypeError each time (~1,800 instructions, callgrind).
        first = line[0]
        if first == 72 and line.startswith(b"HTTP/"):  # "H"
            parts = line.split(None, 2)
            try:
                self.seen = int(parts[1])
            except (IndexError, ValueError):
                self.seen = None
            self.retry_after = self.location = None
        elif first in b"rRlL":
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"retry-after":
                self.retry_after = value.strip().decode("latin-1")
            elif name == b"location":
                self.location = value.strip().decode("latin-1")

    def write(self, chunk: bytes) -> int | None:
        """``WRITEFUNCTION``: past ``BODY_CAP`` the transfer stops (its connection dropped)."""
        self.size += len(chunk)
        if self.body is not None:
            self.body.append(chunk[: len(chunk) - max(0, self.size - BODY_CAP)])
        if self.size > BODY_CAP:
            return 0  # less than was handed over: libcurl aborts the transfer
        return None

    def open_socket(self, purpose: int, address) -> socket.socket | int:
        """``OPENSOCKETFUNCTION``: the address libcurl is about to connect to, checked."""
        try:
            self.policy.check(address.addr[0])
        except RefusedAddressError as exc:
            self.refused = str(exc)
            return pycurl.SOCKET_BAD
        socket_opened()
        # pycurl hands libcurl a duplicate of this socket. This one is closed on the loop's
        # next turn, so that libcurl's close ends the socket (and takes it out of the
        # Transfers' epoll set, which holds the socket, not the number) when libcurl is done.
        opened = socket.socket(address.family, address.socktype, address.protocol)
        asyncio.get_running_loop().call_soon(opened.close)
        return opened


class _Handle:
    """A pooled libcurl handle and what this module knows of it: its answer's callbacks and
    the options its last request left set. Kept here, not as attributes of pycurl's object:
    pycurl looks any attribute of its own up only after the generic lookup has raised and
    cleared an AttributeError, ~2,500 instructions each time (callgrind), several times a
    request. ``setopt`` is the handle's bound method, taken once for the same reason."""

    __slots__ = ("curl", "setopt", "answer", "url", "method", "timeout_ms")

    def __init__(self, curl: pycurl.Curl, answer: _Answer) -> None:
        self.curl = curl
        self.setopt = curl.setopt
        self.answer = answer
        self.url: str | None = None
        self.method = "POST"
        self.timeout_ms = 0


@dataclass(slots=True)
class _Route:
    origin: tuple[str, str, int]  # scheme, host, port
    address: str
    tls: Tls | None = None
    expires: float = 0.0
    policy: AddressPolicy | None = None
    options: list[tuple[int, object]] = field(default_factory=list)  # set on each new handle
    idle: list[_Handle] = field(default_factory=list)
    closed: bool = False

    def handle(self) -> _Handle:
        """An idle request handle of this route, or a new one set up for it."""
        if self.idle:
            return self.idle.pop()
        curl = pycurl.Curl()
        answer = _Answer(self.policy)
        for option, value in self.options:
            curl.setopt(option, value)
        curl.setopt(pycurl.HEADERFUNCTION, answer.header)
        curl.setopt(pycurl.WRITEFUNCTION, answer.write)
        curl.setopt(pycurl.OPENSOCKETFUNCTION, answer.open_socket)
        return _Handle(curl, answer)

    def give_back(self, handle: _Handle) -> None:
        if self.closed or len(self.idle) >= IDLE_HANDLES:
            handle.curl.close()
        else:
            self.idle.append(handle)

    def close(self) -> None:
        self.closed = True
        for handle in self.idle:
            handle.curl.close()
        self.idle.clear()


def _route(
    origin: tuple[str, str, int], address: str, tls: Tls | None, policy: AddressPolicy
) -> _Route:
    """A route to ``address`` for ``origin``'s URLs: the options every handle of it carries."""
    _, host, port = origin
    options: list[tuple[int, object]] = [
        (pycurl.NOSIGNAL, 1),
        (pycurl.PROXY, ""),  # no proxy from the environment between us and the policy
        (pycurl.PROTOCOLS, pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS),
        (pycurl.FOLLOWLOCATION, 0),  # a 3xx is the target's answer
        # No Accept-Encoding: we never look inside a body, so nothing is decompressed.
    ]
    if address != host:  # a name: its one route is the address we checked
        pinned = f"[{address}]" if ":" in address else address
        options.append((pycurl.CONNECT_TO, [f"{host}:{port}:{pinned}:{port}"]))
    if origin[0] == "https":
        if tls is not None and tls.client_cert_file is not None:
            options.append((pycurl.SSLCERT_BLOB, _read(tls.client_cert_file)))
            options.append((pycurl.SSLKEY_BLOB, _read(tls.client_key_file)))
        if tls is not None and tls.ca_file is not None:  # trusted besides the usual roots
            roots = _read(certifi.where()) + b"\n" + _read(tls.ca_file)
            options.append((pycurl.CAINFO_BLOB, roots))
        else:
            options.append((pycurl.CAINFO, certifi.where()))
    return _Route(origin, address, tls, policy=policy, options=options)


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
    """A pooled HTTP session; ``limit`` caps the connections per host (0: no cap).
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
    """One POST with the target's timeout (libcurl's own: no timer of ours), carrying
    ``traceparent`` (the attempt's trace context) when given. Never raises for network
    trouble. Returns the request coroutine itself: no frame of its own on the hot path."""
    if traceparent is not None:  # the span of this attempt, so the receiver can join it
        headers = {**headers, "traceparent": traceparent}
    return post(session, target, body, headers)


def header_lines(headers: dict[str, str]) -> list[str]:
    """libcurl's header list. An empty value is written ``name;`` (``name:`` would remove
    the header); ``Expect:`` keeps libcurl from waiting for a 100 before a large body. A
    line break anywhere is refused (it would split the request): the stored headers are
    checked when written (:mod:`eventpush.sinks.headers`), this holds for any row."""
    lines = [f"{k}: {v}" if v else f"{k};" for k, v in headers.items()]
    lines.append("Expect:")
    text = "".join(lines)
    if "\r" in text or "\n" in text or "\0" in text:
        raise ValueError("a header carries a line break or NUL: not sent")
    return lines


def prepare(
    route: _Route,
    url: str,
    method: str,
    body: bytes,
    lines: list[str],
    timeout_ms: int,
    keep_body: bool = False,
) -> _Handle:
    """A handle of ``route`` set for one request (options the last request left as they
    should be, its URL among them, are not set again); its ``answer`` keeps the body with
    ``keep_body``."""
    handle = route.handle()
    handle.answer.reset(keep_body)
    setopt = handle.setopt
    if handle.url != url:
        setopt(pycurl.URL, url)
        handle.url = url
    setopt(pycurl.POSTFIELDS, body)
    setopt(pycurl.HTTPHEADER, lines)
    if handle.timeout_ms != timeout_ms:
        setopt(pycurl.TIMEOUT_MS, timeout_ms)
        handle.timeout_ms = timeout_ms
    if handle.method != method:
        if method == "POST":
            handle.curl.unsetopt(pycurl.CUSTOMREQUEST)
        else:
            setopt(pycurl.CUSTOMREQUEST, method)
        handle.method = method
    return handle


async def post(session: Session, target: Target, body: bytes, headers: dict[str, str]) -> Outcome:
    """One request of ``body`` with exactly ``headers`` (and the method, query and TLS files
    of ``target``): :func:`attempt` without the trace context. Once the answer's headers are
    in, it is the answer: trouble with the body after them changes nothing.

    At most ``BODY_CAP`` of the body is read, and only counted; past it the transfer stops
    and its connection is dropped. A short answer has been read to its end, so its connection
    goes back to the pool."""
    started = time.perf_counter()
    try:
        url, tls = target.url, target.tls
        route = session.pinned(url, tls) or await session.route_for(url, tls)
        handle = prepare(
            route,
            session.url(url, target.query) if target.query else url,
            target.method,
            body,
            header_lines(headers),
            target.timeout_ms,
        )
        answer = handle.answer
        transfers = session.transfers()
        future = transfers.start(handle.curl)
        try:
            code, message = await future
        except asyncio.CancelledError:
            _abandon(transfers, handle)
            raise
    except (RefusedAddressError, InvalidTargetUrlError) as exc:
        return _refused(target, str(exc), started)
    except (OSError, ValueError, pycurl.error) as exc:
        # ValueError: a request that cannot be sent as it stands (a final condition).
        kind = FINAL if isinstance(exc, ValueError) else RETRY
        error = f"connection failed: {first_line(exc)[:300]}"
        return _outcome(target, kind, None, error, started)
    status, retry_after, location, refused = (
        answer.status,
        answer.retry_after,
        answer.location,
        answer.refused,
    )
    route.give_back(handle)
    if status is None:  # no answer: why the transfer ended is the outcome
        if refused is not None:
            return _refused(target, refused, started)
        kind = FINAL if code in UNSENDABLE else RETRY
        return _outcome(target, kind, None, unanswered(code, message, target.timeout_ms), started)
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


def unanswered(code: int, message: str | None, timeout_ms: int) -> str:
    """Why a transfer that got no answer ended, in one line (the caller redacts it)."""
    if code == TIMED_OUT:
        return f"timed out after {timeout_ms} ms"
    return f"connection failed: {first_line(message or f'libcurl error {code}')[:300]}"


def _abandon(transfers: Transfers, handle: _Handle) -> None:
    """A request whose sender was cancelled: stopped, its handle and sockets let go."""
    transfers.abandon(handle.curl)
    handle.curl.close()


def _refused(target: Target, why: str, started: float) -> Outcome:
    refused = _outcome(target, FINAL, None, f"refused address: {why}", started)
    refused.reached = False
    return refused


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
        session = self.session
        try:
            route = await session.route_for(auth.token_url)
            lines = header_lines(headers)
            handle = prepare(
                route, auth.token_url, "POST", body, lines, target.timeout_ms, keep_body=True
            )
            code, message = await session.run(handle)
        except (RefusedAddressError, InvalidTargetUrlError) as exc:
            raise TokenError(f"token URL {where}: refused address: {exc}") from None
        except (OSError, ValueError, pycurl.error) as exc:
            why = redact(first_line(exc)[:300], auth.token_url)
            raise TokenError(f"token URL {where}: connection failed: {why}") from None
        answer = handle.answer
        status, refused, kept = answer.status, answer.refused, b"".join(answer.body)
        route.give_back(handle)
        if status is None:
            if refused is not None:
                raise TokenError(f"token URL {where}: refused address: {refused}")
            why = redact(unanswered(code, message, target.timeout_ms), auth.token_url)
            raise TokenError(f"token URL {where}: {why}")
        try:
            return parse_token(status, kept)
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
