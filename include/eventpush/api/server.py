"""Running the API under uvicorn: ``eventpush api`` puts its options in the environment
(``EVENTPUSH_API_*``) and uvicorn starts ``--workers`` processes, each building the app from
it (eventpush.api.app.app_from_env). Several servers may run behind one load balancer: they
share nothing but the database.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"  # nobody else's business unless widened
DEFAULT_PORT = 8080


def serve(
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    workers: int = 1,
    region: str | None = None,
    account: str | None = None,
    airflow_url: str | None = None,
    airflow_token_file: Path | None = None,
    max_body: int | None = None,
) -> None:
    import uvicorn

    from eventpush.config import database_url

    database_url()  # a missing or wrong URL fails here, once, not in every worker
    for name, value in (
        ("EVENTPUSH_API_REGION", region),
        ("EVENTPUSH_API_ACCOUNT", account),
        ("EVENTPUSH_API_AIRFLOW_URL", airflow_url),
        ("EVENTPUSH_API_AIRFLOW_TOKEN_FILE", airflow_token_file),
        ("EVENTPUSH_API_MAX_BODY", max_body),
    ):
        if value is not None:
            os.environ[name] = str(value)
    uvicorn.run(
        "eventpush.api.app:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=False,  # one line per request would cost more than the request
        # Nothing reads the client's address, so X-Forwarded-For is not worth a middleware
        # call on every request.
        proxy_headers=False,
        log_level="info",
        # Enough for 64+ load-balanced connections; past it uvicorn answers 503.
        limit_concurrency=2048,
        timeout_keep_alive=75,
    )
