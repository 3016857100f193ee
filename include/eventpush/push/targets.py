"""Target URL rules: http or https, never link-local or cloud-metadata addresses.

The same check runs when a target is created (on the URL) and when the push engine connects
(on every resolved address), so a name that later resolves to a metadata address is refused
too. Operators deny more ranges with ``EVENTPUSH_DENY_CIDRS`` (comma-separated CIDRs).
"""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

DENY_ENV = "EVENTPUSH_DENY_CIDRS"

ALWAYS_DENIED = tuple(
    ipaddress.ip_network(cidr)
    for cidr in (
        "169.254.0.0/16",  # IPv4 link-local, incl. 169.254.169.254 (AWS, GCP, Azure metadata)
        "fe80::/10",  # IPv6 link-local
        "fd00:ec2::254/128",  # AWS metadata over IPv6
        "100.100.100.200/32",  # Alibaba Cloud metadata
        "0.0.0.0/32",
        "::/128",
    )
)
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data"})


class InvalidTargetUrlError(ValueError):
    """A target URL that eventpush will not push to."""


def denied_networks() -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    extra = []
    for raw in os.environ.get(DENY_ENV, "").split(","):
        raw = raw.strip()
        if not raw:
            continue
        try:
            extra.append(ipaddress.ip_network(raw, strict=False))
        except ValueError:
            raise InvalidTargetUrlError(f"{DENY_ENV}: {raw!r} is not a CIDR range") from None
    return ALWAYS_DENIED + tuple(extra)


def check_address(address: str) -> None:
    """Refuse an IP address inside a denied range."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    for net in denied_networks():
        if ip.version == net.version and ip in net:
            raise InvalidTargetUrlError(f"address {ip} is in the denied range {net}")


def shown(url: str) -> str:
    """The URL as errors show it: no query or fragment, where tokens like to hide."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("?", 1)[0].split("#", 1)[0]
    return parts._replace(query="", fragment="").geturl() if parts.query or parts.fragment else url


def validate_url(url: str) -> str:
    """The URL, checked; raises InvalidTargetUrlError saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidTargetUrlError("target URL is empty")
    url = url.strip()
    where = shown(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidTargetUrlError(f"target URL {where!r} is malformed: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidTargetUrlError(
            f"target URL {where!r} must use http or https, not {parts.scheme or 'no scheme'!r}"
        )
    host = parts.hostname
    if not host:
        raise InvalidTargetUrlError(f"target URL {where!r} has no host")
    if parts.username or parts.password:
        raise InvalidTargetUrlError(
            "target URL must not carry credentials: give the target a --secret instead"
        )
    if port == 0:
        raise InvalidTargetUrlError(f"target URL {where!r} has port 0")
    if host.rstrip(".").lower() in METADATA_HOSTS:
        raise InvalidTargetUrlError(f"target URL host {host!r} is a cloud metadata service")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return url  # a name: its addresses are checked when the engine connects
    try:
        check_address(host)
    except InvalidTargetUrlError as exc:
        raise InvalidTargetUrlError(f"target URL {where!r} refused: {exc}") from None
    return url
