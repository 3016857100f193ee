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
    assert f"pyspark=={pyspark.__version__}" in (REPO / "requirements.lock").read_text()
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


SECRET_WORDS = re.compile(r"SECRET|PASSWORD|TOKEN|KEY", re.I)
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?+])?([^}]*)\}")


def _strings(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_no_secret_has_a_default(compose):
    """Every variable that carries a secret is required (${VAR:?message}): compose refuses
    to start without it instead of falling back to a value anyone can read here."""
    text = (REPO / "docker-compose.yaml").read_text()
    assert "change-me" not in text
    secret_refs = [
        m for s in _strings(compose) for m in REFERENCE.finditer(s) if SECRET_WORDS.search(m[1])
    ]
    names = {m[1] for m in secret_refs}
    assert {
        "EVENTPUSH_JWT_SECRET",
        "EVENTPUSH_API_SECRET_KEY",
        "EVENTPUSH_SPARK_SECRET",
        "AIRFLOW_DB_PASSWORD",
        "EVENTPUSH_DB_PASSWORD",
    } <= names
    for m in secret_refs:
        assert m[2] == ":?" and m[3].strip(), f"{m[0]} must be ${{{m[1]}:?message}}"
    for name in AIRFLOW_SERVICES:
        env = compose["services"][name]["environment"]
        for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
            assert REFERENCE.fullmatch(env[key])[2] == ":?", (name, key)
        for key in ("AIRFLOW_CONN_EVENTPUSH_DB", "EVENTPUSH_DATABASE_URL"):
            assert ":${EVENTPUSH_DB_PASSWORD:?" in env[key], (name, key)


def test_only_the_api_server_is_published_and_on_loopback_only(compose):
    published = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            spec = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port}"
            published[name] = spec
            # host_ip:host_port:container_port; without the host ip Docker binds 0.0.0.0.
            assert spec.count(":") == 2 and spec.startswith("127.0.0.1:"), (name, spec)
    assert set(published) == {"airflow-apiserver", "eventpush-api"}


def test_the_eventbridge_api_is_its_own_service(compose):
    """``eventpush api`` in the eventpush image, after the schema is migrated, on the
    database and with the key its sealed access keys open with; healthy on /healthz."""
    services = compose["services"]
    api = services["eventpush-api"]
    assert api["image"] == services["airflow-worker"]["image"]
    assert api["entrypoint"] == ["eventpush"] and api["command"][0] == "api"
    command = api["command"]
    assert command[command.index("--port") + 1] == "8090"
    assert api["ports"] == ["127.0.0.1:8090:8090"]
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    assert ":${EVENTPUSH_DB_PASSWORD:?" in api["environment"]["EVENTPUSH_DATABASE_URL"]
    assert api["environment"]["EVENTPUSH_SECRET_KEY_FILE"] == "/run/secrets/eventpush_secret_key"
    assert api["secrets"] == ["eventpush_secret_key"]
    init = services["airflow-init"]["command"][-1]
    assert "eventpush db migrate" in init
    assert api["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"


def test_spark_authenticates_master_workers_and_submitter(compose):
    services = compose["services"]
    assert "ports" not in services["spark-master"] and "ports" not in services["spark-worker"]
    for name in ("spark-master", "spark-worker"):
        service = services[name]
        command = " ".join(service["command"])
        assert "spark.authenticate=true" in command, name
        assert "spark.authenticate.secret=%s" in command and "$$SPARK_AUTH_SECRET" in command
        assert "--properties-file /tmp/spark-auth.properties" in command
        assert "umask 077" in command  # the file is the container user's alone
        ref = REFERENCE.fullmatch(service["environment"]["SPARK_AUTH_SECRET"])
        assert ref[1] == "EVENTPUSH_SPARK_SECRET" and ref[2] == ":?"
    for name in AIRFLOW_SERVICES:
        ref = REFERENCE.fullmatch(services[name]["environment"]["EVENTPUSH_SPARK_SECRET"])
        assert ref[1] == "EVENTPUSH_SPARK_SECRET" and ref[2] == ":?"


def test_nats_runs_jetstream_with_its_store_in_a_volume(compose):
    nats = compose["services"]["nats"]
    command = nats["command"]
    assert "-js" in command
    store = command[command.index("-sd") + 1]
    volume, _, mounted = nats["volumes"][0].partition(":")
    assert mounted == store and volume in compose["volumes"]
    assert "ports" not in nats  # internal network only
    assert "healthcheck" in nats


def test_spark_runs_from_the_airflow_image_with_its_own_pyspark(compose):
    """Master and workers are the Airflow services' image (same Python, same locked
    dependencies: the executors cannot drift from the drivers), started with spark-class
    from the pyspark installed in it; so no packed environment needs to travel with a job."""
    services = compose["services"]
    airflow = services["airflow-worker"]
    for name in ("spark-master", "spark-worker"):
        service = services[name]
        assert service["image"] == airflow["image"] and service["build"] == airflow["build"]
        command = " ".join(service["command"])
        assert "import os, pyspark; print(os.path.dirname(pyspark.__file__))" in command
        assert '"$$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.' in command
        assert "/opt/spark" not in command and "apache/spark" not in str(service)
    assert "deploy.master.Master" in " ".join(services["spark-master"]["command"])
    assert "spark://spark-master:7077" in " ".join(services["spark-worker"]["command"])
    for name in AIRFLOW_SERVICES:
        assert services[name]["environment"]["EVENTPUSH_SPARK_PYENV"] == "off", name


def test_postgres_is_sized_for_the_api_ingest(compose):
    """The API acknowledges after each commit reaches the disk: its PostgreSQL must not
    checkpoint every few seconds or make a new WAL file at every turn (docs/OPERATIONS.md,
    "PostgreSQL for ingest")."""
    settings = dict(
        arg.split("=", 1) for arg in compose["services"]["postgres"]["command"] if "=" in arg
    )
    assert settings["max_wal_size"] == "16GB" and settings["min_wal_size"] == "4GB"
    assert settings["checkpoint_timeout"] == "15min"
    assert settings["backend_flush_after"] == "256kB"
    assert compose["services"]["postgres"]["command"][0] == "postgres"
