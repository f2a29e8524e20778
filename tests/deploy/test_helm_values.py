"""deploy/helm/values.yaml against what the official Apache Airflow chart documents.

The chart's published ``values.schema.json`` ships only with the chart (the Apache Airflow Helm
repository and the Apache release archive); no package of PyPI, npm or Debian carries it, and
nothing else is reachable from the machines that run these tests, so it cannot be fetched at
set-up time (docs/real-cluster.md says so). What can be checked honestly is checked here, from
the chart's documentation (Parameters reference of chart 1.20.0,
airflow.apache.org/docs/helm-chart/1.20.0/parameters-ref.html, and the types that the chart's
``chart/values.schema.json`` gives these keys):

* every top-level key is a documented parameter of the chart;
* the values set have the documented types: ``env`` is a list of ``{name, value}`` strings and
  nothing else, ``extraEnvFrom`` is a *string* (templated YAML) of ``envFrom`` items, ``executor``
  one the project documents, ``dags.gitSync`` uses documented keys with a duration ``period``,
  ``workers.serviceAccount`` is ``{create, name}``, ``config`` is sections of strings;
* the Kubernetes objects inside (the ``envFrom`` items) are valid against the Kubernetes schema of
  kubernetes-validate, offline;
* connections come from a Secret, never from values; the settings are kubetrain's, with the
  namespace and service account that deploy/rbac.yaml binds.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kubetrain.settings import SETTINGS

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"

# Top-level parameters of the official chart (Parameters reference, chart 1.20.0): the ones a
# kubetrain deployment may need. A key outside this list is not silently accepted: check it in the
# chart's documentation and add it here.
CHART_TOP_LEVEL = {
    "fullnameOverride",
    "nameOverride",
    "useStandardNaming",
    "uid",
    "gid",
    "airflowHome",
    "defaultAirflowRepository",
    "defaultAirflowTag",
    "defaultAirflowDigest",
    "airflowVersion",
    "images",
    "registry",
    "executor",
    "allowPodLaunching",
    "env",
    "volumes",
    "volumeMounts",
    "secret",
    "enableBuiltInSecretEnvVars",
    "extraEnv",
    "extraEnvFrom",
    "extraSecrets",
    "extraConfigMaps",
    "priorityClasses",
    "data",
    "fernetKey",
    "fernetKeySecretName",
    "apiSecretKeySecretName",
    "jwtSecretName",
    "workers",
    "scheduler",
    "apiServer",
    "triggerer",
    "dagProcessor",
    "createUserJob",
    "migrateDatabaseJob",
    "postgresql",
    "pgbouncer",
    "redis",
    "statsd",
    "flower",
    "ingress",
    "networkPolicies",
    "nodeSelector",
    "affinity",
    "tolerations",
    "labels",
    "securityContexts",
    "rbac",
    "dags",
    "logs",
    "config",
    "airflowLocalSettings",
    "cleanup",
    "podTemplate",
    "multiNamespaceMode",
}
# dags.gitSync parameters of the chart (Parameters reference, "Airflow" section).
GIT_SYNC_KEYS = {
    "enabled",
    "repo",
    "branch",
    "rev",
    "ref",
    "depth",
    "maxFailures",
    "subPath",
    "sshKeySecret",
    "credentialsSecret",
    "knownHosts",
    "period",
    "wait",
    "containerName",
    "uid",
    "extraVolumeMounts",
    "env",
    "resources",
    "securityContexts",
}
SERVICE_ACCOUNT_KEYS = {"create", "name", "annotations", "automountServiceAccountToken"}

# The types the chart gives the keys we set, written as JSON Schema (draft 7, as the chart's).
VALUES_SCHEMA = {
    "type": "object",
    "propertyNames": {"enum": sorted(CHART_TOP_LEVEL)},
    "properties": {
        "defaultAirflowRepository": {"type": "string"},
        "defaultAirflowTag": {"type": "string"},
        "airflowVersion": {"type": "string", "pattern": r"^3\.\d+\.\d+$"},
        "executor": {"enum": ["KubernetesExecutor", "CeleryExecutor"]},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
                "required": ["name", "value"],
                "additionalProperties": False,
            },
        },
        "extraEnvFrom": {"type": ["string", "null"]},
        "dags": {
            "type": "object",
            "properties": {
                "gitSync": {
                    "type": "object",
                    "propertyNames": {"enum": sorted(GIT_SYNC_KEYS)},
                    "properties": {
                        "enabled": {"type": "boolean"},
                        "repo": {"type": "string"},
                        "branch": {"type": "string"},
                        "subPath": {"type": "string"},
                        "period": {"type": "string", "pattern": r"^\d+[smh]$"},
                    },
                    "required": ["enabled", "repo", "branch", "subPath"],
                }
            },
            "required": ["gitSync"],
        },
        **{
            component: {
                "type": "object",
                "properties": {
                    "serviceAccount": {
                        "type": "object",
                        "propertyNames": {"enum": sorted(SERVICE_ACCOUNT_KEYS)},
                        "properties": {
                            "create": {"type": "boolean"},
                            "name": {"type": "string"},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    }
                },
            }
            for component in ("workers", "triggerer", "apiServer")
        },
        "config": {
            "type": "object",
            "additionalProperties": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    },
    "required": ["defaultAirflowRepository", "defaultAirflowTag", "executor", "env", "extraEnvFrom", "dags"],
}


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())


def errors(values: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(VALUES_SCHEMA)
    return [f"{'/'.join(map(str, e.path)) or '(top)'}: {e.message}" for e in validator.iter_errors(values)]


def env_from_items(values: dict) -> list[dict]:
    return yaml.safe_load(values["extraEnvFrom"])


def test_values_have_the_documented_keys_and_types(values):
    assert errors(values) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda v: v.update(worker=v.pop("workers")), "'worker' is not one of"),  # a typo of a top-level key
        (
            lambda v: v.update(extraEnvFrom=env_from_items(v)),
            "is not of type 'string', 'null'",
        ),  # a list, not a string
        (lambda v: v["env"].append({"name": "X", "valueFrom": {}}), "Additional properties are not allowed"),
        (lambda v: v["dags"]["gitSync"].update(period=60), "60 is not of type 'string'"),
        (lambda v: v["dags"]["gitSync"].update(subpath="dags"), "'subpath' is not one of"),
        (
            lambda v: v.update(executor="LocalKubernetesExecutor"),
            "is not one of ['KubernetesExecutor', 'CeleryExecutor']",
        ),
    ],
)
def test_the_check_catches_a_mistake(values, change, expected):
    broken = copy.deepcopy(values)
    change(broken)
    assert any(expected in e for e in errors(broken)), errors(broken)


def test_env_from_items_are_valid_kubernetes(values):
    items = env_from_items(values)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "airflow-worker"},
        "spec": {"containers": [{"name": "base", "image": "airflow", "envFrom": items}]},
    }
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    broken = copy.deepcopy(pod)
    broken["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"nmae": "x"}}]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_connections_come_from_a_secret(values):
    """The connections the DAGs use with credentials are in the Secret named by extraEnvFrom, never in values."""
    env = {e["name"]: e["value"] for e in values["env"]}
    secrets = [item["secretRef"]["name"] for item in env_from_items(values) if "secretRef" in item]
    assert secrets == ["kubetrain-connections"]
    for conn in ("AIRFLOW_CONN_AWS_DEFAULT", "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT"):
        assert conn not in env, f"{conn} must come from the Secret kubetrain-connections, not from values"
        assert (
            conn in (REPO / "deploy" / "helm" / "values.yaml").read_text()
        )  # the comment shows how to create it
    kube = json.loads(env["AIRFLOW_CONN_KUBERNETES_DEFAULT"])  # no credential: the worker's service account
    assert kube["extra"]["in_cluster"] is True and set(kube["extra"]) == {"in_cluster", "namespace"}
    text = (REPO / "deploy" / "helm" / "values.yaml").read_text()
    for literal in ("password", "secret_access_key", "aws_secret"):
        assert not re.search(rf"{literal}\s*[:=]", text, re.I), f"values.yaml holds a literal {literal}"


def test_settings_namespace_and_service_account_match_rbac(values):
    env = {e["name"]: e["value"] for e in values["env"]}
    settings_env = {s.env for s in SETTINGS.values()}
    kubetrain = {k: v for k, v in env.items() if k.startswith("KUBETRAIN_")}
    assert set(kubetrain) <= settings_env, f"unknown kubetrain settings: {set(kubetrain) - settings_env}"
    rbac = [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()) if d]
    bindings = {d["roleRef"]["name"]: d for d in rbac if d["kind"] == "RoleBinding"}
    assert {b["metadata"]["namespace"] for b in bindings.values()} == {kubetrain["KUBETRAIN_NAMESPACE"]}
    assert (
        json.loads(env["AIRFLOW_CONN_KUBERNETES_DEFAULT"])["extra"]["namespace"]
        == kubetrain["KUBETRAIN_NAMESPACE"]
    )
    # the workers run pods and builds; the triggerer follows deferred tasks under its own account
    worker_sa = {
        "kind": "ServiceAccount",
        "name": values["workers"]["serviceAccount"]["name"],
        "namespace": "airflow",
    }
    triggerer_sa = {
        "kind": "ServiceAccount",
        "name": values["triggerer"]["serviceAccount"]["name"],
        "namespace": "airflow",
    }
    assert (
        worker_sa in bindings["kubetrain-airflow"]["subjects"]
        and worker_sa in bindings["kubetrain-build"]["subjects"]
    )
    assert triggerer_sa in bindings["kubetrain-triggerer"]["subjects"]


def test_dags_come_from_git_sync(values):
    git_sync = values["dags"]["gitSync"]
    assert git_sync["enabled"] is True and git_sync["subPath"] == "dags"
    assert values["config"]["core"]["load_examples"] == "False"


def test_every_account_that_reads_s3_carries_the_same_iam_role(values):
    """Workers (runs, builds, ECR logins), the triggerer (it follows deferred runs and reads their records)
    and the API server (the Training page and reports read the run store) get S3 without keys (IRSA)."""
    roles = {
        component: values[component]["serviceAccount"]
        .get("annotations", {})
        .get("eks.amazonaws.com/role-arn")
        for component in ("workers", "triggerer", "apiServer")
    }
    assert len(set(roles.values())) == 1 and all(
        re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", role or "") for role in roles.values()
    ), roles


def test_task_logs_outlive_the_deleted_worker_pods(values):
    """The KubernetesExecutor deletes a worker pod when its task ends: without remote logging the task's
    log goes with it. The logs go to the training bucket through the aws_default connection."""
    assert values["config"]["kubernetes_executor"]["delete_worker_pods"] == "True"
    logging = values["config"]["logging"]
    env = {e["name"]: e["value"] for e in values["env"]}
    assert logging["remote_logging"] == "True" and logging["remote_log_conn_id"] == "aws_default"
    assert logging["remote_base_log_folder"].startswith(f"s3://{env['KUBETRAIN_TRAINING_BUCKET']}/")


def test_the_image_tag_is_the_released_one(values):
    env = {e["name"]: e["value"] for e in values["env"]}
    assert (
        re.fullmatch(r"[\w][\w.-]{0,127}", env["KUBETRAIN_IMAGE_TAG"])
        and env["KUBETRAIN_IMAGE_TAG"] != "latest"
    )
