"""eventpush: push events from buses to HTTP targets, matched by EventBridge patterns.

Modules, one job each:

- ``config``: where the database is.
- ``db``: connections and transactions on PostgreSQL.
- ``schema``: applying the versioned migrations (``migrations/``).
- ``catalog``: buses, rules, targets, runners and workers.
- ``targets``: target URL validation.
- ``publish``: parsing and appending events to a bus.
- ``status``: progress and lag per worker and runner.
- ``cli``: the ``eventpush`` command.
"""

__version__ = "0.1.0"
