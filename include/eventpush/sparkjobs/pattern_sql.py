"""Rules evaluated in Spark: EventBridge patterns as Spark SQL Column expressions.

A pattern compiles to one boolean Column over the event parsed as a VARIANT (types kept:
``"5"`` is a string, ``5`` a number, ``true`` a boolean, ``null`` a null). The semantics are
those of ``eventpush.rules.patterns`` (see its docstring): a field's leaves are collected along
every way of grouping its dotted path into keys (``a.b`` reads ``{"a": {"b": ..}}`` and
``{"a.b": ..}``), arrays met on the way or at the end are flattened, objects are not values;
the field matches if any leaf satisfies any matcher, ``exists`` tests presence, and absent
fields satisfy only ``exists: false``.

What SQL cannot say exactly goes to a Python UDF running the Python engine itself:
- whole patterns using ``cidr`` (no IP arithmetic in Spark SQL), or a field name a variant
  path cannot spell (quotes, backslashes, ``$``) - decided when compiling (``compile_pattern_sql``
  returns None);
- events holding arrays directly inside arrays (which the Python engine flattens at any
  depth) - decided per row by a cheap test on the raw JSON text (``NESTED_ARRAYS``), which may
  send a few extra rows to the UDF but never keeps one from it.

Values from patterns enter expressions only as literals (``F.lit``), never as SQL text.
``tests/test_pattern_sql.py`` proves equality with the Python engine on the conformance corpus.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

from eventpush.rules.patterns import RuleIndex, compile_pattern

# An array whose element is an array: "[ [" or ", [" outside strings (inside strings it only
# makes us take the safe, slower path).
NESTED_ARRAYS = r"[\[,]\s*\["
_NUMBER_TYPES = ("TINYINT", "SMALLINT", "INT", "BIGINT", "FLOAT", "DOUBLE")
_MAX_EXACT_INT = 2**53  # beyond this, doubles cannot tell integers apart
_PATH_UNSAFE = set("\"'\\$[]")


class NotExpressible(Exception):
    """This pattern needs the Python engine."""


# --------------------------------------------------------------------------- leaves


def _variant_leaves(ev, segments: tuple[str, ...]):
    """array<struct<k, s, d, b>> of the leaves at a dotted path: k is the JSON kind
    ('s' string, 'd' number, 'b' boolean, 'n' null), s/d/b the value as that kind."""
    from pyspark.sql import functions as F

    groupings = _groupings(segments)
    per_grouping = []
    for keys in groupings:
        level = None
        for key in keys:
            if _PATH_UNSAFE & set(key):
                raise NotExpressible(f"field name {key!r}")
            if level is None:  # the event itself is an object: one direct lookup
                level = F.array(F.try_variant_get(ev, f'$["{key}"]', "variant"))
            else:
                level = F.transform(_unnest(level), _getter(f'$["{key}"]'))
            level = F.filter(level, lambda y: y.isNotNull())
        per_grouping.append(_unnest(level))
    leaves = per_grouping[0] if len(per_grouping) == 1 else F.concat(*per_grouping)
    # The schema once per leaf, then the kind and the values from it.
    with_schema = F.transform(
        leaves, lambda x: F.struct(F.schema_of_variant(x).alias("t"), x.alias("v"))
    )
    typed = F.transform(
        with_schema,
        lambda x: F.struct(
            _kind(x["t"]).alias("k"),
            F.try_variant_get(x["v"], "$", "string").alias("s"),
            F.try_variant_get(x["v"], "$", "double").alias("d"),
            F.try_variant_get(x["v"], "$", "boolean").alias("b"),
        ),
    )
    return F.filter(typed, lambda leaf: leaf["k"] != "o")


def _getter(path: str):
    """One-argument lambda for F.transform (a second argument would be the index)."""
    from pyspark.sql import functions as F

    return lambda x: F.try_variant_get(x, path, "variant")


def _groupings(segments: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every way to join consecutive segments into keys: a.b.c -> (a,b,c), (a.b,c), ..."""
    if len(segments) == 1:
        return [segments]
    out = []
    for i in range(1, len(segments) + 1):
        head = ".".join(segments[:i])
        if i == len(segments):
            out.append((head,))
        else:
            out.extend((head, *rest) for rest in _groupings(segments[i:]))
    return out


