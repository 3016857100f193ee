"""The batch half of eventpush: Spark jobs for audit, replay and rebalance.

``session`` builds the SparkSession (master, JDBC driver, the package shipped to executors),
``jdbc`` reads and writes PostgreSQL, and ``audit``, ``replay`` and ``rebalance`` are the jobs.
The spark-submit entry points in ``spark_jobs/`` and the CLI commands in
``eventpush.cli.batch`` call them.
"""
