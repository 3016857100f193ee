"""spark-submit entry point: replay failed records, audit gaps or a window's events
(eventpush.sparkjobs.replay). Reads EVENTPUSH_DATABASE_URL, prints the result as JSON.
The request's arguments are its fields' (eventpush.sparkjobs.forms.ReplayRequest).
"""

from __future__ import annotations

import json


def main(argv: list[str] | None = None) -> int:
    from eventpush.sparkjobs.forms import job_parser, request_from_args

    parser = job_parser(__doc__)
    parser.set_defaults(label="spark-submit")
    parser.add_argument("--master", help="default: as spark-submit set it")
    args = parser.parse_args(argv)

    from eventpush.config import database_url
    from eventpush.sparkjobs.replay import run_replay
    from eventpush.sparkjobs.session import get_spark, release

    request = request_from_args(args)
    spark = get_spark(args.master, app_name="eventpush-replay")
    result = run_replay(spark, database_url(), request, run_label=args.label)
    print(json.dumps(result.to_json()))
    release(spark)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
