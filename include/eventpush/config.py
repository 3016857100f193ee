"""Where the eventpush database is, which addresses targets may reach, and the one redaction
that every URL or error text passes before it reaches a log, a row or the UI."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from urllib.parse import unquote

ENV_VAR = "EVENTPUSH_DATABASE_URL"
ALLOW_CIDRS_ENV = "EVENTPUSH_ALLOW_CIDRS"
DENY_CIDRS_ENV = "EVENTPUSH_DENY_CIDRS"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ConfigError(RuntimeError):
    """The configuration is missing or wrong; the message says what to set."""


def setting(name: str, default: int | float, minimum: int | float = 1) -> int | float:
    """A numeric limit from the environment variable ``name``, else its documented
    ``default`` (see docs/OPERATIONS.md, "Security"); of the default's type."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = type(default)(raw)
    except ValueError:
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise ConfigError(f"{name} must be {kind}, got {raw!r}") from None
    if not value >= minimum:  # also refuses NaN
        raise ConfigError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


FILE_ENV_VAR = "EVENTPUSH_DATABASE_URL_FILE"


def _url_from_file(path: str) -> str:
    """The URL in the file ``path`` names. A Spark job submitted to a cluster finds the file
    shipped with ``--files`` in its working directory, under the same name."""
    for candidate in (Path(path), Path(Path(path).name)):
        if candidate.is_file():
            # One line naming the file, never its text (it holds the password).
            try:
                return candidate.read_text(encoding="utf-8").strip()
            except OSError as exc:
                why = exc.strerror or type(exc).__name__
                raise ConfigError(
                    f"{FILE_ENV_VAR} names {candidate}, which cannot be read: {why}"
                ) from None
            except UnicodeDecodeError:
                raise ConfigError(
                    f"{FILE_ENV_VAR} names {candidate}, which is not UTF-8 text"
                ) from None
    raise ConfigError(f"{FILE_ENV_VAR} names {path}, which does not exist")


def database_url() -> str:
    """The PostgreSQL URL of the eventpush database: from the file
    ``EVENTPUSH_DATABASE_URL_FILE`` names (how Spark jobs get it, as it is never printed),
    else from ``EVENTPUSH_DATABASE_URL``."""
    # The file wins: a Spark job inherits the submitting worker's environment too.
    path = os.environ.get(FILE_ENV_VAR, "").strip()
    url = _url_from_file(path) if path else os.environ.get(ENV_VAR, "").strip()
    if not url:
        raise ConfigError(f"{ENV_VAR} is not set: give it a PostgreSQL URL")
    if not url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{ENV_VAR} must be a postgresql:// URL, got {redact_url(url)!r}")
    return url


def cidrs(env_var: str, value: str | None = None) -> tuple[Network, ...]:
    """The comma-separated CIDR ranges of ``env_var`` (or of ``value`` when given)."""
    raw_list = os.environ.get(env_var, "") if value is None else value
    nets = []
    for raw in raw_list.split(","):
        raw = raw.strip()
        if not raw:
            continue
        try:
            nets.append(ipaddress.ip_network(raw, strict=False))
        except ValueError:
            raise ConfigError(
                f"{env_var}: {raw!r} is not a CIDR range (e.g. 127.0.0.1/32 or ::1/128)"
            ) from None
    return tuple(nets)


def allow_cidrs() -> tuple[Network, ...]:
    """Ranges the operator opens although the default policy denies them."""
    return cidrs(ALLOW_CIDRS_ENV)


def deny_cidrs() -> tuple[Network, ...]:
    """Ranges the operator denies on top of the defaults; deny wins over allow."""
    return cidrs(DENY_CIDRS_ENV)


def allow_loopback_receiver() -> None:
    """For the demo and the benchmarks, whose receivers live on 127.0.0.1: open exactly that
    address in this process and the ones it starts, on top of what the operator allowed."""
    opened = [part for part in os.environ.get(ALLOW_CIDRS_ENV, "").split(",") if part.strip()]
    if "127.0.0.1/32" not in opened:
        os.environ[ALLOW_CIDRS_ENV] = ",".join([*opened, "127.0.0.1/32"])


# --- redaction ---------------------------------------------------------------------------------

MASK = "***"
# A URL inside free text: a scheme, then everything up to white space or a quote.
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# Parts of a URL shorter than these are not hunted in free text: masking "301" or "json"
# everywhere would garble the message while protecting nothing worth the name. Whole parts
# (the query string, the userinfo) are masked from 3 characters, single values from 6.
_MIN_PART = 3
_MIN_VALUE = 6


