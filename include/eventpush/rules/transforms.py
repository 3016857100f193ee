"""Target transforms: what body a target receives for an event.

Public API
----------
``compile_transform(kind, spec) -> Transform``
    ``kind`` is one of ``ORIGINAL``, ``CONSTANT``, ``JSONPATH``, ``TEMPLATE`` (any case). Raises
    ``InvalidTransformError`` (a ``ValueError``, one-line message) for an unknown kind or an
    invalid spec, so ``eventpush target create`` can refuse it up front.

``Transform.apply(event, rule_name="", *, rule_arn="", ingestion_time=None, bus="",
account=None, region=None) -> bytes``
    The HTTP body for ``event`` (a dict). Compiled once, applied many times. Raises
    ``UndeliverableBodyError`` (one line) when the filled template is a body EventBridge would
    not deliver; the push engine and replay record such a record as failed.

The kinds
---------
``ORIGINAL`` (spec ``None``)
    The event as compact JSON.
``CONSTANT`` (spec: a string, sent as is, or any JSON value, sent as JSON)
    The same body for every event.
``JSONPATH`` (spec: a JSONPath string such as ``"$.detail"``, or ``{"path": ...}``)
    The value the path selects, as JSON (EventBridge's ``InputPath``): ``null`` when nothing
    matches, an array when the path selects several values.
``TEMPLATE`` (spec: ``{"InputPathsMap": {name: jsonpath}, "InputTemplate": text}`` or its JSON)
    EventBridge's input transformer, filled the way EventBridge fills it:

    - A JSON template (one starting with ``{`` or ``[``): a placeholder outside quotes becomes
      the value as JSON, and ``""`` when its path matches nothing. A placeholder inside a quoted
      string becomes the value's text exactly as it is (EventBridge does not escape it), and
      nothing when its path matches nothing. An object or array inside a quoted string, or a
      string whose quotes, backslashes or control characters break the JSON, makes a body
      EventBridge does not deliver: ``apply`` raises ``UndeliverableBodyError``, and
      ``compile_transform`` refuses the template when the path makes it certain (``$``,
      ``$.detail`` and ``$.resources`` always select an object or an array).
    - Any other template: strings are inserted as they are, numbers and booleans as JSON,
      objects and arrays in EventBridge's unquoted form (``{acc_id:0a787ecb-4015,sf_id:baz}``,
      ``[ACTIVE,INACTIVE]``), nothing when the path matches nothing.
    - Reserved variables, usable without a path: ``<aws.events.rule-name>``,
      ``<aws.events.rule-arn>`` (``arn:aws:events:REGION:ACCOUNT:rule/BUS/RULE``),
      ``<aws.events.event.ingestion-time>`` (the ``ingestion_time`` argument, else the event's
      ``time``), ``<aws.events.event>`` (the event without its ``detail``, in EventBridge's
      form: ``version``, ``id``, ``detailType``, ``source``, ``account``, ``time``,
      ``region``, ``resources``) and ``<aws.events.event.json>`` (the whole event). The last
      two can only be the value of a JSON field, as in EventBridge.
    - ``account`` and ``region`` are the event's own when it has them, else the bus's settings
      (``event_bus.account`` and ``.region``; defaults ``DEFAULT_ACCOUNT`` = 000000000000 and
      ``DEFAULT_REGION`` = us-east-1).
    - A placeholder naming neither a path nor a reserved variable is refused, as EventBridge
      refuses it (``InputTemplate ... contains invalid placeholder notdefinedkey.``). At most
      100 paths; names must not start with ``aws.``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from jsonpath_ng import parse as parse_jsonpath

from eventpush.errors import first_line

__all__ = [
    "DEFAULT_ACCOUNT",
    "DEFAULT_REGION",
    "KINDS",
    "MAX_INPUT_PATHS",
    "InvalidTransformError",
    "Transform",
    "UndeliverableBodyError",
    "compile_transform",
    "rule_arn_for",
]

KINDS = ("ORIGINAL", "CONSTANT", "JSONPATH", "TEMPLATE")
MAX_INPUT_PATHS = 100
MAX_TEMPLATE_CHARS = 8192
# What a bus reports as its account and region until `bus create --account/--region` says
# otherwise: LocalStack's test account and AWS's first region, so nothing looks like a real one.
DEFAULT_ACCOUNT = "000000000000"
DEFAULT_REGION = "us-east-1"

RULE_NAME = "aws.events.rule-name"
RULE_ARN = "aws.events.rule-arn"
INGESTION_TIME = "aws.events.event.ingestion-time"
EVENT = "aws.events.event"
EVENT_JSON = "aws.events.event.json"
RESERVED = (RULE_NAME, RULE_ARN, INGESTION_TIME, EVENT, EVENT_JSON)
# Whole-event variables are JSON whose contents are not escaped: only a JSON field's value.
_JSON_ONLY = (EVENT, EVENT_JSON)
# Paths whose value is an object or an array for every event publish accepts.
_ALWAYS_CONTAINER = {"$": "an object", "$.detail": "an object", "$.resources": "an array"}

_VARIABLE_NAME = re.compile(r"[A-Za-z0-9_\-.]+")
_PLACEHOLDER = re.compile(r"<([A-Za-z0-9_\-.]+)>")
# Characters that, inserted unescaped into a JSON string, end it or make it invalid.
_BREAKS_JSON_STRING = re.compile(r'["\\\x00-\x1f]')
_MISSING = object()


class InvalidTransformError(ValueError):
    """A transform spec that cannot be used; the message says which part and why."""


class UndeliverableBodyError(ValueError):
    """The filled template for this event is a body EventBridge would not deliver."""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def rule_arn_for(
    rule: str, bus: str = "", account: str = DEFAULT_ACCOUNT, region: str = DEFAULT_REGION
) -> str:
    """The rule's ARN as EventBridge writes it; rules on the default bus carry no bus name."""
    where = f"{bus}/" if bus and bus != "default" else ""
    return f"arn:aws:events:{region}:{account}:rule/{where}{rule}"


