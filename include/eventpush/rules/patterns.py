"""The Amazon EventBridge event-pattern language: validation, compiled matchers, a rule index.

Public API
----------
``compile_pattern(pattern) -> CompiledPattern``
    ``pattern`` is a dict or a JSON string (an already compiled pattern is returned as is).
    Raises ``InvalidPatternError`` for an invalid pattern.

``CompiledPattern``
    ``.matches(event: dict) -> bool``: does the pattern select this event.
    ``.source_json``: the pattern as compact JSON text; ``compile_pattern(p.source_json)``
    rebuilds an equal matcher. Instances pickle (they recompile from ``source_json``), so the
    Spark audit job can broadcast them or ship the JSON text and compile per executor.

``InvalidPatternError(ValueError)``
    One-line message ``invalid event pattern at <path>: <why>``; ``.path`` is where, written like
    ``detail.x-limit[0]`` (field names joined with dots, ``[i]`` for the i-th element of a match
    array or of ``$or``), ``.reason`` is why.

``RuleIndex``
    Many rules, one event: ``RuleIndex([(rule_id, pattern), ...])``, ``.add(rule_id, pattern)``,
    ``.remove(rule_id)``, ``.matching(event) -> list`` of matching rule ids in the order the rules
    were added. Rules are bucketed by the exact values of one field they require (``source``
    first, then ``detail-type``, then any field tested only by exact values), so an event is
    fully evaluated only against the rules whose bucket its value selects, plus the rules that
    have no such field.

Semantics (those of EventBridge)
--------------------------------
- Fields are ANDed; the values in a match array are ORed; ``$or`` takes two or more
  sub-patterns, one of which must match.
- Field names are joined with dots on both sides: ``{"a.b": [1]}`` matches ``{"a": {"b": 1}}``
  and ``{"a": {"b": [1]}}`` matches ``{"a.b": 1}``.
- Arrays in the event (at any depth, arrays in arrays too) are flattened: the field matches if
  any element matches. Objects are not values: matchers only see leaves.
- Exact values keep their JSON type: ``"5"`` never matches ``5``, ``true`` never matches ``1``.
  Numbers compare numerically, so ``5`` matches ``5.0``.
- ``exists: true`` means the field has at least one leaf value (null counts); ``false`` the
  opposite. Every other matcher, ``anything-but`` included, needs the field to be present.
- ``anything-but`` excludes strings or numbers (one, or a list of one type), or strings by
  ``prefix``, ``suffix``, ``equals-ignore-case`` or ``wildcard`` (one or a list); values of any
  other type (null, booleans, numbers for the string forms) are not excluded.
- ``prefix``/``suffix`` take a string or ``{"equals-ignore-case": string}``; ``wildcard`` takes a
  string where ``*`` matches any run of characters, ``\\*`` a literal star and ``\\\\`` a
  backslash. Two unescaped stars in a row are refused, and so is a wildcard with more than
  ``MAX_WILDCARDS`` stars (EventBridge refuses such values as too complex).
- ``numeric`` takes ``[op, n]`` with op one of ``= < <= > >=``, or a range
  ``[">" | ">=", low, "<" | "<=", high]`` with ``low < high``; it matches JSON numbers only.
- ``cidr`` takes an IPv4 or IPv6 network ``address/bits``; it matches strings holding an
  address of the same family inside it.
- Operator names are case-sensitive; an operator object has exactly one key.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_WILDCARDS",
    "CompiledPattern",
    "InvalidPatternError",
    "RuleIndex",
    "compile_pattern",
]

# EventBridge rejects wildcard values whose matching automaton gets too large; the values it
# rejects in practice carry six stars or more (e.g. "*:*:*:*:*:event-bus/*").
MAX_WILDCARDS = 5

_NUMERIC_OPS = ("=", "<", "<=", ">", ">=")
_MISSING = object()

Predicate = Callable[[Any], bool]
EventTest = Callable[[dict], bool]


class InvalidPatternError(ValueError):
    """An event pattern that EventBridge would refuse. ``path`` says where, ``reason`` why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        where = f" at {path}" if path else ""
        super().__init__(f"invalid event pattern{where}: {reason}")

    def __reduce__(self):
        return (InvalidPatternError, (self.path, self.reason))


# --------------------------------------------------------------------------- event access


def _flatten_leaves(items: list, out: list) -> None:
    for item in items:
        cls = item.__class__
        if cls is list:
            _flatten_leaves(item, out)
        elif cls is not dict:
            out.append(item)


