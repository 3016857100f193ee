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
    were added. The rules' conditions are compiled into per-field structures (hash tables,
    affix tables, interval tables; see "rule index" below), so the cost of ``matching`` follows
    the conditions the event meets and the rules it matches, not the number of rules; adding
    or removing a rule touches only its own conditions. The answers are those of evaluating
    every rule's ``CompiledPattern`` on its own (tests/test_rule_index.py holds it to that).

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
import socket
from bisect import bisect_left, bisect_right
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
    """A test on strings for a parsed wildcard, linear in the string's length.

    A backtracking regex (``a.*a.*a.*b``) takes polynomial time on long runs of ``a``; with only
    ``*`` as a metacharacter, placing each middle literal at its leftmost occurrence after the
    previous one is optimal, so one forward scan decides (the two-pointer glob match)."""
    if len(parts) == 1:
        literal = parts[0]
        return literal.__eq__
    head, tail = parts[0], parts[-1]
    middle = tuple(parts[1:-1])  # never empty strings: two stars in a row are refused
    size = sum(len(p) for p in parts)
    if not middle:
        if not tail:
            return lambda s: s.startswith(head)
        if not head:
            return lambda s: s.endswith(tail)
        return lambda s: len(s) >= size and s.startswith(head) and s.endswith(tail)
    skip, keep = len(head), len(tail)

    def glob(s: str) -> bool:
        if len(s) < size or not s.startswith(head) or not s.endswith(tail):
            return False
        pos, end = skip, len(s) - keep
        for part in middle:
            found = s.find(part, pos, end)
            if found < 0:
                return False
            pos = found + len(part)
        return True

    return glob


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
    # The same matchers again, as data the rule index files in its per-field structures.
    signature: str = ""  # canonical JSON of the match array: equal specs share index states
    ranges: list = field(default_factory=list)  # numeric: (low key, high key), see _bound
    cidrs: list = field(default_factory=list)  # (IP version, first, last address as int)
    wildcards: list = field(default_factory=list)  # literal parts, stars between them
    negative: bool = False  # holds an anything-but: only checkable on candidate rules

    @property
    def exact_only(self) -> bool:
        """True when only exact values are tested: the cheapest field to test first."""
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
    spec.negative = True
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


def _bound(value: Any, side: int) -> tuple:
    """A range end as a key in one total order: ``(v, 0)`` is v itself, ``(v, 1)`` just above
    v (an open low end), ``(v, -1)`` just below v (an open high end). Every range is then a
    non-empty closed interval of keys and holds a number x when low <= (x, 0) <= high."""
    return (value, side)


_BELOW_ALL = _bound(-math.inf, 0)
_ABOVE_ALL = _bound(math.inf, 0)


def _numeric_bounds(arg: list) -> tuple[tuple, tuple]:
    """(low key, high key) of an already validated numeric matcher."""
    if len(arg) == 2:
        op, x = arg
        if op == "=":
            return _bound(x, 0), _bound(x, 0)
        if op == "<":
            return _BELOW_ALL, _bound(x, -1)
        if op == "<=":
            return _BELOW_ALL, _bound(x, 0)
        if op == ">":
            return _bound(x, 1), _ABOVE_ALL
        return _bound(x, 0), _ABOVE_ALL
    low_op, low, high_op, high = arg
    return _bound(low, 1 if low_op == ">" else 0), _bound(high, -1 if high_op == "<" else 0)


def _ip_number(text: str) -> tuple[int, int] | None:
    """(IP version, address as int) of a string holding an IP address, else None; what
    ``ipaddress.ip_address`` accepts. inet_pton reads dotted quads several times faster and
    accepts exactly the strict form ipaddress does (four decimal octets, no leading zeros);
    anything else, IPv6 included, goes to ipaddress."""
    try:
        return 4, int.from_bytes(socket.inet_pton(socket.AF_INET, text), "big")
    except (OSError, ValueError):
        pass
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    return address.version, int(address)


