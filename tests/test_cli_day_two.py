"""The day-two commands through the real ``eventpush`` script: list and show agree in JSON,
every refusal is one line with exit 2, secrets never printed."""

import json

import pytest

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECRET2 = "whsec_QUJDREVGR0hJSktMTU5PUFFSU1RVVldY"


def one_line_refusal(r, text: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-300:], r.stderr[-500:])
    assert r.stderr.startswith(f"error: {text}"), r.stderr[-500:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def ok(r) -> str:
    assert r.returncode == 0, r.stderr[-500:]
    return r.stdout


@pytest.fixture
def shop(cli, db_url):
    ok(cli("bus", "create", "shop", "--queues", "2"))
    ok(cli("rule", "create", "--bus", "shop", "--name", "r", "--pattern", '{"source": ["a"]}'))
    ok(
        cli(
            "target",
            "create",
            "--bus",
            "shop",
            "--rule",
            "r",
            "--name",
            "t",
            "--url",
            "http://127.0.0.1:9/h",
            "--secret",
            SECRET,
        )
    )
    return "shop"


def test_list_and_show_give_the_same_objects(cli, shop):
    for listing, showing in (
        (("bus", "list"), ("bus", "show", "shop")),
        (("rule", "list", "--bus", "shop"), ("rule", "show", "--bus", "shop", "--name", "r")),
        (("target", "list"), ("target", "show", "--bus", "shop", "--rule", "r", "--name", "t")),
    ):
        items = json.loads(ok(cli(*listing, "--json")))
        assert items == [json.loads(ok(cli(*showing, "--json")))]
    table = ok(cli("target", "show", "--bus", "shop", "--rule", "r", "--name", "t"))
    assert "secret_fingerprint" in table
    everything = "".join(
        ok(cli(*args, "--json"))
        for args in (("bus", "list"), ("target", "list"), ("worker", "list"))
    )
    assert "whsec_" not in everything and SECRET[6:] not in everything


def test_changes_and_refusals(cli, shop):
    base = ("--bus", "shop", "--name", "r")
    r = json.loads(ok(cli("rule", "update", *base, "--pattern", '{"source": ["b"]}', "--json")))
    assert (r["version"], r["pattern"]) == (2, {"source": ["b"]})
    one_line_refusal(
        cli("rule", "update", *base, "--description", "x", "--expected-version", "1"),
        "rule shop/r changed meanwhile: it is at version 2, not 1",
    )
    assert json.loads(ok(cli("rule", "disable", *base, "--json")))["state"] == "DISABLED"
    assert json.loads(ok(cli("rule", "enable", *base, "--json")))["state"] == "ENABLED"
    one_line_refusal(cli("rule", "update", *base, "--pattern", "{nope"), "rule 'r': pattern is")
    one_line_refusal(cli("rule", "delete", *base), "rule shop/r has 1 targets")
    one_line_refusal(cli("bus", "delete", "shop"), "bus 'shop' has 1 rules")
    one_line_refusal(cli("bus", "show", "nope"), "unknown bus 'nope'")
    t = ("--bus", "shop", "--rule", "r", "--name", "t")
    one_line_refusal(
        cli("target", "update", *t, "--secret", SECRET2, "--keep-old-secret", "1 day"),
        "--keep-old-secret must be a number and a unit",
    )
    one_line_refusal(cli("target", "update", *t, "--timeout-ms", "0"), "--timeout-ms must be")
    one_line_refusal(cli("target", "update", *t, "--url", "ftp://x/"), "target URL")
    doc = json.loads(
        ok(
            cli(
                "target",
                "update",
                *t,
                "--secret",
                "-",
                "--keep-old-secret",
                "24h",
                "--json",
                input=SECRET2,
            )
        )
    )
    assert doc["version"] == 2 and doc["old_secret_until"] and doc["secret_set"]
    ok(cli("worker", "create", "w1"))
    ok(cli("assign"))
    one_line_refusal(cli("worker", "delete", "w1"), "worker 'w1' holds 1 runners")
    out = ok(cli("bus", "delete", "shop", "--force"))
    assert "bus shop deleted with 1 rules and 1 targets" in out
    assert json.loads(ok(cli("bus", "list", "--json"))) == []
    ok(cli("worker", "delete", "w1"))


def test_a_missing_key_file_names_a_section_the_operations_page_has(cli, shop):
    """Exit 3 in one line, and the section it sends the operator to is one OPERATIONS has."""
    import re
    from pathlib import Path

    from eventpush import sealed

    show = ("target", "show", "--bus", "shop", "--rule", "r", "--name", "t")
    r = cli(*show, env={sealed.KEY_FILE_ENV: ""})
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{sealed.KEY_FILE_ENV} is not set" in r.stderr
    section = re.search(r"docs/OPERATIONS\.md, '([^']+)'", r.stderr).group(1)
    page = (Path(__file__).parents[1] / "docs" / "OPERATIONS.md").read_text()
    assert f"## {section}\n" in page, section


def test_rotate_key_through_the_cli(cli, shop, tmp_path):
    from eventpush import sealed

    key = tmp_path / "new.key"
    sealed.write_key_file(key)
    doc = json.loads(ok(cli("secrets", "rotate-key", "--new-key-file", str(key), "--json")))
    assert doc["reencrypted"] == 1
    r = cli("target", "show", "--bus", "shop", "--rule", "r", "--name", "t")
    assert r.returncode == 3 and "does not open with the key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    env = {sealed.KEY_FILE_ENV: str(key)}
    doc = json.loads(
        ok(cli("target", "show", "--bus", "shop", "--rule", "r", "--name", "t", "--json", env=env))
    )
    assert doc["secret_fingerprint"] == sealed.fingerprint(SECRET)
