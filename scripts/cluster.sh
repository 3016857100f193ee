#!/usr/bin/env bash
# The deployment docker-compose.yaml describes, as processes on this machine:
#
#   scripts/cluster.sh up [spark] | down [--purge] | status | prepare    (or ./dev cluster ...)
#
# (`up spark` starts the Spark part alone. `prepare` does the slow parts of a first `up` that
# need no port and start no service: the executors' packed Python environment and Airflow's
# migrated metadata database; `up` does them too, quickly once done.)
#
# - a Spark standalone master and two workers, from the installed pyspark's own spark-class,
#   bound to 127.0.0.1. The workers run with a PATH whose python3 is the machine's, not this
#   checkout's .venv: each job brings its Python environment along (spark.archives, built
#   from requirements-executor.lock by eventpush.sparkjobs.pyenv), as on a real cluster.
# - Airflow with the CeleryExecutor: API server, scheduler, DAG processor, triggerer and two
#   Celery workers; broker Redis (EVENTPUSH_CLUSTER_BROKER_URL, default
#   redis://127.0.0.1:6379/0), metadata in its own PostgreSQL database
#   (EVENTPUSH_CLUSTER_AIRFLOW_DB, default eventpush_airflow, on EVENTPUSH_ADMIN_URL's server).
#   spark_default points at the Spark master, eventpush_db at EVENTPUSH_DATABASE_URL.
#
# Ports are EVENTPUSH_CLUSTER_PORT_BASE (default 7070) plus: 0 the Airflow API server and UI,
# 1 the triggerer's log server, 2 and 3 the Celery workers' log servers, 7 the Spark master
# (so 7077 by default), 8 its web UI, 9 and 10 the Spark workers' web UIs. None of them is
# `./dev airflow`'s 8080.
# Each Spark application takes every free core by default; EVENTPUSH_CLUSTER_APP_CORES=N caps
# an application that does not say otherwise at N (spark.deploy.defaultCores), so that as many
# jobs run at once (the tests run two DAGs' jobs side by side).
# State lives in EVENTPUSH_CLUSTER_DIR (default var/cluster): logs/, pids/, airflow/
# (AIRFLOW_HOME), spark/ (the workers' directories). `down` stops every process (the whole
# process group of each) and removes pids/ and spark/; logs stay for reading. `down --purge`
# also drops the metadata database and the whole directory.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EVENTPUSH_VENV:-$repo/.venv}"
dir="${EVENTPUSH_CLUSTER_DIR:-$repo/var/cluster}"
base="${EVENTPUSH_CLUSTER_PORT_BASE:-7070}"
broker="${EVENTPUSH_CLUSTER_BROKER_URL:-redis://127.0.0.1:6379/0}"
queue="${EVENTPUSH_CLUSTER_QUEUE:-eventpush}"
airflow_db="${EVENTPUSH_CLUSTER_AIRFLOW_DB:-eventpush_airflow}"

api_port=$base
triggerer_log_port=$((base + 1))
spark_port=$((base + 7))
spark_ui_port=$((base + 8))
master_url="spark://127.0.0.1:$spark_port"
api_url="http://127.0.0.1:$api_port"
services=(spark-master spark-worker-1 spark-worker-2 api-server scheduler dag-processor
  triggerer celery-worker-1 celery-worker-2)

die() { printf 'cluster: %s\n' "$*" >&2; exit 1; }
say() { printf 'cluster: %s\n' "$*" >&2; }

pidfile() { echo "$dir/pids/$1.pid"; }
alive() { local f; f="$(pidfile "$1")"; [[ -s $f ]] && kill -0 "$(cat "$f")" 2>/dev/null; }

start() {
  # start NAME CMD...: in a session of its own (so `down` can stop its whole process group),
  # output to logs/NAME.log, pid to pids/NAME.pid.
  local name=$1
  shift
  if alive "$name"; then
    say "$name already runs (pid $(cat "$(pidfile "$name")"))"
    return
  fi
  setsid "$@" >"$dir/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$(pidfile "$name")"
}

wait_http() {
  # wait_http URL WHAT SECONDS [SERVICE]: until URL answers; a dead SERVICE fails at once.
  local url=$1 what=$2 seconds=$3 service=${4:-}
  for _ in $(seq 1 "$seconds"); do
    curl -fsS -o /dev/null "$url" 2>/dev/null && return 0
    if [[ -n $service ]] && ! alive "$service"; then
      die "$what stopped: see $dir/logs/$service.log"
    fi
    sleep 1
  done
  die "$what did not answer at $url within ${seconds}s: see $dir/logs/"
}

