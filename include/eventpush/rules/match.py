"""Compiled matchers: a parsed event pattern (``rules.parse``) turned into a function that
answers, for one event, whether the pattern selects it (``CompiledPattern`` and
``compile_pattern``): one generated function per pattern, closures per field for what the
generator leaves out and for the rule index, and the leaf access the rule index shares.
"""

from __future__ import annotations

import functools
import json
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
    others = tuple(other[1] for other in sorted(spec.others, key=lambda other: other[0]))

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
    leaves = _leaves_test(predicate, accept_missing)

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


def _leaves_test(predicate: Predicate, accept_missing: bool) -> Callable[[list], bool]:
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

    return leaves


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


# --------------------------------------------------------------------------- generated matchers

# A whole pattern compiled to one Python function, generated as source, so that its field
# tests, their path reads and the value matchers run inline: the closures above cost a call
# per field and per value test, which was most of an evaluation. The source holds names only
# (``k0``, ``k1``, ...): every key, string, number, set and predicate of the pattern reaches
# the function as an argument of the factory that makes it, never as text, so a pattern
# cannot inject code. The source depends on the pattern's shape alone, and each shape is
# compiled once. Shapes the generator leaves to the closures: paths of more than
# _GENERATED_SEGMENTS segments (read by their closure field test, inline in the rest) and
# patterns of more than _GENERATED_FIELDS fields (closures throughout).

_GENERAL = object()  # a path read found an array or a dotted key on the way
_GENERATED_SEGMENTS = 8
_GENERATED_FIELDS = 64
# No builtins but the types the tests compare classes with.
_GENERATED_GLOBALS = {
    "__builtins__": {},
    "dict": dict,
    "list": list,
    "str": str,
    "int": int,
    "float": float,
}


class _Source:
    """A generated function's lines, and the constants its names stand for."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.values: list[Any] = []

    def name(self, value: Any) -> str:
        """The name by which the generated code reads ``value``."""
        self.values.append(value)
        return f"k{len(self.values) - 1}"


@functools.lru_cache(maxsize=1024)
def _factory(source: str) -> Callable[..., EventTest]:
    namespace: dict[str, Any] = {}
    # Safe to run: the source is built from fixed text and generated names only (see above).
    exec(compile(source, "<event pattern>", "exec"), dict(_GENERATED_GLOBALS), namespace)
    return namespace["make"]


def _lazy(build: Callable[[], Callable[[Any], bool]]) -> Callable[[Any], bool]:
    """A test built on its first call: the generated code's rare paths cost no compile time
    until an event takes them."""
    built: list = []

    def lazy(value: Any) -> bool:
        if not built:
            built.append(build())
        return built[0](value)

    return lazy


def _generated(conj: _Conjunction) -> EventTest | None:
    """The conjunction as one generated function, or None for a shape left to the closures."""
    if len(conj.fields) > _GENERATED_FIELDS:
        return None
    src = _Source()
    lines = src.lines
    for spec in sorted(conj.fields, key=lambda f: f.cost):
        if len(spec.segments) > _GENERATED_SEGMENTS:
            lines.append(_FAIL_UNLESS.format(test=src.name(_field_test(spec))))
        else:
            _generate_field(src, spec)
    for group in conj.alternatives:
        branches = [_generated(c) or _compile_conjunction(c) for c in group]
        calls = " or ".join(f"{src.name(b)}(event)" for b in branches)
        lines.append(f"        if not ({calls}):\n            return False")
    names = "".join(f", k{i}" for i in range(len(src.values)))
    text = _FUNCTION.format(names=names, body="\n".join(lines))
    return _factory(text)(_MISSING, _GENERAL, *src.values)


_FUNCTION = """def make(MISSING, GENERAL{names}):
    def match(event):
        if event.__class__ is not dict:
            return False
{body}
        return True
    return match
"""
_FAIL_UNLESS = """        if not {test}(event):
            return False"""
_LEVEL = """        if v.__class__ is dict:
            v = {read}
        elif v.__class__ is list:
            v = GENERAL
        elif v is not GENERAL:
            v = MISSING  # a scalar (or nothing) before the path's end"""


