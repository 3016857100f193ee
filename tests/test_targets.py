"""Target URL validation, the address policy (pure functions on addresses: no packet is
sent anywhere), the one redaction, and Retry-After clamping."""

import ipaddress
import math
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from eventpush.addresses import (
    AddressPolicy,
    InvalidTargetUrlError,
    address_policy,
    check_address,
    embedded_ipv4,
)
from eventpush.config import ConfigError, redact, redact_url
from eventpush.sinks import contract, http, retry, validate_url


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "https://example.com/hook?x=1",
        "http://[::1]:9000/",
        "https://hooks.example.org",
    ],
)
def test_good_urls_pass(url):
    assert validate_url(url) == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("", "empty"),
        ("ftp://example.com/x", "http or https"),
        ("example.com/hook", "http or https"),
        ("http:///nohost", "no host"),
        ("http://169.254.169.254/latest/meta-data", "denied range 169.254.0.0/16"),
        ("http://[fe80::1]/", "denied range fe80::/10"),
        ("http://metadata.google.internal/", "metadata"),
        ("http://user:pw@example.com/", "credentials"),
        ("http://example.com:99999/", "malformed"),
        ("http://[::ffff:169.254.169.254]/", "169.254.0.0/16"),
    ],
)
def test_bad_urls_are_refused_with_the_reason(url, why):
    with pytest.raises(InvalidTargetUrlError, match=why.replace(".", r"\.")):
        validate_url(url)


def test_errors_never_show_the_query_string():
    with pytest.raises(InvalidTargetUrlError) as info:
        validate_url("gopher://example.com/x?token=s3cret")
    assert "s3cret" not in str(info.value)


def test_operator_can_deny_more_ranges(monkeypatch):
    monkeypatch.setenv("EVENTPUSH_ALLOW_CIDRS", "10.0.0.0/8, 192.168.0.0/16, 127.0.0.1/32")
    validate_url("http://10.1.2.3/")
    monkeypatch.setenv("EVENTPUSH_DENY_CIDRS", "10.0.0.0/8, 192.168.0.0/16")
    with pytest.raises(InvalidTargetUrlError, match="10.0.0.0/8"):
        validate_url("http://10.1.2.3/")
    with pytest.raises(InvalidTargetUrlError, match="192.168.0.0/16"):
        check_address("192.168.1.1")
    check_address("127.0.0.1")


DEFAULT = AddressPolicy()  # what a deployment gets with neither variable set

DENIED_BY_DEFAULT = [
    "10.0.0.1",
    "172.16.5.4",
    "172.31.255.255",
    "192.168.1.1",
    "127.0.0.1",
    "127.0.0.2",
    "169.254.169.254",
    "169.254.1.1",
    "100.64.0.1",
    "100.127.255.254",
    "100.100.100.200",
    "168.63.129.16",
    "0.0.0.0",
    "0.1.2.3",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.0.192",
    "198.18.0.1",
    "::",
    "::1",
    "fe80::1",
    "fe80::1%eth0",
    "fc00::1",
    "fd12:3456::1",
    "fd00:ec2::254",
    "ff02::1",
    "2001:db8::1",
]


@pytest.mark.parametrize("address", DENIED_BY_DEFAULT)
def test_default_policy_denies_private_loopback_link_local_and_reserved(address):
    assert DEFAULT.refusal(address) is not None
    with pytest.raises(OSError, match="denied range"):
        DEFAULT.check(address)


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "1.1.1.1"])
def test_default_policy_lets_public_addresses_through(address):
    assert DEFAULT.refusal(address) is None


def _nat64_local(v4: str, prefix_len: int) -> ipaddress.IPv6Address:
    """RFC 6052's layout, written out independently of the module under test."""
    prefix = int(ipaddress.IPv6Address("64:ff9b:1::"))
    v4_bits = format(int(ipaddress.IPv4Address(v4)), "032b")
    bits = list(format(prefix, "0128b"))
    positions = [p for p in range(prefix_len, 128) if not 64 <= p < 72][:32]
    for pos, bit in zip(positions, v4_bits, strict=True):
        bits[pos] = bit
    return ipaddress.IPv6Address(int("".join(bits), 2))


def _teredo(server: str, client: str) -> ipaddress.IPv6Address:
    obfuscated = int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF
    value = (0x20010000 << 96) | (int(ipaddress.IPv4Address(server)) << 64) | obfuscated
    return ipaddress.IPv6Address(value)


