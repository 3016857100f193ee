"""The demo's front door: ``eventpush api`` in a process of its own, and the shop publishing
to it with boto3's PutEvents, signed with a producer key, as an application on AWS would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ENTRIES_PER_CALL = 10  # PutEvents' own limit
REGION = "us-east-1"


class ApiProcess:
    """``eventpush api`` on 127.0.0.1:``port``, started, waited for and stopped."""

    def __init__(self, port: int, database_url: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        exe = Path(sys.executable).with_name("eventpush")
        self.proc = subprocess.Popen(
            [str(exe), "api", "--port", str(port), "--region", REGION],
            env={**os.environ, "EVENTPUSH_DATABASE_URL": database_url},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"eventpush api did not start: {self._stderr()}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=1) as answer:
                return answer.status == 200
        except OSError:
            return False

    def _stderr(self) -> str:
        try:
            return (self.proc.communicate(timeout=5)[1] or "")[-2000:]
        except subprocess.TimeoutExpired:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


def put_events(
    api_url: str, key: tuple[str, str], bus: str, details: list[dict], threads: int = 8
) -> int:
    """Publish ``details`` ({source, detail-type, detail}) in PutEvents calls of ten entries,
    ``threads`` calls in flight; returns how many entries were accepted. A failed entry is an
    error: the demo's books would not add up."""
    import boto3  # heavy; only the demo's publishing step needs it
    from botocore.config import Config

    client = boto3.client(
        "events",
        endpoint_url=api_url,
        region_name=REGION,
        aws_access_key_id=key[0],
        aws_secret_access_key=key[1],
        config=Config(max_pool_connections=threads, retries={"mode": "standard"}),
    )

    def call(chunk: list[dict]) -> int:
        entries = [
            {
                "EventBusName": bus,
                "Source": e["source"],
                "DetailType": e["detail-type"],
                "Detail": json.dumps(e["detail"], separators=(",", ":")),
            }
            for e in chunk
        ]
        answer = client.put_events(Entries=entries)
        if answer["FailedEntryCount"]:
            failed = next(x for x in answer["Entries"] if "ErrorCode" in x)
            raise RuntimeError(f"PutEvents refused an entry: {failed['ErrorMessage']}")
        return len(entries)

    chunks = [details[i : i + ENTRIES_PER_CALL] for i in range(0, len(details), ENTRIES_PER_CALL)]
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(call, chunks))
