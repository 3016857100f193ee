"""The rule index (issue 21) against per-rule evaluation, and the linear wildcard (issue 16).

``RuleIndex`` files rules in per-field structures (hash tables, affix tables, interval tables
and trees) instead of evaluating each rule; its answers must be exactly those of evaluating
every compiled rule on its own, which is the oracle throughout: random rules using every
operator, ``$or`` (nested, and past the alternative cap), arrays and dotted names in events,
adds, replacements and removals in any order, and interval sets large enough to be rebuilt
and overlapping enough to need the tree.
"""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventpush.rules import index as rule_index
from eventpush.rules import match, parse, patterns
from eventpush.rules.patterns import RuleIndex, compile_pattern

# --------------------------------------------------------------------------- random rules

TEXTS = ["", "a", "ab", "abc", "b", "ba", "A", "AB", "aB", "x.y", "*", "a*b", "aab", "aXbYc"]
ADDRESSES = ["198.51.100.7", "198.51.100.200", "198.51.1.1", "2001:db8::5", "2001:db9::1", "::1"]
NUMBERS = [-3, 0, 1, 1.0, 1.5, 2, 2.5, 3, 10**20]

exact = st.sampled_from([*TEXTS[:10], *NUMBERS, True, False, None])
affix = st.sampled_from(["", "a", "ab", "b", "19", "A", "aB"])
number = st.sampled_from([-3, 0, 1, 1.5, 2.5, 10**20])
numeric = st.one_of(
    st.tuples(st.sampled_from(["=", "<", "<=", ">", ">="]), number).map(list),
    st.tuples(st.sampled_from([">", ">="]), number, st.sampled_from(["<", "<="]), number)
    .filter(lambda r: r[1] < r[3])
    .map(list),
)
operator = st.one_of(
    affix.map(lambda s: {"prefix": s}),
    affix.map(lambda s: {"suffix": s}),
    affix.map(lambda s: {"prefix": {"equals-ignore-case": s}}),
    affix.map(lambda s: {"suffix": {"equals-ignore-case": s}}),
    st.sampled_from(["ab", "AB", "x"]).map(lambda s: {"equals-ignore-case": s}),
    st.sampled_from(
        ["*", "a*", "*b", "a*b", "*a*", "a*b*c", "a\\*b", "*.*", "ab", "a*a*a*b", "*X*Y*"]
    ).map(lambda w: {"wildcard": w}),
    numeric.map(lambda r: {"numeric": r}),
    st.sampled_from(
        ["198.51.100.0/24", "198.51.100.7/32", "0.0.0.0/0", "2001:db8::/32", "::1/128"]
    ).map(lambda c: {"cidr": c}),
    st.sampled_from(
        [
            "a",
            ["a", "b"],
            1,
            [1, 2.5],
            {"prefix": "a"},
            {"suffix": ["b", "c"]},
            {"equals-ignore-case": "AB"},
            {"wildcard": "a*"},
            {"wildcard": ["*b", "x*"]},
        ]
    ).map(lambda a: {"anything-but": a}),
    st.booleans().map(lambda b: {"exists": b}),
)
match_array = st.lists(st.one_of(exact, operator), min_size=1, max_size=3)
PATHS = ["source", "detail.x", "detail.y", "a.b"]
fields = st.dictionaries(st.sampled_from(PATHS), match_array, min_size=1, max_size=3)


def _nest(pattern: dict) -> dict:
    """The same pattern with ``detail.*`` written as a nested object (both spellings are one)."""
    out = {k: v for k, v in pattern.items() if not k.startswith("detail.")}
    nested = {k.split(".", 1)[1]: v for k, v in pattern.items() if k.startswith("detail.")}
    if nested:
        out["detail"] = nested
    return out


rule = st.recursive(
    fields,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(lambda branches: {"$or": branches}),
        st.tuples(fields, st.lists(inner, min_size=2, max_size=3)).map(
            lambda pair: {**pair[0], "$or": pair[1]}
        ),
    ),
    max_leaves=4,
).map(lambda p: _nest(p) if "$or" not in p else p)

