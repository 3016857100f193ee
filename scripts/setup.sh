# Sourced by ./dev. Sets up, idempotently: the venv, the Debian packages the command needs
# (the demo: Java and the JDBC driver; the tests: also curl, nats-server, chromium),
# PostgreSQL.
# Exports EVENTPUSH_DATABASE_URL (the demo database) and EVENTPUSH_ADMIN_URL (a URL on the
# same server with the right to create databases, which the tests use for their own).

VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
JDBC_JAR="/usr/share/java/postgresql.jar"
UV_VERSION="0.13.9"
PRIVATE_PG_DIR="$ROOT/var/postgres"
PRIVATE_PG_PORT="${EVENTPUSH_PRIVATE_PG_PORT:-54329}"

say() { printf '\033[1m==>\033[0m %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

apt_install() {
  # Debian packages, only when missing; a clear message when we cannot install them.
  if ! command -v apt-get >/dev/null; then
    die "need Debian packages $* but apt-get is not available: install them by hand"
  fi
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  say "installing Debian packages: $*"
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@"; } >/dev/null; then
    die "could not install Debian packages: $* (run as root or with passwordless sudo)"
  fi
}

setup_venv() {
  command -v "$PYTHON_BIN" >/dev/null || die "$PYTHON_BIN not found: eventpush needs Python 3.11"
  local stamp="$VENV/.eventpush-lock"
  local want  # the lock, the project, and how we install them (bytecode compiled)
  want="$( (cat requirements.lock pyproject.toml; echo compile-bytecode) | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  say "installing Python packages into .venv (from requirements.lock)"
  [ -x "$VENV/bin/python" ] || "$PYTHON_BIN" -m venv "$VENV"
  [ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION"
  # pyspark and pyspark-client share the pyspark/ folder; sync installs both at one version.
  # Every wheel is checked against the lock's hashes: a tampered or swapped file is refused.
  # Bytecode is compiled once, here: where PYTHONDONTWRITEBYTECODE is set (this machine's
  # shells set it) every new process would otherwise compile each module it imports, at
  # each start (`import airflow.sdk` 7.8 s against 2.5-3.2 s compiled; every Airflow task,
  # CLI call and worker starts a process).
  "$VENV/bin/uv" pip sync -q --require-hashes --compile-bytecode --python "$VENV/bin/python" \
    requirements.lock
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps -e .
  "$VENV/bin/python" - <<'PY' || die "pyspark's Python version does not match the Spark jars it ships"
import glob, os, pyspark
jars = glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "spark-core_*.jar"))
assert jars, "pyspark ships no jars: pyspark-client replaced pyspark"
jar_version = os.path.basename(jars[0]).rsplit("-", 1)[1].removesuffix(".jar")
assert jar_version == pyspark.__version__, (jar_version, pyspark.__version__)
PY
  echo "$want" > "$stamp"
}

