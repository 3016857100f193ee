"""Bad input and an unusable database, through the real ``eventpush`` command: one line on
stderr saying what and where, the documented exit code, no traceback, no secret, nothing
half-written."""

from __future__ import annotations

import json
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import pytest
from ports import free_port

PASSWORD = "sEcr3tpw-hunt"


def one_line(r, code: int, starts: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr[-800:])
    assert "Traceback" not in r.stderr, r.stderr[-800:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-800:]
    assert r.stderr.startswith(f"error: {starts}"), r.stderr[-800:]


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://eventpush:{PASSWORD}@[::1/eventpush",  # broken IPv6 literal
        f"postgresql://eventpush:{PASSWORD}@127.0.0.1:5432/eventpush?nosuchoption=1",
    ],
)
@pytest.mark.parametrize("args", [("status",), ("db", "migrate"), ("bus", "list")])
def test_a_malformed_database_url_is_one_redacted_line(cli, url, args):
    r = cli(*args, env={"EVENTPUSH_DATABASE_URL": url})
    one_line(r, 3, "EVENTPUSH_DATABASE_URL 'postgresql://***@")
    assert "not a usable PostgreSQL URL" in r.stderr
    assert PASSWORD not in r.stderr + r.stdout


def test_db_migrate_with_the_database_down_is_one_line(cli):
    port = free_port()  # nothing listens there
    url = f"postgresql://eventpush:{PASSWORD}@127.0.0.1:{port}/eventpush"
    r = cli("db", "migrate", env={"EVENTPUSH_DATABASE_URL": url})
    one_line(r, 3, f"cannot connect to postgresql://***@127.0.0.1:{port}/eventpush")
    assert PASSWORD not in r.stderr + r.stdout


def test_db_migrate_with_a_bad_port_is_one_line_exit_3(cli):
    url = f"postgresql://eventpush:{PASSWORD}@127.0.0.1:notaport/eventpush"
    r = cli("db", "migrate", env={"EVENTPUSH_DATABASE_URL": url})
    one_line(r, 3, "cannot connect to postgresql://***@127.0.0.1:notaport/eventpush")
    assert PASSWORD not in r.stderr + r.stdout


def _nested(levels: int, leaf: str = "[1]") -> str:
    """A JSON object ``levels`` objects deep around ``leaf``."""
    return '{"a":' * levels + leaf + "}" * levels


@pytest.fixture
def orders(cli, db_url):
    assert cli("bus", "create", "orders", "--queues", "1").returncode == 0
    r = cli("rule", "create", "--bus", "orders", "--name", "r", "--pattern", '{"source":["a"]}')
    assert r.returncode == 0, r.stderr
    return db_url


@pytest.mark.parametrize(
    "pattern",
    [
        _nested(300),  # compiled fine, then broke every `rule list` (asdict recursed)
        "[" * 100_000,  # past the JSON parser's own limit: a RecursionError traceback
    ],
)
def test_a_pattern_nested_too_deep_is_refused_and_nothing_is_written(cli, orders, conn, pattern):
    r = cli("rule", "create", "--bus", "orders", "--name", "deep", "--pattern", pattern)
    one_line(r, 2, "rule 'deep': pattern is nested more than 100 levels deep")
    r = cli("rule", "update", "--bus", "orders", "--name", "r", "--pattern", pattern)
    one_line(r, 2, "rule 'r': pattern is nested more than 100 levels deep")
    with conn.cursor() as cur:
        cur.execute("SELECT name, version FROM event_rule ORDER BY name")
        assert cur.fetchall() == [("r", 1)]
    assert cli("rule", "list").returncode == 0


