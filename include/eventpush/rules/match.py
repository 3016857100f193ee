"""Compiled matchers: a parsed event pattern (``rules.parse``) turned into closures that
answer, for one event, whether the pattern selects it: ``CompiledPattern`` and
``compile_pattern``, and the leaf access the rule index shares.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable
from typing import Any

from eventpush.rules.parse import (
    Predicate,
    _Conjunction,
    _FieldSpec,
    _parse_pattern,
)

_MISSING = object()

EventTest = Callable[[dict], bool]


# --------------------------------------------------------------------------- event access


def _flatten_leaves(items: list, out: list) -> None:
    for item in items:
        cls = item.__class__
        if cls is list:
            _flatten_leaves(item, out)
        elif cls is not dict:
            out.append(item)


def _leaf_getter(segments: tuple[str, ...], fast: bool = True) -> Callable[[dict], Any]:
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

    # Two and three segments (``detail.k``, ``detail.a.b``: most paths) through nested objects
    # with no dotted key on the way, walked without recursion or a list; get_many otherwise.
    if not fast:  # the general walk alone (what the fast paths are checked against)
        return get_many
    if n == 2:
        second, joined = segments[1], ".".join(segments)

        def get_two(event: dict) -> Any:
            child = event.get(first, _MISSING)
            cls = child.__class__
            if cls is dict:
                if joined not in event:
                    return _leaf_of(child.get(second, _MISSING))
            elif cls is not list and joined not in event:
                return _MISSING  # nothing (or a scalar) where the path starts
            return get_many(event)

        return get_two
    if n == 3:
        second, third = segments[1], segments[2]
        dotted = (".".join(segments[:2]), ".".join(segments))
        inner = ".".join(segments[1:])

        def get_three(event: dict) -> Any:
            child = event.get(first, _MISSING)
            if dotted[0] not in event and dotted[1] not in event:
                cls = child.__class__
                if cls is dict:
                    grand = child.get(second, _MISSING)
                    if inner not in child:
                        if grand.__class__ is dict:
                            return _leaf_of(grand.get(third, _MISSING))
                        if grand is _MISSING:
                            return _MISSING
                elif cls is not list:
                    return _MISSING  # nothing (or a scalar) where the path starts
            return get_many(event)

        return get_three
    levels = _levels(segments)

    def get_deep(event: dict) -> Any:
        node: Any = event
        for key, dotted in levels:
            cls = node.__class__
            if cls is not dict:
                if cls is list:
                    return get_many(event)  # arrays on the way: the general walk
                return _MISSING  # a scalar (or nothing) before the path's end
            for joined in dotted:
                if joined in node:
                    return get_many(event)  # a dotted key on the way
            node = node.get(key, _MISSING)
        return _leaf_of(node)

    return get_deep


def _levels(segments: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per segment of a path: its key, and the dotted keys starting there that would also
    lead along the path (``a.b`` and ``a.b.c`` at ``a`` of ``a.b.c``): where none is present,
    the path is a plain walk through nested objects."""
    n = len(segments)
    return tuple(
        (segments[i], tuple(".".join(segments[i:j]) for j in range(i + 2, n + 1))) for i in range(n)
    )


def _leaf_of(value: Any) -> Any:
    """What a path ending at ``value`` yields (``_leaf_getter``'s result for one node)."""
    cls = value.__class__
    if cls is list:
        out: list = []
        _flatten_leaves(value, out)
        if len(out) == 1:
            return out[0]
        return out if out else _MISSING
    if cls is dict:
        return _MISSING
    return value


# --------------------------------------------------------------------------- value matchers


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


