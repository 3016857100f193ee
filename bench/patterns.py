"""Rule-engine benchmark: pattern evaluations per second.

Two workloads, compile time excluded from both:

1. The conformance corpus (``tests/conformance/event-patterns``, or
   ``EVENTPUSH_CONFORMANCE_DIR``): every valid pattern matched against every event of the
   corpus, and each pattern against its own event.
2. 500 rules against one event: naively (every rule evaluated) and through ``RuleIndex``.

The figures are compared with the 58,000 evaluations/s that the best-known pure-Python
implementation reaches over the corpus on the reference machine (issue 3); the goal is 3x.

Run: ``.venv/bin/python bench/patterns.py`` (``--seconds`` sets the time per measurement).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import json5

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))

from eventpush.rules.patterns import InvalidPatternError, RuleIndex, compile_pattern  # noqa: E402

REFERENCE_EVALS_PER_SECOND = 58_000
GOAL_FACTOR = 3


def conformance_dir() -> Path:
    default = Path(__file__).resolve().parents[1] / "tests" / "conformance"
    return Path(os.environ.get("EVENTPUSH_CONFORMANCE_DIR", default / "event-patterns"))


def load_corpus() -> tuple[list, list, list]:
    """Compiled valid patterns, all events, and (pattern, own event) pairs."""
    folder = conformance_dir()
    files = sorted(folder.glob("*.json5"))
    if not files:
        raise SystemExit(f"no conformance cases in {folder}")
    patterns, events, pairs = [], [], []
    for path in files:
        case = json5.loads(path.read_text())
        events.append(case["Event"])
        try:
            compiled = compile_pattern(case["EventPattern"])
        except InvalidPatternError:
            continue
        patterns.append(compiled)
        pairs.append((compiled.matches, case["Event"]))
    return patterns, events, pairs


def measure(run: Callable[[], int], seconds: float) -> float:
    """Best rate (units per second) over repeated timed batches of ``run``."""
    run()  # warm up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        units = 0
        while time.perf_counter() - start < 0.2:
            units += run()
        rate = units / (time.perf_counter() - start)
        best = max(best, rate)
        if time.perf_counter() >= deadline:
            return best


def corpus_cross(patterns: list, events: list) -> Callable[[], int]:
    matchers = [p.matches for p in patterns]
    count = len(matchers) * len(events)

    def run() -> int:
        for event in events:
            for matches in matchers:
                matches(event)
        return count

    return run


def corpus_pairs(pairs: list) -> Callable[[], int]:
    def run() -> int:
        for matches, event in pairs:
            matches(event)
        return len(pairs)

    return run


def five_hundred_rules(seed: int = 7) -> tuple[list, dict]:
    """500 varied rules over 50 sources, and an event that a handful of them match."""
    rng = random.Random(seed)
    states = ["pending", "running", "stopping", "stopped", "terminated"]
    rules = []
    for i in range(500):
        detail: dict = {}
        kind = i % 5
        if kind == 0:
            detail["state"] = [rng.choice(states)]
        elif kind == 1:
            detail["count"] = [{"numeric": [">", rng.randint(0, 50), "<=", rng.randint(51, 100)]}]
        elif kind == 2:
            detail["state"] = [{"anything-but": rng.sample(states, 2)}]
        elif kind == 3:
            detail["path"] = [{"wildcard": f"/srv/{rng.choice(['a', 'b', 'c'])}/*.json"}]
        else:
            detail["ip"] = [{"cidr": f"10.{rng.randint(0, 3)}.0.0/16"}]
        pattern: dict = {"detail": detail}
        if i % 10 != 9:  # one rule in ten has no source: it cannot be bucketed
            pattern["source"] = [f"app.service-{i % 50}"]
            pattern["detail-type"] = [{"prefix": "Order"}]
        else:
            pattern["detail-type"] = [f"Order {rng.choice(['Created', 'Paid', 'Shipped'])}"]
        rules.append((f"rule-{i}", pattern))
    event = {
        "version": "0",
        "id": "bench",
        "source": "app.service-7",
        "detail-type": "Order Created",
        "account": "123456789012",
        "time": "2024-05-01T12:00:00Z",
        "region": "eu-west-1",
        "resources": [],
        "detail": {
            "state": "running",
            "count": 60,
            "path": "/srv/b/orders/1.json",
            "ip": "10.2.3.4",
            "items": [{"sku": "x", "qty": 2}],
        },
    }
    return rules, event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    args = parser.parse_args()

    patterns, events, pairs = load_corpus()
    cross = measure(corpus_cross(patterns, events), args.seconds)
    own = measure(corpus_pairs(pairs), args.seconds)

    rules, event = five_hundred_rules()
    compiled = [(rule_id, compile_pattern(p)) for rule_id, p in rules]
    index = RuleIndex(compiled)
    naive_matchers = [(rule_id, c.matches) for rule_id, c in compiled]
    expected = [rule_id for rule_id, matches in naive_matchers if matches(event)]
    assert index.matching(event) == expected, "index and naive evaluation disagree"

    def naive() -> int:
        [rule_id for rule_id, matches in naive_matchers if matches(event)]
        return 1

    def indexed() -> int:
        index.matching(event)
        return 1

    naive_events = measure(naive, args.seconds)
    indexed_events = measure(indexed, args.seconds)

    goal = REFERENCE_EVALS_PER_SECOND * GOAL_FACTOR
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cpus")
    print(
        f"corpus: {len(patterns)} valid patterns x {len(events)} events "
        f"({len(patterns) * len(events)} evaluations a pass)"
    )
    print(
        f"  all events:      {cross:>12,.0f} evals/s  "
        f"{cross / REFERENCE_EVALS_PER_SECOND:5.1f}x reference (goal {goal:,} = {GOAL_FACTOR}x)"
    )
    print(
        f"  own event only:  {own:>12,.0f} evals/s  "
        f"{own / REFERENCE_EVALS_PER_SECOND:5.1f}x reference"
    )
    print(f"500 rules, one event ({len(expected)} match):")
    print(
        f"  naive:           {naive_events:>12,.0f} events/s  "
        f"= {naive_events * len(rules):,.0f} rule evals/s"
    )
    print(
        f"  RuleIndex:       {indexed_events:>12,.0f} events/s  "
        f"= {indexed_events * len(rules):,.0f} rule evals/s equivalent, "
        f"{indexed_events / naive_events:.1f}x naive"
    )
    print(f"goal met: {'yes' if cross >= goal else 'NO'}")


if __name__ == "__main__":
    main()
