"""Secrets at rest: sealed with Fernet (``cryptography``) under a key kept outside the database.

The key file (``EVENTPUSH_SECRET_KEY_FILE``) holds one Fernet key per line: the first seals,
every one unseals (``MultiFernet``), so a key can be rotated while workers run: add the new key
first, ``eventpush secrets rotate-key``, then drop the old line. ``SEALED`` lists every column
that holds a sealed token; ``rotate_key`` re-encrypts them all in one transaction.

A missing, unreadable or wrong key is a :class:`SecretKeyError` with one line saying which;
nothing here ever puts a secret or a key in a message.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

KEY_FILE_ENV = "EVENTPUSH_SECRET_KEY_FILE"
TOKEN_PREFIX = "gAAAAA"  # every Fernet token (version byte 0x80, then the timestamp's zeros)

# (table, id column, secret column): every column holding a sealed token. Issues adding
# secrets (API keys, connection secrets) add theirs here; ``secrets rotate-key`` reads it.
SEALED: list[tuple[str, str, str]] = [
    ("event_target", "id", "secret"),
    ("event_target", "id", "secret_old"),
    ("event_api_key", "id", "secret"),  # the API's secret access keys (eventpush.access_keys)
    ("event_connection", "id", "secret"),  # API key values, passwords, client secrets (issue 32)
]


class SecretKeyError(RuntimeError):
    """The secret key is missing, unreadable or not the one the secrets were sealed with."""


_cache: dict[tuple[str, float], MultiFernet] = {}


def key_path() -> Path:
    path = os.environ.get(KEY_FILE_ENV, "").strip()
    if not path:
        raise SecretKeyError(
            f"{KEY_FILE_ENV} is not set: point it at the file holding the secret key "
            "(scripts/setup.sh makes one; docs/OPERATIONS.md, 'Security')"
        )
    return Path(path)


def load_keys(path: Path) -> MultiFernet:
    """The keys of a key file, the first one sealing."""
    try:
        mtime = path.stat().st_mtime
    except OSError as exc:
        raise SecretKeyError(f"secret key file {path}: {exc.strerror or exc}") from None
    cached = _cache.get((str(path), mtime))
    if cached is not None:
        return cached
    try:
        lines = path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretKeyError(f"secret key file {path} cannot be read: {exc}") from None
    keys = []
    for n, line in enumerate(lines, 1):
        try:
            keys.append(Fernet(line.encode()))
        except ValueError:
            raise SecretKeyError(
                f"secret key file {path}, key {n}: not a Fernet key (32 url-safe base64 bytes)"
            ) from None
    if not keys:
        raise SecretKeyError(f"secret key file {path} holds no key")
    _cache.clear()
    _cache[(str(path), mtime)] = fernet = MultiFernet(keys)
    return fernet


def new_key() -> str:
    return Fernet.generate_key().decode()


def write_key_file(path: Path) -> None:
    """A new key file, mode 0600 from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(new_key() + "\n")


def seal(clear: str, keys: MultiFernet | None = None) -> str:
    keys = keys or load_keys(key_path())
    return keys.encrypt(clear.encode()).decode()


def unseal(token: str, keys: MultiFernet | None = None) -> str:
    keys = keys or load_keys(key_path())
    try:
        return keys.decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretKeyError(
            f"a stored secret does not open with the key in {os.environ.get(KEY_FILE_ENV)}: "
            "wrong key file?"
        ) from None


def unseal_or_none(token: str | None, keys: MultiFernet | None = None) -> str | None:
    return None if token is None else unseal(token, keys)


def fingerprint(clear: str) -> str:
    """First 8 hex of sha256: enough to tell two secrets apart, nothing to sign with."""
    return hashlib.sha256(clear.encode()).hexdigest()[:8]


def check_stored(conn) -> None:
    """Fail now, in one line, when secrets are stored and the key is missing, unreadable or
    does not open them (a worker's start): never a traceback or an unsigned send later."""
    from eventpush.db import transaction

    with transaction(conn) as cur:
        for table, _id, column in SEALED:
            # Names from SEALED, a fixed list in code.
            cur.execute(f"SELECT {column} FROM {table} WHERE {column} IS NOT NULL LIMIT 1")
            row = cur.fetchone()
            if row is not None:
                unseal(row[0])


def rotate_key(conn, new_key_file: Path) -> int:
    """Every sealed column re-encrypted under the first key of ``new_key_file``, in one
    transaction; returns how many secrets. The current key (``EVENTPUSH_SECRET_KEY_FILE``)
    must open them all, or nothing changes."""
    from eventpush.db import transaction

    old = load_keys(key_path())
    new = load_keys(Path(new_key_file))
    count = 0
    with transaction(conn) as cur:
        for table, id_col, column in SEALED:
            # Names from SEALED, a fixed list in code; values always parameterised.
            cur.execute(
                f"SELECT {id_col}, {column} FROM {table} WHERE {column} IS NOT NULL FOR UPDATE"
            )
            for row_id, token in cur.fetchall():
                clear = unseal(token, old)
                cur.execute(
                    f"UPDATE {table} SET {column} = %s WHERE {id_col} = %s",
                    (seal(clear, new), row_id),
                )
                count += 1
    return count
