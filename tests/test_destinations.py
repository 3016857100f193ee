"""Connections, API destinations and what they add to each request (issue 32): API key,
Basic and OAuth2 client credentials checked by a real loopback receiver, a token endpoint
that counts its requests, a failing one, mTLS against a receiver that requires a client
certificate, and the refusals of bad input in one line. Rate limits and adaptive
concurrency are tested with their own code (push side)."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
import os
import ssl
from pathlib import Path

import pytest
from auth_receiver_support import AuthReceiver
from support import events, rows, wait_until

from eventpush import catalog, sealed
from eventpush.addresses import AddressPolicy
from eventpush.publish import publish
from eventpush.push import run_worker, store
from eventpush.sinks import RETRY, contract, http
from eventpush.sinks.contract import DELIVERED, Record, Target
from eventpush.sinks.request import build_request


@pytest.fixture
def ar():
    with AuthReceiver() as receiver:
        yield receiver


def secret_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    return str(path)


def bus_and_worker(conn) -> None:
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    catalog.create_worker(conn, "w1")


def target_via(conn, destination: str, name: str = "t", **spec) -> None:
    catalog.create_target(
        conn,
        "orders",
        "r",
        catalog.TargetSpec(name=name, url="", destination=destination, backoff_ms=5, **spec),
    )
    catalog.assign(conn)


def oauth_connection(conn, ar, name: str = "idp", **extra) -> None:
    catalog.create_connection(
        conn,
        name,
        "oauth-client-credentials",
        ar.state.client_secret,
        token_url=ar.url + "/token",
        client_id=ar.state.client_id,
        **extra,
    )


# --- each kind of auth, end to end through a worker -------------------------------------------


def test_api_key_basic_and_oauth_are_checked_by_the_receiver(conn, ar, caplog):
    bus_and_worker(conn)
    s = ar.state
    catalog.create_connection(
        conn, "key", "api-key", s.api_key, key_name="X-Api-Key", headers=[("X-Team", "blue")]
    )
    catalog.create_connection(conn, "pw", "basic", s.password, username=s.user)
    oauth_connection(conn, ar, scopes=["events.write", "a:b"], oauth_params=[("audience", "x")])
    catalog.create_destination(conn, "d-key", ar.url + "/apikey", connection="key")
    catalog.create_destination(
        conn, "d-pw", ar.url + "/basic", connection="pw", method="PUT", rate_limit=50
    )
    catalog.create_destination(conn, "d-oauth", ar.url + "/bearer", connection="idp")
    target_via(conn, "d-key", "t-key", headers=[("X-Target", "1")])
    target_via(conn, "d-pw", "t-pw")
    target_via(conn, "d-oauth", "t-oauth", concurrency_auto=True)
    publish(conn, "orders", events(6))
    with caplog.at_level(logging.DEBUG):
        report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (18, 0)
    for path in ("/apikey", "/basic", "/bearer"):
        assert len(s.delivered(path)) == 6, path
    assert {x.method for x in s.delivered("/basic")} == {"PUT"}
    key = s.delivered("/apikey")[0]
    assert (key.headers["x-team"], key.headers["x-target"]) == ("blue", "1")
    assert key.headers["webhook-id"].startswith("msg_")
    assert s.token_requests == 1  # one token for every send of the worker
    assert s.token_forms == [
        {"grant_type": "client_credentials", "scope": "events.write a:b", "audience": "x"}
    ]
    # The seam's fields, as the worker loaded them.
    with conn.cursor() as cur:
        loaded = {t.name: t for t in store.load_targets(cur)}
    assert (loaded["t-pw"].destination, loaded["t-pw"].method) == ("d-pw", "PUT")
    assert loaded["t-pw"].rate_limit == 50 and not loaded["t-pw"].concurrency_auto
    assert loaded["t-oauth"].concurrency_auto and loaded["t-oauth"].rate_limit is None
    # No secret in any log line or row.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (s.api_key, s.password, s.client_secret, "tok-1"):
        assert secret not in logged
        assert secret not in repr(loaded)
        assert secret not in json.dumps([c.to_json() for c in catalog.list_connections(conn)])
        assert not rows(conn, "SELECT 1 FROM event_connection WHERE secret LIKE %s", f"%{secret}%")


def test_query_parameters_and_method_reach_the_destination(conn, ar):
    bus_and_worker(conn)
    catalog.create_connection(
        conn,
        "key",
        "api-key",
        ar.state.api_key,
        key_name="X-Api-Key",
        query=[("tenant", "t 1"), ("v", "2")],
    )
    catalog.create_destination(conn, "d", ar.url + "/apikey?fixed=1", connection="key")
    target_via(conn, "d")
    publish(conn, "orders", events(2))
    assert run_worker("w1", until_idle=True, max_seconds=60).delivered == 2
    seen = ar.state.delivered("/apikey")
    assert [x.query for x in seen] == [{"fixed": "1", "tenant": "t 1", "v": "2"}] * 2
    assert [x.method for x in seen] == ["POST"] * 2


def test_a_running_worker_takes_a_connection_change_live(conn, db_url, ar):
    """The connection's new key reaches a running worker without a restart (the change moves
    its targets' versions on, which workers hear of as of any target change)."""
    import threading

    from eventpush.push.engine import Engine

    bus_and_worker(conn)
    catalog.create_connection(conn, "key", "api-key", "key-1", key_name="X-Api-Key")
    catalog.create_destination(conn, "d", ar.url + "/any", connection="key")
    target_via(conn, "d")
    engine = Engine("w1", db_url, max_seconds=120)
    box: dict = {}

    def run() -> None:
        async def main():
            box["loop"] = asyncio.get_running_loop()
            return await engine.run()

        box["report"] = asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        publish(conn, "orders", events(1))
        wait_until(lambda: len(ar.state.delivered("/any")) == 1, what="the first delivery")
        catalog.update_connection(conn, "key", secret="key-2")
        wait_until(
            lambda: [r.target.auth.secret for r in list(engine.runners.values())] == ["key-2"],
            what="the worker to take the new key",
        )
        publish(conn, "orders", events(1))
        wait_until(lambda: len(ar.state.delivered("/any")) == 2, what="the second delivery")
    finally:
        box["loop"].call_soon_threadsafe(engine.stop)
        thread.join(60)
    keys = [x.headers["x-api-key"] for x in ar.state.delivered("/any")]
    assert keys == ["key-1", "key-2"] and box["report"].delivered == 2


