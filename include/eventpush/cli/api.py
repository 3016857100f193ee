"""``eventpush api``: serve the EventBridge-compatible API (eventpush.api)."""

from __future__ import annotations

from pathlib import Path

import click

from eventpush.cli.common import fail, handles_errors


@click.command("api")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--workers", type=int, default=1, show_default=True, help="Server processes.")
@click.option(
    "--region",
    default="us-east-1",
    show_default=True,
    help="The region requests must be signed for (SigV4 scope) and new buses get.",
)
@click.option(
    "--account",
    default="000000000000",
    show_default=True,
    help="The account id of buses created through the API.",
)
@click.option("--airflow-url", default=None, help="Airflow's base URL, for replays.")
@click.option(
    "--airflow-token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A file holding an Airflow API token, for replays.",
)
@click.option(
    "--max-body",
    type=int,
    default=4 * 1024 * 1024,
    show_default=True,
    help="Largest request body in bytes; larger ones are refused before they are read.",
)
@handles_errors
def api_cmd(
    host: str,
    port: int,
    workers: int,
    region: str,
    account: str,
    airflow_url: str | None,
    airflow_token_file: Path | None,
    max_body: int,
) -> None:
    """Serve Amazon EventBridge's API (AWS JSON 1.1, SigV4) for any AWS SDK or the AWS CLI."""
    from eventpush.catalog import ACCOUNT_RE, REGION_RE

    if not 1 <= workers <= 64:
        fail(f"--workers must be between 1 and 64, got {workers}")
    if not 1 <= port <= 65535:
        fail(f"--port must be between 1 and 65535, got {port}")
    if not REGION_RE.fullmatch(region):
        fail(f"--region must look like an AWS region (us-east-1), got {region!r}")
    if not ACCOUNT_RE.fullmatch(account):
        fail(f"--account must be a 12-digit AWS account id, got {account!r}")
    if (airflow_url is None) != (airflow_token_file is None):
        fail("give --airflow-url and --airflow-token-file together")
    if max_body < 1024:
        fail(f"--max-body must be at least 1024, got {max_body}")
    from eventpush.api.server import serve

    serve(
        host=host,
        port=port,
        workers=workers,
        region=region,
        account=account,
        airflow_url=airflow_url,
        airflow_token_file=airflow_token_file,
        max_body=max_body,
    )
