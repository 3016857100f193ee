"""Property tests for the parts of the pattern language that are easy to get subtly wrong.

Each property compares the compiled matcher against a small, obviously-correct oracle written
here: numeric ranges at their edges, arrays inside arrays, anything-but on missing fields,
wildcard escapes, and the rule index against evaluating every rule.
"""

from __future__ import annotations

import math
from functools import cache

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from eventpush.rules.patterns import RuleIndex, compile_pattern

SETTINGS = settings(max_examples=300, deadline=None)


def flatten(value):
    """Leaf values of an event field: arrays (in arrays) are opened, objects are not values."""
    if isinstance(value, list):
        return [leaf for item in value for leaf in flatten(item)]
    if isinstance(value, dict):
        return []
    return [value]


def json_equal(a, b) -> bool:
    """Equality of JSON values the EventBridge way: same JSON type, numbers by value."""

    def kind(v):
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "bool"
        if isinstance(v, int | float):
            return "number"
        return "string"

    return kind(a) == kind(b) and a == b


# --------------------------------------------------------------------------- numeric ranges

finite = st.floats(allow_nan=False, allow_infinity=False, width=64, min_value=-1e12, max_value=1e12)
number = st.one_of(st.integers(min_value=-(10**12), max_value=10**12), finite)

COMPARE = {
    "=": lambda v, x: v == x,
    "<": lambda v, x: v < x,
    "<=": lambda v, x: v <= x,
    ">": lambda v, x: v > x,
    ">=": lambda v, x: v >= x,
}


def near(x):
    """Values at and around x: x itself, as int and float, and the adjacent floats."""
    values = [x, float(x), math.nextafter(float(x), math.inf), math.nextafter(float(x), -math.inf)]
    if float(x).is_integer():
        values += [int(x), int(x) + 1, int(x) - 1]
    return values


@SETTINGS
@given(op=st.sampled_from(sorted(COMPARE)), bound=number, other=number)
def test_single_numeric_comparison_at_its_edge(op, bound, other):
    compiled = compile_pattern({"n": [{"numeric": [op, bound]}]})
    for value in [*near(bound), other]:
        assert compiled.matches({"n": value}) is COMPARE[op](value, bound), (op, bound, value)


@SETTINGS
@given(
    low_op=st.sampled_from([">", ">="]),
    high_op=st.sampled_from(["<", "<="]),
    low=number,
    high=number,
    other=number,
)
def test_numeric_range_at_both_edges(low_op, high_op, low, high, other):
    assume(low < high)
    compiled = compile_pattern({"n": [{"numeric": [low_op, low, high_op, high]}]})
    for value in [*near(low), *near(high), other]:
        expected = COMPARE[low_op](value, low) and COMPARE[high_op](value, high)
        assert compiled.matches({"n": value}) is expected, (low_op, low, high_op, high, value)
    # numeric matchers never see strings, booleans or null, whatever their text says
    for value in [str(low), True, False, None]:
        assert compiled.matches({"n": value}) is False


# --------------------------------------------------------------------------- arrays in arrays

scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([0.0, 1.0, 2.5, -1.0]),
    st.sampled_from(["", "a", "b", "1", "true", "null"]),
)
nested = st.recursive(
    scalar,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(["x", "y"]), children)
    ),
    max_leaves=12,
)


@SETTINGS
@given(event_value=nested, wanted=st.lists(scalar, min_size=1, max_size=4))
def test_exact_values_match_any_leaf_of_nested_arrays(event_value, wanted):
    compiled = compile_pattern({"detail": {"f": wanted}})
    expected = any(json_equal(leaf, w) for leaf in flatten(event_value) for w in wanted)
    assert compiled.matches({"detail": {"f": event_value}}) is expected


@SETTINGS
@given(event_value=nested, wanted=st.lists(scalar, min_size=1, max_size=3))
def test_arrays_of_objects_are_walked_through(event_value, wanted):
    # the pattern tests detail.items.x; items may be an object, an array of objects, arrays...
    compiled = compile_pattern({"detail": {"items": {"x": wanted}}})

    def leaves_at_x(node):
        if isinstance(node, list):
            return [leaf for item in node for leaf in leaves_at_x(item)]
        if isinstance(node, dict) and "x" in node:
            return flatten(node["x"])
        return []

    expected = any(json_equal(leaf, w) for leaf in leaves_at_x(event_value) for w in wanted)
    assert compiled.matches({"detail": {"items": event_value}}) is expected


@SETTINGS
@given(event_value=nested)
def test_exists_means_at_least_one_leaf(event_value):
    event = {"detail": {"f": event_value}}
    present = bool(flatten(event_value))
    assert compile_pattern({"detail": {"f": [{"exists": True}]}}).matches(event) is present
    assert compile_pattern({"detail": {"f": [{"exists": False}]}}).matches(event) is not present


# --------------------------------------------------------------------------- anything-but

MISSING = object()
field_value = st.one_of(st.just(MISSING), nested)
strings = st.lists(st.sampled_from(["a", "b", "ab", "ba", "1"]), min_size=1, max_size=3)
numbers = st.lists(st.sampled_from([0, 1, 1.0, 2.5, -3]), min_size=1, max_size=3)


def anything_but_expected(value, excluded) -> bool:
    if value is MISSING:
        return False
    return any(not excluded(leaf) for leaf in flatten(value))


def event_with(value):
    return {"detail": {} if value is MISSING else {"f": value}}


@SETTINGS
@given(value=field_value, excluded=st.one_of(strings, numbers))
def test_anything_but_values(value, excluded):
    compiled = compile_pattern({"detail": {"f": [{"anything-but": excluded}]}})
    expected = anything_but_expected(value, lambda v: any(json_equal(v, e) for e in excluded))
    assert compiled.matches(event_with(value)) is expected