@dataclass(frozen=True)
class Transform:
    """A compiled transform. ``apply`` renders the HTTP body for one event."""

    kind: str
    spec: Any
    _render: Callable[[dict, dict], bytes]

    def apply(
        self,
        event: dict,
        rule_name: str = "",
        *,
        rule_arn: str = "",
        ingestion_time: str | None = None,
        bus: str = "",
        account: str | None = None,
        region: str | None = None,
    ) -> bytes:
        context = {
            RULE_NAME: rule_name,
            RULE_ARN: rule_arn,
            INGESTION_TIME: ingestion_time,
            "bus": bus,
            "account": account or DEFAULT_ACCOUNT,
            "region": region or DEFAULT_REGION,
        }
        return self._render(event, context)


# --------------------------------------------------------------------------- JSONPath


def _compile_path(path: Any, where: str) -> Callable[[dict], Any]:
    if not isinstance(path, str) or not path.strip():
        raise InvalidTransformError(f"{where}: a JSONPath must be a non-empty string")
    if not path.strip().startswith("$"):
        raise InvalidTransformError(f"{where}: JSONPath {path!r} must start with '$'")
    try:
        expr = parse_jsonpath(path)
    except Exception as exc:  # jsonpath-ng's lexer raises bare Exceptions, not JSONPathError
        message = first_line(exc)
        raise InvalidTransformError(f"{where}: JSONPath {path!r} is invalid: {message}") from None
    find = expr.find

    def select(event: dict) -> Any:
        found = find(event)
        if not found:
            return _MISSING
        if len(found) == 1:
            return found[0].value
        return [m.value for m in found]

    return select


# --------------------------------------------------------------------------- kinds


def _original(spec: Any) -> Callable[[dict, dict], bytes]:
    if spec not in (None, "", {}):
        raise InvalidTransformError("ORIGINAL takes no spec")
    return lambda event, context: _dumps(event).encode()


def _constant(spec: Any) -> Callable[[dict, dict], bytes]:
    if spec is None:
        raise InvalidTransformError("CONSTANT needs a spec: the body to send")
    if isinstance(spec, str):
        body = spec.encode()
    else:
        try:
            body = _dumps(spec).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidTransformError(f"CONSTANT spec is not JSON-serialisable: {exc}") from None
    return lambda event, context: body


def _jsonpath(spec: Any) -> Callable[[dict, dict], bytes]:
    if isinstance(spec, dict):
        if set(spec) != {"path"}:
            raise InvalidTransformError("JSONPATH spec object takes exactly one key, 'path'")
        spec = spec["path"]
    select = _compile_path(spec, "JSONPATH")

    def render(event: dict, context: dict) -> bytes:
        value = select(event)
        return b"null" if value is _MISSING else _dumps(value).encode()

    return render


