"""Signature Version 4 verification: who signed a request, and that nothing in it changed.

The signature is recomputed over exactly the headers the client signed, the body as received
and the client's own timestamp, then compared with ``hmac.compare_digest``. botocore's signer
(``SigV4Auth``) is the reference: every request whose path or query string needs its
normalising goes through it. The requests the SDKs send (``POST /``, no query string) take a
shorter road to the same signature (:func:`_plain_signature`: botocore's steps for that shape,
the derived signing key kept per secret, day and region): botocore's general code was a fifth
of the server's CPU a request, and a test holds the two roads equal. What is refused, with
AWS's codes:

- no ``Authorization`` header: ``MissingAuthenticationTokenException``;
- one that does not parse, or that leaves ``host``, ``x-amz-date`` or ``x-amz-target`` unsigned:
  ``IncompleteSignatureException``;
- an access key id we do not know (or a session token: temporary credentials are not
  issued here): ``UnrecognizedClientException``;
- a scope for another region or service, a timestamp more than five minutes off, a body
  whose hash is not the signed one, or any other mismatch: ``InvalidSignatureException``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import NamedTuple

from botocore.auth import SIGNED_HEADERS_BLACKLIST, SIGV4_TIMESTAMP, SigV4Auth
from botocore.credentials import Credentials

from eventpush.api.errors import ApiError

SERVICE = "events"
MAX_SKEW = timedelta(minutes=5)
ALGORITHM = "AWS4-HMAC-SHA256"
MUST_SIGN = ("host", "x-amz-date", "x-amz-target")

_AUTH_RE = re.compile(
    r"AWS4-HMAC-SHA256\s+"
    r"Credential=(?P<key>[^/\s,]+)/(?P<date>\d{8})/(?P<region>[^/\s,]+)/(?P<service>[^/\s,]+)"
    r"/aws4_request\s*,\s*SignedHeaders=(?P<headers>[a-z0-9;\-]+)\s*,\s*"
    r"Signature=(?P<signature>[0-9a-f]{64})\s*"
)

_AMZ_DATE_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z")


class SignedBy(NamedTuple):
    """What the Authorization header claims, before the claim is checked. (Tuples: a frozen
    dataclass sets each field through ``object.__setattr__``, a microsecond a request.)"""

    access_key_id: str
    date: str
    region: str
    service: str
    signed_headers: tuple[str, ...]
    signature: str


def parse_authorization(value: str | None) -> SignedBy:
    if not value:
        raise ApiError("MissingAuthenticationTokenException", "Missing Authentication Token")
    if not value.startswith(ALGORITHM):
        raise ApiError(
            "IncompleteSignatureException",
            f"Authorization header must use {ALGORITHM} (Signature Version 4)",
        )
    found = _AUTH_RE.fullmatch(value.strip())
    if found is None:
        raise ApiError(
            "IncompleteSignatureException",
            "Authorization header is not 'AWS4-HMAC-SHA256 Credential=KEY/DATE/REGION/"
            "SERVICE/aws4_request, SignedHeaders=..., Signature=...'",
        )
    headers = tuple(found["headers"].split(";"))
    for needed in MUST_SIGN:
        if needed not in headers:
            raise ApiError(
                "IncompleteSignatureException", f"the signature must cover the {needed} header"
            )
    return SignedBy(
        found["key"],
        found["date"],
        found["region"],
        found["service"],
        headers,
        found["signature"],
    )


def request_time(amz_date: str | None, now: datetime) -> datetime:
    """The signed timestamp, refused when missing, malformed or more than 5 minutes off."""
    if not amz_date:
        raise ApiError("IncompleteSignatureException", "X-Amz-Date header is missing")
    try:
        # fromisoformat reads SigV4's basic format (20260101T000000Z) at a 60th of
        # strptime's cost; the pattern first refuses every other ISO 8601 spelling.
        if _AMZ_DATE_RE.fullmatch(amz_date) is None:
            raise ValueError(amz_date)
        when = datetime.fromisoformat(amz_date)
    except ValueError:
        raise ApiError(
            "IncompleteSignatureException", "X-Amz-Date must look like 20260101T000000Z"
        ) from None
    if abs(now - when) > MAX_SKEW:
        raise ApiError(
            "InvalidSignatureException",
            f"Signature expired: {amz_date} is more than 5 minutes from the server's time "
            f"{now.strftime(SIGV4_TIMESTAMP)}",
        )
    return when


def check_scope(claim: SignedBy, amz_date: str, region: str) -> None:
    if claim.service != SERVICE:
        raise ApiError(
            "InvalidSignatureException",
            f"Credential should be scoped to correct service: '{SERVICE}'",
        )
    if claim.region != region:
        raise ApiError(
            "InvalidSignatureException",
            f"Credential should be scoped to a valid region, not '{claim.region}' "
            f"(this server is '{region}')",
        )
    if claim.date != amz_date[:8]:
        raise ApiError(
            "InvalidSignatureException",
            "Date in Credential scope does not match YYYYMMDD from X-Amz-Date",
        )


class Received(NamedTuple):
    """A request as it arrived: what the signature covers."""

    method: str
    url: str  # scheme, the Host header, path and query
    headers: Mapping[str, str]  # lower-case names
    body: bytes


class _SignedHeaders(dict):
    """The signed headers as ``SigV4Auth`` reads them (``items()``, a case-insensitive ``in``
    and lookup): a dict of lower-case names. botocore's own ``HTTPHeaders`` is an
    ``email.message.Message``, whose every read re-parses: a fifth of the check's cost."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())


