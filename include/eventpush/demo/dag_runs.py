"""The demo's DAG runs, all in one Airflow process: what ``airflow dags test`` does, as a call.

``airflow dags test`` is ``DAG.test()`` on the DAG from its file, behind a command that first
starts Python, imports Airflow with its providers and reads its configuration: seconds each
time on a small machine, and the demo runs five DAGs. One process, started while the demo
prepares its data (it migrates Airflow's metadata database meanwhile), pays for that once,
then runs each DAG the demo asks for, from dags/, one after another.

Beside its first runs it also starts, in a thread, what the first batch run would otherwise
start on the demo's clock: with ``--spark MASTER`` (the in-process Spark connection the demo
sets, ``eventpush.airflow.spark_submit``) the local SparkSession every job of the process then
reuses, and Great Expectations' context the checks share. It overlaps the push, which mostly
waits (for the slow target, for the dead one's records to age out); a job that comes first
waits for the session being started (PySpark's builder lock). The DAG runs are the same; only
where those start-ups fall changes.

The parent writes one JSON request a line on the process's stdin (``{"dag_id", "conf"}``);
the process answers each on a pipe of its own (``{"state", "failed"}`` or ``{"state":
"error", "error"}``), since the tasks' own output goes to its stdout and stderr, which go to
a log file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path


class DagRuns:
    """The Airflow process, seen from the demo: ``run(dag_id, conf)`` runs one DAG to its end
    and raises ``RuntimeError`` (naming the failed tasks and the log) unless it succeeded."""

    def __init__(self, env: dict[str, str], log_path: Path, spark: str | None = None) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, write_end = os.pipe()
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eventpush.demo.dag_runs", str(write_end)]
                + (["--spark", spark] if spark else []),
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
                text=True,
            )
        os.close(write_end)
        self.replies = os.fdopen(read_end)

    def run(self, dag_id: str, conf: dict) -> None:
        self.proc.stdin.write(json.dumps({"dag_id": dag_id, "conf": conf}) + "\n")
        self.proc.stdin.flush()
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the Airflow process ended early: see {self.log_path}")
        reply = json.loads(line)
        if reply["state"] != "success":
            why = reply.get("error") or f"failed tasks: {', '.join(reply['failed']) or 'none'}"
            raise RuntimeError(f"{dag_id} run {reply['state']} ({why}); log: {self.log_path}")

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()


def _run(folder: Path, dag_id: str, conf: dict) -> dict:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(folder / f"{dag_id}.py"))
    if bag.import_errors or dag_id not in bag.dags:
        return {"state": "error", "error": f"{dag_id} did not load: {bag.import_errors}"}
    run = bag.dags[dag_id].test(run_conf=conf)
    failed = sorted({ti.task_id for ti in run.get_task_instances() if ti.state == "failed"})
    return {"state": str(run.state), "failed": failed}


def warm(spark_master: str | None) -> None:
    """Start the shared local SparkSession (when ``spark_master`` is given) and GX's context,
    which the first batch run would otherwise start."""
    from eventpush.quality.batch import gx_context

    if spark_master:
        from pyspark.sql import functions as F

        from eventpush.sparkjobs.session import get_spark

        spark = get_spark(spark_master, app_name="eventpush-demo")
        # A JVM's first query pays for loading and compiling Spark's query path and for
        # starting the Python workers (which stay, spark.python.worker.reuse): one small
        # query with a Python UDF pays for them here.
        spark.range(4, numPartitions=2).select(F.udf(abs, "long")("id")).collect()
    gx_context()


def serve(reply_fd: int, spark_master: str | None = None) -> None:
    """Migrate Airflow's metadata database, start what the runs share (``warm``, in a
    thread), and run each requested DAG, answering on ``reply_fd``; ends when stdin does."""
    from airflow.utils import db

    db.initdb()  # created from the models when new, upgraded otherwise
    threading.Thread(target=warm, args=(spark_master,), name="warm", daemon=True).start()
    folder = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    with os.fdopen(reply_fd, "w") as replies:
        for line in sys.stdin:
            request = json.loads(line)
            try:
                reply = _run(folder, request["dag_id"], request["conf"])
            except Exception as exc:  # said to the demo, which stops on it
                reply = {"state": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
            replies.write(json.dumps(reply) + "\n")
            replies.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[3] if sys.argv[2:3] == ["--spark"] else None)
