"""Target transforms: what body a target receives for an event.

Public API
----------
``compile_transform(kind, spec) -> Transform``
    ``kind`` is one of ``ORIGINAL``, ``CONSTANT``, ``JSONPATH``, ``TEMPLATE`` (any case). Raises
    ``InvalidTransformError`` (a ``ValueError``, one-line message) for an unknown kind or an
    invalid spec, so ``eventpush target create`` can refuse it up front.

``Transform.apply(event, rule_name="", *, rule_arn="", ingestion_time=None) -> bytes``
    The HTTP body for ``event`` (a dict). Compiled once, applied many times.

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
    EventBridge's input transformer. Each ``<name>`` in the template is replaced by the value its
    path selects. In a JSON template (one starting with ``{`` or ``[``) a placeholder outside
    quotes becomes the value as JSON (``null`` when the path matches nothing) and a placeholder
    inside a quoted string becomes the text of the value with no quotes of its own (JSON-escaped,
    so the body stays valid JSON; empty when nothing matches). In any other template, values are
    inserted as raw text (strings without quotes, other values as JSON, nothing when missing).
    Reserved variables, usable without a path: ``<aws.events.rule-name>``,
    ``<aws.events.rule-arn>``, ``<aws.events.event.ingestion-time>`` (the ``ingestion_time``
    argument, else the event's ``time``), ``<aws.events.event>`` (the event without its
    ``detail``, as JSON) and ``<aws.events.event.json>`` (the whole event as JSON); the last two
    cannot sit inside a quoted string. At most 100 paths; names must not start with ``aws.``.
    Placeholders naming no variable are left as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from jsonpath_ng import parse as parse_jsonpath

__all__ = [
    "KINDS",
    "MAX_INPUT_PATHS",
    "InvalidTransformError",
    "Transform",
    "compile_transform",
]

KINDS = ("ORIGINAL", "CONSTANT", "JSONPATH", "TEMPLATE")
MAX_INPUT_PATHS = 100
MAX_TEMPLATE_CHARS = 8192

RULE_NAME = "aws.events.rule-name"
RULE_ARN = "aws.events.rule-arn"
INGESTION_TIME = "aws.events.event.ingestion-time"
EVENT = "aws.events.event"
EVENT_JSON = "aws.events.event.json"
RESERVED = (RULE_NAME, RULE_ARN, INGESTION_TIME, EVENT, EVENT_JSON)
# Whole-event variables carry unescaped JSON: inside a JSON string they would break the body.
_JSON_ONLY = (EVENT, EVENT_JSON)

_VARIABLE_NAME = re.compile(r"[A-Za-z0-9_\-.]+")
_PLACEHOLDER = re.compile(r"<([A-Za-z0-9_\-.]+)>")
_MISSING = object()


class InvalidTransformError(ValueError):
    """A transform spec that cannot be used; the message says which part and why."""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


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
    ) -> bytes:
        context = {RULE_NAME: rule_name, RULE_ARN: rule_arn, INGESTION_TIME: ingestion_time}
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
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
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


def _split_template(template: str, known: set[str], is_json: bool) -> list[str | _Slot]:
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
            if m and m.group(1) in known:
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


def _template(spec: Any) -> Callable[[dict, dict], bytes]:
    paths, template = _template_spec(spec)
    selectors: dict[str, Callable[[dict], Any]] = {}
    for name, path in paths.items():
        if not _VARIABLE_NAME.fullmatch(name):
            raise InvalidTransformError(
                f"TEMPLATE variable {name!r}: names use letters, digits, '_', '-' and '.'"
            )
        if name.startswith("aws."):
            raise InvalidTransformError(
                f"TEMPLATE variable {name!r}: names starting with 'aws.' are reserved"
            )
        selectors[name] = _compile_path(path, f"TEMPLATE variable {name!r}")

    stripped = template.strip()
    is_json = stripped.startswith(("{", "["))
    pieces = _split_template(template, set(selectors) | set(RESERVED), is_json)
    if is_json:
        for piece in pieces:
            if isinstance(piece, _Slot) and piece.in_string and piece.name in _JSON_ONLY:
                raise InvalidTransformError(
                    f"TEMPLATE <{piece.name}> can only be a JSON value, not inside a quoted string"
                )
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
            return {k: v for k, v in event.items() if k != "detail"}
        if name == INGESTION_TIME:
            stamp = context.get(INGESTION_TIME) or event.get("time")
            if not isinstance(stamp, str):
                stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return stamp
        return context.get(name) or ""

    def render(event: dict, context: dict) -> bytes:
        values = {name: value_of(name, event, context) for name in used}
        out: list[str] = []
        for piece in pieces:
            if piece.__class__ is str:
                out.append(piece)
                continue
            value = values[piece.name]
            if not is_json:
                if value is _MISSING:
                    continue
                out.append(value if isinstance(value, str) else _dumps(value))
            elif piece.in_string:
                if value is _MISSING:
                    continue
                text = value if isinstance(value, str) else _dumps(value)
                out.append(_dumps(text)[1:-1])
            else:
                out.append("null" if value is _MISSING else _dumps(value))
        return "".join(out).encode()

    return render


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