def _generate_field(src: _Source, spec: _FieldSpec) -> None:
    """Lines leaving ``return False`` when the field fails: the path read into ``v`` level by
    level (as ``test_deep`` reads it), then the leaf's test by its type."""
    lines = src.lines
    levels = _levels(spec.segments)
    for depth, (key, dotted) in enumerate(levels):
        node = "v" if depth else "event"
        read = f"{node}.get({src.name(key)}, MISSING)"
        if dotted:
            found = " or ".join(f"{src.name(d)} in {node}" for d in dotted)
            read = f"GENERAL if ({found}) else {read}"
        lines.append(_LEVEL.format(read=read) if depth else f"        v = {read}")
    accept_missing = spec.exists_false
    lines.append("        cls = v.__class__")
    if spec.exists_true:  # any present leaf will do
        lines.append("        if v is MISSING or cls is dict:")
        others = None
        leaves = _lazy(lambda: _leaves_test(_any_leaf, accept_missing))
    else:
        strings, others = _value_parts(src, spec)
        lines.append("        if cls is str:")
        lines.append(_required(strings))
        lines.append("        elif v is MISSING or cls is dict:")
        leaves = _lazy(lambda: _leaves_test(_value_predicate(spec), accept_missing))
    lines.append("            pass" if accept_missing else "            return False")
    lines.append("        elif cls is list:")
    lines.append(f"            if not {src.name(leaves)}(v):\n                return False")
    if len(levels) > 1:
        general = src.name(_lazy(lambda: _field_test(spec)))
        lines.append("        elif v is GENERAL:  # an array or a dotted key: the general reading")
        lines.append(f"            if not {general}(event):\n                return False")
    if others is not None:
        lines.append("        else:")
        lines.append(_required(others))


def _required(parts: list[str]) -> str:
    """A branch's body: ``return False`` unless one of the tests holds."""
    if "True" in parts:  # an inline form that holds for every leaf of this type
        return "            pass"
    parts = [part for part in parts if part != "False"]
    if not parts:
        return "            return False"
    return f"            if not ({' or '.join(parts)}):\n                return False"


# The tests of a string leaf: (the spec's attribute, the constant made of it, the expression).
_STRING_TESTS = (
    ("strings", frozenset, "v in {}"),
    ("prefixes", tuple, "v.startswith({})"),
    ("suffixes", tuple, "v.endswith({})"),
    ("equals_ic", frozenset, "v.lower() in {}"),
    ("prefixes_ic", tuple, "v.lower().startswith({})"),
    ("suffixes_ic", tuple, "v.lower().endswith({})"),
)
_SCALAR_TESTS = (
    ("accept_true", "v is True"),
    ("accept_false", "v is False"),
    ("accept_null", "v is None"),
)


def _value_parts(src: _Source, spec: _FieldSpec) -> tuple[list[str], list[str]]:
    """The tests (expressions on ``v``, any of which will do) of a string leaf and of any
    other leaf: what ``_value_predicate`` answers, by type."""
    strings = [
        form.format(src.name(kind(getattr(spec, attr))))
        for attr, kind, form in _STRING_TESTS
        if getattr(spec, attr)
    ]
    others = [test for attr, test in _SCALAR_TESTS if getattr(spec, attr)]
    if spec.numbers:
        numbers = src.name(frozenset(spec.numbers))
        others.append(f"((cls is int or cls is float) and v in {numbers})")
    for _, _, inline in sorted(spec.others, key=lambda other: other[0]):
        names = [src.name(value) for value in inline.values]
        strings.append(inline.on_string.format(*names))
        others.append(inline.on_other.format(*names))
    return strings, others


def _any_leaf(value: Any) -> bool:
    """``exists: true``'s value test: a leaf is there."""
    return True


# --------------------------------------------------------------------------- public API


class CompiledPattern:
    """A validated event pattern, compiled into one function. Call ``matches(event)``."""

    __slots__ = ("source_json", "matches", "_conjunction")

    def __init__(self, source_json: str, conjunction: _Conjunction) -> None:
        self.source_json = source_json
        self._conjunction = conjunction
        generated = _generated(conjunction)
        if generated is not None:
            matches = generated
        else:
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
