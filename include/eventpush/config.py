"""Where the eventpush database is: one place that resolves it."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "EVENTPUSH_DATABASE_URL"


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
            return candidate.read_text(encoding="utf-8").strip()
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


def redact_url(url: str) -> str:
    """The URL with any password replaced, fit for logs and errors."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, hostpart = rest.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hostpart}" if ":" in userinfo else url