bare_path() {
  # PATH without this checkout's venv, so the Spark workers' python3 is the machine's.
  local out="" part
  IFS=: read -ra parts <<<"$PATH"
  for part in "${parts[@]}"; do
    [[ $part == "$venv/bin" || $part == "$repo/.venv/bin" ]] && continue
    out="${out:+$out:}$part"
  done
  echo "$out"
}

admin_url() {
  [[ -n ${EVENTPUSH_ADMIN_URL:-${EVENTPUSH_DATABASE_URL:-}} ]] ||
    die "EVENTPUSH_ADMIN_URL (or EVENTPUSH_DATABASE_URL) is not set: run through ./dev cluster"
  echo "${EVENTPUSH_ADMIN_URL:-$EVENTPUSH_DATABASE_URL}"
}

metadata_db() {
  # metadata_db create|drop|url: Airflow's own database on the eventpush server.
  ADMIN_URL="$(admin_url)" AIRFLOW_DB="$airflow_db" "$venv/bin/python" - "$1" <<'PY'
import os, sys
from urllib.parse import urlsplit, urlunsplit
import psycopg2
from psycopg2 import sql

admin, name = os.environ["ADMIN_URL"], os.environ["AIRFLOW_DB"]
parts = urlsplit(admin)
if sys.argv[1] == "url":
    print(urlunsplit(parts._replace(scheme="postgresql+psycopg2", path="/" + name)))
    sys.exit()
conn = psycopg2.connect(admin)
conn.autocommit = True
with conn.cursor() as cur:
    cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
    exists = cur.fetchone() is not None
    if sys.argv[1] == "create" and not exists:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        print("created")
    elif sys.argv[1] == "drop" and exists:
        cur.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
conn.close()
PY
}

airflow_env() {
  [[ -n ${EVENTPUSH_DATABASE_URL:-} ]] || die "EVENTPUSH_DATABASE_URL is not set: run through ./dev cluster"
  [[ -x $venv/bin/airflow ]] || die "no airflow in $venv: run the setup script first"
  local home="$dir/airflow" secrets="$dir/airflow/secrets.env"
  mkdir -p "$home"
  if [[ ! -s $secrets ]]; then
    # Every component must sign and check the same tokens: one secret for all, kept here.
    (umask 077 && "$venv/bin/python" - >"$secrets" <<'PY'
import secrets
from cryptography.fernet import Fernet
print(f"export AIRFLOW__API_AUTH__JWT_SECRET={secrets.token_urlsafe(64)}")
print(f"export AIRFLOW__API__SECRET_KEY={secrets.token_urlsafe(32)}")
print(f"export AIRFLOW__CORE__FERNET_KEY={Fernet.generate_key().decode()}")
PY
    )
  fi
  # shellcheck disable=SC1090
  source "$secrets"
  export AIRFLOW_HOME="$home"
  export AIRFLOW__CORE__EXECUTOR=CeleryExecutor
  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN
  AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="$(metadata_db url)"
  export AIRFLOW__CELERY__BROKER_URL="$broker"
  export AIRFLOW__CELERY__RESULT_BACKEND="db+$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
  # Every task goes to this cluster's queue: another cluster on the same Redis never takes it.
  export AIRFLOW__OPERATORS__DEFAULT_QUEUE="$queue"
  export AIRFLOW__CORE__DAGS_FOLDER="$repo/dags"
  export AIRFLOW__CORE__PLUGINS_FOLDER="$repo/plugins"
  export AIRFLOW__CORE__LOAD_EXAMPLES=False
  export AIRFLOW__CORE__LAZY_LOAD_PLUGINS=False
  export AIRFLOW__API__HOST=127.0.0.1
  export AIRFLOW__API__PORT="$api_port"
  export AIRFLOW__API__BASE_URL="$api_url"
  export AIRFLOW__API__WORKERS="${AIRFLOW__API__WORKERS:-1}"
  export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="$api_url/execution/"
  export AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT="$triggerer_log_port"
  export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL:-30}"
  # A task whose worker died (no heartbeat for this long) is failed, and retried if it may be.
  export AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="${AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT:-60}"
  export AIRFLOW__WORKERS__EXECUTION_API_RETRIES="${AIRFLOW__WORKERS__EXECUTION_API_RETRIES:-60}"
  export AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX="${AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX:-5}"
  export AIRFLOW_CONN_EVENTPUSH_DB="$EVENTPUSH_DATABASE_URL"
  export AIRFLOW_CONN_SPARK_DEFAULT="{\"conn_type\": \"spark\", \"host\": \"$master_url\"}"
  export PYTHONPATH="$repo/include${PYTHONPATH:+:$PYTHONPATH}"
  export GX_ANALYTICS_ENABLED="${GX_ANALYTICS_ENABLED:-False}"
  export PATH="$venv/bin:$PATH"
  unset EVENTPUSH_SPARK_MASTER  # spark_default says where the jobs go
}

