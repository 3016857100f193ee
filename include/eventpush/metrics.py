"""Prometheus metrics: what a push worker serves on ``/metrics``, and what the batch jobs
leave behind as a textfile or push to a Pushgateway.

Every worker has its own :class:`WorkerMetrics` (its own ``CollectorRegistry``, never the
global one: several engines may run in one process, as in the tests). Names follow the
Prometheus conventions: counters end in ``_total``, durations are ``_seconds``.

- ``eventpush_deliveries_total{runner, outcome}``: records committed as ``delivered`` or
  ``failed`` (the rows written to ``event_push_delivery`` / ``event_push_failure``);
- ``eventpush_retries_total{runner}``: requests that retried an earlier attempt;
- ``eventpush_attempt_duration_seconds{runner, outcome}`` (histogram): one HTTP attempt,
  outcome ``delivered``, ``retry`` or ``final``;
- ``eventpush_commit_duration_seconds`` (histogram): one fenced commit, retries included;
- ``eventpush_in_flight_records{runner}``: pulled by this worker and not yet finished;
- ``eventpush_waiting_records{runner}``: published and not yet pulled;
- ``eventpush_lag_events{runner}``: published and not yet committed;
- ``eventpush_lag_seconds{runner}``: age of the oldest event not yet committed (0: none);
- ``eventpush_breaker_open{runner}``: 1 while the target's circuit breaker is open;
- ``eventpush_event_loop_lag_seconds{worker}``: how late the event loop ran a 0.25 s timer;
- ``eventpush_sink_duplicates_total{runner, destination}``: records whose first send from
  the runner the destination already held under their key (a JetStream ``duplicate: true``):
  another writer uses the runner's keys. Anything but 0 deserves a look.

The runner series (gauges, counters, histograms) are those of the runners the worker holds
now; a runner that moves away or is deleted leaves them (one that comes back starts again
from 0, a counter reset). Lag, waiting and the loop lag are refreshed every heartbeat / sample; the
counters and histograms as things happen. The attempt figures (``eventpush_retries_total``,
``eventpush_attempt_duration_seconds``) are counted per request in plain lists on the event
loop and read at scrape time (:class:`AttemptStats`): a prometheus_client child takes a lock
and several calls per observation, a large share of the engine's own work per request.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import operator
import os
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample

from eventpush.config import ConfigError, redact_url
from eventpush.db import transaction
from eventpush.errors import first_line

log = logging.getLogger("eventpush.metrics")

DEFAULT_HOST = "127.0.0.1"  # a worker's metrics are nobody else's business unless widened
ATTEMPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

LAG_SQL = """
SELECT o.runner_id,
       coalesce(sum(q.next_offset - o."offset"), 0)::bigint,
       coalesce(sum(greatest(q.next_offset - greatest(o.pulled, o."offset"), 0)), 0)::bigint,
       coalesce(extract(epoch FROM now() - min(e.ctime)), 0)::float8
FROM event_push_offset o
JOIN event_target_runner r ON r.id = o.runner_id
JOIN event_target t ON t.id = r.target_id
JOIN event_rule ru ON ru.id = t.rule_id
JOIN event_bus_queue q ON q.bus_id = ru.bus_id AND q.queue_id = o.queue_id
LEFT JOIN bus_event e
  ON e.bus_id = ru.bus_id AND e.queue_id = o.queue_id AND e."offset" = o."offset"