@SETTINGS
@given(
    value=field_value,
    form=st.sampled_from(["prefix", "suffix", "equals-ignore-case"]),
    excluded=st.lists(st.sampled_from(["a", "B", "ab", "Ba"]), min_size=1, max_size=3),
)
def test_anything_but_string_forms(value, form, excluded):
    compiled = compile_pattern({"detail": {"f": [{"anything-but": {form: excluded}}]}})
    tests = {
        "prefix": lambda v, e: v.startswith(e),
        "suffix": lambda v, e: v.endswith(e),
        "equals-ignore-case": lambda v, e: v.lower() == e.lower(),
    }

    def is_excluded(v):
        return isinstance(v, str) and any(tests[form](v, e) for e in excluded)

    assert compiled.matches(event_with(value)) is anything_but_expected(value, is_excluded)


@SETTINGS
@given(value=field_value, excluded=strings)
def test_anything_but_or_missing(value, excluded):
    # the documented idiom: "anything but these, or no field at all"
    compiled = compile_pattern({"detail": {"f": [{"anything-but": excluded}, {"exists": False}]}})
    leaves = [] if value is MISSING else flatten(value)
    expected = not leaves or any(not any(json_equal(v, e) for e in excluded) for v in leaves)
    assert compiled.matches(event_with(value)) is expected


# --------------------------------------------------------------------------- wildcards

# A wildcard as tokens: STAR, or one literal character (which may itself be '*' or '\').
STAR = None
token = st.one_of(st.just(STAR), st.sampled_from(["a", "b", "*", "\\", "."]))


def wildcard_text(tokens) -> str:
    out = []
    for t in tokens:
        if t is STAR:
            out.append("*")
        elif t in "*\\":
            out.append("\\" + t)
        else:
            out.append(t)
    return "".join(out)


def oracle_wildcard(tokens, text) -> bool:
    tokens = tuple(tokens)

    @cache
    def match(i, j):
        if i == len(tokens):
            return j == len(text)
        if tokens[i] is STAR:
            return match(i + 1, j) or (j < len(text) and match(i, j + 1))
        return j < len(text) and text[j] == tokens[i] and match(i + 1, j + 1)

    return match(0, 0)


def valid_tokens(tokens) -> bool:
    stars = sum(t is STAR for t in tokens)
    doubled = any(a is STAR and b is STAR for a, b in zip(tokens, tokens[1:], strict=False))
    return stars <= 5 and not doubled


texts = st.text(alphabet="ab*\\.", max_size=10)


@SETTINGS
@given(tokens=st.lists(token, max_size=8), text=texts, fill=st.lists(texts, max_size=6))
def test_wildcard_with_escapes_matches_the_oracle(tokens, text, fill):
    assume(valid_tokens(tokens))
    compiled = compile_pattern({"k": [{"wildcard": wildcard_text(tokens)}]})
    negated = compile_pattern({"k": [{"anything-but": {"wildcard": wildcard_text(tokens)}}]})
    # a text built from the tokens themselves (stars filled in) should usually match
    built = "".join(
        (fill[i] if i < len(fill) else "") if t is STAR else t for i, t in enumerate(tokens)
    )
    for candidate in (text, built):
        expected = oracle_wildcard(tokens, candidate)
        assert compiled.matches({"k": candidate}) is expected, (tokens, candidate)
        assert negated.matches({"k": candidate}) is (not expected)
    assert compiled.matches({"k": built}) is True


# --------------------------------------------------------------------------- rule index

matcher = st.one_of(
    st.sampled_from(["a", "b", "c", 1, 2.0, True, None]),
    st.sampled_from(
        [
            {"prefix": "a"},
            {"anything-but": "a"},
            {"anything-but": [1, 2]},
            {"numeric": [">", 1]},
            {"exists": True},
            {"exists": False},
            {"equals-ignore-case": "A"},
            {"wildcard": "*b"},
        ]
    ),
)
field_rule = st.dictionaries(
    st.sampled_from(["source", "detail-type", "detail.x", "y"]),
    st.lists(matcher, min_size=1, max_size=3),
    min_size=1,
    max_size=3,
)
rule = st.one_of(
    field_rule,
    st.tuples(field_rule, field_rule).map(lambda pair: {"$or": list(pair)}),
    st.tuples(field_rule, field_rule, field_rule).map(
        lambda three: {**three[0], "$or": [three[1], three[2]]}
    ),
)
event_scalar = st.sampled_from(["a", "b", "c", "ab", "A", 1, 1.0, 2, 3, True, False, None])
event_value = st.one_of(event_scalar, st.lists(event_scalar, max_size=3))
event = st.fixed_dictionaries(
    {},
    optional={
        "source": event_value,
        "detail-type": event_value,
        "detail": st.fixed_dictionaries({}, optional={"x": event_value}),
        "y": event_value,
    },
)


@settings(max_examples=200, deadline=None)
@given(
    rules=st.lists(rule, min_size=1, max_size=25), events=st.lists(event, min_size=1, max_size=5)
)
def test_rule_index_gives_the_same_answers_as_evaluating_every_rule(rules, events):
    compiled = [(i, compile_pattern(r)) for i, r in enumerate(rules)]
    index = RuleIndex(compiled)
    for e in events:
        assert index.matching(e) == [i for i, c in compiled if c.matches(e)]
    # removing half the rules keeps it consistent
    for i, _ in compiled[::2]:
        index.remove(i)
    kept = compiled[1::2]
    for e in events:
        assert index.matching(e) == [i for i, c in kept if c.matches(e)]
