"""The cost of a connection's auth per delivery (issue 32), paired against plain targets.

    flock /tmp/eventpush-bench.lock .venv/bin/python bench/destination_auth.py [--events N]
        [--rounds R]

Each round drains the same events to four targets with one worker, three ways in turn: plain
``--url`` targets, targets through an API destination with an API-key connection, and through
one with an OAuth2 client credentials connection (a loopback token endpoint in this process;
one token per run). The receiver (``python -m eventpush.demo.receiver``) runs in a process
of its own and answers every one alike, so the difference is the sender's: the headers and,
for OAuth2, the token look-up per send. Goal: within 5 % of plain.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg2  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402
from eventpush.demo.receiver import ReceiverProcess  # noqa: E402
from eventpush.publish import publish  # noqa: E402
from eventpush.push import run_worker  # noqa: E402

PATHS = ["/ok/a", "/ok/b", "/ok/c", "/ok/d"]


class TokenEndpoint(BaseHTTPRequestHandler):
    requests = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        TokenEndpoint.requests += 1
        body = json.dumps({"access_token": "bench-token", "expires_in": 3600}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def events(n: int) -> list[str]:
    return [
        json.dumps({"source": "shop.orders", "detail-type": "OrderPlaced", "detail": {"n": i}})
        for i in range(n)
    ]


def drain(kind: str, n: int, receiver: str, token_url: str) -> tuple[float, int]:
    with scratch_database() as url:
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4)
        catalog.create_rule(conn, "orders", "all", {"source": ["shop.orders"]})
        if kind == "api-key":
            catalog.create_connection(conn, "c", "api-key", "k" * 32, key_name="X-Api-Key")
        elif kind == "oauth":
            catalog.create_connection(
                conn, "c", "oauth-client-credentials", "s" * 32, token_url=token_url,
                client_id="bench",
            )  # fmt: skip
        for i, path in enumerate(PATHS):
            spec = {"url": receiver + path}
            if kind != "plain":
                catalog.create_destination(conn, f"d{i}", receiver + path, connection="c")
                spec = {"url": "", "destination": f"d{i}"}
            catalog.create_target(
                conn, "orders", "all", catalog.TargetSpec(name=f"t{i}", concurrency=8, **spec)
            )
        catalog.create_worker(conn, "w1")
        catalog.assign(conn)
        publish(conn, "orders", events(n))
        conn.close()
        started = time.perf_counter()
        report = run_worker("w1", until_idle=True, max_seconds=600)
        return time.perf_counter() - started, report.delivered


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not os.environ.get("EVENTPUSH_SECRET_KEY_FILE"):  # connection secrets are sealed
        from eventpush.sealed import write_key_file

        key = Path(tempfile.mkdtemp(prefix="eventpush-bench-key-")) / "secret.key"
        write_key_file(key)
        atexit.register(shutil.rmtree, key.parent, True)
        os.environ["EVENTPUSH_SECRET_KEY_FILE"] = str(key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token_url = f"http://127.0.0.1:{server.server_address[1]}/token"
    print(f"machine: {machine()}; load average at start: {os.getloadavg()}")
    rates: dict[str, list[float]] = {}
    with ReceiverProcess() as rx:
        for r in range(args.rounds):
            for kind in ("plain", "api-key", "oauth"):
                elapsed, delivered = drain(kind, args.events, rx.url, token_url)
                rate = delivered / elapsed
                rates.setdefault(kind, []).append(rate)
                print(
                    f"round {r + 1}, {kind}: {delivered:,} deliveries in {elapsed:.2f} s = "
                    f"{rate:,.0f}/s (load {os.getloadavg()[0]:.2f})"
                )
                sys.stdout.flush()
    server.shutdown()
    plain = sum(rates["plain"]) / len(rates["plain"])
    for kind in ("api-key", "oauth"):
        mean = sum(rates[kind]) / len(rates[kind])
        print(f"{kind}: {mean:,.0f}/s = {mean / plain:.3f} of plain ({plain:,.0f}/s)")
    print(f"token requests: {TokenEndpoint.requests} (one per oauth run expected)")


if __name__ == "__main__":
    main()