leaf = st.sampled_from(
    [*TEXTS, *ADDRESSES, "ABC", "abc", *NUMBERS, 1e300, float("inf"), float("nan"), True, False]
    + [None]
)
value = st.one_of(
    leaf,
    st.lists(leaf, max_size=3),
    st.lists(st.lists(leaf, max_size=2), max_size=2),  # arrays in arrays are flattened
    st.just({"not": "a value"}),
)
event = st.fixed_dictionaries(
    {},
    optional={
        "source": value,
        "detail": st.one_of(
            st.fixed_dictionaries({}, optional={"x": value, "y": value}),
            st.lists(st.fixed_dictionaries({}, optional={"x": value}), max_size=2),
        ),
        "a": st.one_of(
            st.fixed_dictionaries({}, optional={"b": value}),
            st.lists(st.fixed_dictionaries({"b": value}), max_size=2),
        ),
        "a.b": value,  # a dotted key answers for the path a.b too
    },
)


def every_rule(rules: dict, event_: dict) -> list:
    """The oracle: each compiled rule evaluated on its own, in the order of addition."""
    return [rule_id for rule_id, compiled in rules.items() if compiled.matches(event_)]


# --------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(
    rules=st.lists(rule, min_size=1, max_size=20),
    events=st.lists(event, min_size=1, max_size=6),
)
def test_index_answers_as_every_rule_evaluated_on_its_own(rules, events):
    compiled = {i: compile_pattern(r) for i, r in enumerate(rules)}
    index = RuleIndex((i, r) for i, r in enumerate(rules))
    for e in events:
        assert index.matching(e) == every_rule(compiled, e), e


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 7), rule),
    st.tuples(st.just("remove"), st.integers(0, 7), st.none()),
    st.tuples(st.just("match"), st.none(), event),
)


@settings(max_examples=100, deadline=None)
@given(operations=st.lists(operation, min_size=1, max_size=40))
def test_adds_replacements_and_removals_in_any_order(operations):
    index = RuleIndex()
    oracle: dict = {}
    for kind, rule_id, arg in operations:
        if kind == "add":
            index.add(rule_id, arg)
            oracle.pop(rule_id, None)  # a replaced rule counts as added last
            oracle[rule_id] = compile_pattern(arg)
        elif kind == "remove":
            if rule_id in oracle:
                index.remove(rule_id)
                del oracle[rule_id]
            else:
                with pytest.raises(KeyError):
                    index.remove(rule_id)
        else:
            assert index.matching(arg) == every_rule(oracle, arg)
        assert len(index) == len(oracle)
    for rule_id in list(oracle):
        index.remove(rule_id)
    # nothing is left behind: every state and field structure went with its last rule
    assert not index._root.nodes and not index._root.children and not index._root.ends


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet="0123456789.:abcdef%x /", max_size=20))
def test_fast_address_parse_agrees_with_ipaddress(text):
    try:
        address = ipaddress.ip_address(text)
        expected = (address.version, int(address))
    except ValueError:
        expected = None
    assert parse._ip_number(text) == expected


# --------------------------------------------------------------------------- larger sets


def _numeric_rules(rng: random.Random, count: int, width: int) -> list[tuple[str, dict]]:
    rules = []
    for i in range(count):
        low = rng.randrange(1_000)
        form = rng.randrange(4)
        if form == 0:
            numeric = [">=" if rng.random() < 0.5 else ">", low, "<", low + rng.randrange(1, width)]
        elif form == 1:
            numeric = [">", low, "<=", low + rng.randrange(1, width)]
        elif form == 2:
            numeric = [rng.choice(["<", "<=", ">", ">="]), low]
        else:
            numeric = ["=", low]
        rules.append((f"n{i}", {"source": ["shop"], "detail": {"n": [{"numeric": numeric}]}}))
    return rules


@pytest.mark.parametrize("width", [5, 2_000], ids=["narrow-segments", "overlapping-tree"])
def test_many_ranges_through_rebuilds_and_removals(width):
    """Hundreds of ranges on one field: past the slack the interval index is rebuilt, as a
    segment table for narrow ranges and as a tree when they overlap too much for one."""
    rng = random.Random(width)
    rules = _numeric_rules(rng, 400, width)
    index = RuleIndex(rules)
    oracle = {rule_id: compile_pattern(p) for rule_id, p in rules}
    probes = [rng.randrange(-5, 1_005) + rng.choice([0, 0, 0.5]) for _ in range(60)]
    for n in probes:
        e = {"source": "shop", "detail": {"n": n}}
        assert index.matching(e) == every_rule(oracle, e)
    shop = index._root.children[("source", '["shop"]')]
    built = shop.nodes["detail.n"].numeric.snapshot[0]
    expected_kind = rule_index._Segments if width == 5 else rule_index._TreeNode
    assert isinstance(built, expected_kind)
    # churn: remove and re-add rules between matches (filtered, scanned, then rebuilt)
    for step in range(300):
        rule_id, pattern = rules[rng.randrange(len(rules))]
        if rule_id in oracle:
            index.remove(rule_id)
            del oracle[rule_id]
        else:
            index.add(rule_id, pattern)
            oracle[rule_id] = compile_pattern(pattern)
        if step % 7 == 0:
            e = {"source": "shop", "detail": {"n": probes[step % len(probes)]}}
            assert index.matching(e) == every_rule(oracle, e)