def _cidr_predicate(arg: Any, where: str) -> tuple[Predicate, tuple[int, int, int]]:
    """The test of a cidr matcher, and its block as (IP version, first, last address)."""
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

    return in_network, (version, base, base + network.num_addresses - 1)


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
        spec.ranges.append(_numeric_bounds(arg))
    elif op == "cidr":
        predicate, block = _cidr_predicate(arg, where)
        spec.others.append((2, predicate))
        spec.cidrs.append(block)
    elif op == "wildcard":
        if not isinstance(arg, str):
            raise InvalidPatternError(where, f"wildcard takes a string, not {_type_name(arg)}")
        parts = _parse_wildcard(arg, where, "wildcard")[0]
        test = _wildcard_predicate(parts)
        spec.others.append((2, lambda v: v.__class__ is str and test(v)))
        spec.wildcards.append(parts)
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
    spec.signature = json.dumps(values, sort_keys=True, separators=(",", ":"))
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
    return CompiledPattern(*_parse_pattern(pattern))


def _parse_pattern(pattern: dict | str | bytes) -> tuple[str, _Conjunction]:
    """Validate an event pattern: its compact JSON text and its parsed structure."""
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
    return source_json, conjunction


# --------------------------------------------------------------------------- rule index
#
# Rules are compiled into a trie of states. A rule is split into alternatives ($or expanded);
# an alternative's positive conditions (those only a present leaf can satisfy) are sorted into
# one order and become a chain of transitions from the root, equal conditions of different
# rules sharing states (every rule's ``source: shop`` is one transition). Each state keeps, per
# field path, one _FieldNode: the conditions leaving the state on that field, filed in
# structures that answer "which of them does this leaf satisfy" without trying each:
# hash tables (exact values, folded case), tables by length (prefixes, suffixes, wildcards by
# their literal head or tail), sorted intervals (numeric ranges, CIDR blocks: bisection into
# sorted ends, segment tables or a centred interval tree; see _Intervals). Matching walks
# from the root along the transitions the event's leaves satisfy, so its cost follows the
# conditions the event meets, not the number of rules. An alternative's negative conditions
# (anything-but, exists: false) are checked last, only on the rules whose positives all held.

# Expanding $or multiplies alternatives; past this many a rule is filed under its top-level
# positive conditions only and evaluated in full on the events that meet them.
MAX_ALTERNATIVES = 64
# An interval index takes this many additions and removals before it is rebuilt; meanwhile
# the added intervals are scanned and the removed ones filtered out.
_INTERVAL_SLACK = 64
# A segment table may hold this many entries per interval before the tree is used instead.
_SEGMENT_BUDGET = 16
_UNSET = object()


