# The Airflow image eventpush runs on: the official one, plus Java and the PostgreSQL JDBC
# driver (for spark-submit from the workers) and this package.
FROM apache/airflow:3.3.2-python3.11

USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java \
 && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    EVENTPUSH_JDBC_JAR=/usr/share/java/postgresql.jar

USER airflow
COPY --chown=airflow:root requirements.lock pyproject.toml README.md /opt/eventpush/
COPY --chown=airflow:root include /opt/eventpush/include
# The lock pins the same Airflow as the base image; pyspark and pyspark-client at one version.
RUN pip install --no-cache-dir -r /opt/eventpush/requirements.lock \
 && pip install --no-cache-dir --no-deps /opt/eventpush
COPY --chown=airflow:root dags /opt/airflow/dags
COPY --chown=airflow:root plugins /opt/airflow/plugins
COPY --chown=airflow:root spark_jobs /opt/eventpush/spark_jobs
ENV EVENTPUSH_SPARK_JOBS=/opt/eventpush/spark_jobs