def test_many_rules_of_every_family_on_one_source():
    """The benchmark's shape (bench/patterns.py sweep), smaller: every answer as per rule."""
    rng = random.Random(21)
    rules = []
    for i in range(600):
        n = rng.randrange(300)
        detail = rng.choice(
            [
                {"customer": [f"c{n}"]},
                {"sku": [{"prefix": f"S{n % 40}-"}]},
                {"email": [{"suffix": f"@d{n % 40}.example"}]},
                {"city": [{"equals-ignore-case": f"City{n % 40}"}]},
                {"amount": [{"numeric": [">=", n, "<", n + rng.randrange(1, 30)]}]},
                {"path": [{"wildcard": f"/o/{n % 40}/*/i/*"}]},
                {"ip": [{"cidr": f"198.51.{n % 4}.0/24"}]},
            ]
        )
        detail["channel"] = rng.choice(
            [[{"anything-but": ["web"]}], [{"exists": rng.random() < 0.5}], ["app", "web"]]
        )
        rules.append((i, {"source": ["shop"], "detail": detail}))
    index = RuleIndex(rules)
    oracle = {i: compile_pattern(p) for i, p in rules}
    hits = 0
    for _ in range(150):
        n = rng.randrange(300)
        e = {
            "source": "shop",
            "detail": {
                "customer": f"c{n}",
                "sku": f"S{n % 40}-{n}",
                "email": f"x@d{rng.randrange(40)}.example",
                "city": f"CITY{rng.randrange(40)}",
                "amount": rng.randrange(330),
                "path": f"/o/{rng.randrange(40)}/{n}/i/{n}",
                "ip": f"198.51.{rng.randrange(4)}.{rng.randrange(256)}",
                "channel": rng.choice(["web", "app", ["web", "pos"]]),
            },
        }
        expected = every_rule(oracle, e)
        hits += len(expected)
        assert index.matching(e) == expected
    assert hits > 150  # the events do meet rules: the comparison is not all empty lists


def test_an_or_past_the_alternative_cap_is_still_answered_exactly():
    groups = [{"$or": [{f"f{i}": ["a"]}, {f"g{i}": [{"prefix": "b"}]}]} for i in range(7)]
    pattern = {"source": ["shop"], "detail": {f"k{i}": g for i, g in enumerate(groups)}}
    index = RuleIndex([("wide", pattern)])
    compiled = compile_pattern(pattern)
    detail = {f"k{i}": ({f"f{i}": "a"} if i % 2 else {f"g{i}": "bb"}) for i in range(7)}
    e = {"source": "shop", "detail": detail}
    assert compiled.matches(e) and index.matching(e) == ["wide"]
    detail["k3"] = {"f3": "b"}
    assert not compiled.matches(e) and index.matching(e) == []
    assert index.matching({"source": "other", "detail": detail}) == []


def test_conditions_shared_by_rules_are_filed_once_and_go_with_the_last():
    index = RuleIndex()
    index.add("a", {"source": ["shop"], "detail": {"n": [{"numeric": [">", 5]}]}})
    index.add("b", {"source": ["shop"], "detail": {"n": [{"numeric": [">", 5]}]}})
    index.add("c", {"source": ["shop"], "detail": {"s": [{"prefix": "x"}]}})
    root = index._root
    assert list(root.children) == [("source", '["shop"]')]
    shop = root.children[("source", '["shop"]')]
    assert len(shop.children) == 2  # one state for both "n > 5", one for the prefix
    assert index.matching({"source": "shop", "detail": {"n": 6, "s": "xy"}}) == ["a", "b", "c"]
    index.remove("a")
    assert index.matching({"source": "shop", "detail": {"n": 6}}) == ["b"]
    index.remove("b")
    assert list(shop.nodes) == ["detail.s"]
    index.remove("c")
    assert not root.children and not root.nodes