def _leaf_getter(segments: tuple[str, ...]) -> Callable[[dict], Any]:
    """A function returning the leaf values at a dotted path of an event.

    It returns a single scalar when the path leads to exactly one (the usual case, so no list
    is built), ``_MISSING`` when there is none, else a list of leaves (possibly empty).
    Because keys containing dots are joined like nesting, each level tries every way of
    grouping the remaining segments into one key.
    """
    n = len(segments)
    if n == 1:
        key = segments[0]

        def get_one(event: dict) -> Any:
            value = event.get(key, _MISSING)
            cls = value.__class__
            if cls is list:
                out: list = []
                _flatten_leaves(value, out)
                return out
            if cls is dict:
                return _MISSING
            return value

        return get_one

    alternatives = tuple(
        tuple((".".join(segments[i:j]), j) for j in range(i + 1, n + 1)) for i in range(n)
    )

    def walk(node: Any, i: int, out: list) -> None:
        cls = node.__class__
        if i == n:
            if cls is list:
                _flatten_leaves(node, out)
            elif cls is not dict:
                out.append(node)
        elif cls is dict:
            for key, j in alternatives[i]:
                child = node.get(key, _MISSING)
                if child is not _MISSING:
                    walk(child, j, out)
        elif cls is list:
            for item in node:
                walk(item, i, out)

    first = segments[0]
    rest_alternatives = alternatives[0][1:]

    def get_many(event: dict) -> Any:
        out: list = []
        child = event.get(first, _MISSING)
        if child is not _MISSING:
            walk(child, 1, out)
        for key, j in rest_alternatives:
            child = event.get(key, _MISSING)
            if child is not _MISSING:
                walk(child, j, out)
        if len(out) == 1:
            return out[0]
        return out if out else _MISSING

    return get_many


def _leaf_list(value: Any) -> list:
    if value is _MISSING:
        return []
    if value.__class__ is list:
        return value
    return [value]


# --------------------------------------------------------------------------- value matchers


def _is_number(value: Any) -> bool:
    cls = value.__class__
    return (cls is int or cls is float) and (cls is int or math.isfinite(value))


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _parse_wildcard(text: str, where: str, op: str) -> tuple[list[str], int]:
    """Split a wildcard value into its literal parts (stars sit between them)."""
    parts: list[str] = []
    current: list[str] = []
    stars = 0
    i = 0
    previous_star = False
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            if i + 1 >= len(text) or text[i + 1] not in "*\\":
                raise InvalidPatternError(
                    where, f"{op}: invalid escape at position {i + 1}; only \\* and \\\\ escape"
                )
            current.append(text[i + 1])
            i += 2
            previous_star = False
            continue
        if ch == "*":
            if previous_star:
                raise InvalidPatternError(
                    where, f"{op}: consecutive wildcard characters at position {i + 1}"
                )
            parts.append("".join(current))
            current = []
            stars += 1
            previous_star = True
        else:
            current.append(ch)
            previous_star = False
        i += 1
    parts.append("".join(current))
    if stars > MAX_WILDCARDS:
        raise InvalidPatternError(
            where,
            f"{op}: too complex, {stars} wildcard characters (at most {MAX_WILDCARDS})",
        )
    return parts, stars


def _wildcard_predicate(parts: list[str]) -> Callable[[str], bool]:
    """A test on strings for a parsed wildcard; simple shapes avoid the regex engine."""
    if len(parts) == 1:
        literal = parts[0]
        return literal.__eq__
    if len(parts) == 2:
        head, tail = parts
        size = len(head) + len(tail)
        if not tail:
            return lambda s: s.startswith(head)
        if not head:
            return lambda s: s.endswith(tail)
        return lambda s: len(s) >= size and s.startswith(head) and s.endswith(tail)
    regex = re.compile(".*".join(re.escape(p) for p in parts), re.DOTALL)
    fullmatch = regex.fullmatch
    return lambda s: fullmatch(s) is not None


def _string_or_list(value: Any, where: str, what: str, allow_empty: bool) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not value:
        raise InvalidPatternError(where, f"{what} must not be an empty array")
    for item in items:
        if not isinstance(item, str):
            raise InvalidPatternError(
                where, f"{what} must be a string or an array of strings, not {_type_name(item)}"
            )
        if not allow_empty and item == "":
            raise InvalidPatternError(where, f"{what} must not be an empty string")
    return items


