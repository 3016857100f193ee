"""The batch DAGs' forms: the replay request, whose fields are described once here and give
the replay DAG's form, the ``eventpush replay`` options and the replay job's arguments; the
configured bounds of a replay; and the audit's window read from its form.

Light on purpose (no database driver): the DAGs read it at parse time for their forms.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime, timedelta

from eventpush.config import setting

# Message ids become spark-submit arguments: 1,000 of 128 characters stay far below ARG_MAX.
MAX_MESSAGE_IDS = 1_000
MAX_MESSAGE_ID_LENGTH = 128
WHATS = ("failed", "missing", "all")
PATTERN_VERSIONS = ("history", "current")


@dataclass(frozen=True)
class ReplayLimits:
    """What one replay may do, from the environment (defaults in docs/OPERATIONS.md)."""

    max_window: timedelta  # the longest window of an ``all`` replay
    max_count: int  # the most records one run selects
    min_rate: float  # the lowest rate limit, records per second
    timeout: timedelta  # the replay job task's execution timeout


def span_hours(span: timedelta) -> str:
    """A span in hours, as the refusals of a window too long say it."""
    return f"{span.total_seconds() / 3600:.4g}"


def audit_max_window() -> timedelta:
    """The longest window one audit run reads: it classifies every event of the window
    against the books, as a ``what=all`` replay selects them."""
    return timedelta(hours=setting("EVENTPUSH_AUDIT_MAX_WINDOW_HOURS", 168))


def replay_limits() -> ReplayLimits:
    return ReplayLimits(
        max_window=timedelta(hours=setting("EVENTPUSH_REPLAY_MAX_WINDOW_HOURS", 168)),
        max_count=setting("EVENTPUSH_REPLAY_MAX_COUNT", 1_000_000),
        min_rate=setting("EVENTPUSH_REPLAY_MIN_RATE", 1.0, minimum=0.001),
        timeout=timedelta(minutes=setting("EVENTPUSH_REPLAY_TIMEOUT_MINUTES", 240)),
    )


@dataclass(frozen=True)
class Arg:
    """How one replay request field is asked for. ``kind``: ``choice``, ``text``, ``time``
    (ISO 8601, naive is UTC), ``ids`` (repeated ``--message-id``), ``int``, ``float`` or
    ``flag``. ``help`` serves the option and the form; the form adds ``note`` (formatted with
    the ``ReplayLimits``) and ``schema`` (its JSON-schema bounds). Without a ``title`` a field
    is not on the form; without ``cli`` not an ``eventpush replay`` option."""

    kind: str
    help: str
    title: str | None = None
    note: str = ""
    schema: Callable[[ReplayLimits], dict] | None = None
    choices: tuple[str, ...] = ()
    flag: str | None = None  # default: --NAME with dashes
    cli: bool = True


def _arg(default: object, kind: str, help: str, **how) -> object:
    return field(default=default, metadata={"arg": Arg(kind, help, **how)})


@dataclass(frozen=True)
class ReplayRequest:
    """One replay, as the form, the CLI and the job's argv give it (each from these fields)."""

    what: str = _arg(
        "failed",
        "choice",
        "failed records, audit gaps (missing), or every matching event of the window (all)",
        title="What to replay",
        choices=WHATS,
    )
    bus: str | None = _arg(
        None, "text", "only runners of this bus", title="Bus", note="; empty for every bus"
    )
    rule: str | None = _arg(None, "text", "only runners of this rule", title="Rule")
    target: str | None = _arg(None, "text", "only this target's runner", title="Target")
    since: datetime | None = _arg(None, "time", "window start (ISO 8601), inclusive", title="Since")
    until: datetime | None = _arg(None, "time", "window end (ISO 8601), exclusive", title="Until")
    message_ids: tuple[str, ...] = _arg(
        (),
        "ids",
        "only these events (their message ids)",
        title="Message ids",
        note="; empty for any",
        flag="--message-id",
    )
    max_count: int | None = _arg(
        None,
        "int",
        "replay at most this many records",
        title="Maximum count",
        note=" (at most {max_count})",
        schema=lambda limits: {"minimum": 1, "maximum": limits.max_count},
    )
    rate_limit: float | None = _arg(  # records per second over the whole replay
        None,
        "float",
        "at most this many records per second",
        title="Rate limit",
        note=" (at least {min_rate:g})",
        schema=lambda limits: {"minimum": limits.min_rate},
    )
    dry_run: bool = _arg(False, "flag", "select and check, push nothing", title="Dry run")
    # ``all`` with no window: every event ever published, on purpose.
    everything: bool = _arg(
        False,
        "flag",
        "with what=all and no window: re-push every event ever published, on purpose",
        title="Everything",
    )
    # ``history``: each event judged by the rule's version in force at its offset (as live);
    # ``current``: by the rule's pattern now.
    pattern_version: str = _arg(
        "history",
        "choice",
        "judge each event by the rule's version in force at its offset, or by its pattern now",
        choices=PATTERN_VERSIONS,
    )
    # Who asked: e.g. the Airflow run id, to find the run again (the job's argument alone).
    label: str | None = _arg(None, "text", "recorded with the run", cli=False)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["since"] = self.since.isoformat() if self.since else None
        doc["until"] = self.until.isoformat() if self.until else None
        doc["message_ids"] = list(self.message_ids)
        return doc