def test_numbers_keep_their_json_type_and_compare_exactly():
    index = RuleIndex(
        [
            ("five", {"n": [5]}),
            ("true", {"n": [True]}),
            ("big", {"n": [{"numeric": [">", 2**64]}]}),
            ("small", {"n": [{"numeric": ["<", -1e300]}]}),
            ("null", {"n": [None]}),
        ]
    )
    assert index.matching({"n": 5.0}) == ["five"]
    assert index.matching({"n": 1}) == []
    assert index.matching({"n": True}) == ["true"]
    assert index.matching({"n": 2**64}) == []
    assert index.matching({"n": 2**64 + 1}) == ["big"]
    assert index.matching({"n": float("inf")}) == ["big"]
    assert index.matching({"n": float("-inf")}) == ["small"]
    assert index.matching({"n": float("nan")}) == []
    assert index.matching({"n": None}) == ["null"]
    assert index.matching({"n": [None, 5, "5"]}) == ["five", "null"]


# --------------------------------------------------------------------------- wildcards


@pytest.mark.timeout(30)  # a backtracking matcher takes hours here; the linear one milliseconds
def test_many_star_wildcard_is_matched_in_linear_time():
    stars = patterns.MAX_WILDCARDS
    text = "a*" * stars + "b"
    assert text.count("*") == stars
    compiled = compile_pattern({"k": [{"wildcard": text}]})
    negated = compile_pattern({"k": [{"anything-but": {"wildcard": text}}]})
    index = RuleIndex([("w", {"k": [{"wildcard": text}]})])
    run = "a" * 50_000
    assert compiled.matches({"k": run}) is False
    assert negated.matches({"k": run}) is True
    assert index.matching({"k": run}) == []
    assert compiled.matches({"k": run + "b"}) is True
    assert index.matching({"k": run + "b"}) == ["w"]
    assert compiled.matches({"k": "a" * stars + "b"}) is True
    assert compiled.matches({"k": "a" * (stars - 1) + "b"}) is False
    # head and tail match, so the middle literals are searched through the whole run
    searched = compile_pattern({"k": [{"wildcard": "a*" * (stars - 1) + "c*b"}]})
    assert searched.matches({"k": run + "b"}) is False
    assert searched.matches({"k": run + "cb"}) is True


def test_threads_matching_at_once_through_a_first_build():
    """The engine matches windows in worker threads; the first lookups of a fresh index build
    its interval tables. Threads switching every microsecond must all see whole builds."""
    import sys
    import threading

    rng = random.Random(7)
    rules = _numeric_rules(rng, 200, 30)
    oracle = {rule_id: compile_pattern(p) for rule_id, p in rules}
    events = [{"source": "shop", "detail": {"n": rng.randrange(1_000)}} for _ in range(40)]
    expected = [every_rule(oracle, e) for e in events]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            index = RuleIndex(rules)  # nothing built yet: the threads race to build
            barrier = threading.Barrier(4)
            answers: list = [None] * 4

            def run(slot: int, index=index, barrier=barrier, answers=answers) -> None:
                barrier.wait()
                answers[slot] = [index.matching(e) for e in events]

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert answers == [expected] * 4
    finally:
        sys.setswitchinterval(interval)


# --------------------------------------------------------------------------- issue 34

# Leaves of every JSON type that Python finds equal to each other (1, 1.0, true), repeated
# across a window so the memo answers most of it, lists (never memoised) among them.
alike = st.sampled_from([1, 1.0, True, 0, False, "1", None, 2.5, "a", "ab"])
window_event = st.fixed_dictionaries(
    {},
    optional={
        "source": st.one_of(alike, st.sampled_from(TEXTS)),
        "detail": st.fixed_dictionaries(
            {}, optional={"x": st.one_of(alike, st.lists(alike, max_size=2)), "y": alike}
        ),
        "a": st.fixed_dictionaries({}, optional={"b": alike}),
        "a.b": alike,
    },
)


