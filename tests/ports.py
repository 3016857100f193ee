"""Free ports for the servers tests start in processes of their own (API, Airflow, NATS, a
Spark cluster), taken below the kernel's range of ephemeral ports.

A port found free by ``bind(0)`` lies inside that range (32768-60999 by default), and between
the check and the server's own bind any outgoing connection may take it: CI runs two lanes side
by side and each makes thousands (one rehearsal's Airflow API server lost its port so). Below
the range, only another test's server can take a port, and each checks its ports first.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10_000


def ephemeral_from() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_base(span: int = 1, host: str = "127.0.0.1") -> int:
    """A port with ``span`` free ports from it on ``host``, below the ephemeral range."""
    top = max(LOWEST + 1, ephemeral_from() - span)
    for _ in range(200):
        base = random.randrange(LOWEST, top)
        socks = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} free port(s) in a row on {host} below {top}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_base(1, host)