missing_packages() {
  # The Debian packages that $1 needs and are not installed, one a line. demo: Java and the
  # JDBC driver for Spark. airflow (./dev airflow, ./dev cluster): curl for the launcher too.
  # test: also nats-server for the NATS bus tests (each starts its own, with JetStream, on a
  # free loopback port), chromium for the dashboard's browser test, wrk for bench/api.py.
  local purpose="$1" missing=()
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  [ -f "$JDBC_JAR" ] || missing+=(libpostgresql-jdbc-java)
  if [ "$purpose" != demo ]; then
    command -v curl >/dev/null || missing+=(curl)
  fi
  if [ "$purpose" = test ]; then
    command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
    command -v chromium >/dev/null || missing+=(chromium)
    command -v wrk >/dev/null || missing+=(wrk)  # bench/api.py replays a pre-signed request
  fi
  [ ${#missing[@]} -eq 0 ] || printf '%s\n' "${missing[@]}"
}

setup_system_packages() {
  # Only what $1 (demo, airflow or test) needs and is missing, in one apt run.
  local missing
  mapfile -t missing < <(missing_packages "$1")
  [ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
  export EVENTPUSH_JDBC_JAR="${EVENTPUSH_JDBC_JAR:-$JDBC_JAR}"
}

pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return; }
  done
  return 1
}

start_private_postgres() {
  # No server answers: run our own cluster under var/ (git-ignored), listening on 127.0.0.1
  # only and asking for a password (scram-sha-256) on every connection, the socket included:
  # a generated password, kept in var/postgres/password (mode 0600) and put in the URL.
  local bin
  bin="$(pg_bin)" || { apt_install postgresql; bin="$(pg_bin)"; }
  local as=()
  if [ "$(id -u)" -eq 0 ]; then
    # initdb refuses to run as root.
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    as=(runuser -u postgres --)
  fi
  local pwfile="$PRIVATE_PG_DIR/password" data="$PRIVATE_PG_DIR/data"
  mkdir -p "$PRIVATE_PG_DIR"
  chmod 700 "$PRIVATE_PG_DIR"
  if [ ! -s "$pwfile" ]; then
    (umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$pwfile")
  fi
  [ "$(id -u)" -ne 0 ] || chown -R postgres "$PRIVATE_PG_DIR"
  if [ ! -f "$data/PG_VERSION" ]; then
    say "creating a private PostgreSQL cluster in var/postgres"
    "${as[@]}" "$bin/initdb" -D "$data" -U postgres --auth=scram-sha-256 \
      --pwfile="$pwfile" >/dev/null || die "initdb failed in $data"
  fi
  if ! "$bin/pg_isready" -q -h 127.0.0.1 -p "$PRIVATE_PG_PORT"; then
    say "starting the private PostgreSQL on port $PRIVATE_PG_PORT"
    "${as[@]}" "$bin/pg_ctl" -D "$data" -l "$PRIVATE_PG_DIR/server.log" -w \
      -o "-p $PRIVATE_PG_PORT -k $PRIVATE_PG_DIR -c listen_addresses=127.0.0.1" start >/dev/null \
      || die "the private PostgreSQL did not start: see $PRIVATE_PG_DIR/server.log"
  fi
  if grep -Eq '^[[:space:]]*[^#[:space:]].*[[:space:]]trust[[:space:]]*$' "$data/pg_hba.conf"; then
    # A cluster from an older setup, open to every local user: give postgres the password
    # (psql reads it from the file, so it is never on a command line), then require it.
    say "turning off trust authentication on the private PostgreSQL"
    "${as[@]}" "$bin/psql" -q -X -h "$PRIVATE_PG_DIR" -p "$PRIVATE_PG_PORT" -U postgres \
      -d postgres -v ON_ERROR_STOP=1 >/dev/null <<SQL || die "could not set the password"
\\set pw \`cat '$pwfile'\`
ALTER ROLE postgres PASSWORD :'pw';
SQL
    sed -i -E 's/^([[:space:]]*[^#[:space:]].*[[:space:]])trust[[:space:]]*$/\1scram-sha-256/' \
      "$data/pg_hba.conf"
    "${as[@]}" "$bin/pg_ctl" -D "$data" reload >/dev/null
  fi
  echo "postgresql://postgres:$(cat "$pwfile")@127.0.0.1:$PRIVATE_PG_PORT"
}

setup_postgres() {
  if [ -n "${EVENTPUSH_DATABASE_URL:-}" ]; then
    export EVENTPUSH_ADMIN_URL="${EVENTPUSH_ADMIN_URL:-$EVENTPUSH_DATABASE_URL}"
    return
  fi
  local server
  if "$VENV/bin/python" -c "import psycopg2; psycopg2.connect('postgresql://postgres@127.0.0.1:5432/postgres', connect_timeout=3).close()" 2>/dev/null; then
    server="postgresql://postgres@127.0.0.1:5432"
  else
    server="$(start_private_postgres)"
  fi
  export EVENTPUSH_ADMIN_URL="${EVENTPUSH_ADMIN_URL:-$server/postgres}"
  export EVENTPUSH_DATABASE_URL="$server/eventpush"
  "$VENV/bin/python" - <<'PY'
import os, psycopg2
conn = psycopg2.connect(os.environ["EVENTPUSH_ADMIN_URL"])
conn.autocommit = True
with conn.cursor() as cur:
    cur.execute("SELECT 1 FROM pg_database WHERE datname = 'eventpush'")
    if cur.fetchone() is None:
        cur.execute("CREATE DATABASE eventpush")
conn.close()
PY
}

setup_secret_key() {
  # Target secrets are sealed with this key (eventpush.sealed): a file outside the database,
  # mode 0600 from its first byte, made once for the embedded default and kept.
  if [ -n "${EVENTPUSH_SECRET_KEY_FILE:-}" ]; then
    return
  fi
  local keyfile="$ROOT/var/secret.key"
  if [ ! -f "$keyfile" ]; then
    mkdir -p "$ROOT/var"
    say "making the secret key for stored secrets in var/secret.key (mode 0600)"
    PYTHONPATH="$ROOT/include" "$VENV/bin/python" -c \
      "import sys, pathlib; from eventpush.sealed import write_key_file; write_key_file(pathlib.Path(sys.argv[1]))" \
      "$keyfile" || die "could not make the secret key file"
  fi
  export EVENTPUSH_SECRET_KEY_FILE="$keyfile"
}

compile_own_code() {
  # Our own modules too (the editable install is not in site-packages), on every run: only
  # what changed since the last one is compiled. An edited module whose bytecode is stale
  # is compiled in memory as usual until the next run.
  "$VENV/bin/python" -m compileall -q -j0 "$ROOT/include" "$ROOT/dags" "$ROOT/plugins" \
    "$ROOT/spark_jobs" >/dev/null || say "some modules did not compile (the tests will say why)"
}

setup_spark_pyenv() {
  # The Python environment shipped to Spark executors on a cluster (spark.archives), packed
  # from requirements-executor.lock into var/spark-pyenv/ and kept while the lock is the same.
  # Only for a non-local EVENTPUSH_SPARK_MASTER: otherwise the first cluster submit (or
  # `./dev cluster up`) builds it, and `./dev test` and `./dev demo` never wait for it.
  case "${EVENTPUSH_SPARK_MASTER:-local}" in
    local*) return ;;
  esac
  say "packing the Spark executors' Python environment (once per lock file)"
  PYTHONPATH="$ROOT/include" "$VENV/bin/python" -m eventpush.sparkjobs.pyenv build >/dev/null \
    || die "could not pack the Spark executors' Python environment"
}

setup_all() {
  # $1: what it is for (demo, airflow or test: the default, everything).
  setup_venv
  compile_own_code
  setup_system_packages "${1:-test}"
  setup_postgres
  setup_secret_key
  setup_spark_pyenv
  export PATH="$VENV/bin:$PATH"
}