# --- the token cache: one fetch per expiry, one refresh per 401, a failing endpoint ----------


def oauth_target(ar, path: str = "/bearer", connection_id: int = 1) -> Target:
    auth = contract.Auth(
        connection_id,
        "idp",
        1,
        contract.OAUTH,
        ar.state.client_id,
        ar.state.client_secret,
        token_url=ar.url + "/token",
    )
    return Target(1, "b/r/t", "b", 1, "r", "{}", "t", ar.url + path, auth=auth, timeout_ms=2000)


def record(n: int) -> Record:
    return Record(0, n, f"m{n}", {}, json.dumps({"n": n}))


async def sends(sink: http.HttpSink, target: Target, n: int, start: int = 0):
    return await asyncio.gather(*(sink.send(target, [record(i)], None) for i in range(start, n)))


def test_one_token_fetch_per_expiry_and_one_refresh_per_401(ar):
    ar.state.token_lifetime = 600
    ar.state.token_delay_s = 0.05  # the sends pile up behind the one fetch

    async def scenario():
        now = [1000.0]
        sink = http.HttpSink(AddressPolicy(allow=(ipaddress.ip_network("127.0.0.1/32"),)))
        sink.tokens.clock = lambda: now[0]
        target = oauth_target(ar)
        try:
            first = await sends(sink, target, 20)
            assert {o.kind for o in first} == {DELIVERED}
            assert ar.state.token_requests == 1
            now[0] += 600 - 61  # before the leeway: still fresh
            await sends(sink, target, 5)
            assert ar.state.token_requests == 1
            now[0] += 2  # past it: refreshed once, however many send
            assert {o.kind for o in await sends(sink, target, 20)} == {DELIVERED}
            assert ar.state.token_requests == 2
            ar.state.revoke()  # every send is answered 401 once: one refresh, each sent again
            after = await sends(sink, target, 20)
            assert {(o.kind, o.http_status) for o in after} == {(DELIVERED, 200)}
            assert ar.state.token_requests == 3
        finally:
            await sink.close()

    asyncio.run(scenario())
    refused = [x for x in ar.state.seen if x.status == 401]
    assert len(refused) == 20 and {x.headers["authorization"] for x in refused} == {"Bearer tok-2"}


