#!/usr/bin/env bash
# The whole suite as `./dev test` runs it with no arguments: three pytest processes side by
# side. Most tests spend their time waiting on processes of their own (workers, receivers,
# brokers, a JVM, Airflow's scheduler): one pytest process used about a third of a core, so
# lanes overlap those waits instead of adding them up.
# - side lane: the cluster tests and the standalone Airflow platform (a Spark standalone
#   cluster, Celery workers, a scheduler);
# - push lane: the batch DAGs' runs (Spark jobs) and the engine's longest modules (faults,
#   crashes, the push DAG, the CLI's day-two changes, audits, rate limits);
# - first lane: every other module, a new one included, its output shown as it runs.
# Each lane makes its own databases (its own run id). The other lanes' output follows the
# first's; the exit code is the first failing lane's.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"
SIDE=(tests/test_cluster.py tests/test_airflow_ui.py)
PUSH=(
  tests/test_dags_batch.py tests/test_push_dag.py tests/test_push_faults.py
  tests/test_cli_day_two.py tests/test_audit.py tests/test_nats_target.py
  tests/test_push_engine.py tests/test_rate_limits.py
)

cd "$ROOT"
side_log="$(mktemp -t eventpush-side-lane.XXXXXX)"
push_log="$(mktemp -t eventpush-push-lane.XXXXXX)"
pids=()
# A Ctrl-C or a CI timeout stops the other lanes too.
trap 'kill -- "${pids[@]}" 2>/dev/null; rm -f "$side_log" "$push_log"' EXIT INT TERM

"$PY" -m pytest -p no:cacheprovider "${SIDE[@]}" >"$side_log" 2>&1 &
side_pid=$!
pids+=("$side_pid")
"$PY" -m pytest -p no:cacheprovider "${PUSH[@]}" >"$push_log" 2>&1 &
push_pid=$!
pids+=("$push_pid")

ignore=()
for f in "${SIDE[@]}" "${PUSH[@]}"; do ignore+=(--ignore "$f"); done
"$PY" -m pytest "${ignore[@]}"
main_rc=$?

wait "$push_pid"
push_rc=$?
wait "$side_pid"
side_rc=$?
echo
echo "==== push lane: ${PUSH[*]} (ran beside the tests above) ===="
cat "$push_log"
echo
echo "==== side lane: ${SIDE[*]} (ran beside the tests above) ===="
cat "$side_log"
for rc in "$main_rc" "$push_rc" "$side_rc"; do
  if ((rc != 0)); then exit "$rc"; fi
done
exit 0
