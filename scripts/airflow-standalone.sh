#!/usr/bin/env bash
# Start Airflow locally (standalone: API server + UI, scheduler, DAG processor, triggerer) with
# the eventpush DAGs and plugin from this checkout.
#
#   EVENTPUSH_DATABASE_URL=postgresql://... scripts/airflow-standalone.sh
#
# AIRFLOW_HOME is var/airflow in the repository (git-ignored); its metadata database is SQLite
# there. The eventpush database reaches Airflow as the connection `eventpush_db`
# (AIRFLOW_CONN_EVENTPUSH_DB), set from EVENTPUSH_DATABASE_URL. Port: EVENTPUSH_AIRFLOW_PORT
# (default 8080).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EVENTPUSH_VENV:-$repo/.venv}"
port="${EVENTPUSH_AIRFLOW_PORT:-8080}"

if [[ -z "${EVENTPUSH_DATABASE_URL:-}" ]]; then
  echo "EVENTPUSH_DATABASE_URL is not set: give it the eventpush PostgreSQL URL" >&2
  exit 2
fi
if [[ ! -x "$venv/bin/airflow" ]]; then
  echo "no airflow in $venv: run the setup script first" >&2
  exit 2
fi

export AIRFLOW_HOME="$repo/var/airflow"
export AIRFLOW__CORE__DAGS_FOLDER="$repo/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$repo/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__LAZY_LOAD_PLUGINS=False
export AIRFLOW__API__PORT="$port"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$port/execution/"
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL:-30}"
export AIRFLOW_CONN_EVENTPUSH_DB="$EVENTPUSH_DATABASE_URL"
export PATH="$venv/bin:$PATH"
mkdir -p "$AIRFLOW_HOME"

passwords="$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated"
redacted="$(python -c 'import os, sys; from eventpush.config import redact_url; print(redact_url(os.environ["EVENTPUSH_DATABASE_URL"]))')"

cat <<EOF
eventpush: starting Airflow standalone
  AIRFLOW_HOME  $AIRFLOW_HOME
  DAGs          $AIRFLOW__CORE__DAGS_FOLDER
  plugins       $AIRFLOW__CORE__PLUGINS_FOLDER
  eventpush_db  $redacted
EOF

# Say where to go once the API server answers (standalone's own output is long).
(
  for _ in $(seq 1 180); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$port/api/v2/monitor/health" 2>/dev/null; then
      cat <<EOF

==========================================================================================
 Airflow UI:          http://127.0.0.1:$port/
 eventpush dashboard: http://127.0.0.1:$port/plugin/eventpush  (nav: Browse > Event push)
 eventpush API:       http://127.0.0.1:$port/eventpush/api/status
 Log in as "admin"; the generated password is in
   $passwords
 (standalone writes it on first start; stop with Ctrl-C)
==========================================================================================
EOF
      exit 0
    fi
    sleep 1
  done
  echo "eventpush: the API server did not answer on port $port within 3 minutes" >&2
) &

exec airflow standalone
