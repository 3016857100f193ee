"""Connecting to NATS: the ``nats://HOST:PORT[/...]`` URL rules, the address policy at connect
time, and credentials from a file, never from the URL.

A NATS URL names a server, nothing secret: credentials in it are refused (they would show in
the catalog, the CLI and the UI). Credentials come from the NATS ``.creds`` file named by
``EVENTPUSH_NATS_CREDS``. The host is resolved here and every address it resolves to is
judged by the same policy as HTTP targets (``eventpush.push.targets``) before a packet is
sent; the client then connects to the checked address only, and reconnects to it only: servers
a cluster advertises are never used (their addresses were not checked).
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from eventpush.config import redact_url
from eventpush.push.targets import METADATA_HOSTS, RefusedAddressError, address_policy

CREDS_ENV = "EVENTPUSH_NATS_CREDS"
DEFAULT_PORT = 4222
RECONNECT_WAIT_S = 0.5
CONNECT_TIMEOUT_S = 5
ONE_SHOT_ATTEMPTS = 3


class NatsUrlError(ValueError):
    """A NATS URL that eventpush will not use, said in one line."""


@dataclass(frozen=True)
class NatsUrl:
    host: str
    port: int
    path: str  # what follows the authority, without the leading "/"

    @property
    def server(self) -> str:
        return f"nats://{self.host}:{self.port}"


def parse_url(url: str, what: str = "NATS URL") -> NatsUrl:
    """``nats://HOST[:PORT][/PATH]``, checked (NatsUrlError says what is wrong)."""
    if not isinstance(url, str) or not url.strip():
        raise NatsUrlError(f"{what} is empty")
    url = url.strip()
    where = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise NatsUrlError(f"{what} {where!r} is malformed: {exc}") from None
    if parts.scheme != "nats":
        raise NatsUrlError(f"{what} {where!r} must use nats://, not {parts.scheme or 'none'!r}")
    if parts.username or parts.password:
        raise NatsUrlError(
            f"{what} must not carry credentials: name a .creds file in {CREDS_ENV} instead"
        )
    if parts.query or parts.fragment:
        raise NatsUrlError(f"{what} {where!r} must not have a query string or fragment")
    host = parts.hostname
    if not host:
        raise NatsUrlError(f"{what} {where!r} has no host")
    if host.rstrip(".").lower() in METADATA_HOSTS:
        raise NatsUrlError(f"{what} host {host!r} is a cloud metadata service")
    if port == 0:
        raise NatsUrlError(f"{what} {where!r} has port 0")
    return NatsUrl(host, port or DEFAULT_PORT, parts.path.lstrip("/"))


def checked_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, each allowed by the address policy (else
    RefusedAddressError naming the first refused one; nothing is connected to)."""
    policy = address_policy()
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        why = policy.refusal(address)
        if why is not None:
            raise RefusedAddressError(f"NATS server {host}:{port} refused: {why}")
    return addresses


def credentials_file() -> str | None:
    path = os.environ.get(CREDS_ENV, "").strip()
    if not path:
        return None
    if not os.path.isfile(path):
        raise NatsUrlError(f"{CREDS_ENV} names {path!r}, which is not a readable file")
    return path


async def connect(url: str, *, name: str = "eventpush", persistent: bool = False, **options):
    """A connected ``nats.aio.client.Client`` to the server of ``url`` (checked first). A
    ``persistent`` client (a worker's) waits for a server that is away and reconnects to that
    same address forever; any other gives up after ``ONE_SHOT_ATTEMPTS`` tries."""
    import nats

    where = parse_url(url)
    addresses = await asyncio.to_thread(checked_addresses, where.host, where.port)
    address = addresses[0]
    server = (
        f"nats://[{address}]:{where.port}" if ":" in address else f"nats://{address}:{where.port}"
    )
    pinned = urlsplit(server).netloc

    def only_ours(servers, _info):
        return next((s for s in servers if s.uri.netloc == pinned), None), RECONNECT_WAIT_S

    async def quiet(_exc) -> None:  # reconnects are expected; errors surface on use
        return None

    creds = credentials_file()
    return await nats.connect(
        servers=[server],
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1 if persistent else ONE_SHOT_ATTEMPTS,
        reconnect_time_wait=RECONNECT_WAIT_S,
        connect_timeout=CONNECT_TIMEOUT_S,
        reconnect_to_server_handler=only_ours,
        error_cb=quiet,
        user_credentials=creds,
        **options,
    )