def test_the_tokens_of_connections_long_gone_are_not_kept(ar):
    """Weeks of OAuth connections created, used and deleted under one worker, in brief: 50
    connections each fetch a token, send, and are never used again; once their tokens have
    run out, the next token fetched leaves the sink holding only tokens still fresh, not one
    per connection it ever sent through (each held its access token for the process's
    life)."""
    ar.state.token_lifetime = 600

    async def scenario() -> tuple[list[str], int, int]:
        now = [1000.0]
        sink = http.HttpSink(AddressPolicy(allow=(ipaddress.ip_network("127.0.0.1/32"),)))
        sink.tokens.clock = lambda: now[0]
        try:
            kinds = []
            for connection_id in range(1, 51):
                outcomes = await sends(sink, oauth_target(ar, connection_id=connection_id), 1)
                kinds += [o.kind for o in outcomes]
            held = len(sink.tokens._tokens)
            now[0] += 600  # every one of those tokens has run out
            kinds += [o.kind for o in await sends(sink, oauth_target(ar, connection_id=51), 1)]
            return kinds, held, len(sink.tokens._tokens)
        finally:
            await sink.close()

    kinds, held, after = asyncio.run(scenario())
    assert kinds == [DELIVERED] * 51 and held == 50
    assert after == 1, f"{after} tokens held, {after - 1} of connections long gone"


def test_a_failing_token_endpoint_makes_the_send_a_retry_that_says_so(ar):
    ar.state.token_fails = True

    async def scenario():
        sink = http.HttpSink(AddressPolicy(allow=(ipaddress.ip_network("127.0.0.1/32"),)))
        try:
            outcomes = await sends(sink, oauth_target(ar), 8)
            ar.state.token_fails = False
            healed = await sends(sink, oauth_target(ar), 2)
        finally:
            await sink.close()
        return outcomes, healed

    outcomes, healed = asyncio.run(scenario())
    assert {o.kind for o in outcomes} == {RETRY}
    assert {o.error for o in outcomes} == {
        f"connection idp: no OAuth token: token URL {ar.url}/token answered HTTP 500 "
        "(temporarily_unavailable)"
    }
    assert ar.state.token_requests == 2  # one for the 8 waiting sends, one once it healed
    assert {o.kind for o in healed} == {DELIVERED}
    assert not ar.state.seen or all(x.path != "/bearer" or x.status == 200 for x in ar.state.seen)


def test_a_token_url_on_a_denied_address_is_refused_at_create_and_at_connect(conn, ar):
    with pytest.raises(catalog.CatalogError, match=r"--token-url: .*127\.0\.0\.2.*denied"):
        catalog.create_connection(
            conn,
            "c",
            "oauth-client-credentials",
            "s",
            token_url="http://127.0.0.2:9/token",
            client_id="id",
        )

    async def scenario():  # a policy that denies the token endpoint's address since
        sink = http.HttpSink(AddressPolicy(deny=(ipaddress.ip_network("127.0.0.1/32"),)))
        try:
            return await sink.send(oauth_target(ar), [record(0)], None)
        finally:
            await sink.close()

    outcome = asyncio.run(scenario())
    assert outcome.kind == RETRY and "refused address" in outcome.error
    assert "127.0.0.1/32" in outcome.error and ar.state.token_requests == 0