@dataclass(frozen=True)
class _Slot:
    name: str
    in_string: bool


def _split_template(template: str, is_json: bool) -> list[str | _Slot]:
    """Cut the template into literal text and placeholders, noting which sit in JSON strings."""
    pieces: list[str | _Slot] = []
    literal: list[str] = []
    in_string = False
    i = 0
    n = len(template)
    while i < n:
        ch = template[i]
        if ch == "<":
            m = _PLACEHOLDER.match(template, i)
            if m:
                if literal:
                    pieces.append("".join(literal))
                    literal = []
                pieces.append(_Slot(m.group(1), is_json and in_string))
                i = m.end()
                continue
        if is_json:
            if ch == "\\" and in_string and i + 1 < n:
                literal.append(template[i : i + 2])
                i += 2
                continue
            if ch == '"':
                in_string = not in_string
        literal.append(ch)
        i += 1
    if literal:
        pieces.append("".join(literal))
    return pieces


def _template_spec(spec: Any) -> tuple[dict, str]:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidTransformError(f"TEMPLATE spec is not valid JSON: {exc.msg}") from None
    if not isinstance(spec, dict):
        raise InvalidTransformError(
            "TEMPLATE spec must be an object with InputPathsMap and InputTemplate, "
            f"not {_type_name(spec)}"
        )
    unknown = set(spec) - {"InputPathsMap", "InputTemplate"}
    if unknown:
        raise InvalidTransformError(f"TEMPLATE spec has unknown keys: {', '.join(sorted(unknown))}")
    paths = spec.get("InputPathsMap") or {}
    template = spec.get("InputTemplate")
    if not isinstance(paths, dict):
        raise InvalidTransformError("TEMPLATE InputPathsMap must be an object of name -> JSONPath")
    if not isinstance(template, str) or not template:
        raise InvalidTransformError("TEMPLATE InputTemplate must be a non-empty string")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InvalidTransformError(
            f"TEMPLATE InputTemplate is {len(template)} characters (at most {MAX_TEMPLATE_CHARS})"
        )
    if len(paths) > MAX_INPUT_PATHS:
        raise InvalidTransformError(
            f"TEMPLATE InputPathsMap has {len(paths)} paths (at most {MAX_INPUT_PATHS})"
        )
    return paths, template


