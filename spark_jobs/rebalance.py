"""spark-submit entry point: propose, check and apply a worker assignment
(eventpush.sparkjobs.rebalance). Reads EVENTPUSH_DATABASE_URL, prints the result as JSON.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window-minutes", type=int, default=15)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--label", default="spark-submit", help="recorded with the GX check")
    parser.add_argument("--master", help="default: as spark-submit set it")
    args = parser.parse_args(argv)

    from eventpush.config import database_url
    from eventpush.sparkjobs.rebalance import run_rebalance
    from eventpush.sparkjobs.session import get_spark, release

    spark = get_spark(args.master, app_name="eventpush-rebalance")
    result = run_rebalance(
        spark,
        database_url(),
        timedelta(minutes=args.window_minutes),
        apply_it=not args.dry_run,
        run_label=args.label,
    )
    print(json.dumps(result.to_json()))
    release(spark)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