def test_a_pattern_at_the_depth_limit_is_kept_and_listed(cli, orders):
    r = cli("rule", "create", "--bus", "orders", "--name", "deep", "--pattern", _nested(99))
    assert r.returncode == 0, r.stderr
    for args in (("rule", "list"), ("rule", "list", "--json")):
        r = cli(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize(
    "spec",
    [
        '{"value":' + "[" * 300 + "1" + "]" * 300 + "}",  # stored, then broke `target list`
        "[" * 100_000,  # past the JSON parser's own limit
    ],
)
def test_a_transform_spec_nested_too_deep_is_refused(cli, orders, conn, spec):
    base = ("--bus", "orders", "--rule", "r")
    r = cli(
        "target", "create", *base, "--name", "t", "--url", "http://127.0.0.1:9/x",
        "--transform", "constant", "--transform-spec", spec,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-500:]
    assert len(r.stderr.strip().splitlines()) == 1
    assert "--transform-spec is nested" in r.stderr
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_target")
        assert cur.fetchone() == (0,)
    r = cli("target", "create", *base, "--name", "t", "--url", "http://127.0.0.1:9/x")
    assert r.returncode == 0, r.stderr
    r = cli("target", "update", *base, "--name", "t", "--transform", "constant",
            "--transform-spec", spec)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-500:]
    assert "--transform-spec is nested" in r.stderr
    assert cli("target", "list").returncode == 0


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_worker_run_refuses_a_max_seconds_it_cannot_keep(cli, db_url, value):
    # nan: "elapsed >= nan" never held, so the worker ran forever (with --until-idle it
    # returned 0 here only because nothing was to do); -1 and 0 ran nothing, exit 0.
    assert cli("worker", "create", "w1").returncode == 0
    r = cli("worker", "run", "w1", "--until-idle", "--json", "--max-seconds", value)
    one_line(r, 2, "--max-seconds must be a finite number of seconds more than 0, got ")
    assert r.stdout == ""


UNREADABLE = "/proc/self/mem"  # exists, is a file, and reading it fails (EIO), even for root


@pytest.fixture
def not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"whsec_\xff\xfe")
    return str(path)


def test_a_secret_file_that_cannot_be_read_is_one_line_naming_it(cli, orders, conn, not_utf8):
    base = ("--bus", "orders", "--rule", "r", "--name", "t")
    create = ("target", "create", *base, "--url", "http://127.0.0.1:9/x")
    r = cli(*create, "--secret-file", UNREADABLE)
    one_line(r, 2, f"--secret-file {UNREADABLE}: ")
    r = cli(*create, "--secret-file", not_utf8)
    one_line(r, 2, f"--secret-file {not_utf8} is not UTF-8 text")
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_target")
        assert cur.fetchone() == (0,)
    assert cli(*create).returncode == 0
    r = cli("target", "update", *base, "--secret-file", not_utf8)
    one_line(r, 2, f"--secret-file {not_utf8} is not UTF-8 text")
    r = cli("target", "update", *base, "--secret-file", UNREADABLE)
    one_line(r, 2, f"--secret-file {UNREADABLE}: ")


def test_publish_of_a_file_that_cannot_be_read_is_one_line_and_stores_nothing(
    cli, orders, conn, tmp_path
):
    good = "".join(
        f'{{"source": "a", "detail-type": "x", "detail": {{"i": {i}}}}}\n' for i in range(3)
    )
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(good.encode() + b'{"source": "\xff"}\n')
    r = cli("publish", "--bus", "orders", str(mixed))
    one_line(r, 2, f"{mixed} is not UTF-8 text")
    r = cli("publish", "--bus", "orders", UNREADABLE)
    one_line(r, 2, f"{UNREADABLE}: ")
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM bus_event")
        assert cur.fetchone() == (0,)


def test_a_database_url_file_that_cannot_be_read_is_one_line_exit_3(cli, tmp_path):
    not_utf8 = tmp_path / "url"
    not_utf8.write_bytes(f"postgresql://u:{PASSWORD}@127.0.0.1:1/x\xff".encode("latin-1"))
    for path, why in ((UNREADABLE, "which cannot be read: "), (not_utf8, "which is not UTF-8")):
        r = cli("status", env={"EVENTPUSH_DATABASE_URL_FILE": str(path)})
        one_line(r, 3, f"EVENTPUSH_DATABASE_URL_FILE names {path}, {why}")
        assert PASSWORD not in r.stderr


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_replay_refuses_a_rate_limit_that_is_not_finite(cli, db_url, value):
    # Both passed "<= 0" and "< the minimum": Spark started, then recording the request
    # failed on PostgreSQL's JSON ('Token "NaN" is invalid'): a traceback, exit 1.
    r = cli("replay", "--dry-run", "--rate-limit", value)
    one_line(r, 2, f"rate limit must be a finite number of records per second, got {value}")