@dataclass
class _FieldSpec:
    """Everything one match array says about one field, merged into cheap structures."""

    path: str
    segments: tuple[str, ...]
    strings: set = field(default_factory=set)
    numbers: set = field(default_factory=set)
    accept_true: bool = False
    accept_false: bool = False
    accept_null: bool = False
    prefixes: list = field(default_factory=list)
    suffixes: list = field(default_factory=list)
    prefixes_ic: list = field(default_factory=list)
    suffixes_ic: list = field(default_factory=list)
    equals_ic: set = field(default_factory=set)
    others: list = field(default_factory=list)  # (cost, predicate)
    exists_true: bool = False
    exists_false: bool = False

    @property
    def exact_only(self) -> bool:
        """True when only exact values are tested: the field can key an index."""
        return not (
            self.prefixes
            or self.suffixes
            or self.prefixes_ic
            or self.suffixes_ic
            or self.equals_ic
            or self.others
            or self.exists_true
            or self.exists_false
        )

    def exact_keys(self) -> list[Hashable]:
        keys: list[Hashable] = list(self.strings)
        keys += [_index_key(n) for n in self.numbers]
        if self.accept_true:
            keys.append(_index_key(True))
        if self.accept_false:
            keys.append(_index_key(False))
        if self.accept_null:
            keys.append(_index_key(None))
        return keys

    @property
    def cost(self) -> int:
        if self.exact_only:
            return 0
        if self.others:
            return 1 + max(c for c, _ in self.others)
        return 1


def _index_key(value: Any) -> Hashable:
    """A hashable key under which a leaf value is indexed; keeps JSON types apart."""
    cls = value.__class__
    if cls is str:
        return value
    if cls is bool:
        return ("bool", value)
    if cls is int or cls is float:
        return ("num", value)
    if value is None:
        return ("null",)
    return ("other", repr(value))


def _add_anything_but(spec: _FieldSpec, arg: Any, where: str) -> None:
    op = "anything-but"
    if isinstance(arg, dict):
        if len(arg) != 1:
            raise InvalidPatternError(
                where,
                f"{op} object must have exactly one key (prefix, suffix, "
                "equals-ignore-case or wildcard)",
            )
        ((inner, value),) = arg.items()
        if inner in ("prefix", "suffix"):
            if isinstance(value, dict):
                raise InvalidPatternError(
                    where, f"{op}/{inner} takes a string or an array of strings, not an object"
                )
            items = tuple(_string_or_list(value, where, f"{op}/{inner}", allow_empty=False))
            if inner == "prefix":
                spec.others.append((1, lambda v: v.__class__ is not str or not v.startswith(items)))
            else:
                spec.others.append((1, lambda v: v.__class__ is not str or not v.endswith(items)))
        elif inner == "equals-ignore-case":
            lowered = frozenset(
                s.lower() for s in _string_or_list(value, where, f"{op}/{inner}", True)
            )
            spec.others.append((1, lambda v: v.__class__ is not str or v.lower() not in lowered))
        elif inner == "wildcard":
            tests = tuple(
                _wildcard_predicate(_parse_wildcard(s, where, f"{op}/wildcard")[0])
                for s in _string_or_list(value, where, f"{op}/{inner}", True)
            )

            def not_wildcard(v: Any) -> bool:
                if v.__class__ is not str:
                    return True
                return not any(t(v) for t in tests)

            spec.others.append((2, not_wildcard))
        else:
            raise InvalidPatternError(where, f"{op} does not support {inner!r}")
        return

    values = arg if isinstance(arg, list) else [arg]
    if isinstance(arg, list) and not arg:
        raise InvalidPatternError(where, f"{op} must not be an empty array")
    kinds = set()
    for v in values:
        if isinstance(v, str):
            kinds.add("string")
        elif _is_number(v) and not isinstance(v, bool):
            kinds.add("number")
        else:
            raise InvalidPatternError(where, f"{op} takes strings or numbers, not {_type_name(v)}")
    if len(kinds) > 1:
        raise InvalidPatternError(where, f"{op} array must hold only strings or only numbers")
    strings = frozenset(v for v in values if isinstance(v, str))
    numbers = frozenset(v for v in values if not isinstance(v, str))

    def anything_but(v: Any) -> bool:
        cls = v.__class__
        if cls is str:
            return v not in strings
        if cls is int or cls is float:
            return v not in numbers
        return True

    spec.others.append((0, anything_but))


