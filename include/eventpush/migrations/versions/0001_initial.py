"""The initial eventpush schema.

Names and seed columns follow docs/ARCHITECTURE.md ("Tables"). Offsets are RocketMQ-style: a
runner's committed ``offset`` for a queue is the next offset it has not finished, so
``lag = max offset - committed`` where a queue's max offset is ``event_bus_queue.next_offset``.

Revision ID: 0001
Revises:
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NAME_CHECK = r"CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$')"

UPGRADE = f"""
CREATE TABLE event_bus (
    id          serial PRIMARY KEY,
    name        text NOT NULL UNIQUE {NAME_CHECK},
    queues      int NOT NULL CHECK (queues BETWEEN 1 AND 1024),
    description text NOT NULL DEFAULT '',
    ctime       timestamptz NOT NULL DEFAULT now()
);

-- One row per queue: the offset the next published event gets. Publishers lock the rows of
-- the queues they append to, so offsets stay contiguous under concurrent publishers.
CREATE TABLE event_bus_queue (
    bus_id      int NOT NULL REFERENCES event_bus (id) ON DELETE CASCADE,
    queue_id    int NOT NULL CHECK (queue_id >= 0),
    next_offset bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (bus_id, queue_id)
);

-- Partitioned by bus (`bus create` adds the partition); a large bus can later be
-- sub-partitioned by offset range without changing a query.
CREATE TABLE bus_event (
    bus_id      int NOT NULL REFERENCES event_bus (id) ON DELETE CASCADE,
    queue_id    int NOT NULL,
    "offset"    bigint NOT NULL,
    message_id  text NOT NULL,
    source      text NOT NULL,
    detail_type text NOT NULL,
    event_time  timestamptz NOT NULL,
    ctime       timestamptz NOT NULL DEFAULT now(),
    size_bytes  int NOT NULL,
    body        json NOT NULL,
    PRIMARY KEY (bus_id, queue_id, "offset")
) PARTITION BY LIST (bus_id);
CREATE INDEX bus_event_ctime ON bus_event (bus_id, ctime);

CREATE TABLE event_rule (
    id          serial PRIMARY KEY,
    bus_id      int NOT NULL REFERENCES event_bus (id) ON DELETE CASCADE,
    name        text NOT NULL {NAME_CHECK},
    pattern     json NOT NULL,
    state       text NOT NULL DEFAULT 'ENABLED' CHECK (state IN ('ENABLED', 'DISABLED')),
    description text NOT NULL DEFAULT '',
    ctime       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (bus_id, name)
);

CREATE TABLE event_target (
    id             serial PRIMARY KEY,
    rule_id        int NOT NULL REFERENCES event_rule (id) ON DELETE CASCADE,
    name           text NOT NULL {NAME_CHECK},
    url            text NOT NULL,
    secret         text,
    transform_kind text NOT NULL DEFAULT 'ORIGINAL'
                   CHECK (transform_kind IN ('ORIGINAL', 'CONSTANT', 'JSONPATH', 'TEMPLATE')),
    transform_spec json,
    max_attempts   int NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 185),
    backoff_ms     int NOT NULL DEFAULT 200 CHECK (backoff_ms BETWEEN 1 AND 3600000),
    max_age_s      int NOT NULL DEFAULT 3600 CHECK (max_age_s BETWEEN 1 AND 86400),
    timeout_ms     int NOT NULL DEFAULT 5000 CHECK (timeout_ms BETWEEN 1 AND 300000),
    batch_size     int NOT NULL DEFAULT 1 CHECK (batch_size BETWEEN 1 AND 1000),
    concurrency    int NOT NULL DEFAULT 16 CHECK (concurrency BETWEEN 1 AND 1024),
    ordered        boolean NOT NULL DEFAULT false,
    ctime          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (rule_id, name)
);

CREATE TABLE event_push_worker (
    id           serial PRIMARY KEY,
    name         text NOT NULL UNIQUE {NAME_CHECK},
    capacity     int NOT NULL DEFAULT 100 CHECK (capacity BETWEEN 1 AND 1000000),
    enabled      boolean NOT NULL DEFAULT true,
    host         text,
    pid          int,
    started_at   timestamptz,
    heartbeat_at timestamptz,
    metrics      jsonb NOT NULL DEFAULT '{{}}',
    ctime        timestamptz NOT NULL DEFAULT now()
);

