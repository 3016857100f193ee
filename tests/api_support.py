"""The API server for tests: ``eventpush api`` run for real in a subprocess on a free
loopback port, keys made with the real ``eventpush key create``, boto3 clients on it, and
raw signed requests (botocore's signer, as any SDK) for what an SDK would never send.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import httpx
import psutil
from botocore.auth import SIGV4_TIMESTAMP, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from ports import free_port

EXE = str(Path(sys.executable).with_name("eventpush"))
REGION = "us-east-1"


def cli_json(env: dict, *args: str) -> dict:
    r = subprocess.run([EXE, *args, "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def make_key(env: dict, name: str, role: str, *buses: str) -> tuple[str, str]:
    extra = [a for bus in buses for a in ("--bus", bus)]
    doc = cli_json(env, "key", "create", name, "--role", role, *extra)
    return doc["access_key_id"], doc["secret_access_key"]


class ApiServer:
    """``eventpush api`` on a free port of 127.0.0.1, started and waited for; run under
    ``wrapper`` (a command prefix, such as valgrind's) when given, which starts and stops
    slower: ``start_s`` and ``stop_s`` bound both waits."""

    def __init__(
        self,
        env: dict,
        *args: str,
        wrapper: tuple[str, ...] = (),
        start_s: float = 90.0,  # a loaded 2-core machine starts workers slowly
        stop_s: float = 10.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.stop_s = stop_s
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [*wrapper, EXE, "api", "--port", str(self.port), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
        )
        deadline = time.monotonic() + start_s
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                said = self.log.read()[-2000:]
                self.stop()  # closes the log
                raise AssertionError(f"eventpush api did not start: {said}")
            time.sleep(0.1)

    def client(self, key: tuple[str, str], **kw):
        return boto3.client(
            "events",
            endpoint_url=self.url,
            region_name=kw.pop("region", REGION),
            aws_access_key_id=key[0],
            aws_secret_access_key=key[1],
            config=Config(retries={"total_max_attempts": 1}, **kw),
        )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def signed_request(
    url: str,
    operation: str,
    body: bytes,
    key: tuple[str, str],
    *,
    when: float | None = None,
    region: str = REGION,
) -> AWSRequest:
    """A request signed with botocore's SigV4Auth at ``when`` (epoch seconds; now if None)."""
    headers = {
        "Content-Type": "application/x-amz-json-1.1",
        "X-Amz-Target": f"AWSEvents.{operation}",
        "Host": url.split("://", 1)[1],
    }
    request = AWSRequest(method="POST", url=url + "/", data=body, headers=headers)
    stamp = time.strftime(SIGV4_TIMESTAMP, time.gmtime(time.time() if when is None else when))
    request.context["timestamp"] = stamp
    request.headers["X-Amz-Date"] = stamp
    signer = SigV4Auth(Credentials(*key), "events", region)
    canonical = signer.canonical_request(request)
    signature = signer.signature(signer.string_to_sign(request, canonical), request)
    signer._inject_signature_to_request(request, signature)
    return request


def signed_headers(request: AWSRequest) -> dict[str, str]:
    """A signed request's headers to send as they are (``Host`` is the client's to set)."""
    return {k: v for k, v in request.headers.items() if k.lower() != "host"}


def send(request: AWSRequest, body: bytes | None = None) -> httpx.Response:
    """Send a signed request, with ``body`` in place of the signed one when given."""
    return httpx.post(
        request.url, content=request.body if body is None else body, headers=signed_headers(request)
    )


def sockets_by_worker(pid: int, port: int, status: str) -> dict[int, int]:
    """How many TCP sockets on ``port`` in ``status`` (psutil's, e.g. ``ESTABLISHED``) each
    process of the server ``pid`` holds: the top one (which serves alone with one worker)
    and every process under it; processes holding none are left out."""
    held = {}
    top = psutil.Process(pid)
    for proc in [top, *top.children(recursive=True)]:
        try:
            found = proc.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        mine = sum(1 for c in found if c.status == status and c.laddr.port == port)
        if mine:
            held[proc.pid] = mine
    return held


def error_code(response: httpx.Response) -> str:
    return response.json()["__type"]


os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # boto3 never asks 169.254.169.254