@settings(max_examples=150, deadline=None)
@given(
    rules=st.lists(rule, min_size=1, max_size=12),
    events=st.lists(st.one_of(window_event, event), min_size=1, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_a_window_matched_at_once_answers_as_each_event_alone(rules, events, order):
    """matching_each (one match per distinct combination of the values the rules read) says
    for every event of a window what evaluating every rule on it says."""
    compiled = {i: compile_pattern(r) for i, r in enumerate(rules)}
    index = RuleIndex((i, r) for i, r in enumerate(rules))
    window = events * 10  # enough repeats for the memo to stay on past its probe
    order.shuffle(window)
    got = index.matching_each(window)
    assert got == [frozenset(every_rule(compiled, e)) for e in window]


def test_a_window_after_adds_and_removals_reads_the_paths_of_the_rules_left():
    """The memo's key follows the paths of the rules in the index: a rule on a path no
    other rule reads, added after a window was matched, is answered on the next one."""
    index = RuleIndex([(1, {"detail": {"k": [0]}})])
    window = [{"detail": {"k": i % 2, "z": i % 3}} for i in range(60)]
    assert index.matching_each(window) == [frozenset([1] if i % 2 == 0 else []) for i in range(60)]
    index.add(2, {"detail": {"z": [2]}, "source": [{"exists": False}]})
    assert index.matching_each(window) == [
        frozenset(([1] if i % 2 == 0 else []) + ([2] if i % 3 == 2 else [])) for i in range(60)
    ]
    index.remove(1)
    assert index._paths == {"detail.z": 1, "source": 1}
    assert index.matching_each(window) == [frozenset([2] if i % 3 == 2 else []) for i in range(60)]
    # mostly distinct events: the memo gives up after its probe, the answers stay the same
    distinct = [{"detail": {"z": i}} for i in range(100)]
    assert index.matching_each(distinct) == [frozenset([2] if i == 2 else []) for i in range(100)]


nested_value = st.one_of(
    leaf, st.lists(leaf, max_size=2), st.just({}), st.lists(st.just({"c": 1}), max_size=2)
)
nested = st.recursive(
    nested_value,
    lambda inner: st.dictionaries(st.sampled_from(["a", "b", "c", "a.b", "b.c", "a.b.c"]), inner),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(
    event_=st.dictionaries(st.sampled_from(["a", "b", "a.b", "a.b.c", "b.c"]), nested),
    segments=st.sampled_from(
        [("a", "b"), ("a", "b", "c"), ("b", "c"), ("a", "b", "c", "c"), ("a", "a", "b", "c")]
    ),
)
def test_the_fast_paths_of_two_and_more_segments_read_what_the_general_walk_reads(event_, segments):
    fast, general = match._leaf_getter(segments), match._leaf_getter(segments, fast=False)
    got, expected = fast(event_), general(event_)
    assert got is expected or (got == expected and got.__class__ is expected.__class__)


def test_a_window_keeps_equal_values_of_different_json_types_apart():
    """1, 1.0 and true are one dict key in Python, not one value to a pattern."""
    index = RuleIndex([(1, {"detail": {"x": [1]}}), (2, {"detail": {"x": [True]}})])
    values = [1, True, 1.0, "1", 0, False]
    window = [{"detail": {"x": values[i % 6]}} for i in range(60)]
    answers = [{1}, {2}, {1}, set(), set(), set()]  # by position in values
    assert index.matching_each(window) == [frozenset(answers[i % 6]) for i in range(60)]


two_segments = st.fixed_dictionaries(
    {},
    optional={
        "a": st.one_of(
            st.fixed_dictionaries({}, optional={"b": value}),
            st.lists(st.fixed_dictionaries({}, optional={"b": value}), max_size=2),
            value,
        ),
        "a.b": value,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    event_=two_segments,
    path=st.sampled_from(["a", "a.b"]),
    array=match_array,
)
def test_a_field_read_inline_answers_as_the_general_walk(event_, path, array):
    """Fields of one and two segments are read inline (issue 34); what they answer is what
    the general leaf walk and the field's predicate answer."""
    from eventpush.rules.parse import _parse_pattern

    spec = _parse_pattern({path: array} if "." not in path else {"a": {"b": array}})[1].fields[0]
    assert match._field_test(spec)(event_) == general_field_answer(spec, event_)


def general_field_answer(spec, event_: dict) -> bool:
    """What a field answers through the general leaf walk and its predicate (presence alone
    for ``exists: true``)."""
    get = match._leaf_getter(spec.segments, fast=False)
    if spec.exists_true:
        value = get(event_)
        missing = value is match._MISSING or (value.__class__ is list and not value)
        return spec.exists_false if missing else True
    general = match._general_field_test(get, match._value_predicate(spec), spec.exists_false)
    return general(event_)


@settings(max_examples=400, deadline=None)
@given(
    event_=st.dictionaries(st.sampled_from(["a", "b", "a.b", "a.b.c", "b.c"]), nested),
    segments=st.sampled_from([("a", "b", "c"), ("a", "b", "c", "c"), ("a", "a", "b", "c")]),
    array=match_array,
)
def test_a_deep_field_read_inline_answers_as_the_general_walk(event_, segments, array):
    """Fields of three and more segments walk nested objects inline (issue 34) and fall back
    to the general reading at an array or a dotted key; what they answer is the same."""
    from eventpush.rules.parse import _parse_pattern

    pattern: dict = {segments[-1]: array}
    for key in reversed(segments[:-1]):
        pattern = {key: pattern}
    spec = _parse_pattern(pattern)[1].fields[0]
    assert match._field_test(spec)(event_) == general_field_answer(spec, event_)
    assert match._field_test(spec)([event_]) is False  # not an object: no match


def general_answer(conj, event_) -> bool:
    """What a parsed pattern answers through the general leaf walk, field by field."""
    return all(general_field_answer(f, event_) for f in conj.fields) and all(
        any(general_answer(branch, event_) for branch in group) for group in conj.alternatives
    )


DEEP_PATHS = ["a", "b", "a.b", "b.c", "a.b.c", "a.b.c.c", "a.a.b.c"]
deep_fields = st.dictionaries(st.sampled_from(DEEP_PATHS), match_array, min_size=1, max_size=3)
deep_pattern = st.one_of(
    deep_fields,
    st.tuples(deep_fields, st.lists(deep_fields, min_size=2, max_size=3)).map(
        lambda pair: {**pair[0], "$or": pair[1]}
    ),
    st.lists(deep_fields, min_size=2, max_size=3).map(lambda branches: {"$or": branches}),
)


@settings(max_examples=500, deadline=None)
@given(
    event_=st.dictionaries(st.sampled_from(["a", "b", "a.b", "a.b.c", "b.c"]), nested),
    pattern=deep_pattern,
)
def test_a_generated_pattern_answers_as_the_general_walk(event_, pattern):
    """A pattern is compiled to one generated function (issue 34): its fields, of one to four
    segments through arrays and dotted keys, answer as the general reading does."""
    from eventpush.rules.parse import _parse_pattern

    compiled = compile_pattern(pattern)
    assert compiled.matches.__name__ == "match"  # the generated function, not a closure
    conj = _parse_pattern(pattern)[1]
    assert compiled.matches(event_) == general_answer(conj, event_)
    assert compiled.matches([event_]) is False  # not an object: no match


def test_shapes_past_the_generator_s_limits_are_matched_by_the_closures():
    deep = ".".join(["a"] * (match._GENERATED_SEGMENTS + 1))
    nested_event: dict = {"a": 1}
    for _ in range(match._GENERATED_SEGMENTS):
        nested_event = {"a": nested_event}
    compiled = compile_pattern({deep: [1], "b": ["x"]})  # generated, the long path's closure inline
    assert compiled.matches({**nested_event, "b": "x"})
    assert not compiled.matches({**nested_event, "b": "y"})
    assert not compiled.matches({"a": {"a": 1}, "b": "x"})
    many = {f"f{i}": [i] for i in range(match._GENERATED_FIELDS + 1)}
    compiled = compile_pattern(many)
    assert compiled.matches.__name__ != "match"  # closures throughout
    assert compiled.matches({f"f{i}": i for i in range(match._GENERATED_FIELDS + 1)})
    assert not compiled.matches({f"f{i}": 0 for i in range(match._GENERATED_FIELDS + 1)})


def test_a_pattern_s_text_never_reaches_the_generated_source():
    """Keys and values that would be code if spliced into source are matched as data; one
    shape is compiled once whatever its values."""
    hostile = '"]) or exec("import os; os_system(1)") or ([""'  # no dot: one segment
    before = match._factory.cache_info()
    one = compile_pattern({hostile: [hostile], "x": {hostile: [{"prefix": hostile}]}})
    two = compile_pattern({"k": ["v"], "x": {"y": [{"prefix": "p"}]}})
    after = match._factory.cache_info()
    assert after.misses - before.misses <= 1  # one source for both
    assert one.matches({hostile: hostile, "x": {hostile: hostile + "!"}})
    assert not one.matches({hostile: "v", "x": {hostile: hostile}})
    assert two.matches({"k": "v", "x": {"y": "pq"}})
