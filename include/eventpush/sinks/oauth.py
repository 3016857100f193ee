"""OAuth2 client credentials (RFC 6749 4.4) for connections of kind
``oauth-client-credentials``: the token request, the answer's parsing, and the tokens a
process holds (in memory only).

The request's body is built by authlib (``prepare_token_request``); the client id and secret
go in HTTP Basic, form-encoded first (RFC 6749 2.3.1). The transport is the sink's own pinned
session (:mod:`eventpush.sinks.http`), not an authlib client: authlib's clients ride on
requests or httpx, which would connect wherever the token URL's name resolves, past the
address policy every connection of eventpush passes at connect time.

:class:`Tokens` holds one token per connection (and version) for the process: a token is
used until shortly before it expires (:func:`refresh_at`); when none is fresh, **one** fetch
runs however many sends wait for it (single flight), and each of them gets its result; a send
answered ``401`` expires the token it used, so the next fetch happens once for every send
that saw it refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable
from urllib.parse import quote_plus

from authlib.oauth2.rfc6749.parameters import prepare_token_request

from eventpush.sinks.contract import Auth
from eventpush.sinks.headers import VALUE_RE

LEEWAY_S = 60.0  # a token is refreshed this long before it expires (at most a tenth of its life)
NO_EXPIRY_S = 3600.0  # how long a token without ``expires_in`` is used (a 401 ends it sooner)


class TokenError(RuntimeError):
    """The token endpoint did not give a token (one line; no secret in it)."""


def token_request(auth: Auth) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a client credentials token request."""
    extra = dict(auth.params)
    if auth.scopes:
        extra["scope"] = list(auth.scopes)
    body = prepare_token_request("client_credentials", **extra)
    basic = f"{quote_plus(auth.name)}:{quote_plus(auth.secret)}"
    return body.encode(), {
        "content-type": "application/x-www-form-urlencoded",
        "accept": "application/json",
        "authorization": "Basic " + base64.b64encode(basic.encode()).decode(),
    }


def parse_token(status: int, body: bytes) -> tuple[str, float | None]:
    """``(access token, lifetime in seconds or None)`` from the endpoint's answer; raises
    TokenError saying what was wrong with it (the OAuth error code, never a token)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if status != 200:
        code = doc.get("error") if isinstance(doc, dict) else None
        said = f" ({code})" if isinstance(code, str) and VALUE_RE.fullmatch(code[:64]) else ""
        raise TokenError(f"HTTP {status}{said}")
    if not isinstance(doc, dict):
        raise TokenError("the answer is not a JSON object")
    token = doc.get("access_token")
    if not isinstance(token, str) or not token or not VALUE_RE.fullmatch(token):
        raise TokenError("the answer has no usable access_token")
    kind = doc.get("token_type", "bearer")
    if not isinstance(kind, str) or kind.lower() != "bearer":
        raise TokenError(f"token_type {str(kind)[:32]!r} is not bearer")
    expires = doc.get("expires_in")
    if expires is None:
        return token, None
    try:
        lifetime = float(expires)
    except (TypeError, ValueError):
        raise TokenError("expires_in is not a number") from None
    return token, lifetime


def refresh_at(now: float, lifetime: float | None) -> float:
    """When a token fetched at ``now`` is refreshed: shortly before it expires."""
    if lifetime is None:
        return now + NO_EXPIRY_S
    return now + lifetime - min(LEEWAY_S, max(lifetime, 0.0) / 10)


Fetch = Callable[[Auth], Awaitable[tuple[str, float | None]]]


class Tokens:
    """The tokens of one process (a worker, a replay partition), per connection and version;
    ``clock`` is monotonic seconds (tests pass their own to move time on)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tokens: dict[tuple[int, int], tuple[str, float]] = {}
        self._fetching: dict[tuple[int, int], asyncio.Future] = {}

    def fresh(self, auth: Auth) -> str | None:
        """The token held for ``auth`` while it is fresh (no await on the hot path)."""
        held = self._tokens.get(auth.key)
        if held is not None and held[1] > self.clock():
            return held[0]
        return None

    async def get(self, auth: Auth, fetch: Fetch) -> str:
        """A fresh token for ``auth``: the one held, or the result of the one fetch under way
        (started here when none is). TokenError when that fetch fails."""
        held = self.fresh(auth)
        if held is not None:
            return held
        key = auth.key
        task = self._fetching.get(key)
        if task is None:
            task = self._fetching[key] = asyncio.ensure_future(self._fetch(auth, fetch))
            task.add_done_callback(_retrieve)
        # Shielded: a send cancelled while it waits leaves the fetch to the others.
        return await asyncio.shield(task)

    async def _fetch(self, auth: Auth, fetch: Fetch) -> str:
        try:
            token, lifetime = await fetch(auth)
            now = self.clock()
            # An older version's token is never used again; nor is any token past its refresh
            # time (``fresh`` never gives it): kept, a deleted connection's token stayed for the
            # process's life, one per connection ever sent through.
            for key, (_, at) in list(self._tokens.items()):
                if key[0] == auth.connection_id or at <= now:
                    del self._tokens[key]
            self._tokens[auth.key] = (token, refresh_at(now, lifetime))
            return token
        finally:
            self._fetching.pop(auth.key, None)

    def refused(self, auth: Auth, token: str) -> None:
        """A send with ``token`` was answered 401: it is not used again (a token fetched
        since by another send that saw the same 401 stays)."""
        held = self._tokens.get(auth.key)
        if held is not None and held[0] == token:
            del self._tokens[auth.key]


def _retrieve(task: asyncio.Future) -> None:
    """Every waiter got the error; nothing is left to log it as never retrieved."""
    if not task.cancelled():
        task.exception()
