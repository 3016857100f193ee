"""The address policy: which addresses eventpush may push to or read from (the SSRF guard).

A leaf: every sink validates its own URLs through :func:`check_host` and checks each address it
connects to with :meth:`AddressPolicy.check`; nothing here knows the sinks.

Safe by default: private (RFC 1918), loopback, link-local, CGNAT, unique-local IPv6,
multicast, reserved, unspecified, documentation and cloud-metadata addresses are denied.
The operator opens ranges with ``EVENTPUSH_ALLOW_CIDRS`` and denies more with
``EVENTPUSH_DENY_CIDRS``; deny wins over allow. Metadata addresses stay denied whatever is
allowed: no deployment needs to push events to them. IPv6 forms that carry an IPv4 address
(mapped, compatible, NAT64, 6to4, Teredo) are judged like every IPv4 they carry too.

The same policy runs when a target is created (on the URL) and when the engine or replay
connects (on every address a socket is about to reach, IP literals included), so a name that
later resolves to a denied address is refused too.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from eventpush.config import Network, allow_cidrs, deny_cidrs, redact_url

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _nets(*cidrs: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


METADATA = _nets(
    "169.254.169.254/32",  # AWS, GCP, Azure, OpenStack, DigitalOcean...
    "169.254.170.2/32",  # AWS ECS task metadata
    "168.63.129.16/32",  # Azure WireServer
    "100.100.100.200/32",  # Alibaba Cloud
    "192.0.0.192/32",  # Oracle Cloud
    "fd00:ec2::254/128",  # AWS over IPv6
)
DENIED_RANGES = _nets(
    "0.0.0.0/8",  # "this network", incl. the unspecified 0.0.0.0
    "10.0.0.0/8",  # RFC 1918
    "100.64.0.0/10",  # CGNAT (RFC 6598)
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local
    "172.16.0.0/12",  # RFC 1918
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24",  # documentation (TEST-NET-1)
    "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
    "192.168.0.0/16",  # RFC 1918
    "198.18.0.0/15",  # benchmarking
    "198.51.100.0/24",  # documentation (TEST-NET-2)
    "203.0.113.0/24",  # documentation (TEST-NET-3)
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, incl. broadcast 255.255.255.255
    "::/128",  # unspecified
    "::1/128",  # loopback
    "100::/64",  # discard-only
    "2001:db8::/32",  # documentation
    "fc00::/7",  # unique-local
    "fe80::/10",  # link-local
    "fec0::/10",  # site-local (deprecated)
    "ff00::/8",  # multicast
)

NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
# A local-use NAT64 prefix may be any RFC 6052 length from /48 on; each layout is tried.
NAT64_LOCAL_LENGTHS = (48, 56, 64, 96)
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")

METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data"})


class InvalidTargetUrlError(ValueError):
    """A target URL that eventpush will not push to."""


class RefusedAddressError(OSError):
    """A connection to a denied address, refused before a packet is sent.

    An ``OSError`` so that the senders (HTTP and NATS) treat it like any failed connection
    attempt."""


def _nat64_ipv4(value: int, prefix_len: int) -> ipaddress.IPv4Address | None:
    """The IPv4 address RFC 6052 embeds after a ``prefix_len``-bit NAT64 prefix (it skips
    bits 64-71, the u-octet), or None when the address cannot have that layout: the u-octet
    and the bits after the IPv4 address must be zero."""
    bits = format(value, "0128b")
    positions = [p for p in range(prefix_len, 128) if not 64 <= p < 72][:32]
    rest = [p for p in range(positions[-1] + 1, 128) if not 64 <= p < 72]
    if "1" in bits[64:72] or any(bits[p] == "1" for p in rest):
        return None
    return ipaddress.IPv4Address(int("".join(bits[p] for p in positions), 2))


def embedded_ipv4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an IPv6 address carries, as a router on its way would reach it."""
    if ip.version == 4:
        return []
    found: list[ipaddress.IPv4Address] = []
    if ip.ipv4_mapped is not None:
        found.append(ip.ipv4_mapped)
    if ip in IPV4_TRANSLATED:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip in IPV4_COMPATIBLE and int(ip) > 1:  # :: and ::1 are not IPv4-compatible
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip in NAT64_WELL_KNOWN:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip in NAT64_LOCAL:
        # The prefix length is the operator's, unknown here: every layout that fits is
        # judged, except readings in 0.0.0.0/8, which no translator forwards to (they come
        # from reading a longer layout's zero padding as an address).
        layouts = [_nat64_ipv4(int(ip), n) for n in NAT64_LOCAL_LENGTHS]
        found.extend(v4 for v4 in layouts if v4 is not None and v4 not in THIS_NETWORK)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)  # the Teredo server and the (de-obfuscated) client
    return found