class _ToSign:
    """The request as ``SigV4Auth`` reads it (method, url, headers, body, params, context).
    An ``AWSRequest`` would do, but it prepares itself again (a copy of its headers, the body
    re-framed) every time the signer reads its body: a third of the check's cost."""

    __slots__ = ("method", "url", "headers", "body", "params", "context")

    def __init__(self, method: str, url: str, headers: _SignedHeaders, body: bytes, amz_date: str):
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.params: dict = {}
        self.context = {"timestamp": amz_date}


def _signed_values(request: Received, claim: SignedBy) -> dict[str, str]:
    """The values of the headers the client signed (lower-case names), each one required."""
    signed = {}
    for name in claim.signed_headers:
        value = request.headers.get(name)
        if value is None:
            raise ApiError(
                "IncompleteSignatureException", f"signed header {name!r} is not in the request"
            )
        signed[name] = value
    return signed


_UNSIGNABLE = frozenset(SIGNED_HEADERS_BLACKLIST)  # botocore leaves these out of a signature
_SIGNING_KEYS = 1024  # secrets x days x regions kept derived; a key lives a day


@functools.lru_cache(maxsize=_SIGNING_KEYS)
def _signing_key(secret: str, day: str, region: str) -> bytes:
    """SigV4's derived key (four HMACs): the same for every request of a key on one day."""
    key = hmac.digest(f"AWS4{secret}".encode(), day.encode(), "sha256")
    for part in (region, SERVICE, "aws4_request"):
        key = hmac.digest(key, part.encode(), "sha256")
    return key


def _plain_signature(
    request: Received, claim: SignedBy, amz_date: str, secret: str, region: str
) -> str:
    """``expected_signature`` for a request to ``/`` without a query string, in botocore's
    steps (``SigV4Auth.canonical_request``, ``string_to_sign``, ``signature``) for that shape:
    the canonical path is ``/``, the query empty, each signed header (but the ones botocore
    never signs) as ``name:value`` with runs of white space folded, sorted by name, and the
    payload the signed ``X-Amz-Content-Sha256`` or the body's SHA-256."""
    signed = _signed_values(request, claim)
    names = sorted(name for name in signed if name not in _UNSIGNABLE)
    lines = [f"{name}:{' '.join(signed[name].split())}" for name in names]
    payload = signed.get("x-amz-content-sha256") if "x-amz-content-sha256" in names else None
    if payload is None:
        payload = hashlib.sha256(request.body).hexdigest()
    canonical = f"{request.method.upper()}\n/\n\n" + "\n".join(lines)
    canonical += f"\n\n{';'.join(names)}\n{payload}"
    day = amz_date[:8]
    to_sign = (
        f"{ALGORITHM}\n{amz_date}\n{day}/{region}/{SERVICE}/aws4_request\n"
        + hashlib.sha256(canonical.encode()).hexdigest()
    )
    return hmac.digest(_signing_key(secret, day, region), to_sign.encode(), "sha256").hex()


# scheme://host/ and nothing more: no query, no fragment, nothing urlsplit would strip.
_PLAIN_URL = re.compile(r"https?://[^/?#\s]*/")


def expected_signature(
    request: Received, claim: SignedBy, amz_date: str, secret: str, region: str
) -> str:
    """The signature botocore computes for this request with ``secret``: over the headers
    the client signed (only those), the body as received and the client's timestamp."""
    if _PLAIN_URL.fullmatch(request.url):
        return _plain_signature(request, claim, amz_date, secret, region)
    return botocore_signature(request, claim, amz_date, secret, region)


def botocore_signature(
    request: Received, claim: SignedBy, amz_date: str, secret: str, region: str
) -> str:
    """``expected_signature`` by botocore's own signer, for any path and query string."""
    signed = _SignedHeaders(_signed_values(request, claim))
    again = _ToSign(request.method, request.url, signed, request.body, amz_date)
    signer = SigV4Auth(Credentials(claim.access_key_id, secret), SERVICE, region)
    try:
        canonical = signer.canonical_request(again)
    except ValueError:  # urlsplit's: a Host header such as '[' makes no URL
        raise ApiError(
            "InvalidSignatureException",
            f"the Host header {request.headers.get('host')!r:.100} "
            "and the path make no URL to sign",
        ) from None
    return signer.signature(signer.string_to_sign(again, canonical), again)


def verify(request: Received, claim: SignedBy, amz_date: str, secret: str, region: str) -> None:
    """Raise InvalidSignatureException unless the claim's signature is the one recomputed."""
    content_hash = request.headers.get("x-amz-content-sha256")
    if content_hash is not None and content_hash != hashlib.sha256(request.body).hexdigest():
        # Also refuses UNSIGNED-PAYLOAD: a body the signature does not cover.
        raise ApiError(
            "InvalidSignatureException", "X-Amz-Content-Sha256 is not the SHA-256 of the body"
        )
    expected = expected_signature(request, claim, amz_date, secret, region)
    if not hmac.compare_digest(expected.encode(), claim.signature.encode()):
        raise ApiError(
            "InvalidSignatureException",
            "The request signature we calculated does not match the signature you provided",
        )
