"""The ``eventpush`` command, one module per command group. The commands and their meaning
are a contract (docs/ARCHITECTURE.md, "Command line").

Exit codes are in ``common``: 0 success, 1 missing deliveries, 2 refused input, 3 the
database or configuration is unusable.
"""

from __future__ import annotations

import sys

import click

from eventpush.cli import changes  # noqa: F401  (adds list, show, update, delete commands)
from eventpush.cli.api import api_cmd
from eventpush.cli.batch import audit, rebalance, replay
from eventpush.cli.catalog import assign_cmd, bus, db, rule, target
from eventpush.cli.destinations import connection, destination
from eventpush.cli.keys import key
from eventpush.cli.publish import publish_cmd
from eventpush.cli.secrets import secrets
from eventpush.cli.status import status_cmd
from eventpush.cli.workers import runner, worker


class _Command(click.Group):
    """The top group. A usage error (an unknown option, a value of the wrong kind, a missing
    argument) is one line on stderr like every other refusal, exit 2, instead of click's usage
    block; ``--help`` shows the usage."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:  # a group alone: its help, as asked
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else self.name
            click.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)


@click.group(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """eventpush: push events from buses to HTTP targets, matched by EventBridge patterns."""


for _command in (
    db,
    bus,
    rule,
    target,
    connection,
    destination,
    worker,
    runner,
    assign_cmd,
    publish_cmd,
    status_cmd,
    audit,
    replay,
    rebalance,
    secrets,
    key,
    api_cmd,
):
    main.add_command(_command)

if __name__ == "__main__":
    main()
