"""spark-submit entry point: the delivery-completeness audit (eventpush.sparkjobs.audit).

Reads EVENTPUSH_DATABASE_URL, writes an event_audit_report row, prints the report as JSON.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime


def iso(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bus")
    parser.add_argument("--since", type=iso)
    parser.add_argument("--until", type=iso)
    parser.add_argument("--master", help="default: as spark-submit set it")
    parser.add_argument("--verify-sinks", action="store_true", help="read destinations back")
    parser.add_argument("--roll-up", action="store_true", help="roll clean runners' rows up")
    args = parser.parse_args(argv)

    from eventpush.config import database_url
    from eventpush.sparkjobs.audit import run_audit
    from eventpush.sparkjobs.session import get_spark, release

    spark = get_spark(args.master, app_name="eventpush-audit")
    bus = args.bus or None  # the DAG passes "" for "every bus"
    result = run_audit(
        spark,
        database_url(),
        bus=bus,
        since=args.since,
        until=args.until,
        verify_sinks=args.verify_sinks,
        roll_up=args.roll_up,
    )
    print(json.dumps(result.to_json()))
    release(spark)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
