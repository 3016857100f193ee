"""Where the eventpush database is: one place that resolves it."""

from __future__ import annotations

import os

ENV_VAR = "EVENTPUSH_DATABASE_URL"


class ConfigError(RuntimeError):
    """The configuration is missing or wrong; the message says what to set."""


def database_url() -> str:
    """The PostgreSQL URL of the eventpush database, from ``EVENTPUSH_DATABASE_URL``."""
    url = os.environ.get(ENV_VAR, "").strip()
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
