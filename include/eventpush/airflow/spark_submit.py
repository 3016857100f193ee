"""The SparkSubmitOperator the batch DAGs use for ``spark_jobs/*.py``.

It adds what every eventpush job needs at execute time, never through templates (rendered
fields are shown in the UI, and the database URL carries a password): the package zip as
``--py-files``, the JDBC jar, the database URL in a file of mode 0600 in a private directory
(the job finds it through ``EVENTPUSH_DATABASE_URL_FILE``; ``--files`` ships it to a
cluster-mode driver), Spark's shared secret in a private ``--properties-file`` when one is
set, the Python and ``spark-submit`` of this installation, and for a master that is not
``local[...]`` the executors' packed Python environment (``--archives``, see
``eventpush.sparkjobs.pyenv``). A missing Spark connection
fails the task with a message instead of meaning YARN.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from eventpush.airflow.connection import database_url
from eventpush.config import FILE_ENV_VAR
from eventpush.sparkjobs.session import SparkSetupError

# A checkout has spark_jobs/ beside include/; an image says where it put them.
JOBS_DIR = Path(
    os.environ.get("EVENTPUSH_SPARK_JOBS", Path(__file__).resolve().parents[3] / "spark_jobs")
)


class EventpushSparkSubmitOperator(SparkSubmitOperator):
    """``spark-submit`` of one eventpush job, with the package and driver shipped along."""

    def execute(self, context):
        # Deferred: the Spark jobs are loaded only by the batch commands.
        from eventpush.sparkjobs.session import on_loopback, require_airflow_master

        master = require_airflow_master(self._conn_id)
        self.log.info("submitting %s to %s", Path(self.application).name, master)
        secrets = Path(tempfile.mkdtemp(prefix="eventpush-submit-"))
        try:
            self.prepare_submit(secrets, master)
            if on_loopback(master):
                # A local job, or one on a loopback cluster: its driver stays on loopback,
                # not the first NIC.
                self.env_vars = {"SPARK_LOCAL_IP": "127.0.0.1", **self.env_vars}
            return super().execute(context)
        finally:
            # spark-submit has returned: a local or client-mode driver is done with the
            # files, and a cluster-mode one got its copy through --files at submit time.
            shutil.rmtree(secrets, ignore_errors=True)

    def prepare_submit(self, secrets: Path, master: str) -> None:
        """Point the submission at the package, the driver and the secrets in ``secrets``
        (a private directory), and, for a cluster ``master``, at the executors' packed Python
        environment. The provider prints ``--conf``, and on YARN and Kubernetes turns
        ``env_vars`` into ``--conf``: only file paths go there, never a secret."""
        # Deferred: the Spark jobs are loaded only by the batch commands.
        from eventpush.sparkjobs.pyenv import cluster_conf
        from eventpush.sparkjobs.session import (
            auth_properties_file,
            jdbc_jar,
            package_zip,
            write_private,
        )

        self.py_files = package_zip()
        self.jars = jdbc_jar()
        url_file = str(write_private("database-url", database_url(), secrets))
        # A cluster-mode driver runs elsewhere: --files puts the file in its working directory.
        self.files = ",".join(f for f in (self.files, url_file) if f)
        properties = auth_properties_file(secrets)
        if properties:
            if self.properties_file:
                raise SparkSetupError(
                    "EVENTPUSH_SPARK_SECRET needs eventpush's own --properties-file; "
                    f"the task already sets {self.properties_file}"
                )
            self.properties_file = properties
        python = sys.executable
        env = {
            FILE_ENV_VAR: url_file,
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", python),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", python),
        }
        shipped = cluster_conf(master, driver_python=env["PYSPARK_DRIVER_PYTHON"])
        if shipped:
            # spark.archives and spark.pyspark.python win over PYSPARK_PYTHON in spark-submit.
            archive = shipped.pop("spark.archives")
            self._archives = ",".join(a for a in (self._archives, archive) if a)
            self.conf = {**(self.conf or {}), **shipped}
        if shutil.which("spark-submit") is None:  # the venv's spark-submit, next to python
            env["PATH"] = f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env_vars = {**(self.env_vars or {}), **env}


def spark_job(job: str, args_from: str, **kwargs) -> EventpushSparkSubmitOperator:
    """The task that runs ``spark_jobs/JOB.py`` on ``spark_default``, with the arguments that
    ``args_from`` names: a Jinja expression over XCom, evaluated natively (the batch DAGs set
    ``render_template_as_native_obj``). ``kwargs`` go to the operator (e.g. a timeout)."""
    return EventpushSparkSubmitOperator(
        task_id=f"{job}_job",
        application=str(JOBS_DIR / f"{job}.py"),
        conn_id="spark_default",
        name=f"eventpush-{job}",
        application_args="{{ " + args_from + " }}",
        **kwargs,
    )
