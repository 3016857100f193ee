"""docker-compose.yaml parses and is consistent (no Docker engine runs here to start it)."""

import json
import re
from importlib.metadata import version
from pathlib import Path

import pyspark
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
AIRFLOW_SERVICES = {
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-worker",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def test_services_are_all_there(compose):
    assert {"postgres", "spark-master", "spark-worker", *AIRFLOW_SERVICES} <= set(
        compose["services"]
    )


def test_images_match_the_locked_versions(compose):
    dockerfile = (REPO / "docker" / "airflow.Dockerfile").read_text()
    base = re.search(r"^FROM apache/airflow:(\S+)-python3\.11$", dockerfile, re.M).group(1)
    assert base == version("apache-airflow")
    for name in ("spark-master", "spark-worker"):
        assert compose["services"][name]["image"] == f"apache/spark:{pyspark.__version__}"
    for source in re.findall(r"^COPY --chown=\S+ (.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (REPO / path).exists(), f"Dockerfile copies missing {path}"


def test_airflow_services_share_image_secret_and_connections(compose):
    services = compose["services"]
    secrets = set()
    for name in AIRFLOW_SERVICES:
        service = services[name]
        assert service["image"] == "eventpush-airflow:3.3.2"
        env = service["environment"]
        secrets.add(env["AIRFLOW__API_AUTH__JWT_SECRET"])
        spark = json.loads(env["AIRFLOW_CONN_SPARK_DEFAULT"])
        assert spark["host"] == "spark://spark-master" and spark["port"] == 7077
        assert "@postgres:5432/eventpush" in env["AIRFLOW_CONN_EVENTPUSH_DB"]
        for dep in service.get("depends_on", {}):
            assert dep in services
    assert len(secrets) == 1
    assert "7077:7077" in services["spark-master"]["ports"]


def test_long_running_services_have_health_checks_and_volumes_exist(compose):
    for name, service in compose["services"].items():
        if name not in ("airflow-init", "spark-worker"):
            assert "healthcheck" in service, name
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), source
            else:
                assert source in compose["volumes"], source
