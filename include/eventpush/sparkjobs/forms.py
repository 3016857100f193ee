"""The batch DAGs' forms: their fields, the configured bounds of a replay, and the audit's
window read from its form.

Light on purpose (no database driver): the DAGs read it at parse time for their forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from eventpush.config import setting

# Message ids become spark-submit arguments: 1,000 of 128 characters stay far below ARG_MAX.
MAX_MESSAGE_IDS = 1_000
MAX_MESSAGE_ID_LENGTH = 128
FORM_FIELDS = (
    "what",
    "bus",
    "rule",
    "target",
    "since",
    "until",
    "message_ids",
    "max_count",
    "rate_limit",
    "dry_run",
    "everything",
)


@dataclass(frozen=True)
class ReplayLimits:
    """What one replay may do, from the environment (defaults in docs/OPERATIONS.md)."""

    max_window: timedelta  # the longest window of an ``all`` replay
    max_count: int  # the most records one run selects
    min_rate: float  # the lowest rate limit, records per second
    timeout: timedelta  # the replay job task's execution timeout


def replay_limits() -> ReplayLimits:
    return ReplayLimits(
        max_window=timedelta(hours=setting("EVENTPUSH_REPLAY_MAX_WINDOW_HOURS", 168)),
        max_count=setting("EVENTPUSH_REPLAY_MAX_COUNT", 1_000_000),
        min_rate=setting("EVENTPUSH_REPLAY_MIN_RATE", 1.0, minimum=0.001),
        timeout=timedelta(minutes=setting("EVENTPUSH_REPLAY_TIMEOUT_MINUTES", 240)),
    )


AUDIT_FORM_FIELDS = ("bus", "since", "until", "replay_missing", "verify_sinks", "roll_up")


class FormError(ValueError):
    """A form that cannot be run; the message names the field."""


def parse_time(key: str, value: object) -> datetime:
    """An ISO 8601 time from a form; without an offset it is UTC (as in the CLI and jobs)."""
    if isinstance(value, datetime):
        parsed = value
    else:
        try:
            parsed = datetime.fromisoformat(str(value))
        except ValueError:
            raise FormError(f"{key} {value!r} is not an ISO 8601 time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def check_form_keys(*forms: dict | None, known: tuple[str, ...]) -> None:
    """Refuse a field the form does not have: a typo would otherwise be silently ignored."""
    unknown = sorted({str(k) for form in forms if form for k in form} - set(known))
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise FormError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {names} in the request; "
            f"known: {', '.join(known)}"
        )


def audit_flag(params: dict, key: str) -> bool:
    """A yes/no field of the audit's form (``verify_sinks``): a JSON boolean, off when empty;
    anything else is refused rather than guessed."""
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise FormError(f"{key} must be true or false, got {value!r}")
    return value


def audit_window(
    params: dict,
    conf: dict | None,
    interval_start: datetime | None,
    interval_end: datetime | None,
    now: datetime | None = None,
) -> tuple[datetime, datetime, str | None]:
    """The audit's window and bus: the form's ``since``/``until`` (naive times are UTC), else
    the run's data interval, else (a run triggered without a logical date has none) the hour
    before ``now``; refused when ``until`` is not after ``since``."""
    check_form_keys(params, conf, known=AUDIT_FORM_FIELDS)
    if interval_start is None or interval_end is None:
        interval_end = now or datetime.now(UTC)
        interval_start = interval_end - timedelta(hours=1)
    since = parse_time("since", params["since"]) if params.get("since") else interval_start
    until = parse_time("until", params["until"]) if params.get("until") else interval_end
    if until <= since:
        raise FormError(f"until ({until.isoformat()}) must be after since ({since.isoformat()})")
    return since, until, (str(params.get("bus") or "").strip() or None)