def _unnest(level):
    """Replace each array element by its elements (one level: deeper rows go to Python)."""
    from pyspark.sql import functions as F

    return F.flatten(
        F.transform(
            level,
            lambda x: F.when(
                F.schema_of_variant(x).startswith("ARRAY"),
                F.try_variant_get(x, "$", "array<variant>"),
            ).otherwise(F.array(x)),
        )
    )


def _kind(schema):
    from pyspark.sql import functions as F

    return (
        F.when(schema == "STRING", "s")
        .when(schema.isin(*_NUMBER_TYPES) | schema.startswith("DECIMAL"), "d")
        .when(schema == "BOOLEAN", "b")
        .when(schema == "VOID", "n")
        .otherwise("o")  # objects (and arrays too deep): not values
    )


# --------------------------------------------------------------------------- matchers


def _number(value) -> float:
    if isinstance(value, int) and abs(value) > _MAX_EXACT_INT:
        raise NotExpressible(f"integer {value} beyond double precision")
    return float(value)


def _wildcard(text: str):
    """A test on a string Column for an EventBridge wildcard value, linear in the string.

    Not a regex: Java's engine backtracks on ``^a.*a.*a.*b$`` (polynomial in the length of a
    run of ``a``), so one event could stall an executor. Instead, the Python engine's
    two-pointer glob: the string starts with the head, ends with the tail, and each middle
    literal is found at its leftmost place after the previous one (``position`` from a start,
    folded over the literals with ``aggregate``), the last ending before the tail."""
    from pyspark.sql import functions as F

    parts = _wildcard_parts(text)
    if len(parts) == 1:
        return lambda s: s == F.lit(parts[0])
    head, middle, tail = parts[0], parts[1:-1], parts[-1]
    size = sum(len(p) for p in parts)

    def test(s):
        out = (F.length(s) >= F.lit(size)) & s.startswith(F.lit(head)) & s.endswith(F.lit(tail))
        if not middle:
            return out
        # 1-based position just after the literals placed so far; 0 once one is missing.
        after = F.aggregate(
            F.array(*(F.lit(p) for p in middle)),
            F.lit(len(head) + 1),
            lambda at, part: F.when(
                at > 0,
                F.when(
                    F.position(part, s, at) > 0, F.position(part, s, at) + F.length(part)
                ).otherwise(0),
            ).otherwise(0),
        )
        return out & (after > 0) & (after <= F.length(s) - F.lit(len(tail) - 1))

    return test


