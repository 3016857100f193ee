"""A loopback receiver that checks credentials, and an OAuth2 token endpoint that counts its
requests (issue 32's tests). aiohttp on a thread of its own, optionally over TLS.

Paths:

- ``/token``: a client credentials token endpoint; checks the HTTP Basic client auth and the
  form, issues ``tok-N`` (``expires_in``: ``token_lifetime``); 500 while ``token_fails``;
- ``/apikey``: 200 when ``X-Api-Key`` is ``api_key``, else 401;
- ``/basic``: 200 when Basic auth is ``user``/``password``, else 401;
- ``/bearer``: 200 when the bearer token is one issued and not revoked, else 401;
- any other path: 200.

Every request but the token endpoint's is recorded (method, path, query, headers, body).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote_plus

from aiohttp import web

from eventpush.demo.serving import AppThread


@dataclass
class Seen:
    method: str
    path: str
    query: dict
    headers: dict
    body: bytes
    status: int


@dataclass
class AuthState:
    api_key: str = "k-0123456789"
    user: str = "alice"
    password: str = "p@ss:word w"
    client_id: str = "client-1"
    client_secret: str = "cs secret/+="
    token_lifetime: int | None = 3600
    token_fails: bool = False
    token_delay_s: float = 0.0
    token_requests: int = 0
    token_forms: list = field(default_factory=list)
    valid: set = field(default_factory=set)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def revoke(self) -> None:
        with self.lock:
            self.valid.clear()

    def delivered(self, path: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.path == path and s.status == 200]


def _basic(header: str) -> tuple[str, str] | None:
    if not header.startswith("Basic "):
        return None
    user, _, password = base64.b64decode(header[6:]).decode().partition(":")
    return user, password


def make_app(state: AuthState) -> web.Application:
    async def token(request: web.Request) -> web.Response:
        form = await request.post()
        with state.lock:
            state.token_requests += 1
            n = state.token_requests
            state.token_forms.append(dict(form))
        if state.token_delay_s:
            await asyncio.sleep(state.token_delay_s)
        if state.token_fails:
            return web.json_response({"error": "temporarily_unavailable"}, status=500)
        creds = _basic(request.headers.get("Authorization", ""))
        expected = (state.client_id, state.client_secret)
        if creds is None or tuple(unquote_plus(c) for c in creds) != expected:
            return web.json_response({"error": "invalid_client"}, status=401)
        if form.get("grant_type") != "client_credentials":
            return web.json_response({"error": "unsupported_grant_type"}, status=400)
        issued = f"tok-{n}"
        with state.lock:
            state.valid.add(issued)
        doc = {"access_token": issued, "token_type": "Bearer"}
        if state.token_lifetime is not None:
            doc["expires_in"] = state.token_lifetime
        return web.json_response(doc)

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        auth = request.headers.get("Authorization", "")
        kind = request.path
        if kind == "/apikey":
            ok = request.headers.get("X-Api-Key") == state.api_key
        elif kind == "/basic":
            ok = _basic(auth) == (state.user, state.password)
        elif kind == "/bearer":
            with state.lock:
                ok = auth.startswith("Bearer ") and auth[7:] in state.valid
        else:
            ok = True
        status = 200 if ok else 401
        seen = Seen(
            request.method,
            request.path,
            dict(request.query),
            {k.lower(): v for k, v in request.headers.items()},
            body,
            status,
        )
        with state.lock:
            state.seen.append(seen)
        return web.Response(status=status)

    app = web.Application()
    app.router.add_route("POST", "/token", token)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


class AuthReceiver:
    """The app on 127.0.0.1 in a thread of its own (``ssl_context``: over TLS)."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.state = AuthState()
        self._server = AppThread("auth-receiver", ssl_context)
        self.url = ""

    def __enter__(self) -> AuthReceiver:
        self.url = self._server.start(lambda: make_app(self.state))
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()