class _TreeNode:
    """Intervals holding ``center`` (as parallel lists of keys and states, by low end and by
    high end, so a bisection finds those holding a point); those wholly below it on the left,
    those wholly above it on the right."""

    __slots__ = ("center", "lows", "low_states", "highs", "high_states", "left", "right")

    def __init__(self, items: list[tuple]) -> None:
        items.sort(key=_low_end)
        # The median low end is inside its own interval, so every node keeps at least one
        # interval and each side gets at most half of them: depth stays logarithmic.
        center = self.center = items[len(items) // 2][0]
        here = [iv for iv in items if iv[0] <= center <= iv[1]]
        self.lows = [iv[0] for iv in here]
        self.low_states = [iv[2] for iv in here]
        here.sort(key=_high_end)
        self.highs = [iv[1] for iv in here]
        self.high_states = [iv[2] for iv in here]
        left = [iv for iv in items if iv[1] < center]
        right = [iv for iv in items if iv[0] > center]
        self.left = _TreeNode(left) if left else None
        self.right = _TreeNode(right) if right else None


def _low_end(interval: tuple) -> tuple:
    return interval[0]


def _high_end(interval: tuple) -> tuple:
    return interval[1]


class _Segments:
    """The same question by one bisection: the sorted distinct interval ends, and for each the
    states of the intervals holding it (``at``) and holding the points just above it, up to
    the next end (``above``). Its size grows with how much the intervals overlap, so it is
    only built within a budget (see _Intervals)."""

    __slots__ = ("keys", "at", "above")

    def __init__(self, keys: list, at: list, above: list) -> None:
        self.keys, self.at, self.above = keys, at, above


def _segments(items: list[tuple], budget: int) -> _Segments | None:
    keys = sorted({iv[0] for iv in items} | {iv[1] for iv in items})
    position = {key: i for i, key in enumerate(keys)}
    starts: list[list] = [[] for _ in keys]
    ends: list[list] = [[] for _ in keys]
    for low, high, state in items:
        starts[position[low]].append(state)
        ends[position[high]].append(state)
    active: dict[_State, int] = {}  # state -> intervals of it holding the sweep point
    at, above, size = [], [], 0
    for i in range(len(keys)):
        for state in starts[i]:
            active[state] = active.get(state, 0) + 1
        at.append(tuple(active))
        for state in ends[i]:
            if active[state] == 1:
                del active[state]
            else:
                active[state] -= 1
        above.append(tuple(active))
        size += len(at[-1]) + len(above[-1])
        if size > budget:
            return None
    return _Segments(keys, at, above)


class _Intervals:
    """Which intervals hold a point. Items are (low key, high key, state) (keys: see _bound).
    One-sided ranges (``> x``, ``<= x``) are sorted by their one end, so those holding a point
    are a slice found by bisection; ranges with two ends go into a _Segments table when they
    overlap little (the usual case: one bisection), else into a centred interval tree
    (logarithmic depth, any overlap). Items added since the build are scanned and states
    removed since are filtered out, until the next build. A state's intervals are always
    removed together (its whole condition is unfiled), so removal is by state.

    The build happens on a lookup; everything a lookup reads is one snapshot tuple, replaced
    whole, so threads matching events at the same time never see half of a build."""

    __slots__ = ("live", "snapshot")

    def __init__(self) -> None:
        self.live: dict[_State, list[tuple]] = {}
        # (index, lows, low states, highs, high states, added items, removed states):
        # lows/highs are the ranges with no high/no low end, sorted by their end.
        self.snapshot: tuple = (None, [], [], [], [], [], frozenset())

    def __len__(self) -> int:
        return len(self.live)

    def add(self, item: tuple) -> None:
        self.live.setdefault(item[2], []).append(item)
        self.snapshot[5].append(item)

    def remove_state(self, state: _State) -> None:
        if self.live.pop(state, None) is None:
            return
        *built, added, removed = self.snapshot
        kept = [iv for iv in added if iv[2] is not state]
        if len(kept) == len(added):
            removed = removed | {state}
        self.snapshot = (*built, kept, removed)

    def _build(self) -> tuple:
        items, rising, falling = [], [], []
        for intervals in list(self.live.values()):
            for iv in intervals:
                if iv[1] == _ABOVE_ALL:
                    rising.append(iv)
                elif iv[0] == _BELOW_ALL:
                    falling.append(iv)
                else:
                    items.append(iv)
        rising.sort(key=_low_end)
        falling.sort(key=_high_end)
        index = None
        if items:
            index = _segments(items, _SEGMENT_BUDGET * len(items)) or _TreeNode(items)
        self.snapshot = snapshot = (
            index,
            [iv[0] for iv in rising],
            [iv[2] for iv in rising],
            [iv[1] for iv in falling],
            [iv[2] for iv in falling],
            [],
            frozenset(),
        )
        return snapshot

    def stab(self, point: tuple, out: set) -> None:
        snapshot = self.snapshot
        if len(snapshot[5]) + len(snapshot[6]) > _INTERVAL_SLACK:
            snapshot = self._build()
        index, lows, low_states, highs, high_states, added, removed = snapshot
        found = []
        if lows:
            found.append(low_states[: bisect_right(lows, point)])
        if highs:
            found.append(high_states[bisect_left(highs, point) :])
        if index is None:
            pass
        elif index.__class__ is _Segments:
            keys = index.keys
            i = bisect_left(keys, point)
            if i < len(keys) and keys[i] == point:
                found.append(index.at[i])
            elif i:
                found.append(index.above[i - 1])
        else:
            node = index
            while node is not None:
                center = node.center
                if point < center:
                    found.append(node.low_states[: bisect_right(node.lows, point)])
                    node = node.left
                elif point > center:
                    found.append(node.high_states[bisect_left(node.highs, point) :])
                    node = node.right
                else:
                    found.append(node.low_states)
                    node = None
        for hits in found:
            if removed:
                out.update(state for state in hits if state not in removed)
            else:
                out.update(hits)
        for low, high, state in added:
            if low <= point <= high:
                out.add(state)


# An affix table's kind -> (matched at the end of the leaf, matched on the leaf lower-cased,
# items are (wildcard test, state) to check in full rather than states).
_AFFIX_KINDS = {
    "prefix": (False, False, False),
    "suffix": (True, False, False),
    "prefix-ic": (False, True, False),
    "suffix-ic": (True, True, False),
    "wild-head": (False, False, True),
    "wild-tail": (True, False, True),
}


class _Affixes:
    """Prefixes (or suffixes) of one kind filed by length, then by text: a leaf is looked up
    once per distinct length, however many affixes there are."""

    __slots__ = ("by_length", "lengths", "at_end", "folded", "tested")

    def __init__(self, kind: str) -> None:
        self.by_length: dict[int, dict[str, list]] = {}
        self.lengths: list[int] = []
        self.at_end, self.folded, self.tested = _AFFIX_KINDS[kind]

    def add(self, text: str, item: Any) -> None:
        table = self.by_length.get(len(text))
        if table is None:
            table = self.by_length[len(text)] = {}
            self.lengths = sorted(self.by_length)
        table.setdefault(text, []).append(item)

    def remove(self, text: str, item: Any) -> None:
        table = self.by_length[len(text)]
        bucket = table[text]
        bucket.remove(item)
        if not bucket:
            del table[text]
            if not table:
                del self.by_length[len(text)]
                self.lengths = sorted(self.by_length)

    def reached(self, leaf: str, low: str | None, out: set) -> None:
        """Add to ``out`` the states of the affixes ``leaf`` meets (``low``: the leaf
        lower-cased, for the ignore-case kinds)."""
        s = low if self.folded else leaf
        size, by_length, at_end, tested = len(s), self.by_length, self.at_end, self.tested
        for n in self.lengths:
            if n > size:
                break
            bucket = by_length[n].get(s[size - n :] if at_end else s[:n])
            if bucket:
                if tested:
                    out.update(state for test, state in bucket if test(s))
                else:
                    out.update(bucket)


def _add_to(table: dict, key: Hashable, item: Any) -> None:
    table.setdefault(key, []).append(item)


def _remove_from(table: dict, key: Hashable, item: Any) -> None:
    bucket = table[key]
    bucket.remove(item)
    if not bucket:
        del table[key]


class _FieldNode:
    """The conditions leaving one state on one field path, filed by operator family; each
    filed condition leads to the state reached when a leaf satisfies it. Tables other than
    the exact one are made when a condition first needs them."""

    __slots__ = (
        "exact",
        "folded",
        "affixes",
        "wild_any",
        "numeric",
        "cidr",
        "present",
        "size",
        "other",
        "single",
    )

    def __init__(self) -> None:
        self.exact: dict[Hashable, list[_State]] = {}
        self.folded: dict[str, list[_State]] | None = None  # equals-ignore-case
        # "prefix", "suffix", "prefix-ic", "suffix-ic", "wild-head", "wild-tail" -> _Affixes;
        # wildcards are filed by a literal end as (test, state) and then checked in full.
        self.affixes: dict[str, _Affixes] = {}
        self.wild_any: list[tuple[_WildcardTest, _State]] = []  # no literal end: scanned
        self.numeric: _Intervals | None = None
        self.cidr: dict[int, _Intervals] = {}
        self.present: list[_State] = []  # exists: true
        # Conditions filed, and how many of them are not exact strings: with none, a string
        # leaf needs one dict probe (the commonest node: source, detail-type, ...).
        self.size = 0
        self.other = 0
        # The node's only condition, as (leaf test or None for exists: true, state): chains
        # past a rule's first conditions mostly hold one, and one closure call beats the
        # family tables for it.
        self.single: tuple | None = None

    def file(self, spec: _FieldSpec, state: _State, undo: bool = False) -> None:
        """File (or, with ``undo``, unfile) a positive condition leading to ``state``."""
        step = -1 if undo else 1
        self.size += step
        self.single = None
        if self.size == 1 and not undo:
            self.single = (None if spec.exists_true else _value_predicate(spec), state)
        exact = _remove_from if undo else _add_to
        if spec.exists_true:  # any leaf satisfies it: the other matchers add nothing
            self.other += step
            if undo:
                self.present.remove(state)
            else:
                self.present.append(state)
            return
        for text in spec.strings:
            exact(self.exact, text, state)
        others = [_index_key(number) for number in spec.numbers]
        for flag, value in ((spec.accept_true, True), (spec.accept_false, False)):
            if flag:
                others.append(_index_key(value))
        if spec.accept_null:
            others.append(_index_key(None))
        for key in others:
            exact(self.exact, key, state)
        if spec.equals_ic:
            if self.folded is None:
                self.folded = {}
            for text in spec.equals_ic:
                exact(self.folded, text, state)
        affixed = [
            ("prefix", spec.prefixes, state),
            ("suffix", spec.suffixes, state),
            ("prefix-ic", spec.prefixes_ic, state),
            ("suffix-ic", spec.suffixes_ic, state),
        ]
        for parts in spec.wildcards:
            if len(parts) == 1:  # no star: an exact string
                exact(self.exact, parts[0], state)
                continue
            item = (_WildcardTest(parts), state)
            if parts[0]:
                affixed.append(("wild-head", [parts[0]], item))
            elif parts[-1]:
                affixed.append(("wild-tail", [parts[-1]], item))
            elif undo:
                self.wild_any.remove(item)
            else:
                self.wild_any.append(item)
        for kind, texts, item in affixed:
            if texts:
                table = self.affixes.get(kind)
                if table is None:
                    table = self.affixes[kind] = _Affixes(kind)
                for text in texts:
                    if undo:
                        table.remove(text, item)
                    else:
                        table.add(text, item)
                if not table.lengths:
                    del self.affixes[kind]
        blocks = [(self.numeric_tree(), low, high) for low, high in spec.ranges]
        blocks += [
            (self.cidr_tree(version), (first, 0), (last, 0)) for version, first, last in spec.cidrs
        ]
        for tree, low, high in blocks:
            if undo:
                tree.remove_state(state)
            else:
                tree.add((low, high, state))
        if self.numeric is not None and not self.numeric.live:
            self.numeric = None
        for version in [v for v, tree in self.cidr.items() if not tree.live]:
            del self.cidr[version]
        # Anything but exact strings takes the lookup off its one-probe path.
        if others or spec.equals_ic or spec.wildcards or blocks or any(t for _, t, _ in affixed):
            self.other += step

    def numeric_tree(self) -> _Intervals:
        if self.numeric is None:
            self.numeric = _Intervals()
        return self.numeric

    def cidr_tree(self, version: int) -> _Intervals:
        tree = self.cidr.get(version)
        if tree is None:
            tree = self.cidr[version] = _Intervals()
        return tree

    def reached(self, value: Any) -> Iterable[_State]:
        """The states whose condition one of the leaves ``value`` (a leaf or a list) meets."""
        if not self.other and value.__class__ is str:
            return self.exact.get(value, ())
        single = self.single
        if single is not None:
            test, state = single
            if test is None:
                return (state,)
            if value.__class__ is list:
                for leaf in value:
                    if test(leaf):
                        return (state,)
                return ()
            return (state,) if test(value) else ()
        out: set[_State] = set()
        if value.__class__ is list:
            for leaf in value:
                self._leaf(leaf, out)
        else:
            self._leaf(value, out)
        if self.present:
            out.update(self.present)
        return out

    def _leaf(self, leaf: Any, out: set) -> None:
        cls = leaf.__class__
        if cls is str:
            bucket = self.exact.get(leaf)
            if bucket:
                out.update(bucket)
            if not self.other:
                return
            low = None
            if self.folded:
                low = leaf.lower()
                bucket = self.folded.get(low)
                if bucket:
                    out.update(bucket)
            for table in self.affixes.values():
                if table.folded and low is None:
                    low = leaf.lower()
                table.reached(leaf, low, out)
            for test, state in self.wild_any:
                if test(leaf):
                    out.add(state)
            if self.cidr:
                address = _ip_number(leaf)
                if address is not None:
                    tree = self.cidr.get(address[0])
                    if tree is not None:
                        tree.stab((address[1], 0), out)
        elif cls is int or cls is float:
            bucket = self.exact.get(("num", leaf))
            if bucket:
                out.update(bucket)
            if self.numeric is not None and leaf == leaf:  # NaN is in no range
                self.numeric.stab((leaf, 0), out)
        else:
            bucket = self.exact.get(_index_key(leaf))
            if bucket:
                out.update(bucket)


class _WildcardTest:
    """A wildcard's linear test; equal wildcards compare equal, so unfiling finds the item."""

    __slots__ = ("parts", "test")

    def __init__(self, parts: list[str]) -> None:
        self.parts = tuple(parts)
        self.test = _wildcard_predicate(parts)

    def __call__(self, s: str) -> bool:
        return self.test(s)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _WildcardTest) and other.parts == self.parts

    def __hash__(self) -> int:
        return hash(self.parts)