def _unquoted(value: Any) -> str:
    """A value as EventBridge writes it into text: JSON with every string left unquoted."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_unquoted(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_unquoted(v) for v in value) + "]"
    return _dumps(value)


def _event_form(event: dict, context: dict) -> dict:
    """``<aws.events.event>``: the envelope in EventBridge's key order, ``detailType`` spelt
    as EventBridge spells it, account and region from the event or else from the bus."""
    form = {
        "version": event.get("version", "0"),
        "id": event.get("id"),
        "detailType": event.get("detail-type"),
        "source": event.get("source"),
        "account": event.get("account") or context["account"],
        "time": event.get("time"),
        "region": event.get("region") or context["region"],
        "resources": event.get("resources", []),
    }
    return {k: v for k, v in form.items() if v is not None}


def _check_placeholders(pieces: list, selectors: dict, paths: dict, is_json: bool) -> None:
    for piece in pieces:
        if not isinstance(piece, _Slot):
            continue
        name = piece.name
        if name not in selectors and name not in RESERVED:
            raise InvalidTransformError(
                f"TEMPLATE InputTemplate contains invalid placeholder {name}: it is neither "
                "in InputPathsMap nor a reserved aws.events variable"
            )
        if name in _JSON_ONLY and not (is_json and not piece.in_string):
            raise InvalidTransformError(
                f"TEMPLATE <{name}> can only be the value of a JSON field (outside quotes "
                "in a JSON template), as in EventBridge"
            )
        if piece.in_string and name in selectors:
            kind = _ALWAYS_CONTAINER.get(paths[name].strip())
            if kind:
                raise InvalidTransformError(
                    f"TEMPLATE <{name}> sits inside a quoted string but its path "
                    f"{paths[name].strip()} always selects {kind}: the filled body would not "
                    f"be valid JSON and EventBridge does not deliver it; put <{name}> "
                    "outside quotes"
                )


def _template(spec: Any) -> Callable[[dict, dict], bytes]:
    paths, template = _template_spec(spec)
    selectors: dict[str, Callable[[dict], Any]] = {}
    for name, path in paths.items():
        if not isinstance(name, str) or not _VARIABLE_NAME.fullmatch(name):
            raise InvalidTransformError(
                f"TEMPLATE variable {name!r}: names use letters, digits, '_', '-' and '.'"
            )
        if name.startswith("aws."):
            raise InvalidTransformError(
                f"TEMPLATE variable {name!r}: names starting with 'aws.' are reserved"
            )
        selectors[name] = _compile_path(path, f"TEMPLATE variable {name!r}")

    is_json = template.strip().startswith(("{", "["))
    pieces = _split_template(template, is_json)
    _check_placeholders(pieces, selectors, paths, is_json)
    if is_json:
        probe = "".join(
            p if isinstance(p, str) else ("x" if p.in_string else "null") for p in pieces
        )
        try:
            json.loads(probe)
        except json.JSONDecodeError as exc:
            raise InvalidTransformError(
                "TEMPLATE InputTemplate starts like JSON but is not valid JSON once its "
                f"placeholders are filled: {exc.msg} at position {exc.pos} "
                "(placeholders cannot be object keys)"
            ) from None
    used = {p.name for p in pieces if isinstance(p, _Slot)}

    def value_of(name: str, event: dict, context: dict) -> Any:
        if name in selectors:
            return selectors[name](event)
        if name == EVENT_JSON:
            return event
        if name == EVENT:
            return _event_form(event, context)
        if name == INGESTION_TIME:
            stamp = context.get(INGESTION_TIME) or event.get("time")
            if not isinstance(stamp, str):
                stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return stamp
        if name == RULE_ARN:
            return context.get(RULE_ARN) or rule_arn_for(
                context.get(RULE_NAME) or "", context["bus"], context["account"], context["region"]
            )
        return context.get(name) or ""

    def render_text(event: dict, context: dict) -> bytes:
        values = {name: value_of(name, event, context) for name in used}
        out: list[str] = []
        for piece in pieces:
            if piece.__class__ is str:
                out.append(piece)
                continue
            value = values[piece.name]
            if value is not _MISSING:
                out.append(_unquoted(value))
        return "".join(out).encode()

    def render_json(event: dict, context: dict) -> bytes:
        values = {name: value_of(name, event, context) for name in used}
        out: list[str] = []
        broken = None  # the first placeholder whose raw text may break the JSON
        for piece in pieces:
            if piece.__class__ is str:
                out.append(piece)
                continue
            value = values[piece.name]
            if not piece.in_string:
                out.append('""' if value is _MISSING else _dumps(value))
            elif value is _MISSING:
                continue
            elif isinstance(value, str):
                if broken is None and _BREAKS_JSON_STRING.search(value):
                    broken = piece.name
                out.append(value)
            elif isinstance(value, dict | list):
                kind = "an object" if isinstance(value, dict) else "an array"
                raise UndeliverableBodyError(
                    f"TEMPLATE <{piece.name}> is {kind} inside a quoted string, so the filled "
                    "body is not valid JSON; EventBridge does not deliver it"
                )
            else:
                out.append(_dumps(value))
        body = "".join(out)
        if broken is not None:
            try:
                json.loads(body)
            except json.JSONDecodeError as exc:
                raise UndeliverableBodyError(
                    f"TEMPLATE <{broken}> put quotes, backslashes or control characters inside "
                    f"a quoted string (EventBridge does not escape them), so the filled body is "
                    f"not valid JSON ({exc.msg} at position {exc.pos}); EventBridge does not "
                    "deliver it"
                ) from None
        return body.encode()

    return render_json if is_json else render_text


_BUILDERS: dict[str, Callable[[Any], Callable[[dict, dict], bytes]]] = {
    "ORIGINAL": _original,
    "CONSTANT": _constant,
    "JSONPATH": _jsonpath,
    "TEMPLATE": _template,
}


def compile_transform(kind: str, spec: dict | str | None = None) -> Transform:
    """Validate a transform spec and compile it; see the module docstring for the kinds."""
    if not isinstance(kind, str) or kind.strip().upper() not in _BUILDERS:
        raise InvalidTransformError(
            f"unknown transform kind {kind!r}; expected one of {', '.join(KINDS)}"
        )
    kind = kind.strip().upper()
    return Transform(kind=kind, spec=spec, _render=_BUILDERS[kind](spec))
