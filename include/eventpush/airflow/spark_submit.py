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

# A checkout has spark_jobs/ beside include/; an image says where it put them.
JOBS_DIR = Path(
    os.environ.get("EVENTPUSH_SPARK_JOBS", Path(__file__).resolve().parents[3] / "spark_jobs")
)


class EventpushSparkSubmitOperator(SparkSubmitOperator):
    """``spark-submit`` of one eventpush job, with the package and driver shipped along."""

    def execute(self, context):
        from eventpush.airflow.connection import database_url
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


def spark_job(job: str, args_from: str) -> EventpushSparkSubmitOperator:
    """The task that runs ``spark_jobs/JOB.py`` on ``spark_default``, with the arguments that
    ``args_from`` names: a Jinja expression over XCom, evaluated natively (the batch DAGs set
    ``render_template_as_native_obj``)."""
    return EventpushSparkSubmitOperator(
        task_id=f"{job}_job",
        application=str(JOBS_DIR / f"{job}.py"),
        conn_id="spark_default",
        name=f"eventpush-{job}",
        application_args="{{ " + args_from + " }}",
    )
