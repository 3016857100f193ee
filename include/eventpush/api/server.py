"""Running the API under uvicorn: ``eventpush api`` puts its options in the environment
(``EVENTPUSH_API_*``) and uvicorn starts ``--workers`` processes, each building the app from
it (eventpush.api.app.app_from_env). Several servers may run behind one load balancer: they
share nothing but the database.

With several workers on Linux, each worker listens on a socket of its own in one
``SO_REUSEPORT`` group, and the kernel spreads new connections across them by a hash of the
connection's addresses. On uvicorn's one shared socket, whichever worker wakes first accepts
every connection waiting: 64 connections opened at once split anywhere from 33/31 to 58/6,
and the busier worker sets the tail of every client's latency (bench/api.py prints the
split). uvicorn's own supervisor still starts, watches and restarts the workers; what it
hands each one in place of a socket is a :class:`_WorkerSocket`, which becomes the worker's
own bound socket when the worker unpickles it. The price: a worker that stops (SIGHUP's
rolling restart, a crash) takes with it the connections still waiting in its socket's
queue, unanswered, where a shared socket would have left them to the others.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"  # nobody else's business unless widened
DEFAULT_PORT = 8080
APP = "eventpush.api.app:app_from_env"
PROTOCOL = "eventpush.api.protocol:OneWriteProtocol"  # a response in one write

log = logging.getLogger("uvicorn.error")


def serve(
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    workers: int = 1,
    region: str | None = None,
    account: str | None = None,
    airflow_url: str | None = None,
    airflow_token_file: Path | None = None,
    max_body: int | None = None,
) -> None:
    import uvicorn

    from eventpush.config import database_url

    database_url()  # a missing or wrong URL fails here, once, not in every worker
    _probe(host, port)
    for name, value in (
        ("EVENTPUSH_API_REGION", region),
        ("EVENTPUSH_API_ACCOUNT", account),
        ("EVENTPUSH_API_AIRFLOW_URL", airflow_url),
        ("EVENTPUSH_API_AIRFLOW_TOKEN_FILE", airflow_token_file),
        ("EVENTPUSH_API_MAX_BODY", max_body),
    ):
        if value is not None:
            os.environ[name] = str(value)
    options = dict(
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=False,  # one line per request would cost more than the request
        # Nothing reads the client's address, so X-Forwarded-For is not worth a middleware
        # call on every request.
        proxy_headers=False,
        log_level="info",
        # Enough for 64+ load-balanced connections; past it uvicorn answers 503.
        limit_concurrency=2048,
        timeout_keep_alive=75,
        http=PROTOCOL,
    )
    if workers == 1 or sys.platform != "linux":
        uvicorn.run(APP, **options)
        return
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config(APP, **options)  # sets up uvicorn's logging
    reserved = _reserve(host, port)
    log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port)
    try:
        Multiprocess(config, sockets=[_WorkerSocket(host, port)]).run()  # type: ignore[list-item]
    finally:
        reserved.close()


def _probe(host: str, port: int) -> None:
    """Refuse, in one line, an address the server cannot have (taken, not this host's, a
    name that does not resolve) before uvicorn starts and logs its own failure. The bind is
    without ``SO_REUSEPORT``: any process of the same user may join such a group, a second
    ``eventpush api`` on the port included, and this fails while anyone listens there."""
    from eventpush.config import ConfigError

    try:
        _bind(host, port, reuse_port=False).close()
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _reserve(host: str, port: int) -> socket.socket:
    """The address, held for the workers by a socket of their group that never listens (so
    it takes no connection); :func:`_probe` has made sure no one else listens there."""
    return _bound(host, port)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A worker's socket: bound to ``(host, port)`` in the address's ``SO_REUSEPORT`` group,
    not yet listening (uvicorn listens on it)."""
    return _bound(host, port)


def _bound(host: str, port: int) -> socket.socket:
    """:func:`_bind` in the address's ``SO_REUSEPORT`` group; exits with uvicorn's start-up
    failure code when the address cannot be had, as uvicorn does."""
    from uvicorn.config import STARTUP_FAILURE

    try:
        return _bind(host, port, reuse_port=True)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        sys.exit(STARTUP_FAILURE)


def _bind(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``(host, port)``, or OSError (the socket closed)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, as uvicorn
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _WorkerSocket:
    """What uvicorn's supervisor hands each worker it starts (and restarts) in its list of
    sockets: pickled to the worker as the recipe for its own socket, not as a shared one."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def __reduce__(self):
        return reuse_port_socket, (self.host, self.port)
