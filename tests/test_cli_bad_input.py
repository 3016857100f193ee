"""Bad input and an unusable database, through the real ``eventpush`` command: one line on
stderr saying what and where, the documented exit code, no traceback, no secret, nothing
half-written."""

from __future__ import annotations

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
