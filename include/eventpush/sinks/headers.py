"""Headers and query parameters an operator adds to requests (connections, targets): checked
when they are stored, so a send never carries a header that could split a request, change
its framing or stand in for eventpush's own.

Refused: names that are not an HTTP token; values with CR, LF or other control characters
(request splitting); the framing and hop-by-hop headers (``host``, ``content-length``,
``transfer-encoding``, ``connection``...); ``webhook-*`` (the Standard Webhooks id, timestamp
and signature); ``traceparent`` and ``tracestate`` (the attempt's trace context). A plain
header may not be ``authorization`` either: a credential belongs in a connection, where it
is sealed (an API-key connection may name ``Authorization`` as its key's header); nor may it
be another header named for a credential (``x-api-key``, ``cookie``...).

The sink still sets its own headers after these (:func:`eventpush.sinks.request.build_request`),
so even a row written around these checks never overrides them.
"""

from __future__ import annotations

import re

# RFC 9110 5.6.2: a token.
TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,256}")
# Visible ASCII, space and tab: no CR, LF, NUL or other control character.
VALUE_RE = re.compile(r"[\x20-\x7e\t]{0,4096}")
FRAMING = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
OWN = frozenset({"traceparent", "tracestate"})  # and every webhook-* name
# Headers that carry a credential by their very name: stored as a plain header they would be
# kept unsealed and shown by `target show`, so they belong in a connection.
CREDENTIALS = frozenset({"authorization", "x-api-key", "api-key", "x-auth-token", "cookie"})
MAX_PARAMETERS = 50


class HeaderError(ValueError):
    """A header or query parameter that may not be stored (one line, no value in it)."""


def check_header(name: str, value: str, where: str, credential: bool = False) -> tuple[str, str]:
    """``(name lower-cased, value)`` when the header may be sent; ``credential``: the header
    of an API-key connection, which may be ``authorization``."""
    if not isinstance(name, str) or not TOKEN_RE.fullmatch(name):
        raise HeaderError(
            f"{where}: header name {name!r} is invalid: use 1-256 letters, digits or "
            "!#$%&'*+-.^_`|~"
        )
    lower = name.lower()
    if lower in FRAMING:
        raise HeaderError(f"{where}: header {name!r} is set by the HTTP client, not by hand")
    if lower in OWN or lower.startswith("webhook-"):
        raise HeaderError(
            f"{where}: header {name!r} is eventpush's own (Standard Webhooks signature or trace "
            "context) and cannot be overridden"
        )
    if lower in CREDENTIALS and not credential:
        raise HeaderError(
            f"{where}: header {lower!r} carries a credential: put it in a connection "
            f"(--auth api-key --key-name {name}), where it is sealed"
        )
    if not isinstance(value, str) or not VALUE_RE.fullmatch(value):
        raise HeaderError(
            f"{where}: the value of header {name!r} must be printable ASCII up to 4096 "
            "characters, without CR or LF"
        )
    return lower, value


def check_headers(pairs, where: str) -> list[tuple[str, str]]:
    """Checked ``[(name, value), ...]``: each header once (a name given twice is refused)."""
    pairs = _pairs(pairs, where, "header")
    checked = [check_header(name, value, where) for name, value in pairs]
    seen: set[str] = set()
    for name, _ in checked:
        if name in seen:
            raise HeaderError(f"{where}: header {name!r} is given twice")
        seen.add(name)
    return checked


def check_query(pairs, where: str) -> list[tuple[str, str]]:
    """Checked query parameters ``[(name, value), ...]`` (any printable text; the client
    encodes them)."""
    pairs = _pairs(pairs, where, "query parameter")
    for name, value in pairs:
        if not isinstance(name, str) or not name or not VALUE_RE.fullmatch(name):
            raise HeaderError(f"{where}: query parameter name {name!r} is invalid")
        if not isinstance(value, str) or not VALUE_RE.fullmatch(value):
            raise HeaderError(
                f"{where}: the value of query parameter {name!r} must be printable ASCII "
                "up to 4096 characters"
            )
    return pairs


def _pairs(pairs, where: str, what: str) -> list[tuple[str, str]]:
    if isinstance(pairs, dict):
        pairs = list(pairs.items())
    try:
        pairs = [(name, value) for name, value in pairs]
    except (TypeError, ValueError):
        raise HeaderError(f"{where}: {what}s must be name and value pairs") from None
    if len(pairs) > MAX_PARAMETERS:
        raise HeaderError(f"{where}: at most {MAX_PARAMETERS} {what}s, got {len(pairs)}")
    return pairs


def split_pair(text: str, sep: str, option: str) -> tuple[str, str]:
    """``K:V`` or ``K=V`` as the command line gives it: (name, value), the blanks around the
    separator dropped."""
    name, found, value = text.partition(sep)
    if not found or not name.strip():
        raise HeaderError(f"{option} wants NAME{sep}VALUE, got {text!r}")
    return name.strip(), value.strip()