def _numeric_predicate(arg: Any, where: str) -> Predicate:
    op_name = "numeric"
    if not isinstance(arg, list):
        raise InvalidPatternError(where, f"{op_name} takes an array, not {_type_name(arg)}")
    if len(arg) not in (2, 4):
        raise InvalidPatternError(
            where, f"{op_name} takes [op, number] or [>|>=, low, <|<=, high], got {len(arg)} items"
        )
    for i in range(0, len(arg), 2):
        op, num = arg[i], arg[i + 1]
        if not isinstance(op, str) or op not in _NUMERIC_OPS:
            raise InvalidPatternError(where, f"{op_name}: unknown operator {op!r}")
        if isinstance(num, bool) or not _is_number(num):
            raise InvalidPatternError(
                where, f"{op_name}: value of {op!r} must be a number, not {_type_name(num)}"
            )
    if len(arg) == 2:
        op, x = arg
        if op == "=":
            return lambda v: (v.__class__ is int or v.__class__ is float) and v == x
        if op == "<":
            return lambda v: (v.__class__ is int or v.__class__ is float) and v < x
        if op == "<=":
            return lambda v: (v.__class__ is int or v.__class__ is float) and v <= x
        if op == ">":
            return lambda v: (v.__class__ is int or v.__class__ is float) and v > x
        return lambda v: (v.__class__ is int or v.__class__ is float) and v >= x
    low_op, low, high_op, high = arg
    if low_op not in (">", ">="):
        raise InvalidPatternError(
            where, f"{op_name}: a range must start with > or >=, not {low_op!r}"
        )
    if high_op not in ("<", "<="):
        raise InvalidPatternError(
            where, f"{op_name}: a range must end with < or <=, not {high_op!r}"
        )
    if not low < high:
        raise InvalidPatternError(
            where, f"{op_name}: range bottom {low} must be less than top {high}"
        )
    if low_op == ">" and high_op == "<":
        return lambda v: (v.__class__ is int or v.__class__ is float) and low < v < high
    if low_op == ">" and high_op == "<=":
        return lambda v: (v.__class__ is int or v.__class__ is float) and low < v <= high
    if low_op == ">=" and high_op == "<":
        return lambda v: (v.__class__ is int or v.__class__ is float) and low <= v < high
    return lambda v: (v.__class__ is int or v.__class__ is float) and low <= v <= high


def _cidr_predicate(arg: Any, where: str) -> Predicate:
    if not isinstance(arg, str):
        raise InvalidPatternError(where, f"cidr takes a string, not {_type_name(arg)}")
    address, slash, bits = arg.partition("/")
    if not slash:
        raise InvalidPatternError(where, f"cidr {arg!r} is malformed: one '/' required")
    if not bits.isdigit():
        raise InvalidPatternError(where, f"cidr {arg!r} is malformed: mask bits must be an integer")
    try:
        network = ipaddress.ip_network(arg, strict=False)
    except ValueError:
        raise InvalidPatternError(where, f"cidr {arg!r} is not an IP network") from None
    version = network.version
    mask = int(network.netmask)
    base = int(network.network_address)
    parse = ipaddress.ip_address

    def in_network(v: Any) -> bool:
        if v.__class__ is not str:
            return False
        try:
            ip = parse(v)
        except ValueError:
            return False
        return ip.version == version and (int(ip) & mask) == base

    return in_network


