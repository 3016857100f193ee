"""Target URL validation."""

import pytest

from eventpush.push.targets import InvalidTargetUrlError, check_address, validate_url


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
    validate_url("http://10.1.2.3/")
    monkeypatch.setenv("EVENTPUSH_DENY_CIDRS", "10.0.0.0/8, 192.168.0.0/16")
    with pytest.raises(InvalidTargetUrlError, match="10.0.0.0/8"):
        validate_url("http://10.1.2.3/")
    with pytest.raises(InvalidTargetUrlError, match="192.168.0.0/16"):
        check_address("192.168.1.1")
    check_address("127.0.0.1")