@dataclass(frozen=True)
class AddressPolicy:
    """Which addresses targets may reach: the defaults, opened by ``allow``, closed by
    ``deny`` (deny wins). Small and picklable, so replay ships the driver's policy to its
    executors instead of trusting theirs."""

    allow: tuple[Network, ...] = ()
    deny: tuple[Network, ...] = ()

    def refusal(self, address: str | IPAddress) -> str | None:
        """Why ``address`` is refused, or None when it may be reached. An address carrying
        IPv4 addresses is refused when it or any of them is; the gravest reason is given."""
        ip = _ip(address)
        reasons = []
        for candidate in [ip, *embedded_ipv4(ip)]:
            found = self._refusal_of(candidate)
            if found is not None:
                rank, why = found
                reasons.append((rank, why if candidate is ip else f"{why} (carried by {ip})"))
        return min(reasons)[1] if reasons else None

    def _refusal_of(self, ip: IPAddress) -> tuple[int, str] | None:
        for net in self.deny:
            if _within(ip, net):
                return 0, f"address {ip} is in the denied range {net} (EVENTPUSH_DENY_CIDRS)"
        broad = next((net for net in DENIED_RANGES if _within(ip, net)), None)
        metadata = next((net for net in METADATA if _within(ip, net)), None)
        if metadata is not None:
            return 1, f"address {ip} is in the denied range {broad or metadata}: cloud metadata"
        if broad is None or any(_within(ip, net) for net in self.allow):
            return None
        return 2, (
            f"address {ip} is in the denied range {broad} (open it with EVENTPUSH_ALLOW_CIDRS)"
        )

    def check(self, address: str | IPAddress) -> None:
        """Raise RefusedAddressError when ``address`` may not be reached."""
        why = self.refusal(address)
        if why is not None:
            raise RefusedAddressError(why)


def _within(ip: IPAddress, net: Network) -> bool:
    return ip.version == net.version and ip in net


def _ip(address: str | IPAddress) -> IPAddress:
    if isinstance(address, str):
        return ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    return address


def address_policy() -> AddressPolicy:
    """The policy configured in the environment (ConfigError names a bad range)."""
    return AddressPolicy(allow=allow_cidrs(), deny=deny_cidrs())


def check_address(address: str, policy: AddressPolicy | None = None) -> None:
    """Refuse an address the policy denies (InvalidTargetUrlError says why)."""
    why = (policy or address_policy()).refusal(address)
    if why is not None:
        raise InvalidTargetUrlError(why)


def split_url(url: str, what: str, error: type[ValueError] = InvalidTargetUrlError):
    """``(url, parts, port, where)``: the URL stripped, split, its port, and its redacted form
    for messages; ``error`` says in one line when it is empty or does not parse."""
    if not isinstance(url, str) or not url.strip():
        raise error(f"{what} is empty")
    url = url.strip()
    where = redact_url(url)
    try:
        parts = urlsplit(url)
        return url, parts, parts.port, where
    except ValueError as exc:
        raise error(f"{what} {where!r} is malformed: {exc}") from None


def scheme_of(url: str) -> str:
    """A URL's scheme, lower-cased (empty when it has none): what chooses its sink."""
    return url.partition(":")[0].strip().lower()


def check_host(url: str, host: str, where: str, policy: AddressPolicy | None = None) -> str:
    """``url`` when its ``host`` may be pushed to: not a cloud metadata name, and an IP literal
    the policy allows (a name's addresses are checked when the sink connects); raises
    InvalidTargetUrlError saying why not. ``where`` is the URL's redacted form."""
    if host.rstrip(".").lower() in METADATA_HOSTS:
        raise InvalidTargetUrlError(f"target URL host {host!r} is a cloud metadata service")
    try:
        _ip(host)
    except ValueError:
        return url  # a name: its addresses are checked when the engine connects
    try:
        check_address(host, policy)
    except InvalidTargetUrlError as exc:
        raise InvalidTargetUrlError(f"target URL {where!r} refused: {exc}") from None
    return url