REQUEST_ARGS: tuple[tuple[str, object, Arg], ...] = tuple(
    (f.name, f.default, f.metadata["arg"]) for f in fields(ReplayRequest)
)
FORM_FIELDS = tuple(name for name, _, arg in REQUEST_ARGS if arg.title)


def flag_of(name: str, arg: Arg) -> str:
    return arg.flag or "--" + name.replace("_", "-")


def form_params(limits: ReplayLimits) -> dict[str, dict]:
    """The replay DAG's form: each field's ``airflow.sdk.Param`` keyword arguments."""
    params = {}
    for name, default, arg in REQUEST_ARGS:
        if not arg.title:
            continue
        kw: dict = {"title": arg.title, "description": arg.help + arg.note.format_map(vars(limits))}
        if arg.kind == "choice":
            kw.update(default=default, type="string", enum=list(arg.choices))
        elif arg.kind == "flag":
            kw.update(default=default, type="boolean")
        elif arg.kind == "ids":
            items = {"type": "string", "minLength": 1, "maxLength": MAX_MESSAGE_ID_LENGTH}
            kw.update(default=[], type="array", items=items, maxItems=MAX_MESSAGE_IDS)
        else:
            kind = {"text": "string", "time": "string", "int": "integer", "float": "number"}
            kw.update(default=None, type=["null", kind[arg.kind]])
            if arg.kind == "time":
                kw["format"] = "date-time"
        if arg.schema is not None:
            kw.update(arg.schema(limits))
        params[name] = kw
    return params


def _form_number(params: dict, key: str, kind: type) -> int | float | None:
    value = params.get(key)
    if value in (None, ""):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise FormError(f"{key} must be a number, got {value!r}")
    try:
        number = kind(value)
    except ValueError:
        raise FormError(f"{key} must be a number, got {value!r}") from None
    if kind is float and number != number:  # NaN
        raise FormError(f"{key} must be a number, got {value!r}")
    return number


def _form_value(params: dict, name: str, default: object, arg: Arg) -> object:
    """One field's value from the form, empty meaning "any" (the default)."""
    value = params.get(name)
    if arg.kind == "choice":
        return str(value or default)
    if arg.kind == "flag":
        return bool(value)
    if arg.kind == "ids":
        ids = value or ()
        if isinstance(ids, str):
            ids = [line for line in ids.replace(",", "\n").splitlines() if line.strip()]
        if not isinstance(ids, list | tuple):
            raise FormError(f"{name} must be a list of strings, got {ids!r}")
        return tuple(str(m).strip() for m in ids)
    if arg.kind in ("int", "float"):
        return _form_number(params, name, int if arg.kind == "int" else float)
    if value in (None, ""):
        return None
    if arg.kind == "time":
        return parse_time(name, value)
    return str(value).strip() or None


def request_from_form(
    params: dict, label: str | None = None, conf: dict | None = None
) -> ReplayRequest:
    """A request from the replay DAG's form (empty fields mean "any"); ``conf`` is the run's
    raw configuration, checked for unknown fields too. FormError names a bad field."""
    check_form_keys(params, conf, known=FORM_FIELDS)
    values = {n: _form_value(params, n, d, arg) for n, d, arg in REQUEST_ARGS if arg.title}
    return ReplayRequest(**values, label=label)


