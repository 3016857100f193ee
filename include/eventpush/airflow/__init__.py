"""The Airflow side of eventpush: the database connection as Airflow sees it, the push DAG's
slice and its deferrable trigger, the SparkSubmit operator of the batch DAGs, and the
plugin's web app. Nothing here is imported by the engine itself."""