class _State:
    """Where the walk stands after some positive conditions held: the alternatives ending
    here, and per field path the conditions leading on."""

    __slots__ = ("parent", "spec", "nodes", "children", "ends", "users")

    def __init__(self, parent: _State | None, spec: _FieldSpec | None) -> None:
        self.parent = parent
        self.spec = spec  # the condition leading here from parent
        self.nodes: dict[str, _FieldNode] = {}
        self.children: dict[tuple[str, str], _State] = {}
        self.ends: list[_End] = []
        self.users = 0  # alternatives ending here or below


@dataclass(eq=False)
class _Rule:
    seq: int
    rule_id: Hashable
    ends: list = field(default_factory=list)  # (state, _End)


@dataclass(eq=False)
class _End:
    rule: _Rule
    residual: EventTest | None  # the negative conditions, checked once the positives held


def _is_positive(spec: _FieldSpec) -> bool:
    """Only a present leaf can satisfy the field: the index can file it."""
    return not (spec.negative or spec.exists_false)


def _rank(spec: _FieldSpec) -> int:
    """Order of an alternative's conditions along its chain: families whose lookup reaches
    few states first, so the walk narrows early."""
    if spec.exists_true:
        return 5
    if spec.ranges:
        return 4
    if spec.cidrs:
        return 3
    if spec.wildcards:
        return 2
    if spec.prefixes or spec.suffixes or spec.prefixes_ic or spec.suffixes_ic or spec.equals_ic:
        return 1
    return 0