@pytest.fixture
def ca_file(tmp_path):
    """A real PEM certificate (the catalog loads TLS files when they are set)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hunt-b")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    path = tmp_path / "ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def test_contradicting_options_of_update_are_refused_and_change_nothing(
    cli, orders, tmp_path, ca_file
):
    # Before: whichever the code applied last won, silently: --no-tls dropped the --ca-file
    # just given, --header beat --no-header, --no-connection beat --connection, ...
    target = ("--bus", "orders", "--rule", "r", "--name", "t")
    url = "http://127.0.0.1:9/x"
    assert cli("target", "create", *target, "--url", url, "--header", "X-A:1").returncode == 0
    secret = tmp_path / "key"
    secret.write_text("k3y\n")
    r = cli("connection", "create", "c", "--auth", "api-key", "--key-name", "X-Key",
            "--key-value-file", str(secret), "--header", "X-C:1", "--query", "q=1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = cli("destination", "create", "d", "--url", url, "--connection", "c", "--rate-limit", "5")
    assert r.returncode == 0, r.stderr
    t_update = ("target", "update", *target)
    refusals = [  # (command, flag, option, its value)
        (t_update, "--no-tls", "--ca-file", ca_file),
        (t_update, "--no-header", "--header", "X-B:2"),
        (("connection", "update", "c"), "--no-header", "--header", "X-D:2"),
        (("connection", "update", "c"), "--no-query", "--query", "q=2"),
        (("destination", "update", "d"), "--no-connection", "--connection", "c"),
        (("destination", "update", "d"), "--no-rate-limit", "--rate-limit", "7"),
        (("destination", "update", "d"), "--no-tls", "--ca-file", ca_file),
    ]
    for command, flag, option, value in refusals:
        r = cli(*command, flag, option, value)
        one_line(r, 2, f"give {option} or {flag}, not both")
    for args in (
        ("target", "show", *target),
        ("connection", "show", "c"),
        ("destination", "show", "d"),
    ):
        doc = json.loads(cli(*args, "--json").stdout)
        assert doc["version"] == 1, (args, doc)


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("bus", "create", "orders"),
        ("rule", "list"),
        ("key", "list"),
        ("db", "maintain"),
    ],
)
def test_a_database_without_the_schema_is_one_line_saying_migrate(cli, empty_db_url, args):
    # Before: psycopg2's UndefinedTable traceback, exit 1 ("missing deliveries").
    r = cli(*args, env={"EVENTPUSH_DATABASE_URL": empty_db_url})
    one_line(r, 3, "the database lacks this version's schema (relation ")
    assert r.stderr.strip().endswith("run 'eventpush db migrate'")


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_transform_spec_with_a_number_json_cannot_hold_is_refused(cli, orders, conn, number):
    # Python's json reads these; PostgreSQL's JSON refuses them: a traceback, exit 1.
    base = ("--bus", "orders", "--rule", "r", "--name", "t")
    spec = '{"value": [%s]}' % number  # noqa: UP031
    create = ("target", "create", *base, "--url", "http://127.0.0.1:9/x", "--transform", "constant")
    r = cli(*create, "--transform-spec", spec)
    one_line(r, 2, "target 't': --transform-spec holds a number that is not finite")
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_target")
        assert cur.fetchone() == (0,)
    assert cli(*create, "--transform-spec", '{"value": 1}').returncode == 0
    r = cli("target", "update", *base, "--transform-spec", spec)
    one_line(r, 2, "target 't': --transform-spec holds a number that is not finite")


def test_db_migrate_of_a_database_at_an_unknown_revision_is_one_line(cli, empty_db_url):
    # As after rolling eventpush back past a migration: Alembic's CommandError traceback.
    env = {"EVENTPUSH_DATABASE_URL": empty_db_url}
    assert cli("db", "migrate", env=env).returncode == 0
    c = psycopg2.connect(empty_db_url)
    with c, c.cursor() as cur:
        cur.execute("UPDATE eventpush_alembic_version SET version_num = '0099_future'")
    c.close()
    r = cli("db", "migrate", env=env)
    one_line(r, 3, "cannot migrate the database from revision 0099_future: ")


@pytest.fixture
def read_only_url(db_url, conn):
    """The test database through a role of its own that may only read it."""
    import uuid

    role = f"eventpush_ro_{uuid.uuid4().hex[:8]}"
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
        cur.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        parts = urlsplit(db_url)
        host = parts.netloc.rpartition("@")[2]
        yield urlunsplit(parts._replace(netloc=f"{role}:{PASSWORD}@{host}"))
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP OWNED BY {role}")
            cur.execute(f"DROP ROLE {role}")


def test_a_role_that_may_not_write_is_one_line_exit_3(cli, read_only_url):
    env = {"EVENTPUSH_DATABASE_URL": read_only_url}
    assert cli("bus", "list", env=env).returncode == 0
    r = cli("bus", "create", "orders", env=env)
    one_line(r, 3, "the database refused: permission denied for table event_bus")
    assert PASSWORD not in r.stderr


@pytest.mark.parametrize("keep", ["99999999999d", "999999999999999999999999999s"])
def test_keep_old_secret_past_any_date_is_one_line(cli, orders, conn, tmp_path, keep):
    # timedelta raises OverflowError (not a ValueError) there: a traceback, exit 1.
    base = ("--bus", "orders", "--rule", "r", "--name", "t")
    assert cli("target", "create", *base, "--url", "http://127.0.0.1:9/x").returncode == 0
    secret = tmp_path / "secret"
    secret.write_text("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n")
    r = cli("target", "update", *base, "--secret-file", str(secret), "--keep-old-secret", keep)
    one_line(r, 2, f"--keep-old-secret '{keep}' is out of range")
    with conn.cursor() as cur:
        cur.execute("SELECT version, secret IS NULL FROM event_target")
        assert cur.fetchone() == (1, True)


@pytest.fixture
def table_locked(db_url):
    """A transaction holding every lock on the buses' table, as a migration or a long
    maintenance statement would."""
    holder = psycopg2.connect(db_url)
    try:
        with holder.cursor() as cur:
            cur.execute("LOCK TABLE event_bus IN ACCESS EXCLUSIVE MODE")
        yield
    finally:
        holder.rollback()
        holder.close()


def test_a_lock_timeout_in_the_middle_of_a_command_is_one_line_exit_3(cli, orders, table_locked):
    r = cli("bus", "list", env={"PGOPTIONS": "-c lock_timeout=300"})
    one_line(r, 3, "the database failed during the command: canceling statement due to lock")


def test_a_database_turned_read_only_is_one_line_exit_3_and_nothing_written(cli, orders, conn):
    # As after a failover to a standby: every write is refused by the server itself.
    r = cli("bus", "create", "more", env={"PGOPTIONS": "-c default_transaction_read_only=on"})
    one_line(r, 3, "the database failed during the command: cannot execute INSERT")
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM event_bus WHERE name = 'more'")
        assert cur.fetchone() == (0,)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_api_on_a_port_taken_is_one_line_exit_3(cli, db_url, workers):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli("api", "--port", str(port), "--workers", workers)
    one_line(r, 3, f"cannot listen on 127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize(
    ("args", "starts", "where"),
    [
        (
            ("replay", "--what", "nonsense"),
            "Invalid value for '--what': 'nonsense' is not one of",
            "eventpush replay",
        ),
        (("status", "--worker", "w1"), "No such option '--worker'", "eventpush status"),
        (("bus", "create"), "Missing argument 'NAME'", "eventpush bus create"),
        (
            ("rebalance", "--window-minutes", "0"),
            "Invalid value for '--window-minutes'",
            "eventpush rebalance",
        ),
        (("nosuch",), "No such command 'nosuch'", "eventpush"),
    ],
)
def test_a_usage_mistake_is_one_line_naming_the_help_to_read(cli, args, starts, where):
    """An unknown option, a value of the wrong kind, a missing argument: one line like every
    other refusal (click's usage block was four), exit 2, and where to read more."""
    r = cli(*args)
    one_line(r, 2, starts)
    assert r.stderr.rstrip().endswith(f"(see '{where} --help')"), r.stderr
