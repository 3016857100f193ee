"""Operator input is refused cleanly (one line, exit 2) or read from a safe channel: names,
events, target secrets (issue 16)."""

from __future__ import annotations

import json

import pytest

from eventpush.catalog import CatalogError, check_name
from eventpush.publish import MalformedEventError, parse_events

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.mark.parametrize("name", ["bus\n", "bus\r\n", "\nbus", "bus\x00", "b us"])
def test_names_with_line_breaks_or_odd_characters_are_refused(name):
    with pytest.raises(CatalogError, match="name .* is invalid"):
        check_name("bus", name)


def test_bus_name_with_a_trailing_newline_is_one_line_exit_2(cli, db_url):
    r = cli("bus", "create", "orders\n", "--queues", "1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: bus name 'orders\\n' is invalid")
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.fixture
def orders(cli, db_url):
    assert cli("bus", "create", "orders", "--queues", "1").returncode == 0
    return db_url


def _one_line_refusal(r, line_text: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert r.stderr.startswith(f"error: {line_text}"), r.stderr[-500:]
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_publish_refuses_an_event_nested_beyond_the_recursion_limit(cli, orders, conn):
    deep = "[" * 100_000 + "]" * 100_000
    event = '{"source": "shop", "detail-type": "x", "detail": {"d": ' + deep + "}}"
    good = json.dumps({"source": "shop", "detail-type": "x"})
    r = cli("publish", "--bus", "orders", input=f"{good}\n{event}\n")
    _one_line_refusal(r, "line 2: the event is nested too deeply")
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM bus_event")
        assert cur.fetchone()[0] == 0  # all or nothing


@pytest.mark.parametrize(
    "detail",
    [{"note": "a\u0000b"}, {"a\u0000": 1}, {"list": ["ok", ["x\u0000"]]}],
)
def test_a_nul_character_anywhere_in_an_event_is_refused(detail):
    event = json.dumps({"source": "shop", "detail-type": "x", "detail": detail})
    with pytest.raises(MalformedEventError, match=r"^line 1: a NUL character"):
        parse_events([event], 1)


def test_publish_refuses_a_nul_character(cli, orders):
    event = json.dumps({"source": "shop", "detail-type": "x", "detail": {"n": "a\u0000"}})
    r = cli("publish", "--bus", "orders", input=event + "\n")
    _one_line_refusal(r, "line 1: a NUL character (\\u0000) is not allowed")


def test_an_escaped_backslash_before_u0000_is_not_a_nul(cli, orders, conn):
    event = json.dumps({"source": "shop", "detail-type": "x", "detail": {"path": "C:\\u0000"}})
    assert "\\\\u0000" in event
    r = cli("publish", "--bus", "orders", input=event + "\n")
    assert r.returncode == 0, r.stderr
    with conn.cursor() as cur:
        cur.execute("SELECT body->'detail'->>'path' FROM bus_event")
        assert cur.fetchone()[0] == "C:\\u0000"


def _create_target(cli, *extra: str, input: str | None = None):
    return cli(
        "target",
        "create",
        "--bus",
        "orders",
        "--rule",
        "r",
        "--name",
        "t",
        "--url",
        "http://127.0.0.1:1/hook",
        *extra,
        input=input,
    )


def _stored_secret(conn) -> str | None:
    """The stored secret, opened: the column itself holds only a sealed token."""
    from eventpush import sealed

    with conn.cursor() as cur:
        cur.execute("SELECT secret FROM event_target WHERE name = 't'")
        token = cur.fetchone()[0]
    assert token is None or (token.startswith(sealed.TOKEN_PREFIX) and "whsec_" not in token)
    return sealed.unseal_or_none(token)


@pytest.fixture
def rule(cli, orders):
    r = cli("rule", "create", "--bus", "orders", "--name", "r", "--pattern", '{"source": ["s"]}')
    assert r.returncode == 0, r.stderr
    return orders


def test_target_secret_from_stdin(cli, rule, conn):
    r = _create_target(cli, "--secret", "-", input=SECRET + "\n")
    assert r.returncode == 0, r.stderr
    assert _stored_secret(conn) == SECRET
    assert "whsec_" not in r.stdout + r.stderr


def test_target_secret_from_a_file(cli, rule, conn, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    r = _create_target(cli, "--secret-file", str(path))
    assert r.returncode == 0, r.stderr
    assert _stored_secret(conn) == SECRET


def test_target_secret_channels_are_checked(cli, rule, conn, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    r = _create_target(cli, "--secret", SECRET, "--secret-file", str(path))
    _one_line_refusal(r, "give --secret or --secret-file, not both")
    r = _create_target(cli, "--secret", "-", input="\n")
    _one_line_refusal(r, "the secret read from stdin is empty")
    r = _create_target(cli, "--secret", "-", input="whsec_short\n")
    _one_line_refusal(r, "--secret is not valid base64")
    assert "whsec_short" not in r.stderr