def _value_predicate(spec: _FieldSpec) -> Predicate:
    """One function answering whether a single leaf value satisfies any matcher of the field."""
    # The common shapes get a dedicated closure: matching cost is dominated by call overhead.
    exact = _strings_only(spec)
    if exact is not None:
        return lambda v: v.__class__ is str and v in exact
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
            if event.__class__ is not dict:
                return False
            value = get(event)
            if value is _MISSING or (value.__class__ is list and not value):
                return accept_missing
            return True

        return present

    predicate = _value_predicate(spec)
    test = _general_field_test(get, predicate, accept_missing)

    def leaves(value: list) -> bool:
        """A list found at the path: flattened, any leaf satisfying the field will do."""
        out: list = []
        _flatten_leaves(value, out)
        if not out:
            return accept_missing
        for leaf in out:
            if predicate(leaf):
                return True
        return False

    # The path read inline (one and two segments directly, more through nested objects):
    # calls saved per evaluation, and the test also answers for a whole pattern of this one
    # field (a non-dict: False).
    segments = spec.segments
    if len(segments) > 2:
        levels = _levels(segments)

        def test_deep(event: dict) -> bool:
            if event.__class__ is not dict:
                return False
            value: Any = event
            for key, dotted in levels:
                if value.__class__ is not dict:
                    if value.__class__ is list:
                        return test(event)  # arrays on the way: the general reading
                    return accept_missing  # a scalar (or nothing) before the path's end
                for joined in dotted:
                    if joined in value:
                        return test(event)  # a dotted key on the way
                value = value.get(key, _MISSING)
            cls = value.__class__
            if cls is list:
                return leaves(value)
            if cls is dict or value is _MISSING:
                return accept_missing
            return predicate(value)

        return test_deep
    first = segments[0]
    strings = _strings_only(spec)
    if len(segments) == 1:
        if strings is not None:  # the commonest field of all: a list of strings, inline

            def test_strings_one(event: dict) -> bool:
                if event.__class__ is not dict:
                    return False
                value = event.get(first, _MISSING)
                cls = value.__class__
                if cls is str:
                    return value in strings
                if cls is list:
                    return leaves(value)
                return accept_missing if cls is dict or value is _MISSING else False

            return test_strings_one

        def test_one(event: dict) -> bool:
            if event.__class__ is not dict:
                return False
            value = event.get(first, _MISSING)
            cls = value.__class__
            if cls is list:
                return leaves(value)
            if cls is dict or value is _MISSING:
                return accept_missing
            return predicate(value)

        return test_one

    second = segments[1]
    joined = ".".join(segments)
    if strings is not None:

        def test_strings_two(event: dict) -> bool:
            if event.__class__ is not dict:
                return False
            value = event.get(first, _MISSING)
            if value.__class__ is not dict or joined in event:
                if value.__class__ is list or joined in event:
                    return test(event)  # through dotted keys or arrays: the general reading
                return accept_missing  # nothing (or a scalar) where the path starts
            value = value.get(second, _MISSING)
            cls = value.__class__
            if cls is str:
                return value in strings
            if cls is list:
                return leaves(value)
            return accept_missing if cls is dict or value is _MISSING else False

        return test_strings_two

    def test_two(event: dict) -> bool:
        if event.__class__ is not dict:
            return False
        value = event.get(first, _MISSING)
        if value.__class__ is not dict or joined in event:
            if value.__class__ is list or joined in event:
                return test(event)  # through dotted keys or arrays: the general reading
            return accept_missing  # nothing (or a scalar) where the path starts
        value = value.get(second, _MISSING)
        cls = value.__class__
        if cls is list:
            return leaves(value)
        if cls is dict or value is _MISSING:
            return accept_missing
        return predicate(value)

    return test_two


def _strings_only(spec: _FieldSpec) -> frozenset | None:
    """The field's strings when exact strings are all its values may match (presence aside):
    ``_value_predicate``'s first shape, and what a field test checks without calling it."""
    if (
        spec.accept_true
        or spec.accept_false
        or spec.accept_null
        or spec.numbers
        or spec.prefixes
        or spec.suffixes
        or spec.prefixes_ic
        or spec.suffixes_ic
        or spec.equals_ic
        or spec.others
    ):
        return None
    return frozenset(spec.strings)


def _general_field_test(
    get: Callable[[dict], Any], predicate: Predicate, accept_missing: bool
) -> EventTest:
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

        if not conjunction.alternatives:
            matches = test  # each field's own test answers for non-dicts too

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
