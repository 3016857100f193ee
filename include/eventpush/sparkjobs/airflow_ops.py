"""The SparkSubmitOperator the batch DAGs use for ``spark_jobs/*.py``.

It adds what every eventpush job needs at execute time, never through templates (rendered
fields are shown in the UI, and the database URL carries a password): the package zip as
``--py-files``, the JDBC jar, the database URL in the job's environment, and the Python and
``spark-submit`` of this installation. A missing Spark connection fails the task with a
message instead of meaning YARN.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator


class EventpushSparkSubmitOperator(SparkSubmitOperator):
    """``spark-submit`` of one eventpush job, with the package and driver shipped along."""

    def execute(self, context):
        from eventpush.airflow_support import database_url
        from eventpush.sparkjobs.session import jdbc_jar, package_zip, require_airflow_master

        master = require_airflow_master(self._conn_id)
        self.log.info("submitting %s to %s", Path(self.application).name, master)
        self.py_files = package_zip()
        self.jars = jdbc_jar()
        python = sys.executable
        env = {
            "EVENTPUSH_DATABASE_URL": database_url(),
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", python),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", python),
        }
        if shutil.which("spark-submit") is None:  # the venv's spark-submit, next to python
            env["PATH"] = f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env_vars = {**(self.env_vars or {}), **env}
        return super().execute(context)
