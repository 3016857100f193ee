"""Reading request members and writing the shapes AWS answers with: required and optional
members of the right type, bus names given as names or ARNs, ARNs, timestamps, pages.

Every refusal is a ``ValidationException`` naming the member, as AWS's request validation
does ("... at 'Name' failed to satisfy constraint ...", said here in one plain line).
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import datetime

from eventpush.api.errors import ApiError, validation
from eventpush.catalog.common import MAX_DESCRIPTION

DEFAULT_BUS = "default"
BUS_SCHEME = "bus://"  # our URL of a bus-to-bus target (eventpush.bus_targets)
MAX_LIMIT = 100
BUS_ARN_RE = re.compile(
    r"arn:aws:events:(?P<region>[a-z0-9-]+):(?P<account>[0-9]{12}):event-bus/(?P<name>.+)"
)


def described(text: str | None) -> dict:
    """``{"Description": text}``, or nothing: AWS leaves an unset description out."""
    return {"Description": text} if text else {}


def required(body: dict, name: str, kind: type = str) -> object:
    value = body.get(name)
    if value is None:
        raise validation(f"member '{name}' is required")
    return checked(value, name, kind)


def optional(body: dict, name: str, kind: type = str, default: object = None) -> object:
    value = body.get(name)
    if value is None:
        return default
    return checked(value, name, kind)


_KIND_NAMES = {str: "a string", list: "a list", dict: "a structure", bool: "a boolean"}
# AWS's length limits for members of these names, in every operation that takes them (an
# event pattern: its largest quota; the default is 2,048). A description's is the catalog's.
MAX_LENGTHS = {"Description": MAX_DESCRIPTION, "EventPattern": 4096}


def checked(value: object, name: str, kind: type) -> object:
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        what = "an integer"
    else:
        ok = isinstance(value, kind)
        what = _KIND_NAMES.get(kind, kind.__name__)
    if not ok:
        raise validation(f"member '{name}' must be {what}")
    limit = MAX_LENGTHS.get(name)
    if limit is not None and len(value) > limit:
        got = f"{len(value):,}"
        raise validation(f"member '{name}' must be at most {limit:,} characters, got {got}")
    return value


def bus_arn(account: str, region: str, bus: str) -> str:
    return f"arn:aws:events:{region}:{account}:event-bus/{bus}"


def archive_arn(account: str, region: str, name: str) -> str:
    return f"arn:aws:events:{region}:{account}:archive/{name}"


def replay_arn(account: str, region: str, name: str) -> str:
    return f"arn:aws:events:{region}:{account}:replay/{name}"


def parse_bus_arn(arn: str) -> tuple[str, str, str] | None:
    """(region, account, bus) of an event bus ARN, None when ``arn`` is not one."""
    found = BUS_ARN_RE.fullmatch(arn)
    return None if found is None else (found["region"], found["account"], found["name"])


def bus_name(body: dict, member: str = "EventBusName") -> tuple[str, tuple[str, str] | None]:
    """The bus a request names (a name or an ARN; ``default`` when absent), and for an ARN
    the (account, region) it claims, which the caller checks against the bus's own."""
    value = optional(body, member)
    if value is None or value == "":
        return DEFAULT_BUS, None
    if value.startswith("arn:"):
        parsed = parse_bus_arn(value)
        if parsed is None:
            raise validation(f"member '{member}' is not an event bus ARN: {value[:200]!r}")
        region, account, name = parsed
        return name, (account, region)
    return value, None


def check_owner(claimed: tuple[str, str] | None, account: str, region: str, what: str) -> None:
    """An ARN naming another account or region is refused: this server holds only its own."""
    if claimed is None:
        return
    if claimed != (account, region):
        raise ApiError(
            "AccessDeniedException",
            f"{what} belongs to account {claimed[0]} in {claimed[1]}; this server serves "
            f"{account} in {region}",
        )


def timestamp(value: datetime | str | None) -> float | None:
    """AWS JSON 1.1 timestamps are epoch seconds; the catalog gives ISO 8601 text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return None if value is None else value.timestamp()


def page(items: list, body: dict, key=lambda item: item, *, scope: str) -> tuple[list, str | None]:
    """One page of ``items`` (sorted by ``key``) after the request's NextToken, at most its
    Limit (1-100), and the token of the next page (None on the last). A token holds its
    ``scope`` (the list it pages: one per operation) so another operation's is refused."""
    limit = optional(body, "Limit", int, MAX_LIMIT)
    if not 1 <= limit <= MAX_LIMIT:
        raise validation(f"member 'Limit' must be between 1 and {MAX_LIMIT}, got {limit}")
    token = optional(body, "NextToken")
    items = sorted(items, key=key)
    if token:
        try:
            # validate: without it characters outside the alphabet are dropped, and a token
            # of nothing but those restarted the listing from the first page.
            text = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            text = ""
        given, sep, after = text.partition(":")
        if not sep or given != scope or not after:
            raise validation("member 'NextToken' is not a token this server gave")
        items = [item for item in items if key(item) > after]
    chunk = items[:limit]
    more = len(items) > limit
    next_token = None
    if more:
        next_token = base64.urlsafe_b64encode(f"{scope}:{key(chunk[-1])}".encode()).decode()
    return chunk, next_token


def url_of_arn(arn: str, account: str, region: str) -> str:
    """Our target URL for a target ``Arn``: the URL itself, or ``bus://NAME`` for a bus ARN
    of ``account`` in ``region`` (another's is refused: it is not the local bus NAME)."""
    parsed = parse_bus_arn(arn)
    if parsed is not None:
        check_owner((parsed[1], parsed[0]), account, region, f"event bus {parsed[2]}")
        return BUS_SCHEME + parsed[2]
    if arn.startswith(("http://", "https://", "nats://")):
        return arn
    raise validation(
        f"target Arn {arn[:200]!r} is not supported: give an event bus ARN or an http(s):// "
        "or nats:// URL"
    )