def _add_operator(spec: _FieldSpec, matcher: dict, where: str) -> None:
    if len(matcher) != 1:
        raise InvalidPatternError(
            where, f"an operator object must have exactly one key, not {len(matcher)}"
        )
    ((op, arg),) = matcher.items()
    if op == "prefix" or op == "suffix":
        if isinstance(arg, dict):
            if set(arg) != {"equals-ignore-case"}:
                raise InvalidPatternError(
                    where, f"{op} object only supports equals-ignore-case, got {sorted(arg)}"
                )
            value = arg["equals-ignore-case"]
            if not isinstance(value, str):
                raise InvalidPatternError(
                    where, f"{op}/equals-ignore-case takes a string, not {_type_name(value)}"
                )
            (spec.prefixes_ic if op == "prefix" else spec.suffixes_ic).append(value.lower())
        elif isinstance(arg, str):
            (spec.prefixes if op == "prefix" else spec.suffixes).append(arg)
        else:
            raise InvalidPatternError(where, f"{op} takes a string, not {_type_name(arg)}")
    elif op == "equals-ignore-case":
        if not isinstance(arg, str):
            raise InvalidPatternError(
                where, f"equals-ignore-case takes a string, not {_type_name(arg)}"
            )
        spec.equals_ic.add(arg.lower())
    elif op == "anything-but":
        _add_anything_but(spec, arg, where)
    elif op == "exists":
        if not isinstance(arg, bool):
            raise InvalidPatternError(where, f"exists takes true or false, not {_type_name(arg)}")
        if arg:
            spec.exists_true = True
        else:
            spec.exists_false = True
    elif op == "numeric":
        spec.others.append((0, _numeric_predicate(arg, where)))
    elif op == "cidr":
        spec.others.append((2, _cidr_predicate(arg, where)))
    elif op == "wildcard":
        if not isinstance(arg, str):
            raise InvalidPatternError(where, f"wildcard takes a string, not {_type_name(arg)}")
        test = _wildcard_predicate(_parse_wildcard(arg, where, "wildcard")[0])
        spec.others.append((2, lambda v: v.__class__ is str and test(v)))
    else:
        raise InvalidPatternError(where, f"unknown operator {op!r} (operators are case-sensitive)")


def _value_predicate(spec: _FieldSpec) -> Predicate:
    """One function answering whether a single leaf value satisfies any matcher of the field."""
    strings = frozenset(spec.strings)
    numbers = frozenset(spec.numbers)
    accept_true, accept_false, accept_null = spec.accept_true, spec.accept_false, spec.accept_null
    has_exact_other = accept_true or accept_false or accept_null or bool(numbers)
    prefixes = tuple(spec.prefixes)
    suffixes = tuple(spec.suffixes)
    prefixes_ic = tuple(spec.prefixes_ic)
    suffixes_ic = tuple(spec.suffixes_ic)
    equals_ic = frozenset(spec.equals_ic)
    has_ic = bool(prefixes_ic or suffixes_ic or equals_ic)
    others = tuple(p for _, p in sorted(spec.others, key=lambda cp: cp[0]))

    # The common shapes get a dedicated closure: matching cost is dominated by call overhead.
    if not has_exact_other and not prefixes and not suffixes and not has_ic and not others:
        return lambda v: v.__class__ is str and v in strings
    only_others = not (strings or has_exact_other or prefixes or suffixes or has_ic)
    if only_others and len(others) == 1:
        return others[0]

    def predicate(v: Any) -> bool:
        cls = v.__class__
        if cls is str:
            if (
                v in strings
                or (prefixes and v.startswith(prefixes))
                or (suffixes and v.endswith(suffixes))
            ):
                return True
            if has_ic:
                low = v.lower()
                if (
                    low in equals_ic
                    or (prefixes_ic and low.startswith(prefixes_ic))
                    or (suffixes_ic and low.endswith(suffixes_ic))
                ):
                    return True
        elif has_exact_other:
            if cls is bool:
                if accept_true if v else accept_false:
                    return True
            elif cls is int or cls is float:
                if v in numbers:
                    return True
            elif v is None and accept_null:
                return True
        for other in others:
            if other(v):
                return True
        return False

    return predicate


def _field_test(spec: _FieldSpec) -> EventTest:
    get = _leaf_getter(spec.segments)
    accept_missing = spec.exists_false
    if spec.exists_true:
        # Any present leaf satisfies the field; only presence needs checking.
        def present(event: dict) -> bool:
            value = get(event)
            if value is _MISSING or (value.__class__ is list and not value):
                return accept_missing
            return True

        return present

    predicate = _value_predicate(spec)

    def test(event: dict) -> bool:
        value = get(event)
        if value.__class__ is list:
            if not value:
                return accept_missing
            for leaf in value:
                if predicate(leaf):
                    return True
            return False
        if value is _MISSING:
            return accept_missing
        return predicate(value)

    return test


# --------------------------------------------------------------------------- pattern structure


@dataclass
class _Conjunction:
    """The fields of one (sub-)pattern, all of which must match, and its $or groups."""

    fields: list[_FieldSpec]
    alternatives: list[list[_Conjunction]]


def _join(base: str, key: str) -> str:
    return f"{base}.{key}" if base else key


