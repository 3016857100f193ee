"""The Python environment that travels with every Spark job sent to a cluster.

Spark's executors run the job's Python functions (rule matching, replay's push) in their own
interpreter, which on a cluster is not this checkout's: without the dependencies they fail
with ``No module named 'pyarrow'``. So, as Spark documents for PySpark, a job whose master is
not ``local[...]`` ships a virtual environment packed with venv-pack as ``spark.archives``
(unpacked as ``./pyenv`` in each executor's working directory) and points
``spark.pyspark.python`` into it. The executors then need only Java and this driver's Python
(same version, at the same path: a venv links to its base interpreter, it does not carry it).

The environment is built from ``requirements-executor.lock`` (what the executors import,
pinned by ``requirements.lock``), every wheel checked against the lock's hashes, then packed
into ``var/spark-pyenv/pyenv-KEY.tar.gz``, where KEY hashes the lock and the interpreter. It
is built once, on the first non-local submit (or by ``scripts/setup.sh``), and reused after;
a file lock keeps two submitters from building it at once.

``EVENTPUSH_SPARK_PYENV`` overrides: the path of a ready archive (an image builds its own),
or ``off`` when the executors already have everything installed (then ``PYSPARK_PYTHON``
says which interpreter they run).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from eventpush import sealed
from eventpush.sparkjobs.errors import SparkSetupError

PYENV_ENV_VAR = "EVENTPUSH_SPARK_PYENV"
ALIAS = "pyenv"
EXECUTOR_PYTHON = f"./{ALIAS}/bin/python"
REPO = Path(__file__).resolve().parents[3]
LOCK_FILE = REPO / "requirements-executor.lock"
CACHE_DIR = REPO / "var" / "spark-pyenv"


def is_local(master: str) -> bool:
    return master.startswith("local")


def base_python() -> str:
    """The interpreter this venv was made from: the one the packed venv links to."""
    return getattr(sys, "_base_executable", None) or sys.executable


def cache_key(lock: Path = LOCK_FILE) -> str:
    digest = hashlib.sha256(lock.read_bytes())
    digest.update(f"{base_python()}\0{sys.version}".encode())
    return digest.hexdigest()[:16]


def _uv() -> str:
    # Deferred: uv is needed only to build the executors' environment.
    from uv import find_uv_bin

    return find_uv_bin()


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise SparkSetupError(f"{what} failed: " + " / ".join(tail))


def build_archive(lock: Path = LOCK_FILE, cache_dir: Path = CACHE_DIR) -> Path:
    """The packed executor environment for ``lock``, built now unless already cached."""
    # Deferred: venv-pack is needed only to pack the executors' environment.
    import venv_pack

    if not lock.is_file():
        raise SparkSetupError(
            f"{lock} not found: the executors' environment is built from it in a checkout; "
            f"elsewhere set {PYENV_ENV_VAR} to a packed environment (or 'off')"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    archive = cache_dir / f"pyenv-{cache_key(lock)}.tar.gz"
    with open(cache_dir / ".lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another submitter may be building the same one
        if archive.is_file():
            return archive
        prefix = cache_dir / f"build-{os.getpid()}"
        partial = archive.with_suffix(".partial")
        shutil.rmtree(prefix, ignore_errors=True)
        try:
            _run([_uv(), "venv", "-q", "--python", base_python(), str(prefix)], "uv venv")
            # Copies, not links into uv's cache: the archive must hold the files themselves.
            _run(
                [_uv(), "pip", "sync", "-q", "--require-hashes", "--link-mode", "copy"]
                + ["--python", str(prefix / "bin" / "python"), str(lock)],
                f"installing {lock.name}",
            )
            partial.unlink(missing_ok=True)
            venv_pack.pack(prefix=str(prefix), output=str(partial), format="tar.gz")
            os.replace(partial, archive)
        finally:
            shutil.rmtree(prefix, ignore_errors=True)
            partial.unlink(missing_ok=True)
    for stale in cache_dir.glob("pyenv-*.tar.gz"):  # older locks' archives
        if stale != archive:
            stale.unlink(missing_ok=True)
    return archive


def archive_for_cluster() -> Path | None:
    """The archive to ship, or None when ``EVENTPUSH_SPARK_PYENV`` is ``off``."""
    chosen = os.environ.get(PYENV_ENV_VAR, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        if not Path(chosen).is_file():
            raise SparkSetupError(f"{PYENV_ENV_VAR} names {chosen}, which is not a file")
        return Path(chosen)
    return build_archive()


def cluster_conf(master: str, driver_python: str = sys.executable) -> dict[str, str]:
    """The Spark properties that ship the executors' environment to ``master``; none for a
    local master (its Python workers are this interpreter) or when shipping is off. The
    driver stays on ``driver_python``: it runs here, where ``./pyenv`` does not exist."""
    if is_local(master):
        return {}
    archive = archive_for_cluster()
    if archive is None:
        return {}
    conf = {
        "spark.archives": f"{archive}#{ALIAS}",
        "spark.pyspark.python": EXECUTOR_PYTHON,
        "spark.pyspark.driver.python": driver_python,
    }
    # Replay's executors open target secrets: they read the key from the same path on their
    # host (only the path travels in the job's properties, never the key).
    key_file = os.environ.get(sealed.KEY_FILE_ENV, "").strip()
    if key_file:
        conf[f"spark.executorEnv.{sealed.KEY_FILE_ENV}"] = key_file
    return conf


def main(argv: list[str] | None = None) -> int:
    """``python -m eventpush.sparkjobs.pyenv build``: build (or find) the archive, print it."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print("usage: python -m eventpush.sparkjobs.pyenv build", file=sys.stderr)
        return 2
    try:
        print(build_archive())
    except SparkSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