def redact_url(url: str) -> str:
    """The URL fit for logs, rows and errors: userinfo, query string and fragment masked.

    Written without ``urlsplit`` on purpose: it must also cope with URLs that do not parse
    (a bad port, a broken IPv6 literal), which are exactly the ones that end in errors."""
    url = url.split("#", 1)[0]
    base, qmark, _query = url.partition("?")
    scheme, sep, rest = base.partition("://")
    if sep:
        authority, slash, path = rest.partition("/")
        if "@" in authority:
            authority = f"{MASK}@{authority.rpartition('@')[2]}"
        base = f"{scheme}://{authority}{slash}{path}"
    return f"{base}?{MASK}" if qmark else base


def _secret_parts(url: str) -> list[str]:
    """The pieces of ``url`` that may hold a secret, in the spellings a message may use."""
    parts: list[str] = []
    head, _, fragment = url.partition("#")
    head, _, query = head.partition("?")
    _, sep, rest = head.partition("://")
    authority = rest.partition("/")[0] if sep else ""
    userinfo = authority.rpartition("@")[0] if "@" in authority else ""
    values = [*userinfo.split(":", 1)]
    for pair in query.replace(";", "&").split("&"):
        values.append(pair.partition("=")[2])
    for piece, least in [(p, _MIN_PART) for p in (fragment, query, userinfo)] + [
        (v, _MIN_VALUE) for v in values
    ]:
        for form in {piece, unquote(piece), unquote(piece.replace("+", " "))}:
            if len(form) >= least:
                parts.append(form)
    return sorted(set(parts), key=len, reverse=True)  # longest first: no partial leftovers


def redact(text: str, *urls: str | None) -> str:
    """``text`` with every URL in it redacted, and every secret part of ``urls`` (the URLs
    the text may talk about, e.g. a target's) masked wherever it appears, in whatever
    spelling. The one function all error texts bound for a row, a log or the UI go through."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    for url in urls:
        if url:
            for secret in _secret_parts(url):
                text = text.replace(secret, MASK)
    return text


# --- retention ---------------------------------------------------------------------------------

RETENTION_ENV = "EVENTPUSH_RETENTION"
FAILURE_RETENTION_ENV = "EVENTPUSH_FAILURE_RETENTION"
PARTITIONS_AHEAD_ENV = "EVENTPUSH_PARTITIONS_AHEAD_DAYS"
DEFAULT_RETENTION = "7d"  # Kafka's retention.ms default; EventBridge archives keep by days
DEFAULT_FAILURE_RETENTION = "30d"  # the dead-letter store outlives the events, on purpose
MIN_RETENTION_S = 3600
MAX_RETENTION_S = 3650 * 86400
# ASCII digits, at most ten: ``\d`` took any script's digits (an Arabic-Indic seven and a 'd'
# kept events a week), and thousands of digits failed in int() with Python's words instead.
_RETENTION = re.compile(r"([0-9]{1,10})([hdw])")
_RETENTION_UNITS = {"h": 3600, "d": 86400, "w": 7 * 86400}


def retention_seconds(text: str, where: str) -> int:
    """``12h``, ``7d``, ``2w``: a retention in seconds, between an hour and ten years.
    ValueError naming ``where`` (an option or a variable) otherwise."""
    found = _RETENTION.fullmatch(str(text).strip())
    seconds = int(found[1]) * _RETENTION_UNITS[found[2]] if found else 0
    if not MIN_RETENTION_S <= seconds <= MAX_RETENTION_S:
        raise ValueError(
            f"{where} must be a number and a unit (h, d or w) between 1h and 3650d, "
            f"such as 7d; got {text!r}"
        )
    return seconds


def format_retention(seconds: int) -> str:
    """The shortest exact spelling: 604800 -> '7d', 7200 -> '2h'."""
    return f"{seconds // 86400}d" if seconds % 86400 == 0 else f"{seconds // 3600}h"


def _retention_env(name: str, default: str) -> int:
    try:
        return retention_seconds(os.environ.get(name, "").strip() or default, name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def default_retention_s() -> int:
    """How long a bus without its own ``--retention`` keeps its events (EVENTPUSH_RETENTION)."""
    return _retention_env(RETENTION_ENV, DEFAULT_RETENTION)


def failure_retention_s() -> int:
    """How long failure rows (the dead-letter store) are kept (EVENTPUSH_FAILURE_RETENTION)."""
    return _retention_env(FAILURE_RETENTION_ENV, DEFAULT_FAILURE_RETENTION)


# Each day ahead is a table per bus: a year is far more than any lapse of maintenance needs,
# and a huge value made millions of tables (past year 9999: a traceback) instead of refusing.
MAX_PARTITIONS_AHEAD_DAYS = 366


def partitions_ahead_days() -> int:
    """How many days of partitions maintenance keeps made ahead of today."""
    days = int(setting(PARTITIONS_AHEAD_ENV, 3))
    if days > MAX_PARTITIONS_AHEAD_DAYS:
        raise ConfigError(
            f"{PARTITIONS_AHEAD_ENV} must be at most {MAX_PARTITIONS_AHEAD_DAYS}, got {days}"
        )
    return days
