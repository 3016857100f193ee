"""spark-submit entry point: replay failed records, audit gaps or a window's events
(eventpush.sparkjobs.replay). Reads EVENTPUSH_DATABASE_URL, prints the result as JSON.
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
    parser.add_argument("--what", choices=["failed", "missing", "all"], default="failed")
    parser.add_argument("--bus")
    parser.add_argument("--rule")
    parser.add_argument("--target")
    parser.add_argument("--since", type=iso)
    parser.add_argument("--until", type=iso)
    parser.add_argument("--message-id", action="append", default=[])
    parser.add_argument("--max-count", type=int)
    parser.add_argument("--rate-limit", type=float)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--everything", action="store_true", help="what=all with no window")
    parser.add_argument("--pattern-version", choices=["history", "current"], default="history")
    parser.add_argument("--label", default="spark-submit", help="recorded with the run")
    parser.add_argument("--master", help="default: as spark-submit set it")
    args = parser.parse_args(argv)

    from eventpush.config import database_url
    from eventpush.sparkjobs.replay import ReplayRequest, run_replay
    from eventpush.sparkjobs.session import get_spark, release

    request = ReplayRequest(
        what=args.what,
        bus=args.bus,
        rule=args.rule,
        target=args.target,
        since=args.since,
        until=args.until,
        message_ids=tuple(args.message_id),
        max_count=args.max_count,
        rate_limit=args.rate_limit,
        dry_run=args.dry_run,
        label=args.label,
        everything=args.everything,
        pattern_version=args.pattern_version,
    )
    spark = get_spark(args.master, app_name="eventpush-replay")
    result = run_replay(spark, database_url(), request, run_label=args.label)
    print(json.dumps(result.to_json()))
    release(spark)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