-- One row per rule-target pair: the unit of work and of assignment.
CREATE TABLE event_target_runner (
    id              serial PRIMARY KEY,
    target_id       int NOT NULL UNIQUE REFERENCES event_target (id) ON DELETE CASCADE,
    name            text NOT NULL UNIQUE,
    worker_id       int REFERENCES event_push_worker (id) ON DELETE SET NULL,
    state           text NOT NULL DEFAULT 'RUNNING' CHECK (state IN ('RUNNING', 'PAUSED')),
    generation      bigint NOT NULL DEFAULT 0,
    delivered_total bigint NOT NULL DEFAULT 0,
    failed_total    bigint NOT NULL DEFAULT 0,
    ctime           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX event_target_runner_worker ON event_target_runner (worker_id);

-- Seed columns: id, consumer_group (runner name), topic_name (bus), broker_name, queue_id,
-- offset (committed: the next offset not yet finished), message_id, ctime.
-- start_offset is where the runner began (the bus end when its target was created).
CREATE TABLE event_push_offset (
    id             bigserial PRIMARY KEY,
    runner_id      int NOT NULL REFERENCES event_target_runner (id) ON DELETE CASCADE,
    consumer_group text NOT NULL,
    topic_name     text NOT NULL,
    broker_name    text NOT NULL DEFAULT 'eventpush',
    queue_id       int NOT NULL,
    "offset"       bigint NOT NULL CHECK ("offset" >= 0),
    start_offset   bigint NOT NULL CHECK (start_offset >= 0),
    pulled         bigint NOT NULL CHECK (pulled >= 0),
    message_id     text,
    ctime          timestamptz NOT NULL DEFAULT now(),
    mtime          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (runner_id, queue_id),
    CHECK ("offset" >= start_offset)
);

CREATE TABLE event_replay_run (
    id          bigserial PRIMARY KEY,
    request     jsonb NOT NULL,
    what        text NOT NULL CHECK (what IN ('failed', 'missing', 'all')),
    dry_run     boolean NOT NULL DEFAULT false,
    status      text NOT NULL DEFAULT 'running'
                CHECK (status IN ('running', 'succeeded', 'failed')),
    selected    bigint NOT NULL DEFAULT 0,
    delivered   bigint NOT NULL DEFAULT 0,
    failed      bigint NOT NULL DEFAULT 0,
    error       text,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

-- Records that exhausted their retries or were refused for good; what replay re-pushes.
CREATE TABLE event_push_failure (
    id             bigserial PRIMARY KEY,
    runner_id      int NOT NULL REFERENCES event_target_runner (id) ON DELETE CASCADE,
    consumer_group text NOT NULL,
    topic_name     text NOT NULL,
    broker_name    text NOT NULL DEFAULT 'eventpush',
    queue_id       int NOT NULL,
    "offset"       bigint NOT NULL,
    message_id     text NOT NULL,
    ctime          timestamptz NOT NULL DEFAULT now(),
    attempts       int NOT NULL CHECK (attempts >= 0),
    http_status    int,
    last_error     text NOT NULL CHECK (last_error <> ''),
    status         text NOT NULL DEFAULT 'failed' CHECK (status IN ('failed', 'replayed', 'dead')),
    replay_id      bigint REFERENCES event_replay_run (id) ON DELETE SET NULL,
    mtime          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (runner_id, queue_id, "offset")
);
CREATE INDEX event_push_failure_open ON event_push_failure (runner_id) WHERE status = 'failed';

-- The delivery log: one row per record and runner that reached its target. No unique key on
-- purpose: at-least-once delivery may log a record twice, and the audit counts that.
-- runner_id carries no foreign key so the hot insert path stays cheap.
CREATE TABLE event_push_delivery (
    id             bigserial PRIMARY KEY,
    runner_id      int NOT NULL,
    consumer_group text NOT NULL,
    topic_name     text NOT NULL,
    broker_name    text NOT NULL DEFAULT 'eventpush',
    queue_id       int NOT NULL,
    "offset"       bigint NOT NULL,
    message_id     text NOT NULL,
    ctime          timestamptz NOT NULL DEFAULT now(),
    attempts       int NOT NULL CHECK (attempts >= 1),
    http_status    int NOT NULL CHECK (http_status BETWEEN 200 AND 299),
    latency_ms     real NOT NULL CHECK (latency_ms >= 0),
    origin         text NOT NULL DEFAULT 'live' CHECK (origin IN ('live', 'replay')),
    replay_id      bigint
);
CREATE INDEX event_push_delivery_position ON event_push_delivery (runner_id, queue_id, "offset");
CREATE INDEX event_push_delivery_ctime ON event_push_delivery USING brin (ctime);

CREATE TABLE event_audit_report (
    id           bigserial PRIMARY KEY,
    bus          text,
    window_start timestamptz,
    window_end   timestamptz,
    expected     bigint NOT NULL,
    delivered    bigint NOT NULL,
    failed       bigint NOT NULL,
    missing      bigint NOT NULL,
    pending      bigint NOT NULL,
    duplicates   bigint NOT NULL,
    runners      jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Time series for the dashboard and the rebalancer: one row per runner per metrics interval.
CREATE TABLE event_push_metric (
    id         bigserial PRIMARY KEY,
    ts         timestamptz NOT NULL DEFAULT now(),
    worker_id  int NOT NULL,
    runner_id  int NOT NULL,
    delivered  bigint NOT NULL,
    failed     bigint NOT NULL,
    lag        bigint NOT NULL,
    in_flight  bigint NOT NULL,
    waiting    bigint NOT NULL,
    p50_ms     real,
    p99_ms     real
);
CREATE INDEX event_push_metric_runner_ts ON event_push_metric (runner_id, ts);

-- Runtime knobs (pool sizes, lane limits, pause) that running workers pick up.
CREATE TABLE event_runtime_control (
    scope text NOT NULL CHECK (scope IN ('worker', 'runner')),
    name  text NOT NULL,
    key   text NOT NULL,
    value jsonb NOT NULL,
    mtime timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, name, key)
);

-- Each change of the runner-to-worker assignment gets a generation.
CREATE TABLE event_assignment (
    generation bigserial PRIMARY KEY,
    origin     text NOT NULL,
    moves      int NOT NULL,
    details    jsonb NOT NULL DEFAULT '{{}}',
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Great Expectations results, kept for the dashboard and the operator.
CREATE TABLE event_check_result (
    id         bigserial PRIMARY KEY,
    suite      text NOT NULL,
    run_label  text NOT NULL,
    success    boolean NOT NULL,
    statistics jsonb NOT NULL,
    failures   jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""

TABLES = [
    "event_check_result",
    "event_assignment",
    "event_runtime_control",
    "event_push_metric",
    "event_audit_report",
    "event_push_delivery",
    "event_push_failure",
    "event_replay_run",
    "event_push_offset",
    "event_target_runner",
    "event_push_worker",
    "event_target",
    "event_rule",
    "bus_event",
    "event_bus_queue",
    "event_bus",
]


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    for table in TABLES:
        op.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