def test_a_failing_token_endpoint_leaves_failure_rows_saying_why(conn, ar):
    ar.state.token_fails = True
    bus_and_worker(conn)
    oauth_connection(conn, ar)
    catalog.create_destination(conn, "d", ar.url + "/bearer", connection="idp")
    target_via(conn, "d", max_attempts=2)
    publish(conn, "orders", events(3))
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (0, 3)
    [(attempts, status, error)] = rows(
        conn, "SELECT DISTINCT attempts, http_status, last_error FROM event_push_failure"
    )
    assert (attempts, status) == (2, None)
    assert "no OAuth token" in error and "HTTP 500" in error
    assert ar.state.client_secret not in error


# --- headers eventpush owns -------------------------------------------------------------------


def test_headers_never_override_the_signature_or_the_trace_context():
    """Even a Target built around the catalog's checks: eventpush's own headers come last."""
    target = Target(
        1,
        "b/r/t",
        "b",
        1,
        "r",
        "{}",
        "t",
        "http://127.0.0.1:1/x",
        secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        headers=(("webhook-signature", "forged"), ("traceparent", "x"), ("x-ok", "1")),
    )
    _, headers = build_request(target, [record(0)], None, traceparent="00-" + "1" * 32 + "-01")
    assert headers["webhook-signature"].startswith("v1,") and headers["x-ok"] == "1"
    assert headers["traceparent"].startswith("00-1111")


# --- mTLS -------------------------------------------------------------------------------------