def _parse_object(obj: dict, prefix: str, where: str) -> _Conjunction:
    if not obj:
        raise InvalidPatternError(where, "an object in a pattern must have at least one field")
    conj = _Conjunction(fields=[], alternatives=[])
    for key, value in obj.items():
        if not isinstance(key, str):
            raise InvalidPatternError(where, f"field names must be strings, not {key!r}")
        if key == "$or":
            here = _join(where, "$or")
            if not isinstance(value, list) or len(value) < 2:
                raise InvalidPatternError(here, "$or takes an array of at least two objects")
            branches = []
            for i, branch in enumerate(value):
                if not isinstance(branch, dict):
                    raise InvalidPatternError(
                        f"{here}[{i}]", f"$or branches must be objects, not {_type_name(branch)}"
                    )
                branches.append([_parse_object(branch, prefix, f"{here}[{i}]")])
            conj.alternatives.append([b[0] for b in branches])
            continue
        path = _join(prefix, key)
        here = _join(where, key)
        if isinstance(value, dict):
            sub = _parse_object(value, path, here)
            conj.fields.extend(sub.fields)
            conj.alternatives.extend(sub.alternatives)
        elif isinstance(value, list):
            conj.fields.append(_parse_match_array(path, value, here))
        else:
            raise InvalidPatternError(
                here, f"must be an object or an array of match values, not {_type_name(value)}"
            )
    return conj


def _parse_match_array(path: str, values: list, where: str) -> _FieldSpec:
    if not values:
        raise InvalidPatternError(where, "empty arrays are not allowed")
    spec = _FieldSpec(path=path, segments=tuple(path.split(".")))
    for i, value in enumerate(values):
        here = f"{where}[{i}]"
        if isinstance(value, str):
            spec.strings.add(value)
        elif isinstance(value, bool):
            if value:
                spec.accept_true = True
            else:
                spec.accept_false = True
        elif value is None:
            spec.accept_null = True
        elif isinstance(value, int | float):
            if not math.isfinite(value):
                raise InvalidPatternError(here, "numbers must be finite")
            spec.numbers.add(value)
        elif isinstance(value, dict):
            _add_operator(spec, value, here)
        else:
            raise InvalidPatternError(
                here,
                "match values must be strings, numbers, true, false, null or operator objects, "
                f"not {_type_name(value)}",
            )
    return spec


def _compile_conjunction(conj: _Conjunction) -> EventTest:
    tests: list[tuple[int, EventTest]] = [(f.cost, _field_test(f)) for f in conj.fields]
    for group in conj.alternatives:
        branches = tuple(_compile_conjunction(c) for c in group)

        def any_branch(event: dict, branches=branches) -> bool:
            for branch in branches:
                if branch(event):
                    return True
            return False

        tests.append((10, any_branch))
    # Cheap exact tests first: most events are rejected by them before anything costly runs.
    ordered = tuple(t for _, t in sorted(tests, key=lambda ct: ct[0]))
    if len(ordered) == 1:
        return ordered[0]
    if len(ordered) == 2:
        first, second = ordered
        return lambda event: first(event) and second(event)

    def all_fields(event: dict) -> bool:
        for test in ordered:
            if not test(event):
                return False
        return True

    return all_fields


# --------------------------------------------------------------------------- public API


def _reject_constant(name: str) -> Any:
    raise InvalidPatternError("", f"{name} is not a JSON number")


