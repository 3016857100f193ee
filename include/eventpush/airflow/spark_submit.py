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

**In-process mode.** A Spark connection with a ``local[...]`` master and the extra
``{"in_process": true}`` runs the job's ``main()`` inside the task's own process instead of a
``spark-submit`` JVM of its own: the job's local SparkSession is started there and kept for
the process's next job (``eventpush.sparkjobs.session.shared_sessions``). Under a
LocalExecutor or Celery each task is a process of its own, so this saves only the
``spark-submit`` launcher; where one process runs many tasks (``airflow dags test``,
``DAG.test()``, the demo) the JVM, its Python workers and the loaded libraries serve them all.
The same checks apply as for a submission (the database URL in a private file, the
connection required); a master that is not local is refused, since a cluster's driver
belongs in ``spark-submit``.
"""

from __future__ import annotations

import importlib.util
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
IN_PROCESS = "in_process"  # the Spark connection's extra that asks for in-process mode


def in_process(conn_id: str, master: str) -> bool:
    """Whether connection ``conn_id`` asks for in-process runs: its extra ``in_process``, a
    boolean, and only with a ``local[...]`` master."""
    # Deferred: Airflow's SDK is loaded only when an Airflow task calls this.
    from airflow.sdk import BaseHook

    value = BaseHook.get_connection(conn_id).extra_dejson.get(IN_PROCESS, False)
    if not isinstance(value, bool):
        raise SparkSetupError(
            f"Airflow connection {conn_id!r}: extra {IN_PROCESS!r} must be true or false, "
            f"got {value!r}"
        )
    if value and not master.startswith("local"):
        raise SparkSetupError(
            f"Airflow connection {conn_id!r}: {IN_PROCESS!r} is for local masters only, "
            f"not {master}: a cluster's driver is started by spark-submit"
        )
    return value


class EventpushSparkSubmitOperator(SparkSubmitOperator):
    """``spark-submit`` of one eventpush job, with the package and driver shipped along."""

    def execute(self, context):
        # Deferred: the Spark jobs are loaded only by the batch commands.
        from eventpush.sparkjobs.session import on_loopback, require_airflow_master

        master = require_airflow_master(self._conn_id)
        secrets = Path(tempfile.mkdtemp(prefix="eventpush-submit-"))
        if in_process(self._conn_id, master):
            try:
                return self.run_in_process(secrets, master)
            finally:
                shutil.rmtree(secrets, ignore_errors=True)
        self.log.info("submitting %s to %s", Path(self.application).name, master)
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

    def run_in_process(self, secrets: Path, master: str) -> None:
        """The job's ``main()`` in this process, on the process's shared local session, with
        the database URL in a private file as a submission has it."""
        # Deferred: the Spark jobs are loaded only by the batch commands.
        from eventpush.sparkjobs.session import environment, shared_sessions, write_private

        path = Path(self.application)
        self.log.info("running %s in-process on %s", path.name, master)
        spec = importlib.util.spec_from_file_location(f"eventpush_spark_job_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise SparkSetupError(f"{path} is not a Python file")
        job = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(job)
        args = [str(a) for a in self.application_args or []] + ["--master", master]
        url_file = str(write_private("database-url", database_url(), secrets))
        with environment({FILE_ENV_VAR: url_file}), shared_sessions():
            code = job.main(args)
        if code:
            raise RuntimeError(f"{path.name} ended with exit code {code}")

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
