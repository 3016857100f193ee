"""What every ``eventpush`` command shares: consoles, exit codes, one-line errors, JSON output.

Exit codes: 0 success; 1 the audit found missing deliveries (or a check refused a result);
2 refused input (the message says what and where); 3 the database, Spark or the
configuration is unusable.
"""

from __future__ import annotations

import functools
import json
import sys

import click
import psycopg2.errors
from rich.console import Console

from eventpush.config import ConfigError
from eventpush.db import StoreError
from eventpush.errors import first_line

EXIT_MISSING = 1
EXIT_INPUT = 2
EXIT_STORE = 3

out = Console()
err = Console(stderr=True)


def fail(message: str, code: int = EXIT_INPUT) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(code)


def read_text_file(path: str, option: str) -> str:
    """The text of the file ``option`` names; one line naming it when it cannot be read or is
    not UTF-8 (click checks only that it exists: reading may still fail, EACCES or EIO)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        fail(f"{option} {path}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{option} {path} is not UTF-8 text")


def not_both(given: dict[str, object], flag: str, flag_set: bool) -> None:
    """Refuse ``flag`` (e.g. --no-tls) together with an option it contradicts (``given``:
    option -> value, None or empty when absent), as ``--secret`` with ``--no-secret`` is:
    whichever the code applied last used to win silently."""
    if flag_set:
        for option, value in given.items():
            if value not in (None, (), []):
                fail(f"give {option} or {flag}, not both")


def handles_errors(func):
    """One-line errors instead of tracebacks for everything a user can get wrong. Input
    errors are ValueErrors (catalog, patterns, events, controls, replay requests); the
    messages carry no secret."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from eventpush.sealed import SecretKeyError

        # Deferred: the Spark jobs are loaded only by the batch commands.
        from eventpush.sparkjobs.session import SparkSetupError

        try:
            return func(*args, **kwargs)
        except ValueError as exc:
            fail(str(exc))
        except (ConfigError, StoreError, SparkSetupError, SecretKeyError) as exc:
            fail(str(exc), EXIT_STORE)
        except (psycopg2.errors.UndefinedTable, psycopg2.errors.UndefinedColumn) as exc:
            # A database never migrated (or by an older eventpush): the tables or columns
            # this version reads are missing. Say so, not psycopg2's traceback (exit 1).
            fail(
                f"the database lacks this version's schema ({first_line(exc)}): "
                "run 'eventpush db migrate'",
                EXIT_STORE,
            )
        except psycopg2.errors.InsufficientPrivilege as exc:
            # A role that may read but not write (or not even read) the catalog.
            fail(
                f"the database refused: {first_line(exc)} (see the role "
                "EVENTPUSH_DATABASE_URL connects as)",
                EXIT_STORE,
            )
        except (
            psycopg2.OperationalError,
            psycopg2.InterfaceError,
            psycopg2.errors.ReadOnlySqlTransaction,
        ) as exc:
            # The database went away or gave up in the middle of the command (a restart, a
            # failover to a read-only standby, a lock or statement timeout): its open
            # transaction is rolled back, and one line says so instead of a traceback.
            fail(f"the database failed during the command: {first_line(exc)}", EXIT_STORE)

    return wrapper


def print_json(doc: object) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


def pairs(values: tuple[str, ...], sep: str, option: str) -> list[tuple[str, str]]:
    """``K:V`` (headers) or ``K=V`` (query, token fields) options as (name, value) pairs."""
    from eventpush.sinks.headers import HeaderError, split_pair

    try:
        return [split_pair(v, sep, option) for v in values]
    except HeaderError as exc:
        fail(str(exc))


TLS_FIELDS = ("client_cert_file", "client_key_file", "ca_file")


def tls_options(func):
    """--client-cert-file, --client-key-file, --ca-file (destinations and targets)."""
    func = click.option("--ca-file", default=None, help="CA bundle (PEM) to trust too.")(func)
    func = click.option("--client-key-file", default=None, help="mTLS: client key (PEM).")(func)
    return click.option("--client-cert-file", default=None, help="mTLS: client certificate (PEM).")(
        func
    )


class NumberOrAuto(click.ParamType):
    """``--concurrency N|auto``: the value as given (its default stays the number), judged by
    :func:`concurrency_option` so a wrong one is refused in one line."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        return value if isinstance(value, int) else str(value)


def concurrency_option(value: int | str | None) -> dict:
    """``--concurrency N|auto`` as TargetSpec fields."""
    if value is None:
        return {}
    if isinstance(value, int):
        return {"concurrency": value, "concurrency_auto": False}
    if value.strip().lower() == "auto":
        return {"concurrency_auto": True}
    try:
        return {"concurrency": int(value), "concurrency_auto": False}
    except ValueError:
        fail(f"--concurrency must be a number or auto, got {value!r}")