WHERE o.runner_id = ANY(%s)
GROUP BY o.runner_id
"""


def read_lag(conn, runner_ids: list[int]) -> dict[int, tuple[int, int, float]]:
    """Per runner: (lag in events, waiting records, lag in seconds). The age is that of the
    first uncommitted event of each queue (a primary-key look-up), the oldest one counting."""

    if not runner_ids:
        return {}
    with transaction(conn) as cur:
        cur.execute(LAG_SQL, (list(runner_ids),))
        return {rid: (lag, waiting, max(age, 0.0)) for rid, lag, waiting, age in cur.fetchall()}


def metrics_port(port: int | None) -> int | None:
    """The port asked for (``--metrics-port``), else ``EVENTPUSH_METRICS_PORT``, else None."""
    if port is not None:
        return port
    value = os.environ.get("EVENTPUSH_METRICS_PORT", "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        # The environment is configuration (exit 3, as every other EVENTPUSH_* setting),
        # where a wrong --metrics-port is refused input (exit 2).
        raise ConfigError(f"EVENTPUSH_METRICS_PORT must be a port number, got {value!r}")
    return int(value)


def metrics_host() -> str:
    return os.environ.get("EVENTPUSH_METRICS_HOST", "").strip() or DEFAULT_HOST


class AttemptStats:
    """The attempt counters and histogram of one worker, kept as plain numbers: per runner
    and outcome one list of bucket counts (the last, past every bound, is +Inf) with the sum
    of the seconds appended; per runner the retries. The event loop only adds; the scrape
    (another thread) copies each list in one C call under the GIL and builds the cumulative
    buckets from the copy: the buckets and the count agree, nothing shown ever goes down,
    and at worst the sum misses the one observation being added at that instant."""

    HISTOGRAM = "eventpush_attempt_duration_seconds"
    RETRIES = "eventpush_retries"

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], list] = {}
        self.retries: dict[str, int] = {}
        self.created: dict[object, float] = {}  # series -> when first seen (the _created)
        self._bounds = [*(repr(float(b)) for b in ATTEMPT_BUCKETS), "+Inf"]

    def add(self, runner: str, outcome: str, seconds: float, retry: bool) -> None:
        counts = self.counts.get((runner, outcome))
        if counts is None:
            self.created[runner, outcome] = time.time()
            counts = self.counts[runner, outcome] = [0] * (len(ATTEMPT_BUCKETS) + 1) + [0.0]
        # bisect_left: the first bound >= seconds, Prometheus's "le"; past all: +Inf.
        counts[bisect.bisect_left(ATTEMPT_BUCKETS, seconds)] += 1
        counts[-1] += seconds
        if retry:
            n = self.retries.get(runner)
            if n is None:
                self.created[runner] = time.time()
                n = 0
            self.retries[runner] = n + 1

    def forget(self, runners: set[str]) -> None:
        """The series of runners no longer held here (a deleted runner's name never comes
        back; one that does starts again from 0, a counter reset Prometheus expects)."""
        for key in [k for k in self.counts if k[0] in runners]:
            del self.counts[key]
            self.created.pop(key, None)
        for runner in runners:
            if self.retries.pop(runner, None) is not None:
                self.created.pop(runner, None)

    def describe(self) -> list:
        return [
            HistogramMetricFamily(self.HISTOGRAM, HISTOGRAM_HELP, labels=["runner", "outcome"]),
            CounterMetricFamily(self.RETRIES, RETRIES_HELP, labels=["runner"]),
        ]

    def collect(self) -> list:
        histogram, retries = self.describe()
        created = self.created
        for (runner, outcome), live in list(self.counts.items()):
            when = created.get((runner, outcome))
            if when is None:  # forgotten since the copy (the runner left)
                continue
            counts = list(live)
            cumulative, total = [], 0
            for bound, n in zip(self._bounds, counts[:-1], strict=True):
                total += n
                cumulative.append((bound, total))
            histogram.add_metric([runner, outcome], cumulative, counts[-1])
            histogram.samples.append(
                Sample(
                    f"{self.HISTOGRAM}_created",
                    {"runner": runner, "outcome": outcome},
                    when,
                )
            )
        for runner, n in list(self.retries.items()):
            when = created.get(runner)
            if when is not None:
                retries.add_metric([runner], n, created=when)
        return [histogram, retries]


_runner_of = operator.attrgetter("runner")
HISTOGRAM_HELP = "Duration of one HTTP attempt to a target"
RETRIES_HELP = "Requests that retried an earlier attempt"


class WorkerMetrics:
    """One worker's metrics, in a registry of its own."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.registry = r = CollectorRegistry()
        self.deliveries = Counter(
            "eventpush_deliveries",
            "Records committed, by outcome (delivered or failed)",
            ["runner", "outcome"],
            registry=r,
        )
        self.attempts = AttemptStats()  # eventpush_retries, eventpush_attempt_duration_seconds
        r.register(self.attempts)
        self.commit_seconds = Histogram(
            "eventpush_commit_duration_seconds",
            "Duration of one fenced commit of outcomes and offsets",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "eventpush_in_flight_records",
            "Records pulled and not yet finished",
            ["runner"],
            registry=r,
        )
        self.waiting = Gauge(
            "eventpush_waiting_records",
            "Records published and not yet pulled",
            ["runner"],
            registry=r,
        )
        self.lag_events = Gauge(
            "eventpush_lag_events",
            "Records published and not yet committed",
            ["runner"],
            registry=r,
        )
        self.lag_seconds = Gauge(
            "eventpush_lag_seconds", "Age of the oldest uncommitted record", ["runner"], registry=r
        )
        self.breaker_open = Gauge(
            "eventpush_breaker_open",
            "1 while the target's circuit breaker is open",
            ["runner"],
            registry=r,
        )
        self.concurrency = Gauge(
            "eventpush_concurrency_limit",
            "Requests the runner may have in flight now (adapting with --concurrency auto)",
            ["runner"],
            registry=r,
        )
        self.rate_limit = Gauge(
            "eventpush_destination_rate_limit",
            "The destination's rate limit, invocations per second for all its targets",
            ["destination"],
            registry=r,
        )
        self.throttled = Counter(
            "eventpush_destination_throttled_seconds",
            "Seconds this worker's sends to the destination waited for its rate limit",
            ["destination"],
            registry=r,
        )
        self.rate_sent = Counter(
            "eventpush_destination_invocations",
            "Invocations this worker sent through the destination's rate limit",
            ["destination"],
            registry=r,
        )
        self.destinations_seen: dict[str, tuple[float, int]] = {}  # throttled_s, sent reported
        self.loop_lag = Gauge(
            "eventpush_event_loop_lag_seconds",
            "How late the worker's event loop ran a short timer",
            ["worker"],
            registry=r,
        )
        self.loop_lag.labels(worker)
        self.sink_duplicates = Counter(
            "eventpush_sink_duplicates",
            "Records whose first send the destination already held under their key",
            ["runner", "destination"],
            registry=r,
        )
        self.held: set[str] = set()  # runners whose gauges are set now
        # Runners with delivery counters, (runner, destination) with duplicate counters: their
        # series go when the runner is no longer held here (runner_state).
        self.counted: set[str] = set()
        self.duplicated: set[tuple[str, str]] = set()
        self.server = None
        self.thread = None

    # --- what the engine reports ----------------------------------------------------------

    def committed(self, deliveries: Iterable, failures: Iterable) -> None:
        """Rows that a commit wrote: the counters follow the tables exactly."""
        for outcome, rows in (("delivered", deliveries), ("failed", failures)):
            # Counted in C (a row per record committed, on the event loop).
            for runner, n in collections.Counter(map(_runner_of, rows)).items():
                self.deliveries.labels(runner, outcome).inc(n)
                self.counted.add(runner)

    def attempted(self, runner: str, outcome: str, seconds: float, retry: bool) -> None:
        """One request's outcome (this runs per request: see :class:`AttemptStats`)."""
        self.attempts.add(runner, outcome, seconds, retry)

    def already_held(self, runner: str, destination: str, n: int) -> None:
        """``n`` first sends ``destination`` already held (see ``Lanes.held_on_first_send``)."""
        self.sink_duplicates.labels(runner, destination).inc(n)
        self.duplicated.add((runner, destination))

    def runner_state(self, runners: dict[str, tuple]) -> None:
        """runner name -> (in-flight records, breaker open[, concurrency limit]), for the
        runners held now."""
        for name, (in_flight, breaker_open, *limit) in runners.items():
            self.in_flight.labels(name).set(in_flight)
            self.breaker_open.labels(name).set(1 if breaker_open else 0)
            if limit:
                self.concurrency.labels(name).set(limit[0])
        for gone in self.held - set(runners):
            for gauge in (
                self.in_flight,
                self.breaker_open,
                self.concurrency,
                self.waiting,
                self.lag_events,
                self.lag_seconds,
            ):
                with contextlib.suppress(KeyError):
                    gauge.remove(gone)
        self.held = set(runners)
        self._forget_counters(runners)

    def _forget_counters(self, runners: dict) -> None:
        """The counters and histograms of runners no longer held: a series per runner ever
        pushed here (and per destination it found duplicates at) stayed for the worker's
        life, and over weeks of targets created and deleted /metrics grew without bound.
        A runner that comes back starts again from 0 (a counter reset, as on a restart)."""
        gone = {r for r in self.counted if r not in runners}
        gone.update(r for r, _ in self.attempts.counts if r not in runners)
        gone.update(r for r in self.attempts.retries if r not in runners)
        if gone:
            for runner in gone:
                for outcome in ("delivered", "failed"):
                    with contextlib.suppress(KeyError):
                        self.deliveries.remove(runner, outcome)
            self.counted -= gone
            self.attempts.forget(gone)
        for key in [k for k in self.duplicated if k[0] not in runners]:
            self.duplicated.discard(key)
            with contextlib.suppress(KeyError):
                self.sink_duplicates.remove(*key)

    def destinations(self, figures: dict[str, dict]) -> None:
        """Destinations' rate limits as ``RateGates.figures`` gives them (cumulative figures:
        the counters move by what changed since the last call). A destination no longer
        limited here loses its limit gauge and its counters (kept, a series per destination
        ever limited here stayed for the worker's life: destinations are created and deleted
        for weeks); should it come back, they start again from 0 (a counter reset)."""
        for name in [n for n in self.destinations_seen if n not in figures]:
            del self.destinations_seen[name]
            self.rate_limit.remove(name)
            for counter in (self.throttled, self.rate_sent):
                with contextlib.suppress(KeyError):
                    counter.remove(name)
        for name, f in figures.items():
            throttled, sent = self.destinations_seen.get(name, (0.0, 0))
            self.rate_limit.labels(name).set(f["rate_limit"])
            if f["throttled_s"] > throttled:
                self.throttled.labels(name).inc(f["throttled_s"] - throttled)
            if f["sent"] > sent:
                self.rate_sent.labels(name).inc(f["sent"] - sent)
            self.destinations_seen[name] = (
                max(f["throttled_s"], throttled),
                max(f["sent"], sent),
            )

    def lag(self, runner: str, events: int, waiting: int, seconds: float) -> None:
        """Lag figures of a runner held now (read at the heartbeat)."""
        self.held.add(runner)
        self.lag_events.labels(runner).set(events)
        self.waiting.labels(runner).set(waiting)
        self.lag_seconds.labels(runner).set(seconds if events else 0.0)

    # --- serving --------------------------------------------------------------------------

    def serve(self, port: int, host: str | None = None) -> int:
        """Serve ``/metrics`` on host:port (port 0: any free one); returns the port."""
        # Deferred: prometheus_client is loaded only when metrics are served or pushed.
        from prometheus_client import start_http_server

        self.server, self.thread = start_http_server(
            port, addr=host or metrics_host(), registry=self.registry
        )
        return self.server.server_address[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


# --- batch jobs ---------------------------------------------------------------------------


def batch_registry(job: str, results: dict[str, list[tuple[dict[str, str], float]]]) -> object:
    """A registry of gauges for one batch job's results: ``{metric name: [(labels, value)]}``
    plus ``eventpush_batch_last_success_timestamp_seconds{job}``."""

    registry = CollectorRegistry()
    for name, samples in results.items():
        labels = sorted({k for lbls, _ in samples for k in lbls})
        gauge = Gauge(name, BATCH_HELP.get(name, name), labels, registry=registry)
        for lbls, value in samples:
            (gauge.labels(**lbls) if labels else gauge).set(value)
    done = Gauge(
        "eventpush_batch_last_success_timestamp_seconds",
        "When the batch job last finished",
        ["job"],
        registry=registry,
    )
    done.labels(job).set(time.time())
    return registry


BATCH_HELP = {
    "eventpush_audit_expected_records": "Records the last audit expected, per runner",
    "eventpush_audit_missing_records": "Records the last audit found neither delivered nor failed",
    "eventpush_audit_failed_records": "Records the last audit found failed, per runner",
    "eventpush_audit_absent_records": (
        "Records the last audit found delivered in the books but not at their destination"
    ),
    "eventpush_rebalance_spread": "Load spread over workers after the last rebalance (1 = even)",
    "eventpush_alert": "1 while an alert raised by an Airflow callback stands",
    "eventpush_replay_records": (
        "Records of the last replay, by stage (selected, delivered, failed)"
    ),
    "eventpush_rebalance_moves": "Runners the last rebalance moved (or would move)",
}


def publish_batch(job: str, results: dict[str, list[tuple[dict[str, str], float]]]) -> list[str]:
    """Write a batch job's results where the environment says: a node-exporter textfile in
    ``EVENTPUSH_METRICS_TEXTFILE_DIR`` (atomically: a temp file renamed over
    ``eventpush_<job>.prom``) and/or ``EVENTPUSH_PUSHGATEWAY_URL`` (grouped by job). Returns
    where it went; a failure to push is logged, never fails the job that did the work."""
    # Deferred: prometheus_client is loaded only when metrics are served or pushed.
    from prometheus_client import push_to_gateway, write_to_textfile

    registry = batch_registry(job, results)
    where = []
    directory = os.environ.get("EVENTPUSH_METRICS_TEXTFILE_DIR", "").strip()
    if directory:
        path = Path(directory) / f"eventpush_{job}.prom"
        try:
            # write_to_textfile writes a temp file beside the target and renames it over.
            write_to_textfile(str(path), registry)
            where.append(str(path))
        except OSError as exc:
            log.error("metrics textfile %s not written: %s", path, exc)
    gateway = os.environ.get("EVENTPUSH_PUSHGATEWAY_URL", "").strip()
    if gateway:
        try:
            push_to_gateway(gateway, job=f"eventpush_{job}", registry=registry, timeout=10)
            where.append(gateway)
        except Exception as exc:  # the job's result stands; the push is a report of it
            log.error("push to gateway %s failed: %s", redact_url(gateway), first_line(exc))
    return where


Results = dict[str, list[tuple[dict[str, str], float]]]


def audit_results(result) -> Results:
    """An audit's figures per runner (``sparkjobs.audit.AuditResult``), labelled by its id
    beside its name: a deleted target's runner and a live one re-created with the same names
    would otherwise be one series, the last written hiding the other."""
    out: Results = {}
    for key in ("expected", "missing", "failed", "absent"):
        out[f"eventpush_audit_{key}_records"] = [
            ({"runner": r.runner, "runner_id": _label(r.runner_id)}, getattr(r, key))
            for r in result.runners
        ]
    return out


def _label(value: object) -> str:
    """A label's value; None is the empty value, which Prometheus reads as no label."""
    return "" if value is None else str(value)


def replay_results(result) -> Results:
    """A replay's counts by stage (``sparkjobs.replay.ReplayResult``)."""
    stages = ("selected", "delivered", "failed", "skipped")
    return {"eventpush_replay_records": [({"stage": s}, getattr(result, s)) for s in stages]}


def rebalance_results(result, applied: bool) -> Results:
    """A rebalance's moves and spread (``sparkjobs.rebalance.RebalanceResult``)."""
    labels = {"applied": "true" if applied else "false"}
    return {
        "eventpush_rebalance_moves": [(labels, result.proposal.moves)],
        "eventpush_rebalance_spread": [(labels, result.proposal.spread)],
    }