def _pki(tmp_path: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def cert(name, key, issuer, issuer_key, ca=False, san=None, usage=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def key_pem(key):
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = cert("test CA", ca_key, ca_name, ca_key, ca=True)
    files = {}
    for who, san, usage in (
        (
            "server",
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
            ExtendedKeyUsageOID.SERVER_AUTH,
        ),
        ("client", None, ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        c = cert(who, key, ca_name, ca_key, san=san, usage=usage)
        (tmp_path / f"{who}.crt").write_bytes(c.public_bytes(serialization.Encoding.PEM))
        (tmp_path / f"{who}.key").write_bytes(key_pem(key))
        files[who] = str(tmp_path / f"{who}.crt")
        files[f"{who}_key"] = str(tmp_path / f"{who}.key")
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["ca"] = str(tmp_path / "ca.crt")
    return files


def test_mtls_against_a_receiver_that_requires_a_client_certificate(conn, tmp_path):
    pki = _pki(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki["ca"])
    server.load_cert_chain(pki["server"], pki["server_key"])
    server.verify_mode = ssl.CERT_REQUIRED
    with AuthReceiver(ssl_context=server) as tls_rx:
        bus_and_worker(conn)
        catalog.create_destination(
            conn,
            "mtls",
            tls_rx.url + "/any",
            client_cert_file=pki["client"],
            client_key_file=pki["client_key"],
            ca_file=pki["ca"],
        )
        catalog.create_destination(conn, "ca-only", tls_rx.url + "/any", ca_file=pki["ca"])
        target_via(conn, "mtls", "with-cert")
        target_via(conn, "ca-only", "no-cert", max_attempts=1)
        publish(conn, "orders", events(3))
        report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (3, 3)
    assert len(tls_rx.state.delivered("/any")) == 3
    failures = rows(conn, "SELECT consumer_group, last_error FROM event_push_failure")
    assert sorted(runner for runner, _ in failures) == ["orders/r/no-cert"] * 3
    # With TLS 1.3 the client may finish its side of the handshake before the server refuses
    # the missing certificate, so each refusal reads as a failed handshake or as a connection
    # the server closed, whichever the client saw first: the texts differ, the kind does not.
    assert all(error.startswith("connection failed: ") for _, error in failures), failures


# --- the catalog: shown without secrets, changes taken live, deletes refused while used -------


def test_show_never_gives_a_secret_and_changes_move_the_targets_on(conn, ar):
    bus_and_worker(conn)
    info = catalog.create_connection(
        conn, "key", "api-key", "sekrit-value-1", key_name="Authorization"
    )
    assert info.secret_set and "sekrit" not in json.dumps(info.to_json())
    catalog.create_destination(conn, "d", ar.url + "/apikey", connection="key")
    target_via(conn, "d")
    before = catalog.get_target(conn, "orders", "r", "t")
    assert (before.destination, before.url, before.version) == ("d", ar.url + "/apikey", 1)
    catalog.update_connection(conn, "key", secret="sekrit-value-2")
    catalog.update_destination(conn, "d", url=ar.url + "/any", method="PATCH")
    after = catalog.get_target(conn, "orders", "r", "t")
    assert (after.url, after.version) == (ar.url + "/any", 3)
    with conn.cursor() as cur:
        [loaded] = store.load_targets(cur)
    assert (loaded.auth.secret, loaded.auth.version, loaded.method) == (
        "sekrit-value-2",
        2,
        "PATCH",
    )
    assert loaded.auth.name == "Authorization"
    assert sealed.SEALED[-1] == ("event_connection", "id", "secret")
    new_key = Path(os.environ["EVENTPUSH_SECRET_KEY_FILE"]).with_name("rotated.key")
    sealed.write_key_file(new_key)
    assert sealed.rotate_key(conn, new_key) == 1  # `secrets rotate-key` covers connections
    [(token,)] = rows(conn, "SELECT secret FROM event_connection")
    assert sealed.unseal(token, sealed.load_keys(new_key)) == "sekrit-value-2"
    new_key.unlink()
    with pytest.raises(catalog.ConflictError, match="connection 'key' is used by destination d"):
        catalog.delete_connection(conn, "key")
    with pytest.raises(catalog.ConflictError, match="destination 'd' is used by target orders/r/t"):
        catalog.delete_destination(conn, "d")
    catalog.update_target(conn, "orders", "r", "t", url=ar.url + "/any")
    assert catalog.get_target(conn, "orders", "r", "t").destination is None
    catalog.delete_destination(conn, "d")
    catalog.delete_connection(conn, "key")
    assert catalog.list_connections(conn) == [] and catalog.list_destinations(conn) == []


BAD_CONNECTIONS = [
    ({"auth": "digest"}, "--auth must be one of api-key, basic, oauth-client-credentials"),
    ({"auth": "api-key"}, "--auth api-key needs --key-name"),
    ({"auth": "api-key", "key_name": "X-K", "username": "u"}, "--username does not apply"),
    ({"auth": "api-key", "key_name": "X K"}, "header name 'X K' is invalid"),
    ({"auth": "api-key", "key_name": "webhook-id"}, "eventpush's own"),
    ({"auth": "api-key", "key_name": "X-K", "secret": "a\r\nb"}, "without control characters"),
    ({"auth": "basic", "username": "a:b"}, "--username must be printable ASCII without ':'"),
    ({"auth": "basic", "username": "u", "secret": ""}, "--password-file is empty"),
    ({"auth": "basic", "username": "u", "headers": [("X-A", "1\r\nHost: x")]}, "without CR or LF"),
    ({"auth": "basic", "username": "u", "headers": [("Host", "x")]}, "set by the HTTP client"),
    ({"auth": "basic", "username": "u", "headers": [("traceparent", "x")]}, "eventpush's own"),
    (
        {"auth": "basic", "username": "u", "headers": [("Authorization", "x")]},
        "put it in a connection",
    ),
    ({"auth": "basic", "username": "u", "headers": [("a", "1"), ("A", "2")]}, "given twice"),
    (
        {"auth": "oauth-client-credentials", "client_id": "i", "token_url": "ftp://h/t"},
        "--token-url",
    ),
    (
        {
            "auth": "oauth-client-credentials",
            "client_id": "i",
            "token_url": "http://127.0.0.1/",
            "scopes": ["a b"],
        },
        "--scope 'a b' is invalid",
    ),
    (
        {
            "auth": "oauth-client-credentials",
            "client_id": "i",
            "token_url": "http://127.0.0.1/",
            "oauth_params": [("grant_type", "x")],
        },
        "--oauth-param grant_type is set by eventpush",
    ),
]


@pytest.mark.parametrize(("args", "why"), BAD_CONNECTIONS)
def test_bad_connections_are_refused_in_one_line_without_the_secret(conn, args, why):
    args = {"secret": "s3cr3t-value", **args}
    with pytest.raises(catalog.CatalogError) as info:
        catalog.create_connection(conn, "c", args.pop("auth"), args.pop("secret"), **args)
    text = str(info.value)
    assert why in text and "\n" not in text and "s3cr3t" not in text
    assert catalog.list_connections(conn) == []


def test_bad_destinations_and_targets_are_refused_in_one_line(conn, ar, tmp_path):
    bus_and_worker(conn)
    cases = [
        (lambda: catalog.create_destination(conn, "d", "nats://127.0.0.1:4222/x"), "http or https"),
        (lambda: catalog.create_destination(conn, "d", ar.url, method="HEAD"), "--method must be"),
        (lambda: catalog.create_destination(conn, "d", ar.url, rate_limit=0), "--rate-limit"),
        (  # more than 0, and never sends again
            lambda: catalog.create_destination(conn, "d", ar.url, rate_limit=1e-320),
            "--rate-limit must be from 0.000278 (one an hour)",
        ),
        (
            lambda: catalog.create_destination(conn, "d", ar.url, connection="nope"),
            "unknown connection 'nope'",
        ),
        (lambda: catalog.create_destination(conn, "d", "http://127.0.0.2/"), "denied"),
        (
            lambda: catalog.create_destination(
                conn,
                "d",
                ar.url,
                client_cert_file="/nonexistent.crt",
                client_key_file="/nonexistent.key",
            ),
            "--client-cert-file /nonexistent.crt: No such file",
        ),
        (
            lambda: catalog.create_destination(
                conn, "d", ar.url, ca_file=secret_file(tmp_path, "x", "junk")
            ),
            "does not hold PEM certificates",
        ),
        (
            lambda: catalog.create_destination(conn, "d", ar.url, client_cert_file="rel.crt"),
            "go together",
        ),
        (lambda: target_via(conn, "nope"), "unknown destination 'nope'"),
        (
            lambda: catalog.create_target(
                conn,
                "orders",
                "r",
                catalog.TargetSpec("t", ar.url, headers=[("webhook-timestamp", "1")]),
            ),
            "eventpush's own",
        ),
        *(
            (
                # Named for a credential: kept unsealed and shown by `target show` if stored.
                lambda name=name: catalog.create_target(
                    conn, "orders", "r", catalog.TargetSpec("t", ar.url, headers=[(name, "k")])
                ),
                f"header {name.lower()!r} carries a credential: put it in a connection",
            )
            for name in ("X-Api-Key", "Cookie", "authorization")
        ),
        (
            lambda: catalog.create_target(
                conn,
                "orders",
                "r",
                catalog.TargetSpec("t", "nats://127.0.0.1:4222/x", headers=[("x-a", "1")]),
            ),
            "apply to http and https targets only",
        ),
    ]
    for call, why in cases:
        with pytest.raises(catalog.CatalogError) as info:
            call()
        assert why in str(info.value) and "\n" not in str(info.value), why
    catalog.create_destination(conn, "d", ar.url + "/any")
    with pytest.raises(catalog.CatalogError, match="give --url or --destination, not both"):
        catalog.create_target(conn, "orders", "r", catalog.TargetSpec("t", ar.url, destination="d"))
    assert catalog.list_destinations(conn)[0].targets == 0 and catalog.list_targets(conn) == []


# --- the command line -------------------------------------------------------------------------


def test_connection_commands_take_secrets_from_stdin_or_a_file_and_never_print_them(
    conn, cli, ar, tmp_path
):
    """The real script (one subprocess family): the secret from stdin and from a file."""
    done = cli(
        "connection", "create", "idp", "--auth", "oauth-client-credentials",
        "--token-url", ar.url + "/token", "--client-id", "client-1",
        "--client-secret-file", "-", "--scope", "a", "--scope", "b",
        "--oauth-param", "audience=x", "--header", "X-A: 1", "--query", "t=1", "--json",
        input="cs-from-stdin\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    created = json.loads(done.stdout)
    assert created["scopes"] == ["a", "b"] and created["headers"] == [["x-a", "1"]]
    assert created["oauth_params"] == [["audience", "x"]] and created["secret_set"]
    key_file = secret_file(tmp_path, "key", "k-from-file")
    done = cli(
        "connection", "create", "key", "--auth", "api-key", "--key-name", "X-Api-Key",
        "--key-value-file", key_file,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = cli("connection", "show", "idp", "--json")
    listed = cli("connection", "list", "--json")
    assert json.loads(shown.stdout)["client_id"] == "client-1"
    assert [c["name"] for c in json.loads(listed.stdout)] == ["idp", "key"]
    for out in (done.stdout, shown.stdout, listed.stdout, shown.stderr):
        assert "cs-from-stdin" not in out and "k-from-file" not in out
    [(sealed_secret,)] = rows(conn, "SELECT secret FROM event_connection WHERE name = 'idp'")
    assert sealed.unseal(sealed_secret) == "cs-from-stdin"
    refused = cli("connection", "create", "x", "--auth", "basic", "--username", "u")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: --auth basic needs its secret: --password-file FILE (or - for stdin)"
    ]
    no_argv = cli("connection", "create", "x", "--auth", "basic", "--password", "pw")
    assert no_argv.returncode == 2 and "No such option '--password'" in no_argv.stderr


def run(*args: str, input: str | None = None):
    """The command in-process (click's runner): for the checks past the one subprocess."""
    from click.testing import CliRunner

    from eventpush.cli import main

    return CliRunner().invoke(main, list(args), input=input)


def test_destination_and_target_commands(conn, ar):
    bus_and_worker(conn)
    catalog.create_connection(conn, "key", "api-key", "k", key_name="X-Api-Key")
    done = run(
        "destination", "create", "d", "--url", ar.url + "/apikey", "--method", "PUT",
        "--connection", "key", "--rate-limit", "5", "--json",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["rate_limit"] == 5.0
    done = run(
        "target", "create", "--bus", "orders", "--rule", "r", "--name", "t",
        "--destination", "d", "--header", "X-T:1", "--concurrency", "auto", "--json",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    info = json.loads(done.output)
    assert (info["destination"], info["url"], info["headers"]) == (
        "d",
        ar.url + "/apikey",
        [["x-t", "1"]],
    )
    assert info["concurrency_auto"] is True
    done = run("target", "update", "--bus", "orders", "--rule", "r", "--name", "t",
               "--concurrency", "4", "--no-header", "--json")  # fmt: skip
    info = json.loads(done.output)
    assert (info["concurrency"], info["concurrency_auto"], info["headers"]) == (4, False, [])
    done = run(
        "connection", "update", "key", "--key-value-file", "-", "--header", "X-B:2", "--json",
        input="k2\n",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["headers"] == [["x-b", "2"]] and "k2" not in done.output
    with conn.cursor() as cur:
        [loaded] = store.load_targets(cur)
    assert loaded.auth.secret == "k2" and loaded.headers == (("x-b", "2"),)
    done = run("destination", "update", "d", "--no-rate-limit", "--no-connection", "--json")
    assert json.loads(done.output)["rate_limit"] is None
    assert json.loads(done.output)["connection"] is None
    for args, why in (
        (("destination", "delete", "d"), "error: destination 'd' is used by target orders/r/t"),
        (("connection", "create", "c", "--auth", "api-key", "--key-name", "X",
          "--password-file", "-"), "error: --password-file applies to --auth basic, not api-key"),
        (("target", "create", "--bus", "orders", "--rule", "r", "--name", "u"),
         "error: give --url or --destination (one of them)"),
        (("target", "create", "--bus", "orders", "--rule", "r", "--name", "u",
          "--destination", "d", "--concurrency", "lots"),
         "error: --concurrency must be a number or auto, got 'lots'"),
        (("target", "create", "--bus", "orders", "--rule", "r", "--name", "u",
          "--destination", "d", "--header", "nocolon"),
         "error: --header wants NAME:VALUE, got 'nocolon'"),
    ):  # fmt: skip
        done = run(*args, input="secret\n")
        assert done.exit_code == 2 and done.output.strip().startswith(why), (args, done.output)
        assert len(done.output.strip().splitlines()) == 1