def _alternatives(conj: _Conjunction) -> list[list[_FieldSpec]] | None:
    """The pattern as a disjunction of conjunctions of fields ($or multiplied out), or None
    past MAX_ALTERNATIVES."""
    alternatives = [list(conj.fields)]
    for group in conj.alternatives:
        options: list[list[_FieldSpec]] = []
        for branch in group:
            expanded = _alternatives(branch)
            if expanded is None:
                return None
            options.extend(expanded)
        alternatives = [a + o for a in alternatives for o in options]
        if len(alternatives) > MAX_ALTERNATIVES:
            return None
    return alternatives


class RuleIndex:
    """Matches one event against many rules at a cost set by the conditions the event meets
    and the rules it matches, not by how many rules there are (see the comment above).

    Several threads may call ``matching`` at once (the engine matches windows in worker
    threads); ``add`` and ``remove`` must not run while a ``matching`` call is under way."""

    def __init__(self, rules: Iterable[tuple[Hashable, Any]] = ()) -> None:
        self._seq = 0
        self._rules: dict[Hashable, _Rule] = {}
        self._root = _State(None, None)
        self._getters: dict[str, Callable[[dict], Any]] = {}
        for rule_id, pattern in rules:
            self.add(rule_id, pattern)

    def __len__(self) -> int:
        return len(self._rules)

    def __contains__(self, rule_id: object) -> bool:
        return rule_id in self._rules

    def add(self, rule_id: Hashable, pattern: Any) -> None:
        """Add (or replace) a rule. ``pattern`` may be a dict, JSON text or a CompiledPattern."""
        # Parsed only (the index files the conditions itself), and before removing: a bad
        # pattern changes nothing.
        if isinstance(pattern, CompiledPattern):
            source_json, conj = pattern.source_json, pattern._conjunction
        else:
            source_json, conj = _parse_pattern(pattern)
        if rule_id in self._rules:
            self.remove(rule_id)
        rule = self._rules[rule_id] = _Rule(self._seq, rule_id)
        self._seq += 1
        alternatives = _alternatives(conj)
        if alternatives is None:
            positives = [f for f in conj.fields if _is_positive(f)]
            self._file(rule, positives, CompiledPattern(source_json, conj).matches)
            return
        for fields in alternatives:
            negatives = [f for f in fields if not _is_positive(f)]
            residual = _compile_conjunction(_Conjunction(negatives, [])) if negatives else None
            self._file(rule, [f for f in fields if _is_positive(f)], residual)

    def _file(self, rule: _Rule, positives: list[_FieldSpec], residual: EventTest | None) -> None:
        state = self._root
        state.users += 1
        for spec in sorted(positives, key=lambda f: (_rank(f), f.path, f.signature)):
            key = (spec.path, spec.signature)
            child = state.children.get(key)
            if child is None:
                child = state.children[key] = _State(state, spec)
                node = state.nodes.get(spec.path)
                if node is None:
                    node = state.nodes[spec.path] = _FieldNode()
                    if spec.path not in self._getters:
                        self._getters[spec.path] = _leaf_getter(spec.segments)
                node.file(spec, child)
            state = child
            state.users += 1
        end = _End(rule, residual)
        state.ends.append(end)
        rule.ends.append((state, end))

    def remove(self, rule_id: Hashable) -> None:
        rule = self._rules.pop(rule_id)
        for state, end in rule.ends:
            state.ends.remove(end)
            while state is not None:
                state.users -= 1
                parent = state.parent
                if state.users == 0 and parent is not None:
                    spec = state.spec
                    del parent.children[(spec.path, spec.signature)]
                    node = parent.nodes[spec.path]
                    node.file(spec, state, undo=True)
                    if node.size == 0:
                        del parent.nodes[spec.path]
                state = parent

    def matching(self, event: dict) -> list[Hashable]:
        """The ids of the rules whose pattern matches ``event``, in the order they were added."""
        if event.__class__ is not dict:
            return []
        found: dict[int, _Rule] = {}
        values: dict[str, Any] = {}
        getters = self._getters
        pending = [self._root]
        while pending:
            state = pending.pop()
            for end in state.ends:
                if end.residual is None or end.residual(event):
                    found[end.rule.seq] = end.rule
            for path, node in state.nodes.items():
                value = values.get(path, _UNSET)
                if value is _UNSET:
                    value = values[path] = getters[path](event)
                if value is _MISSING or (value.__class__ is list and not value):
                    continue  # a filed condition needs a leaf
                pending.extend(node.reached(value))
        if len(found) > 1:
            return [found[seq].rule_id for seq in sorted(found)]
        return [rule.rule_id for rule in found.values()]
