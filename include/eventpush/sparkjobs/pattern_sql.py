"""Rules evaluated in Spark: EventBridge patterns as Spark SQL, with a Python fallback.

(Placeholder header: the SQL compiler is added below the fallback.)
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=256)
def _compiled(pattern_json: str):
    from eventpush.patterns import compile_pattern

    return compile_pattern(pattern_json)


def python_matches(pattern_json: str, body: str) -> bool:
    """The Python engine's answer, as executors compute it (patterns cached per process)."""
    import json

    return _compiled(pattern_json).matches(json.loads(body))


def with_matching_runners(events, rules: list[tuple[int, int, str]], body: str = "body"):
    """``events`` plus ``runner_ids``: the ids of the rules (runner_id, bus_id, pattern JSON)
    that match each event of their bus."""
    import json

    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    frozen = tuple((int(rid), int(bus_id), str(p)) for rid, bus_id, p in rules)

    @F.udf(T.ArrayType(T.IntegerType()))
    def matching(bus_id: int, text: str) -> list[int]:
        event = json.loads(text)
        return [rid for rid, b, p in frozen if b == bus_id and _compiled(p).matches(event)]

    return events.withColumn("runner_ids", matching(F.col("bus_id"), F.col(body)))