spark_home() { "$venv/bin/python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))'; }

up() {
  mkdir -p "$dir/logs" "$dir/pids" "$dir/spark"
  local spark_home_dir bare python3_seen
  spark_home_dir="$(spark_home)"
  bare="$(bare_path)"
  python3_seen="$(PATH="$bare" command -v python3 || true)"
  [[ -n $python3_seen ]] || die "no python3 on PATH outside $venv: the Spark workers need one"
  case "$(readlink -f "$python3_seen")" in
    "$(readlink -f "$venv")"/*) die "python3 on the workers' PATH is the checkout's venv" ;;
  esac

  # Build the executors' environment now, not inside the first task (which has a timeout).
  build_pyenv

  say "starting Spark: master $master_url, two workers (python3: $python3_seen)"
  local spark_env=(env -u VIRTUAL_ENV -u PYTHONPATH -u PYSPARK_PYTHON -u PYSPARK_DRIVER_PYTHON
    PATH="$bare" SPARK_HOME="$spark_home_dir" SPARK_LOCAL_IP=127.0.0.1
    SPARK_LOG_DIR="$dir/logs" SPARK_NO_DAEMONIZE=1
    SPARK_MASTER_OPTS="${EVENTPUSH_CLUSTER_APP_CORES:+-Dspark.deploy.defaultCores=$EVENTPUSH_CLUSTER_APP_CORES}"
    SPARK_WORKER_OPTS="-Dspark.worker.cleanup.enabled=true -Dspark.worker.cleanup.interval=300 -Dspark.worker.cleanup.appDataTtl=900")
  start spark-master "${spark_env[@]}" "$spark_home_dir/bin/spark-class" \
    org.apache.spark.deploy.master.Master --host 127.0.0.1 --port "$spark_port" \
    --webui-port "$spark_ui_port"
  wait_http "http://127.0.0.1:$spark_ui_port/json/" "the Spark master" 120 spark-master
  local i
  for i in 1 2; do
    mkdir -p "$dir/spark/worker-$i"
    start "spark-worker-$i" "${spark_env[@]}" "$spark_home_dir/bin/spark-class" \
      org.apache.spark.deploy.worker.Worker --host 127.0.0.1 --cores 1 \
      --memory "${EVENTPUSH_CLUSTER_WORKER_MEMORY:-2g}" --work-dir "$dir/spark/worker-$i" \
      --webui-port $((base + 8 + i)) "$master_url"
  done

  if [[ ${1:-} == spark ]]; then  # Spark alone, e.g. for bench/audit.py --master
    wait_workers 2 120
    status || true
    return
  fi
  airflow_env
  migrate_metadata
  start api-server airflow api-server --host 127.0.0.1 --port "$api_port"
  start scheduler airflow scheduler
  start dag-processor airflow dag-processor
  start triggerer airflow triggerer
  for i in 1 2; do
    start "celery-worker-$i" env AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=$((base + 1 + i)) \
      airflow celery worker --queues "$queue" --concurrency "${EVENTPUSH_CLUSTER_CELERY_CONCURRENCY:-4}" \
      --celery-hostname "eventpush-$i@%h"
  done
  wait_http "$api_url/api/v2/monitor/health" "the Airflow API server" 300 api-server
  wait_workers 2 120
  status
}

build_pyenv() {
  say "packing the executors' Python environment (once per lock file)"
  PYTHONPATH="$repo/include" "$venv/bin/python" -m eventpush.sparkjobs.pyenv build >/dev/null
}

migrate_metadata() {
  # Skipped when this directory's stamp says the same database was migrated by the same
  # Airflow (by `prepare`, or an earlier `up`): even with nothing to do it costs half a minute.
  local stamp="$dir/airflow/.migrated" want created
  want="$airflow_db $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("apache-airflow"))')"
  created="$(metadata_db create)"
  if [[ -z $created && -s $stamp && $(cat "$stamp") == "$want" ]]; then
    say "Airflow metadata: database $airflow_db, already migrated"
    return
  fi
  say "Airflow metadata: database $airflow_db; migrating (a minute or two the first time)"
  airflow db migrate >>"$dir/logs/db-migrate.log" 2>&1 || die "airflow db migrate failed: see $dir/logs/db-migrate.log"
  echo "$want" >"$stamp"
}

prepare() {
  mkdir -p "$dir/logs"
  build_pyenv
  airflow_env
  migrate_metadata
}

wait_workers() {
  # wait_workers N SECONDS: until the Spark master lists N alive workers.
  local n=$1 seconds=$2
  for _ in $(seq 1 "$seconds"); do
    [[ $(spark_workers_alive) -ge $n ]] && return 0
    sleep 1
  done
  die "the Spark master has fewer than $n workers after ${seconds}s: see $dir/logs/"
}

spark_workers_alive() {
  curl -fsS "http://127.0.0.1:$spark_ui_port/json/" 2>/dev/null |
    "$venv/bin/python" -c 'import json, sys; print(sum(w["state"] == "ALIVE" for w in json.load(sys.stdin)["workers"]))' 2>/dev/null ||
    echo 0
}

status() {
  local name state any=0
  for name in "${services[@]}"; do
    if alive "$name"; then
      state="running (pid $(cat "$(pidfile "$name")"))"
      any=1
    else
      state="stopped"
    fi
    printf '  %-16s %s\n' "$name" "$state"
  done
  cat <<EOF
  Spark master     $master_url   (UI http://127.0.0.1:$spark_ui_port/, workers alive: $(spark_workers_alive))
  Airflow UI, API  $api_url/   (CeleryExecutor, queue $queue, broker $broker)
  Airflow login    see $dir/airflow/simple_auth_manager_passwords.json.generated
  logs             $dir/logs/
EOF
  [[ $any -eq 1 ]]
}

stop_one() {
  local name=$1 f pid
  f="$(pidfile "$name")"
  [[ -s $f ]] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  fi
}

strays() {
  local fd pid target
  for fd in /proc/[0-9]*/fd/*; do
    target="$(readlink "$fd" 2>/dev/null)" || continue
    [[ $target == "$dir"/* ]] || continue
    pid="${fd#/proc/}"
    pid="${pid%%/*}"
    [[ "$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" == airflow\ * ]] && echo "$pid"
  done | sort -u
}

down() {
  local name pid f _
  # Airflow first (its tasks may be submitting Spark jobs), then Spark, workers before master.
  for name in celery-worker-1 celery-worker-2 triggerer dag-processor scheduler api-server \
    spark-worker-1 spark-worker-2 spark-master; do
    stop_one "$name"
  done
  for _ in $(seq 1 30); do
    local left=0
    for f in "$dir"/pids/*.pid; do
      [[ -e $f ]] || continue
      pid="$(cat "$f")"
      # the group outlives its leader when children linger: check the group
      if kill -0 -- "-$pid" 2>/dev/null; then left=1; fi
    done
    [[ $left -eq 0 ]] && break
    sleep 1
  done
  for f in "$dir"/pids/*.pid; do
    [[ -e $f ]] || continue
    pid="$(cat "$f")"
    if kill -0 -- "-$pid" 2>/dev/null; then
      say "$(basename "$f" .pid) did not stop in 30s: SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  # A task that outlived its Celery worker (one killed mid-task, as the crash test does) runs
  # in a session of its own, out of every group above, and lingered for hours: anything
  # Airflow's that still holds a file under this cluster's directory is ours to stop.
  for pid in $(strays); do
    say "task process $pid outlived its worker: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$dir/spark"
  if [[ ${1:-} == --purge ]]; then
    metadata_db drop
    rm -rf "$dir"
    say "stopped; metadata database $airflow_db dropped and $dir removed"
  else
    say "stopped; logs kept in $dir/logs (down --purge removes them and the metadata database)"
  fi
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) shift; down "$@" ;;
  status) status ;;
  prepare) prepare ;;
  *) echo "usage: scripts/cluster.sh up [spark] | down [--purge] | status | prepare" >&2; exit 2 ;;
esac