def _wildcard_parts(text: str) -> list[str]:
    """The literal parts of a (validated) wildcard value; stars sit between them."""
    parts, current, i = [], [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            current.append(text[i + 1])
            i += 2
            continue
        if ch == "*":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return parts


def _leaf_matchers(values: list) -> tuple[list, bool, bool]:
    """(leaf predicates, exists_true, exists_false) for one match array."""
    from pyspark.sql import functions as F

    preds, exists_true, exists_false = [], False, False
    lit = F.lit

    def is_str(leaf):
        return leaf["k"] == "s"

    def is_num(leaf):
        return leaf["k"] == "d"

    for value in values:
        if isinstance(value, str):
            preds.append(lambda x, v=value: is_str(x) & (x["s"] == lit(v)))
        elif isinstance(value, bool):
            preds.append(lambda x, v=value: (x["k"] == "b") & (x["b"] == lit(v)))
        elif value is None:
            preds.append(lambda x: x["k"] == "n")
        elif isinstance(value, int | float):
            number = _number(value)
            preds.append(lambda x, v=number: is_num(x) & (x["d"] == lit(v)))
        else:
            ((op, arg),) = value.items()
            if op == "exists":
                exists_true |= arg is True
                exists_false |= arg is False
            elif op in ("prefix", "suffix"):
                method = "startswith" if op == "prefix" else "endswith"
                if isinstance(arg, dict):
                    low = arg["equals-ignore-case"].lower()
                    preds.append(
                        lambda x, m=method, s=low: is_str(x) & getattr(F.lower(x["s"]), m)(lit(s))
                    )
                else:
                    preds.append(lambda x, m=method, s=arg: is_str(x) & getattr(x["s"], m)(lit(s)))
            elif op == "equals-ignore-case":
                low = arg.lower()
                preds.append(lambda x, s=low: is_str(x) & (F.lower(x["s"]) == lit(s)))
            elif op == "wildcard":
                glob = _wildcard(arg)
                preds.append(lambda x, g=glob: is_str(x) & g(x["s"]))
            elif op == "numeric":
                preds.append(_numeric(arg, is_num))
            elif op == "anything-but":
                preds.append(_anything_but(arg, is_str, is_num))
            else:  # cidr
                raise NotExpressible(op)
    return preds, exists_true, exists_false


def _numeric(arg: list, is_num):
    from pyspark.sql import functions as F

    ops = {
        "=": lambda a, b: a == b,
        "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b,
    }
    pairs = [(ops[arg[i]], _number(arg[i + 1])) for i in range(0, len(arg), 2)]

    def pred(x):
        out = is_num(x)
        for op, n in pairs:
            out = out & op(x["d"], F.lit(n))
        return out

    return pred


def _anything_but(arg, is_str, is_num):
    from pyspark.sql import functions as F

    lit = F.lit
    if isinstance(arg, dict):
        ((inner, value),) = arg.items()
        items = value if isinstance(value, list) else [value]
        if inner == "prefix":
            hits = [lambda x, s=s: x["s"].startswith(lit(s)) for s in items]
        elif inner == "suffix":
            hits = [lambda x, s=s: x["s"].endswith(lit(s)) for s in items]
        elif inner == "equals-ignore-case":
            lowered = [s.lower() for s in items]
            hits = [lambda x, s=s: F.lower(x["s"]) == lit(s) for s in lowered]
        else:  # wildcard
            globs = [_wildcard(s) for s in items]
            hits = [lambda x, g=g: g(x["s"]) for g in globs]

        def not_string_hit(x):
            any_hit = hits[0](x)
            for h in hits[1:]:
                any_hit = any_hit | h(x)
            return ~is_str(x) | ~any_hit

        return not_string_hit
    values = arg if isinstance(arg, list) else [arg]
    strings = [v for v in values if isinstance(v, str)]
    numbers = [_number(v) for v in values if not isinstance(v, str)]

    def not_excluded(x):
        out = lit(True)
        if strings:
            out = out & ~(is_str(x) & x["s"].isin(*strings))
        if numbers:
            out = out & ~(is_num(x) & x["d"].isin(*numbers))
        return out

    return not_excluded


# --------------------------------------------------------------------------- patterns


def _field(ev, path: str, values: list, cache: dict):
    from pyspark.sql import functions as F

    preds, exists_true, exists_false = _leaf_matchers(values)
    if path not in cache:
        # Each path's leaves become a column of their own, computed once per row however
        # many rules and tests read them (rules share paths: source, detail-type, ...).
        cache[path] = (f"_leaves{len(cache)}", _variant_leaves(ev, tuple(path.split("."))))
    leaves = F.col(cache[path][0])
    present = F.size(leaves) > 0
    if exists_true:
        return present | F.lit(exists_false)
    if not preds:  # only exists:false
        return ~present

    def any_pred(x):
        out = preds[0](x)
        for p in preds[1:]:
            out = out | p(x)
        return out

    matched = F.exists(leaves, any_pred)
    return F.when(present, matched).otherwise(F.lit(exists_false))


def _object(ev, obj: dict, prefix: str, cache: dict):
    from pyspark.sql import functions as F

    terms = []
    for key, value in obj.items():
        if key == "$or":
            branches = [_object(ev, b, prefix, cache) for b in value]
            alt = branches[0]
            for b in branches[1:]:
                alt = alt | b
            terms.append(alt)
            continue
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            terms.append(_object(ev, value, path, cache))
        else:
            terms.append(_field(ev, path, value, cache))
    out = terms[0] if terms else F.lit(True)
    for t in terms[1:]:
        out = out & t
    return out


def compile_pattern_sql(pattern, ev, cache: dict | None = None):
    """A boolean Column for ``pattern`` over the VARIANT column ``ev``, or None when the
    pattern needs the Python engine. Invalid patterns raise InvalidPatternError.

    The Column reads one column per field path, which ``cache`` (path -> (column name,
    leaves expression)) tells the caller to add first: see ``with_matching_runners``."""
    compiled = compile_pattern(pattern)  # validation, with the engine's messages
    doc = json.loads(compiled.source_json)
    if _has_non_finite(doc):
        return None
    try:
        return _object(ev, doc, "", {} if cache is None else cache)
    except NotExpressible:
        return None


def _has_non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


# --------------------------------------------------------------------------- in a job


@lru_cache(maxsize=256)
def _compiled(pattern_json: str):
    return compile_pattern(pattern_json)


@lru_cache(maxsize=16)
def _indexes(rules: tuple[tuple[int, int, str], ...]) -> dict[int, RuleIndex]:
    """bus id -> the rule index of the rules on that bus: built once per executor process, so
    an event costs what its fields match, not how many rules there are."""
    by_bus: dict[int, list] = {}
    for rid, bus_id, pattern in rules:
        by_bus.setdefault(bus_id, []).append((rid, pattern))
    return {bus_id: RuleIndex(rs) for bus_id, rs in by_bus.items()}


def python_matches(pattern_json: str, body: str) -> bool:
    """The Python engine's answer, as executors compute it (patterns cached per process)."""
    return _compiled(pattern_json).matches(json.loads(body))


def with_matching_runners(
    events,
    rules: list[tuple[int, int, str]],
    body: str = "body",
    sql: bool = True,
    stats: dict | None = None,
):
    """``events`` plus ``runner_ids``: the ids of the rules (runner_id, bus_id, pattern JSON)
    that match each event of their bus. Rules run as Spark SQL where they compile, through
    the Python engine otherwise (see the module docstring); ``sql=False`` forces Python.
    ``stats``, when given, receives how many rules went each way."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    frozen = tuple((int(rid), int(bus_id), str(p)) for rid, bus_id, p in rules)
    ev = F.col("_ev")
    sql_rules, py_rules = [], []
    cache: dict = {}
    for rid, bus_id, pattern in frozen:
        column = compile_pattern_sql(pattern, ev, cache) if sql else None
        (py_rules if column is None else sql_rules).append((rid, bus_id, pattern, column))
    if stats is not None:
        stats.update(sql=len(sql_rules), python=len(py_rules))

    def python_udf(subset):
        chosen = tuple((rid, b, p) for rid, b, p, _ in subset)

        @F.udf(T.ArrayType(T.IntegerType()))
        def matching(bus_id: int, text: str) -> list[int]:
            index = _indexes(chosen).get(bus_id)
            return index.matching(json.loads(text)) if index is not None else []

        return matching(F.col("bus_id"), F.col(body))

    empty = F.array().cast("array<int>")
    if not sql_rules:
        return events.withColumn("runner_ids", python_udf(py_rules) if py_rules else empty)
    sql_ids = F.filter(
        F.array(
            *(
                F.when((F.col("bus_id") == F.lit(b)) & F.coalesce(c, F.lit(False)), F.lit(rid))
                for rid, b, _, c in sql_rules
            )
        ),
        lambda x: x.isNotNull(),
    )
    # A ``nested`` column computed at the source (jdbc.read_events) lets a pushed-down filter
    # split the rows; otherwise the same test runs here.
    nested = F.col("nested") if "nested" in events.columns else F.col(body).rlike(NESTED_ARRAYS)
    leaf_columns = [expr.alias(name) for name, expr in cache.values()]
    simple = (
        events.where(~nested)
        .withColumn("_ev", F.try_parse_json(F.col(body)))
        .select("*", *leaf_columns)
        .withColumn(
            "runner_ids",
            F.concat(sql_ids, python_udf(py_rules)) if py_rules else sql_ids,
        )
        .drop("_ev", *(name for name, _ in cache.values()))
    )
    all_rules = sql_rules + py_rules
    complex_rows = events.where(nested).withColumn("runner_ids", python_udf(all_rules))
    return simple.unionByName(complex_rows)
