#!/usr/bin/env bash
# Start Airflow locally (standalone: API server + UI, scheduler, DAG processor, triggerer) with
# the eventpush DAGs and plugin from this checkout, ready to run every DAG.
#
#   EVENTPUSH_DATABASE_URL=postgresql://... scripts/airflow-standalone.sh
#
# AIRFLOW_HOME is var/airflow in the repository (git-ignored; EVENTPUSH_AIRFLOW_HOME moves it);
# its metadata database is SQLite there. The eventpush database reaches Airflow as the
# connection `eventpush_db` (AIRFLOW_CONN_EVENTPUSH_DB), set from EVENTPUSH_DATABASE_URL.
# The Spark jobs run on the connection `spark_default`: local mode unless
# AIRFLOW_CONN_SPARK_DEFAULT is already set or EVENTPUSH_SPARK_MASTER names a master
# (spark://HOST:7077 when a cluster runs). Port: EVENTPUSH_AIRFLOW_PORT (default 8080).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EVENTPUSH_VENV:-$repo/.venv}"
port="${EVENTPUSH_AIRFLOW_PORT:-8080}"
base="http://127.0.0.1:$port"

if [[ -z "${EVENTPUSH_DATABASE_URL:-}" ]]; then
  echo "EVENTPUSH_DATABASE_URL is not set: give it the eventpush PostgreSQL URL" >&2
  exit 2
fi
if [[ ! -x "$venv/bin/airflow" ]]; then
  echo "no airflow in $venv: run the setup script first" >&2
  exit 2
fi

export AIRFLOW_HOME="${EVENTPUSH_AIRFLOW_HOME:-$repo/var/airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$repo/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$repo/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__LAZY_LOAD_PLUGINS=False
export AIRFLOW__API__PORT="$port"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="$base/execution/"
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL:-30}"
export AIRFLOW_CONN_EVENTPUSH_DB="$EVENTPUSH_DATABASE_URL"
# The LocalExecutor forks one worker process per slot up front (32 by default): a laptop's
# worth is plenty for one person's DAGs and keeps the memory for Spark.
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-8}"
# Standalone starts the scheduler beside the API server, and on a busy machine the API server
# answers last: tasks queued by the first scheduled runs must wait for it, not fail after the
# default five quick retries.
export AIRFLOW__WORKERS__EXECUTION_API_RETRIES="${AIRFLOW__WORKERS__EXECUTION_API_RETRIES:-60}"
export AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX="${AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX:-5}"
# The provider reads a missing spark_default as YARN; the jobs refuse that, so always set it.
spark_master="${EVENTPUSH_SPARK_MASTER:-local[*]}"
if [[ -z "${AIRFLOW_CONN_SPARK_DEFAULT:-}" ]]; then
  export AIRFLOW_CONN_SPARK_DEFAULT="{\"conn_type\": \"spark\", \"host\": \"$spark_master\"}"
fi
# This checkout's package first, so the DAGs and the plugin run the code beside them.
export PYTHONPATH="$repo/include${PYTHONPATH:+:$PYTHONPATH}"
export GX_ANALYTICS_ENABLED="${GX_ANALYTICS_ENABLED:-False}"
export PATH="$venv/bin:$PATH"
mkdir -p "$AIRFLOW_HOME"

first_start=no
[[ -e "$AIRFLOW_HOME/airflow.db" ]] || first_start=yes
passwords="$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated"
redacted="$(python -c 'import os; from eventpush.config import redact_url; print(redact_url(os.environ["EVENTPUSH_DATABASE_URL"]))')"
spark_shown="$(python -c 'from eventpush.sparkjobs.session import airflow_master; print(airflow_master())')"

cat <<EOF
eventpush: starting Airflow standalone
  AIRFLOW_HOME   $AIRFLOW_HOME
  DAGs           $AIRFLOW__CORE__DAGS_FOLDER
  plugins        $AIRFLOW__CORE__PLUGINS_FOLDER
  eventpush_db   $redacted
  spark_default  $spark_shown
EOF
if [[ $first_start == yes ]]; then
  echo "  first start: Airflow creates its metadata database first (a minute or two)"
fi

# Say what runs where once the API server answers (standalone's own output is long).
(
  for _ in $(seq 1 300); do
    if curl -fsS -o /dev/null "$base/api/v2/monitor/health" 2>/dev/null; then
      cat <<EOF

==========================================================================================
 eventpush on Airflow standalone (stop with Ctrl-C)

 Airflow UI           $base/
 eventpush dashboard  $base/plugin/eventpush  (nav: Browse > Event push)
 eventpush API        $base/eventpush/api/status
 Log in as "admin"; the generated password is in
   $passwords

 Running on this machine: API server + UI, scheduler, DAG processor and triggerer;
 tasks run in local processes (LocalExecutor). Metadata: SQLite in AIRFLOW_HOME.
 Spark jobs (spark_default): $spark_shown
 eventpush database (eventpush_db): $redacted

 The DAGs are active from their first parse:
   eventpush_push       always on: pushes events to targets, one run after another
   eventpush_push_checks  after each push slice: Great Expectations checks, off the push path
   eventpush_audit      hourly: audits the past hour; Trigger for any window
   eventpush_rebalance  every 10 minutes: balances runners over push workers
   eventpush_retention  daily at 00:05: makes days ahead, drops days past each bus's retention
   eventpush_replay_gaps  on the audit's gaps: replays them when the Variable eventpush_replay_gaps is true
   eventpush_replay     on demand only: Trigger in the UI, or through the REST API:
     TOKEN=\$(curl -s -X POST $base/auth/token -H 'Content-Type: application/json' \\
       -d '{"username": "admin", "password": "..."}' | python -c 'import json,sys; print(json.load(sys.stdin)["access_token"])')
     curl -X POST $base/api/v2/dags/eventpush_replay/dagRuns \\
       -H "Authorization: Bearer \$TOKEN" -H 'Content-Type: application/json' \\
       -d '{"logical_date": null, "conf": {"what": "failed", "target": "crm", "dry_run": true}}'
   Each DAG's docs (the book icon on its page) list its fields and an example conf.
==========================================================================================
EOF
      exit 0
    fi
    sleep 1
  done
  echo "eventpush: the API server did not answer on port $port within 5 minutes" >&2
) &

exec airflow standalone
