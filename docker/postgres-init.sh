#!/bin/bash
# Creates the eventpush role and database beside Airflow's own (first start only).
set -euo pipefail
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v pw="$EVENTPUSH_DB_PASSWORD" <<'SQL'
CREATE ROLE eventpush LOGIN PASSWORD :'pw';
CREATE DATABASE eventpush OWNER eventpush;
SQL
