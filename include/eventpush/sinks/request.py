"""What every built-in sink sends for a batch: the body (the event as stored, or transformed;
a JSON array for batch targets), the headers of the target's connection and its own, and the
Standard Webhooks headers (id, timestamp, signature), set last so nothing overrides them."""

from __future__ import annotations

from datetime import UTC, datetime

from standardwebhooks import Webhook

from eventpush.sinks.contract import Record, Target, webhook_id

USER_AGENT = "eventpush/0.1"


def build_request(
    target: Target,
    records: list[Record],
    transform,
    now: datetime | None = None,
    traceparent: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one request: one event, or a JSON array for batch targets;
    with ``traceparent``, the header of that name too (built here, not copied in later)."""
    if target.batch_size > 1:
        body = b"[" + b",".join(_body(target, r, transform) for r in records) + b"]"
    else:
        body = _body(target, records[0], transform)
    msg_id = webhook_id(target, records)
    headers = {"content-type": "application/json", "user-agent": USER_AGENT}
    if target.headers:  # the connection's and the target's, before eventpush's own
        headers.update(target.headers)
    headers["webhook-id"] = msg_id
    if target.secret:
        now = now or datetime.now(UTC)
        headers["webhook-timestamp"] = str(int(now.timestamp()))
        headers["webhook-signature"] = signature(target, msg_id, now, body)
    if traceparent is not None:
        headers["traceparent"] = traceparent
    return body, headers


def signature(target: Target, msg_id: str, now: datetime, body: bytes) -> str:
    """``webhook-signature``: one ``v1,...`` per secret in force, space separated (Standard
    Webhooks: a receiver accepts the request when any one of them verifies)."""
    text = body.decode("utf-8")
    return " ".join(Webhook(s).sign(msg_id, now, text) for s in target.signing_secrets(now))


def _body(target: Target, record: Record, transform) -> bytes:
    if target.transform_kind == "ORIGINAL":
        return record.raw.encode()  # the event exactly as stored: no re-serialising
    return transform.apply(
        record.event,
        target.rule,
        bus=target.bus,
        account=target.bus_account,
        region=target.bus_region,
    )
