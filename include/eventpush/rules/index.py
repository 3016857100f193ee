"""The rule index: many rules, one event (``RuleIndex``). Each rule's parsed conditions
(``rules.parse``) are filed in per-field tables (hash tables, affix tables, interval tables),
so the cost of ``matching`` follows the conditions the event meets and the rules it matches,
not the number of rules; ``rules.match`` supplies the leaf access and the full evaluation of
the rules too large to file.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from eventpush.rules.match import (
    _MISSING,
    CompiledPattern,
    EventTest,
    _compile_conjunction,
    _leaf_getter,
    _value_predicate,
)
from eventpush.rules.parse import (
    _ABOVE_ALL,
    _BELOW_ALL,
    _Conjunction,
    _FieldSpec,
    _ip_number,
    _parse_pattern,
    _wildcard_predicate,
)


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
        "plain",
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
        # Only exact values filed (strings, numbers, booleans, null): a scalar leaf needs one
        # probe of the exact table, whatever its type.
        self.plain = True

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
            self._replain()
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
        self._replain()

    def _replain(self) -> None:
        self.plain = (
            not (self.folded or self.affixes or self.wild_any or self.numeric or self.cidr)
            and not self.present
        )

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
        if self.plain and value.__class__ is not list:
            return self.exact.get(_index_key(value), ())
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
    paths: list = field(default_factory=list)  # every field path its pattern reads


def _paths_of(conj: _Conjunction, out: set | None = None) -> set:
    """The field paths a (sub-)pattern reads, its $or branches' included."""
    out = set() if out is None else out
    out.update(f.path for f in conj.fields)
    for group in conj.alternatives:
        for branch in group:
            _paths_of(branch, out)
    return out


# matching_each: a window's events are matched once per distinct combination of the values
# the rules read, while that pays: for indexes reading at most _MEMO_PATHS paths, as long as
# at least half of the first _MEMO_PROBE events of a call repeat an earlier combination.
_MEMO_PATHS = 8
_MEMO_PROBE = 32
_NO_KEY = object()


def _memo_part(value: Any) -> Any:
    """A leaf value as part of a memo key: strings as they are, other scalars with their type
    (1, 1.0 and true are equal in Python, not to every condition); _NO_KEY for lists."""
    cls = value.__class__
    if cls is str:
        return value
    if cls is list:
        return _NO_KEY
    return (cls, value)


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
        # Every path any rule reads (filed, residual or evaluated in full), with how many
        # rules read it: what a match depends on, for ``matching_each``'s memo.
        self._paths: dict[str, int] = {}
        self._key_getters: tuple | None = None
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
        rule.paths = sorted(_paths_of(conj))
        for path in rule.paths:
            self._paths[path] = self._paths.get(path, 0) + 1
        self._key_getters = None
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
        for path in rule.paths:
            self._paths[path] -= 1
            if not self._paths[path]:
                del self._paths[path]
        self._key_getters = None
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

    def matching_each(self, events: list) -> list[frozenset]:
        """``frozenset(self.matching(event))`` for each event: matched once per distinct
        combination of the values at the paths the rules read (every condition reads the
        event only through them), while enough events of the call repeat one."""
        key_getters = self._key_getters
        if key_getters is None:
            key_getters = self._key_getters = tuple(
                (path, self._getters.get(path) or _leaf_getter(tuple(path.split("."))))
                for path in sorted(self._paths)
            )
        matching = self.matching
        if not self._rules or len(key_getters) > _MEMO_PATHS:
            return [frozenset(matching(event)) for event in events]
        memo: dict = {}
        out = []
        hits = 0
        for i, event in enumerate(events):
            if i == _MEMO_PROBE and hits * 2 < i:  # mostly distinct: memo costs, not pays
                out.extend(frozenset(matching(e)) for e in events[i:])
                return out
            if event.__class__ is not dict:
                out.append(frozenset())
                continue
            values = {path: get(event) for path, get in key_getters}
            key = tuple(map(_memo_part, values.values()))
            if _NO_KEY in key:
                out.append(frozenset(self._walk(event, values)))
                continue
            try:
                found = memo[key]
                hits += 1
            except KeyError:
                found = memo[key] = frozenset(self._walk(event, values))
            except TypeError:  # an unhashable leaf (none from JSON; kept safe)
                found = frozenset(self._walk(event, values))
            out.append(found)
        return out

    def matching(self, event: dict) -> list[Hashable]:
        """The ids of the rules whose pattern matches ``event``, in the order they were added."""
        if event.__class__ is not dict:
            return []
        return self._walk(event, {})

    def _walk(self, event: dict, values: dict[str, Any]) -> list[Hashable]:
        """matching's walk; ``values``: leaves already read, by path."""
        found: dict[int, _Rule] = {}
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
