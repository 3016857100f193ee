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
    ``.matching_each(events) -> list`` of frozensets answers a whole window at once, matching
    once per distinct combination of the values the rules read (the engine's reader uses it).

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

from eventpush.rules.index import MAX_ALTERNATIVES, RuleIndex
from eventpush.rules.match import CompiledPattern, compile_pattern
from eventpush.rules.parse import MAX_WILDCARDS, InvalidPatternError

__all__ = [
    "MAX_ALTERNATIVES",
    "MAX_WILDCARDS",
    "CompiledPattern",
    "InvalidPatternError",
    "RuleIndex",
    "compile_pattern",
]
