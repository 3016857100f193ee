"""Connecting to NATS, for buses (``eventpush.sources.nats``) and targets
(``eventpush.sinks.nats``) alike: the ``nats://HOST[:PORT][/...]`` URL rules, credentials from
a file, never from the URL, and a connection pinned to an address the policy allows.

A NATS URL names a server, nothing secret: credentials in it are refused (they would show in
the catalog, the CLI and the UI). Credentials come from the file ``EVENTPUSH_NATS_CREDENTIALS``
names: a NATS ``.creds`` file (user JWT and seed), a ``user:password`` line or a token. The host
is resolved here and every address it resolves to is judged by the same policy as HTTP targets
(``eventpush.push.targets``) before a packet is sent; the client then connects to the checked
address only, and reconnects to it only: servers a cluster advertises are never used (their
addresses were not checked).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from eventpush.addresses import (
    METADATA_HOSTS,
    AddressPolicy,
    InvalidTargetUrlError,
    RefusedAddressError,
    address_policy,
    check_host,
    split_url,
)
from eventpush.config import ConfigError

CREDENTIALS_ENV = "EVENTPUSH_NATS_CREDENTIALS"
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
    explicit_port: bool = True

    @property
    def server(self) -> str:
        return f"nats://{self.host}:{self.port}"


def parse_url(url: str, what: str = "NATS URL") -> NatsUrl:
    """``nats://HOST[:PORT][/PATH]``, checked (NatsUrlError says what is wrong)."""
    url, parts, port, where = split_url(url, what, NatsUrlError)
    if parts.scheme != "nats":
        raise NatsUrlError(f"{what} {where!r} must use nats://, not {parts.scheme or 'none'!r}")
    if parts.username or parts.password:
        raise NatsUrlError(
            f"{what} must not carry credentials: put the NATS credentials in a file named by "
            f"{CREDENTIALS_ENV}"
        )
    if parts.query or parts.fragment:
        raise NatsUrlError(f"{what} {where!r} must have no query or fragment")
    host = parts.hostname
    if not host:
        raise NatsUrlError(f"{what} {where!r} has no host")
    if host.rstrip(".").lower() in METADATA_HOSTS:
        raise NatsUrlError(f"{what} host {host!r} is a cloud metadata service")
    if port == 0:
        raise NatsUrlError(f"{what} {where!r} has port 0")
    return NatsUrl(host, port or DEFAULT_PORT, parts.path.lstrip("/"), port is not None)


def credentials() -> dict:
    """nats-py connect options from the file ``EVENTPUSH_NATS_CREDENTIALS`` names: a NATS
    ``.creds`` file (user JWT and seed), a ``user:password`` line or a token; none when unset."""
    path = os.environ.get(CREDENTIALS_ENV, "").strip()
    if not path:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{CREDENTIALS_ENV} names {path}, which cannot be read: "
            f"{exc.strerror or type(exc).__name__}"
        ) from None
    if "BEGIN NATS USER JWT" in text:
        return {"user_credentials": path}
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not line:
        raise ConfigError(f"{CREDENTIALS_ENV} names {path}, which is empty")
    user, sep, password = line.partition(":")
    return {"user": user, "password": password} if sep else {"token": line}


def secrets_of(options: dict) -> list[str]:
    """The credential values among connect ``options``, to mask out of any text shown."""
    return [v for k, v in options.items() if k in ("password", "token") and v]


async def checked_address(host: str, port: int, policy: AddressPolicy | None = None) -> str:
    """The address to connect to, after every address ``host`` resolves to passed the policy
    (RefusedAddressError names the first refused one; a name that mixes allowed and denied
    addresses is a rebinding trick, not a broker)."""
    policy = policy or address_policy()
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        policy.check(address)
    return addresses[0]


# Pinning: the client's server pool must never hold an address the policy did not check. Of
# the two ways nats-py offers, dropping ``connect_urls`` from every INFO is the sturdier: the
# advertised servers never enter the pool, so no code path can pick one. A
# ``reconnect_to_server_handler`` only steers the choice, and nats-py falls back to the first
# eligible pool entry (an advertised server) when the handler finds none, e.g. once the pinned
# server used up its reconnect attempts. The override hooks a private method, so its absence
# (a nats-py that renamed it) fails loudly instead of silently unpinning.
@functools.cache
def _pinned_client_class() -> type:
    import nats  # heavy; only a connection needs it

    if not callable(getattr(nats.NATS, "_process_info", None)):  # pragma: no cover
        raise RuntimeError("nats-py no longer has NATS._process_info: NATS pinning needs review")

    class PinnedClient(nats.NATS):
        """A client that never adds the servers a cluster advertises to its pool."""

        async def _process_info(self, info: dict, initial_connection: bool = False) -> None:
            info = {key: value for key, value in info.items() if key != "connect_urls"}
            await super()._process_info(info, initial_connection)

    return PinnedClient


async def connect_pinned(host: str, port: int, *, policy: AddressPolicy | None = None, **options):
    """A client connected to the checked address of ``host`` and reconnecting to it only;
    ``options`` go to nats-py's connect (credentials included: see ``credentials``)."""
    address = await checked_address(host, port, policy)
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    client = _pinned_client_class()()
    try:
        await client.connect(servers=[f"nats://{netloc}"], dont_randomize=True, **options)
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(client.close())
        raise
    return client


async def connect(url: str, *, name: str = "eventpush", persistent: bool = False, **options):
    """A bus's client for the server of ``url`` (checked first). A ``persistent`` client (a
    worker's) waits for a server that is away and reconnects to that same address forever; any
    other gives up after ``ONE_SHOT_ATTEMPTS`` tries."""
    where = parse_url(url)

    async def quiet(_exc) -> None:  # reconnects are expected; errors surface on use
        return None

    try:
        return await connect_pinned(
            where.host,
            where.port,
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1 if persistent else ONE_SHOT_ATTEMPTS,
            reconnect_time_wait=RECONNECT_WAIT_S,
            connect_timeout=CONNECT_TIMEOUT_S,
            error_cb=quiet,
            **credentials(),
            **options,
        )
    except RefusedAddressError as exc:
        raise RefusedAddressError(f"NATS server {where.host}:{where.port} refused: {exc}") from None


# A NATS subject token: no separators, wildcards or whitespace (a target publishes to one
# concrete subject).
_NATS_TOKEN = re.compile(r"[^.*>\s/]+")


def validate_target_url(url: str, policy: AddressPolicy | None = None) -> str:
    """A nats:// target URL, checked: the rules every NATS URL follows (:func:`parse_url`),
    then a target's own: an explicit port and one concrete subject as the path, and a host
    the address policy passes. Raises InvalidTargetUrlError saying what is wrong."""
    url, _, _, where = split_url(url, "target URL")
    try:
        nats_url = parse_url(url, "target URL")
    except NatsUrlError as exc:
        raise InvalidTargetUrlError(str(exc)) from None
    if not nats_url.explicit_port:
        raise InvalidTargetUrlError(
            f"target URL {where!r} has no port: write nats://HOST:PORT/SUBJECT (NATS uses 4222)"
        )
    subject = nats_url.path
    if not subject:
        raise InvalidTargetUrlError(
            f"target URL {where!r} must be nats://HOST:PORT/SUBJECT: one subject as the path, "
            "no query or fragment"
        )
    if not all(_NATS_TOKEN.fullmatch(t) for t in subject.split(".")):
        raise InvalidTargetUrlError(
            f"target URL {where!r}: {subject!r} is not a concrete NATS subject (dot-separated "
            "tokens without '/', '*', '>' or spaces)"
        )
    return check_host(url, nats_url.host, where, policy)