EMBEDDED_METADATA = {
    "mapped": "::ffff:169.254.169.254",
    "compatible": "::169.254.169.254",
    "translated": "::ffff:0:169.254.169.254",
    "nat64": "64:ff9b::169.254.169.254",
    "nat64-local/48": str(_nat64_local("169.254.169.254", 48)),
    "nat64-local/56": str(_nat64_local("169.254.169.254", 56)),
    "nat64-local/64": str(_nat64_local("169.254.169.254", 64)),
    "nat64-local/96": str(_nat64_local("169.254.169.254", 96)),
    "6to4": "2002:a9fe:a9fe::1",
    "teredo-client": str(_teredo("93.184.216.34", "169.254.169.254")),
    "teredo-server": str(_teredo("169.254.169.254", "93.184.216.34")),
}


@pytest.mark.parametrize("form", sorted(EMBEDDED_METADATA))
def test_embedded_ipv4_forms_are_judged_like_the_ipv4_they_carry(form):
    ip = ipaddress.ip_address(EMBEDDED_METADATA[form])
    assert ipaddress.IPv4Address("169.254.169.254") in embedded_ipv4(ip)
    # Opening every IPv6 address changes nothing: the carried IPv4 is metadata.
    policy = AddressPolicy(allow=(ipaddress.ip_network("::/0"),))
    why = policy.refusal(ip)
    assert why is not None and "cloud metadata" in why and f"carried by {ip}" in why


@pytest.mark.parametrize(
    "address",
    ["::ffff:10.0.0.1", "::10.0.0.1", "64:ff9b::10.0.0.1", "2002:0a00:0001::1", "64:ff9b::7f00:1"],
)
def test_embedded_private_ipv4_is_denied_by_default(address):
    assert DEFAULT.refusal(address) is not None


def test_embedded_forms_follow_allow_and_deny_of_the_ipv4():
    policy = AddressPolicy(allow=(ipaddress.ip_network("127.0.0.1/32"),))
    assert policy.refusal("::ffff:127.0.0.1") is None
    assert policy.refusal("64:ff9b::127.0.0.1") is None
    assert policy.refusal("::ffff:127.0.0.2") is not None
    policy = AddressPolicy(
        allow=(ipaddress.ip_network("::/0"),), deny=(ipaddress.ip_network("93.184.216.0/24"),)
    )
    assert "EVENTPUSH_DENY_CIDRS" in policy.refusal("::ffff:93.184.216.34")
    assert "EVENTPUSH_DENY_CIDRS" in policy.refusal("2002:5db8:d822::1")


def test_nat64_to_a_public_address_passes():
    assert DEFAULT.refusal("64:ff9b::93.184.216.34") is None
    assert DEFAULT.refusal(_nat64_local("93.184.216.34", 96)) is None
    assert DEFAULT.refusal(_nat64_local("93.184.216.34", 48)) is None


def test_ipv6_loopback_is_not_mistaken_for_an_ipv4_compatible_address():
    assert embedded_ipv4(ipaddress.ip_address("::1")) == []
    assert AddressPolicy(allow=(ipaddress.ip_network("::1/128"),)).refusal("::1") is None


def test_allow_opens_ranges_deny_wins_and_metadata_stays_closed():
    net = ipaddress.ip_network
    policy = AddressPolicy(
        allow=(net("10.0.0.0/8"), net("169.254.0.0/16"), net("0.0.0.0/0")),
        deny=(net("10.1.0.0/16"),),
    )
    assert policy.refusal("10.2.0.1") is None
    assert policy.refusal("172.16.0.1") is None
    assert "10.1.0.0/16" in policy.refusal("10.1.2.3")
    assert policy.refusal("169.254.1.1") is None
    assert "cloud metadata" in policy.refusal("169.254.169.254")
    assert "cloud metadata" in policy.refusal("100.100.100.200")


def test_policy_reads_the_environment(monkeypatch):
    monkeypatch.setenv("EVENTPUSH_ALLOW_CIDRS", " 127.0.0.1/32 ,, ::1 ")
    monkeypatch.setenv("EVENTPUSH_DENY_CIDRS", "127.0.0.1")
    policy = address_policy()
    assert policy.refusal("::1") is None
    assert "EVENTPUSH_DENY_CIDRS" in policy.refusal("127.0.0.1")
    monkeypatch.delenv("EVENTPUSH_ALLOW_CIDRS")
    monkeypatch.delenv("EVENTPUSH_DENY_CIDRS")
    with pytest.raises(InvalidTargetUrlError, match="EVENTPUSH_ALLOW_CIDRS"):
        validate_url("http://127.0.0.1:8080/hook")