class CompiledPattern:
    """A validated event pattern, compiled into closures. Call ``matches(event)``."""

    __slots__ = ("source_json", "matches", "_conjunction")

    def __init__(self, source_json: str, conjunction: _Conjunction) -> None:
        self.source_json = source_json
        self._conjunction = conjunction
        test = _compile_conjunction(conjunction)

        def matches(event: dict) -> bool:
            if event.__class__ is not dict:
                return False
            return test(event)

        # An instance attribute, not a method: saves building a bound method on every call.
        self.matches = matches

    @property
    def pattern(self) -> dict:
        """The pattern as a fresh dict."""
        return json.loads(self.source_json)

    def index_field(self) -> tuple[str, list[Hashable]] | None:
        """A top-level field tested by exact values only, and its index keys (or None)."""
        candidates = [f for f in self._conjunction.fields if f.exact_only]
        if not candidates:
            return None
        by_path = {f.path: f for f in candidates}
        for preferred in ("source", "detail-type"):
            if preferred in by_path:
                spec = by_path[preferred]
                break
        else:
            spec = min(candidates, key=lambda f: len(f.strings) + len(f.numbers))
        return spec.path, spec.exact_keys()

    def __reduce__(self):
        return (compile_pattern, (self.source_json,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompiledPattern) and other.source_json == self.source_json

    def __hash__(self) -> int:
        return hash(self.source_json)

    def __repr__(self) -> str:
        return f"CompiledPattern({self.source_json})"


def compile_pattern(pattern: dict | str | bytes | CompiledPattern) -> CompiledPattern:
    """Validate an event pattern (a dict or JSON text) and compile it into a matcher."""
    if isinstance(pattern, CompiledPattern):
        return pattern
    if isinstance(pattern, bytes | bytearray):
        pattern = pattern.decode("utf-8")
    if isinstance(pattern, str):
        try:
            pattern = json.loads(pattern, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise InvalidPatternError(
                "", f"not valid JSON ({exc.msg} at position {exc.pos})"
            ) from None
    if not isinstance(pattern, dict):
        raise InvalidPatternError("", f"a pattern must be a JSON object, not {_type_name(pattern)}")
    conjunction = _parse_object(pattern, "", "")
    try:
        source_json = json.dumps(
            pattern, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise InvalidPatternError("", f"not representable as JSON ({exc})") from None
    return CompiledPattern(source_json, conjunction)


@dataclass
class _Entry:
    seq: int
    rule_id: Hashable
    matches: EventTest


class RuleIndex:
    """Matches one event against many rules without evaluating every rule in full.

    Each rule with a top-level field tested only by exact values is filed under those values
    (``source`` preferred, then ``detail-type``); for an event, only the rules filed under the
    event's own values of those fields are evaluated, plus the rules that could not be filed.
    """

    def __init__(self, rules: Iterable[tuple[Hashable, Any]] = ()) -> None:
        self._seq = 0
        self._entries: dict[Hashable, tuple[_Entry, str | None, list[Hashable]]] = {}
        # path -> (leaf getter, value key -> entries)
        self._by_path: dict[str, tuple[Callable[[dict], Any], dict[Hashable, list[_Entry]]]] = {}
        self._unfiled: list[_Entry] = []
        for rule_id, pattern in rules:
            self.add(rule_id, pattern)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rule_id: object) -> bool:
        return rule_id in self._entries

    def add(self, rule_id: Hashable, pattern: Any) -> None:
        """Add (or replace) a rule. ``pattern`` may be a dict, JSON text or a CompiledPattern."""
        if rule_id in self._entries:
            self.remove(rule_id)
        compiled = compile_pattern(pattern)
        entry = _Entry(self._seq, rule_id, compiled.matches)
        self._seq += 1
        filed = compiled.index_field()
        if filed is None:
            self._unfiled.append(entry)
            self._entries[rule_id] = (entry, None, [])
            return
        path, keys = filed
        if path not in self._by_path:
            self._by_path[path] = (_leaf_getter(tuple(path.split("."))), {})
        table = self._by_path[path][1]
        for key in keys:
            table.setdefault(key, []).append(entry)
        self._entries[rule_id] = (entry, path, keys)

    def remove(self, rule_id: Hashable) -> None:
        entry, path, keys = self._entries.pop(rule_id)
        if path is None:
            self._unfiled.remove(entry)
            return
        getter, table = self._by_path[path]
        for key in keys:
            bucket = table[key]
            bucket.remove(entry)
            if not bucket:
                del table[key]
        if not table:
            del self._by_path[path]

    def matching(self, event: dict) -> list[Hashable]:
        """The ids of the rules whose pattern matches ``event``, in the order they were added."""
        if event.__class__ is not dict:
            return []
        found: list[_Entry] = []
        for getter, table in self._by_path.values():
            value = getter(event)
            if value is _MISSING:
                continue
            if value.__class__ is list:
                seen: set[int] = set()
                for leaf in value:
                    for entry in table.get(_index_key(leaf), ()):
                        if entry.seq not in seen:
                            seen.add(entry.seq)
                            if entry.matches(event):
                                found.append(entry)
            else:
                for entry in table.get(_index_key(value), ()):
                    if entry.matches(event):
                        found.append(entry)
        for entry in self._unfiled:
            if entry.matches(event):
                found.append(entry)
        if len(found) > 1:
            found.sort(key=lambda e: e.seq)
        return [e.rule_id for e in found]
