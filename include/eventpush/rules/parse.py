"""Validating an EventBridge event pattern into its parsed form: ``_FieldSpec`` per field,
``_Conjunction`` per (sub-)pattern, ``InvalidPatternError`` for what EventBridge would refuse.

The front end of the rule engine: ``rules.match`` compiles the parsed form into closures and
``rules.index`` files it in the rule index's tables. The language itself is described in
``eventpush.rules.patterns``. The operators that only a test can decide (anything-but,
numeric, cidr, wildcard) get their value test here, as they are validated, with the same
matcher again as data for the index (ranges, CIDR blocks, wildcard parts).
"""

from __future__ import annotations

import ipaddress
import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# EventBridge rejects wildcard values whose matching automaton gets too large; the values it
# rejects in practice carry six stars or more (e.g. "*:*:*:*:*:event-bus/*").
MAX_WILDCARDS = 5

_NUMERIC_OPS = ("=", "<", "<=", ">", ">=")

Predicate = Callable[[Any], bool]


class InvalidPatternError(ValueError):
    """An event pattern that EventBridge would refuse. ``path`` says where, ``reason`` why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        where = f" at {path}" if path else ""
        super().__init__(f"invalid event pattern{where}: {reason}")

    def __reduce__(self):
        return (InvalidPatternError, (self.path, self.reason))


# --------------------------------------------------------------------------- value matchers


@dataclass(frozen=True, slots=True)
class _Inline:
    """A value test as expressions for the generated matchers of ``rules.match``: on a string
    leaf ``v``, and on any other leaf ``v`` of class ``cls``; ``{0}``, ``{1}`` stand for the
    names under which ``values`` reach the generated code. Fixed text only, never a pattern's:
    an operator of the pattern selects one of these texts, its values go in ``values``."""

    on_string: str
    on_other: str
    values: tuple = ()


def _on_strings(test: Callable[[str], bool]) -> _Inline:
    """A test of string leaves alone (every other leaf fails it), called on them."""
    return _Inline("{0}(v)", "False", (test,))


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
    others: list = field(default_factory=list)  # (cost, predicate, _Inline)
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
            return 1 + max(other[0] for other in self.others)
        return 1


# anything-but's prefix and suffix: the test, and its text in generated code.
_EXCLUDED_AFFIX = {
    "prefix": (str.startswith, "not v.startswith({0})"),
    "suffix": (str.endswith, "not v.endswith({0})"),
}


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
            affix, text = _EXCLUDED_AFFIX[inner]
            spec.others.append(
                (
                    1,
                    lambda v: v.__class__ is not str or not affix(v, items),
                    _Inline(text, "True", (items,)),
                )
            )
        elif inner == "equals-ignore-case":
            lowered = frozenset(
                s.lower() for s in _string_or_list(value, where, f"{op}/{inner}", True)
            )
            spec.others.append(
                (
                    1,
                    lambda v: v.__class__ is not str or v.lower() not in lowered,
                    _Inline("v.lower() not in {0}", "True", (lowered,)),
                )
            )
        elif inner == "wildcard":
            tests = tuple(
                _wildcard_predicate(_parse_wildcard(s, where, f"{op}/wildcard")[0])
                for s in _string_or_list(value, where, f"{op}/{inner}", True)
            )

            def any_wildcard(v: str) -> bool:
                for test in tests:
                    if test(v):
                        return True
                return False

            match_any = tests[0] if len(tests) == 1 else any_wildcard
            spec.others.append(
                (
                    2,
                    lambda v: v.__class__ is not str or not match_any(v),
                    _Inline("not {0}(v)", "True", (match_any,)),
                )
            )
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

    inline = (
        _Inline("v not in {0}", "True", (strings,))
        if strings
        else _Inline("True", "not (cls is int or cls is float) or v not in {0}", (numbers,))
    )
    spec.others.append((0, anything_but, inline))


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


# A numeric matcher's test of a leaf in generated code, by its operators: fixed text, made
# once ({0} and {1} the bounds' names); numbers alone may match.
_NUMERIC_TESTS = {
    ops: "(cls is int or cls is float) and " + test
    for ops, test in {
        "=": "v == {0}",
        "<": "v < {0}",
        "<=": "v <= {0}",
        ">": "v > {0}",
        ">=": "v >= {0}",
        (">", "<"): "{0} < v < {1}",
        (">", "<="): "{0} < v <= {1}",
        (">=", "<"): "{0} <= v < {1}",
        (">=", "<="): "{0} <= v <= {1}",
    }.items()
}


def _numeric_inline(arg: list) -> _Inline:
    """The inline form of an already validated numeric matcher."""
    if len(arg) == 2:
        return _Inline("False", _NUMERIC_TESTS[arg[0]], (arg[1],))
    low_op, low, high_op, high = arg
    return _Inline("False", _NUMERIC_TESTS[low_op, high_op], (low, high))


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


def _cidr_predicate(arg: Any, where: str) -> tuple[Predicate, _Inline, tuple[int, int, int]]:
    """The test of a cidr matcher, its inline form, and its block as (IP version, first, last
    address)."""
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

    def in_block(v: str) -> bool:
        address = _ip_number(v)
        return address is not None and address[0] == version and (address[1] & mask) == base

    return (
        lambda v: v.__class__ is str and in_block(v),
        _on_strings(in_block),
        (version, base, base + network.num_addresses - 1),
    )


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
        spec.others.append((0, _numeric_predicate(arg, where), _numeric_inline(arg)))
        spec.ranges.append(_numeric_bounds(arg))
    elif op == "cidr":
        predicate, inline, block = _cidr_predicate(arg, where)
        spec.others.append((2, predicate, inline))
        spec.cidrs.append(block)
    elif op == "wildcard":
        if not isinstance(arg, str):
            raise InvalidPatternError(where, f"wildcard takes a string, not {_type_name(arg)}")
        parts = _parse_wildcard(arg, where, "wildcard")[0]
        test = _wildcard_predicate(parts)
        inline = _Inline("v == {0}", "False", (parts[0],)) if len(parts) == 1 else _on_strings(test)
        spec.others.append((2, lambda v: v.__class__ is str and test(v), inline))
        spec.wildcards.append(parts)
    else:
        raise InvalidPatternError(where, f"unknown operator {op!r} (operators are case-sensitive)")


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


# Objects and arrays inside one another, in a pattern (and, through the catalog, a target's
# transform spec). Compiling a pattern costs about the cube of its depth (21 ms at 100 levels,
# 1.3 s at 400, 10 s near the parser's own limit), and TestEventPattern is open to producer
# keys: a 5 KB request could hold an API worker for seconds. A stored one is also walked
# recursively wherever it is read (list, show, the API, the dashboard), where a few hundred
# levels broke `rule list` or `target list` for everyone. No real pattern comes near it.
MAX_JSON_DEPTH = 100
_TOO_DEEP = f"nested more than {MAX_JSON_DEPTH} levels deep"


def nested_deeper_than(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether objects and arrays nest more than ``limit`` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def _reject_constant(name: str) -> Any:
    raise InvalidPatternError("", f"{name} is not a JSON number")


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
        except RecursionError:  # the text is the client's: it may nest without end
            raise InvalidPatternError("", _TOO_DEEP) from None
    if not isinstance(pattern, dict):
        raise InvalidPatternError("", f"a pattern must be a JSON object, not {_type_name(pattern)}")
    if nested_deeper_than(pattern):
        raise InvalidPatternError("", _TOO_DEEP)
    conjunction = _parse_object(pattern, "", "")
    try:
        source_json = json.dumps(
            pattern, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise InvalidPatternError("", f"not representable as JSON ({exc})") from None
    return source_json, conjunction
