"""The catalog: buses, rules, targets, runners, workers, connections and API destinations
(docs/ARCHITECTURE.md, "Catalog").

One implementation for the CLI, the EventBridge API and the dashboard
(/work/coord/catalog-contract.md is the agreed shape). Every function takes an open psycopg2
connection, does its work in one transaction and raises ``CatalogError`` (one line) for
refused input: ``NotFoundError`` or ``ConflictError`` when that is what it is.
"""

from eventpush.catalog.buses import (
    ACCOUNT_RE,
    MAX_QUEUES,
    REGION_RE,
    BusInfo,
    create_bus,
    delete_bus,
    get_bus,
    list_buses,
    update_bus_retention,
)
from eventpush.catalog.common import (
    CATALOG_CHANNEL,
    NAME_RE,
    CatalogError,
    ConflictError,
    NotFoundError,
    check_name,
    runner_name,
)
from eventpush.catalog.connections import (
    ConnectionInfo,
    create_connection,
    delete_connection,
    get_connection,
    list_connections,
    update_connection,
)
from eventpush.catalog.destinations import (
    METHODS,
    DestinationInfo,
    create_destination,
    delete_destination,
    get_destination,
    list_destinations,
    update_destination,
)
from eventpush.catalog.rules import (
    RuleInfo,
    create_rule,
    delete_rule,
    get_rule,
    list_rules,
    rule_names_by_target_url,
    set_rule_enabled,
    update_rule,
)
from eventpush.catalog.targets import (
    TRANSFORM_KINDS,
    TargetInfo,
    TargetSpec,
    check_secret,
    check_target,
    create_target,
    delete_target,
    get_target,
    list_targets,
    update_target,
)
from eventpush.catalog.workers import (
    WorkerInfo,
    assign,
    create_worker,
    delete_worker,
    list_workers,
    set_worker_enabled,
)
from eventpush.policy import DEFAULTS, LIMITS

__all__ = [
    "ACCOUNT_RE",
    "CATALOG_CHANNEL",
    "DEFAULTS",
    "LIMITS",
    "METHODS",
    "MAX_QUEUES",
    "NAME_RE",
    "REGION_RE",
    "TRANSFORM_KINDS",
    "BusInfo",
    "CatalogError",
    "ConflictError",
    "ConnectionInfo",
    "DestinationInfo",
    "NotFoundError",
    "RuleInfo",
    "TargetInfo",
    "TargetSpec",
    "WorkerInfo",
    "assign",
    "check_name",
    "check_secret",
    "check_target",
    "create_bus",
    "create_connection",
    "create_destination",
    "create_rule",
    "create_target",
    "create_worker",
    "delete_bus",
    "delete_connection",
    "delete_destination",
    "delete_rule",
    "delete_target",
    "delete_worker",
    "get_bus",
    "get_connection",
    "get_destination",
    "get_rule",
    "get_target",
    "list_buses",
    "list_connections",
    "list_destinations",
    "update_bus_retention",
    "list_rules",
    "list_targets",
    "list_workers",
    "rule_names_by_target_url",
    "runner_name",
    "set_rule_enabled",
    "set_worker_enabled",
    "update_connection",
    "update_destination",
    "update_rule",
    "update_target",
]