def test_a_bad_range_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("EVENTPUSH_ALLOW_CIDRS", "127.0.0.1/32,10.0.0.0/33")
    with pytest.raises(ConfigError) as info:
        address_policy()
    assert str(info.value) == (
        "EVENTPUSH_ALLOW_CIDRS: '10.0.0.0/33' is not a CIDR range (e.g. 127.0.0.1/32 or ::1/128)"
    )
    with pytest.raises(ConfigError, match="EVENTPUSH_ALLOW_CIDRS"):
        http.new_session()  # a worker or replay refuses to start, before any request


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:s3cret@db:5432/x", "postgresql://***@db:5432/x"),
        ("postgresql://db/x?password=s3cret", "postgresql://db/x?***"),
        ("postgresql://db/x?sslmode=require&password=s3cret", "postgresql://db/x?***"),
        ("https://user:pass@host/hook?token=abc#frag", "https://***@host/hook?***"),
        ("https://host/hook#access_token=abc", "https://host/hook"),
        ("http://[::1:99999/?token=abc", "http://[::1:99999/?***"),
        ("http://host:1/plain", "http://host:1/plain"),
    ],
)
def test_redact_url_masks_userinfo_query_and_fragment(url, shown):
    assert redact_url(url) == shown


def test_redact_finds_urls_and_the_targets_secrets_in_any_spelling():
    url = "https://alice_ops:pa%24%24word@hooks.example.com/in?token=to%2Fken&x=1"
    text = (
        "Cannot connect: https://alice_ops:pa$$word@hooks.example.com/in?token=to/ken&x=1; "
        "url='hooks.example.com/in?token=to%2Fken' user alice_ops pass pa$$word tok to/ken"
    )
    out = redact(text, url)
    for secret in ("pa$$word", "pa%24%24word", "to/ken", "to%2Fken", "alice_ops"):
        assert secret not in out
    assert "hooks.example.com/in" in out
    # Short values are no secrets worth garbling a message for: a status code stays.
    assert redact("HTTP 301: moved", "https://h/in?code=301") == "HTTP 301: moved"


BOUNDS = (0.0, retry.RETRY_AFTER_CAP_S)
NOW = datetime.now(UTC)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("nan", None),
        ("NaN", None),
        ("inf", None),
        ("-inf", None),
        ("-5", None),
        ("1e308", None),
        ("garbage", None),
        ("", None),
        ("0", 0.0),
        ("7", 7.0),
        ("1.5", 1.5),
        ("9" * 400, retry.RETRY_AFTER_CAP_S),
        ("100000000", retry.RETRY_AFTER_CAP_S),
        (format_datetime(NOW - timedelta(days=3), usegmt=True), 0.0),
        (format_datetime(NOW.replace(year=9999), usegmt=True), retry.RETRY_AFTER_CAP_S),
        ("Mon, 01 Jan 99999 00:00:00 GMT", None),
        ("Fri, 31 Dec 9999 23:59:59 -0000", retry.RETRY_AFTER_CAP_S),
    ],
)
def test_retry_after_is_finite_and_clamped(value, expected):
    got = retry.parse_retry_after(value)
    assert got == expected
    target = contract.Target(0, "r", "b", 0, "r", "{}", "t", "http://h/", backoff_ms=50)
    delay = retry.backoff_s(target, 3, got)
    assert math.isfinite(delay) and 0.025 <= delay <= retry.RETRY_AFTER_CAP_S


@pytest.mark.parametrize("raw", [math.nan, math.inf, -math.inf, -5.0, 1e308])
def test_backoff_never_passes_on_a_non_finite_or_out_of_bounds_delay(raw):
    target = contract.Target(0, "r", "b", 0, "r", "{}", "t", "http://h/", backoff_ms=200)
    delay = retry.backoff_s(target, 1, raw)
    assert math.isfinite(delay) and 0.2 <= delay <= retry.RETRY_AFTER_CAP_S
    huge_attempts = retry.backoff_s(target, 10_000)
    assert math.isfinite(huge_attempts) and huge_attempts <= retry.BACKOFF_CAP_S
