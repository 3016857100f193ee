"""The API's CPU a request by part, measured in place: the real app (``app_from_env``, its
lifespan, its group commit on a scratch database) called in-process by ``--callers`` tasks for
``--seconds``, no HTTP server, with one part taken out at a time.

On a slow host code run once a request among everything else costs two to four times its
figure in a loop of its own (the SigV4 check: 58 µs warm, ~130 µs in the app), so a part's
cost is sized here by what the app saves without it:

- ``--skip auth``: the signature check made a no-op (the key is still looked up);
- ``--skip entries``: ``entry_event`` memoised per entry position (each call returns a fresh
  ``Prepared`` with the request's id and queue, as the real one would);
- ``--skip commit``: ``GroupPublisher.publish`` returns after one turn of the loop, nothing
  stored (the group commit's Python: the queueing, the wake-ups, the statement's
  parameters, psycopg).

Each round runs the whole app, then the app without each part named, in turn, ``--rounds``
times, and prints CPU µs a request (this process, ``time.process_time``; the database's
backends are not counted) and requests/s. Compare two trees by running it under each one's
``PYTHONPATH=<tree>/include``.

    .venv/bin/python bench/api_parts.py [--skip auth --skip entries --skip commit] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import psycopg2  # noqa: E402
import uvloop  # noqa: E402
from api import ENTRIES, put_events_body  # noqa: E402
from api_support import make_key, signed_request  # noqa: E402
from common import machine, scratch_database  # noqa: E402

from eventpush import catalog  # noqa: E402

PARTS = ("auth", "entries", "commit")


def _skipping(part: str | None) -> list[tuple[object, str, object]]:
    """The patches that take ``part`` out: (module, attribute, replacement)."""
    import eventpush.api.app as app_module
    import eventpush.api.events as events_module

    if part == "auth":
        return [(app_module.auth, "verify", lambda *args: None)]
    if part == "entries":
        real = events_module.entry_event
        made: dict[str, object] = {}

        def memoised(entry, bus, where, now_iso, queue_id, event_id):
            first = made.get(where)
            if first is None:
                first = made[where] = real(entry, bus, where, now_iso, queue_id, event_id)
            return events_module.Prepared(
                queue_id,
                event_id,
                first.source,
                first.detail_type,
                first.time,
                first.body,
                first.size,
            )

        return [(events_module, "entry_event", memoised)]
    if part == "commit":
        from eventpush.group_publish import GroupPublisher

        async def stored_at_once(self, bus, events) -> None:
            # One turn of the loop, as a request waiting for its commit gives up: without
            # it a caller would never yield, and the loop's own work would count as the
            # commit's.
            await asyncio.sleep(0)

        return [(GroupPublisher, "publish", stored_at_once)]
    return []


async def _start(app) -> tuple[asyncio.Queue, asyncio.Task]:
    """The app's lifespan started: its inbox (for the shutdown) and its task."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put)
    )
    await inbox.put({"type": "lifespan.startup"})
    answer = await outbox.get()
    if answer["type"] != "lifespan.startup.complete":
        sys.exit(f"the app did not start: {answer}")
    return inbox, task


async def _run(part: str | None, key: tuple[str, str], callers: int, seconds: float):
    """(CPU µs a request, requests/s) of the app with ``part`` taken out (None: whole)."""
    from eventpush.api.app import app_from_env

    patches = _skipping(part)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        app = app_from_env()
        inbox, lifespan = await _start(app)
        body = put_events_body()
        signed = signed_request("http://127.0.0.1:8080", "PutEvents", body, key)
        headers = [(k.lower().encode(), v.encode()) for k, v in signed.headers.items()]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/",
            "query_string": b"",
            "headers": headers,
        }
        answered, refused = 0, 0
        stop = time.monotonic() + seconds

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        async def one_request() -> list[int]:
            statuses: list[int] = []

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await app(dict(scope), receive, send)
            return statuses

        async def caller() -> None:
            nonlocal answered, refused
            while time.monotonic() < stop:
                refused += await one_request() != [200]
                answered += 1

        cpu, started = time.process_time(), time.monotonic()
        await asyncio.gather(*(caller() for _ in range(callers)))
        cpu, elapsed = time.process_time() - cpu, time.monotonic() - started
        await inbox.put({"type": "lifespan.shutdown"})
        await lifespan
        if refused:
            sys.exit(f"{refused} of {answered} requests were not answered 200")
        return cpu / answered * 1e6, answered / elapsed
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip", action="append", choices=PARTS, default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--callers", type=int, default=32)
    args = parser.parse_args()
    variants: list[str | None] = [None, *args.skip]
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        from eventpush.sealed import KEY_FILE_ENV, write_key_file

        write_key_file(Path(tmp) / "secret.key")
        os.environ.update({"EVENTPUSH_DATABASE_URL": url, KEY_FILE_ENV: f"{tmp}/secret.key"})
        conn = psycopg2.connect(url)
        catalog.create_bus(conn, "orders", 4)
        conn.close()
        key = make_key(dict(os.environ), "bench", "admin")
        uvloop.install()
        got: dict[str | None, list[tuple[float, float]]] = {v: [] for v in variants}
        for n in range(args.rounds):
            for variant in variants:
                cpu, rate = asyncio.run(_run(variant, key, args.callers, args.seconds))
                got[variant].append((cpu, rate))
                label = "whole app" if variant is None else f"without {variant}"
                print(f"round {n + 1}, {label}: {cpu:,.0f} µs of CPU a request, {rate:,.0f}/s")
    print(f"machine: {machine()}; {args.callers} callers, PutEvents of {ENTRIES} entries")
    whole = statistics.median(cpu for cpu, _ in got[None])
    print(f"whole app: {whole:,.0f} µs a request (median of {args.rounds})")
    for part in args.skip:
        without = statistics.median(cpu for cpu, _ in got[part])
        print(
            f"{part}: {whole - without:,.0f} µs a request in place (the app without it: "
            f"{without:,.0f})"
        )


if __name__ == "__main__":
    main()
