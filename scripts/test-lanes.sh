#!/usr/bin/env bash
# The whole suite as `./dev test` runs it with no arguments: two pytest processes side by
# side. The cluster tests, the standalone Airflow platform and the batch DAGs' runs (a Spark
# standalone cluster, Celery workers, a scheduler, a spark-submit JVM per job: minutes spent
# mostly waiting on their own processes), a real spark-submit's secrets and the NATS
# target's crash tests (the first lane ended ~5 min after the side lane on a slow host with
# them: 20.4 against 15.6 min) run in a lane of their own while every other
# module runs in the first, so their waits overlap instead of adding up. The side lane ends
# with the adaptive-concurrency tests, whose limits follow measured latencies: at the start
# of the first lane they met the cluster's start-up (JVMs, Airflow, Celery) and a limit
# failed to grow back in time. (Three lanes were tried: both cores stayed 95 % busy, the
# suite ended no sooner, and those tests failed under that load.) Each lane makes its own
# databases (its own run id). The side lane's output follows the first's; the exit code is
# the first failing lane's.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"
SIDE=(
  tests/test_cluster.py tests/test_airflow_ui.py tests/test_dags_batch.py
  tests/test_spark_secrets.py tests/test_nats_target.py tests/test_adaptive_concurrency.py
)

cd "$ROOT"
# Every temporary file of the run (pytest's, the Airflow test homes, multiprocessing's, the
# browser's) goes under one directory, removed at the end: a process a test stops or kills
# leaves its own behind (each run left a dozen in /tmp). A short name: socket paths are
# bounded.
run_tmp="$(mktemp -d /tmp/ept.XXXXXX)"
chmod 755 "$run_tmp"  # as /tmp lets it: the setup tests' initdb runs as the postgres user
export TMPDIR="$run_tmp"
side_log="$(mktemp -t eventpush-side-lane.XXXXXX)"
trap 'rm -rf "$run_tmp"' EXIT

# Each lane lists its slowest tests at the end: where CI's minutes go, in CI's own output.
"$PY" -m pytest -p no:cacheprovider --durations=15 "${SIDE[@]}" >"$side_log" 2>&1 &
side_pid=$!
# A Ctrl-C or a CI timeout stops the side lane too.
trap 'kill -- "$side_pid" 2>/dev/null; rm -rf "$run_tmp"' EXIT INT TERM

ignore=()
for f in "${SIDE[@]}"; do ignore+=(--ignore "$f"); done
"$PY" -m pytest --durations=25 "${ignore[@]}"
main_rc=$?

wait "$side_pid"
side_rc=$?
echo
echo "==== side lane: ${SIDE[*]} (ran beside the tests above) ===="
cat "$side_log"
if ((main_rc != 0)); then exit "$main_rc"; fi
exit "$side_rc"