def job_args(req: ReplayRequest) -> list[str]:
    """The replay job's arguments (``spark_jobs/replay.py``) for ``req``: each field that
    is set and not its default."""
    args: list[str] = []
    for name, default, arg in REQUEST_ARGS:
        value = getattr(req, name)
        if not value or value == default:  # None, "", (), False: as absent
            continue
        flag = flag_of(name, arg)
        if arg.kind == "flag":
            args.append(flag)
        elif arg.kind == "ids":
            for one in value:
                args += [flag, one]
        else:
            args += [flag, value.isoformat() if arg.kind == "time" else str(value)]
    return args


def iso(value: str) -> datetime:
    """An ISO 8601 time argument; without an offset it is UTC."""
    return parse_time("time", value)


def job_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The replay job's argument parser, reading what :func:`job_args` writes (into the
    request's field names: :func:`request_from_args`)."""
    parser = argparse.ArgumentParser(description=description)
    for name, default, arg in REQUEST_ARGS:
        kw: dict = {"dest": name, "help": arg.help}
        if arg.kind == "choice":
            kw.update(choices=arg.choices, default=default)
        elif arg.kind == "flag":
            kw.update(action="store_true")
        elif arg.kind == "ids":
            kw.update(action="append", default=[])
        elif arg.kind != "text":
            kw["type"] = {"time": iso, "int": int, "float": float}[arg.kind]
        parser.add_argument(flag_of(name, arg), **kw)
    return parser


def request_from_args(args: argparse.Namespace) -> ReplayRequest:
    values = {name: getattr(args, name) for name, _, _ in REQUEST_ARGS}
    values["message_ids"] = tuple(values["message_ids"])
    return ReplayRequest(**values)


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
            f"known: {', '.join(known) or 'none (the DAG takes no configuration)'}"
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


REBALANCE_FORM_FIELDS = ("window_minutes", "dry_run")
MAX_LOAD_WINDOW_MINUTES = 1440


def rebalance_args(params: dict, conf: dict | None, label: str) -> list[str]:
    """The rebalance job's arguments from its form. A field the form does not have is refused:
    a mistyped ``dry_run`` would otherwise apply a real rebalance. ``window_minutes`` is a
    whole number (JSON's 15.0 passes the form's schema, not the job's parser)."""
    check_form_keys(params, conf, known=REBALANCE_FORM_FIELDS)
    minutes = params.get("window_minutes")
    if (
        isinstance(minutes, bool)
        or not isinstance(minutes, int | float)
        or not 1 <= minutes <= MAX_LOAD_WINDOW_MINUTES  # NaN fails it too (before int())
        or minutes != int(minutes)
    ):
        raise FormError(
            f"window_minutes must be a whole number from 1 to {MAX_LOAD_WINDOW_MINUTES}, "
            f"got {minutes!r}"
        )
    args = ["--label", label, "--window-minutes", str(int(minutes))]
    return args + (["--dry-run"] if audit_flag(params, "dry_run") else [])


def audit_window(
    params: dict,
    conf: dict | None,
    interval_start: datetime | None,
    interval_end: datetime | None,
    now: datetime | None = None,
) -> tuple[datetime, datetime, str | None]:
    """The audit's window and bus: the form's ``since``/``until`` (naive times are UTC), else
    the run's data interval, else (a run triggered without a logical date has none) the hour
    before ``now``; refused when ``until`` is not after ``since`` or the window is longer than
    ``EVENTPUSH_AUDIT_MAX_WINDOW_HOURS``."""
    check_form_keys(params, conf, known=AUDIT_FORM_FIELDS)
    if interval_start is None or interval_end is None:
        interval_end = now or datetime.now(UTC)
        interval_start = interval_end - timedelta(hours=1)
    since = parse_time("since", params["since"]) if params.get("since") else interval_start
    until = parse_time("until", params["until"]) if params.get("until") else interval_end
    if until <= since:
        raise FormError(f"until ({until.isoformat()}) must be after since ({since.isoformat()})")
    limit = audit_max_window()
    if until - since > limit:
        raise FormError(
            f"the audit window spans {span_hours(until - since)} hours, over the limit of "
            f"{span_hours(limit)} (EVENTPUSH_AUDIT_MAX_WINDOW_HOURS): audit it as shorter windows"
        )
    return since, until, (str(params.get("bus") or "").strip() or None)
