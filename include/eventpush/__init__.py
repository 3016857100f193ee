"""eventpush: push events from buses (PostgreSQL, NATS JetStream, plug-ins) to targets (HTTP,
NATS, plug-ins), matched by EventBridge patterns, run by Airflow.

Layers, top to bottom (docs/ARCHITECTURE.md, "Code map"; checked by tests/test_layers.py):

- ``cli``, ``demo``: the entry points;
- ``airflow``, ``sparkjobs``, ``quality``: the Airflow glue, the Spark jobs, their GX suites;
- ``push`` (the runtime), ``catalog``, ``publish``, ``status``, ``charts``;
- ``sinks``, ``sources``: their contracts, registries and built-in kinds;
- ``nats_client``, ``dbslot``: the connections they share;
- leaves: ``addresses`` (the address policy), ``policy`` (a target's defaults), ``tracing``,
  ``metrics``, ``schema``, ``backoff``, ``patterns``, ``rules``, ``db``, ``config``, ``errors``.
"""

__version__ = "0.1.0"
