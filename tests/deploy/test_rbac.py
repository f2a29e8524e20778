"""deploy/rbac.yaml: valid Kubernetes objects that grant what kubetrain's operators and preflight do."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kubetrain.settings import SETTINGS

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()) if d]


def test_every_object_is_valid_kubernetes(documents):
    assert [d["kind"] for d in documents] == ["ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"]
    for doc in documents:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_mistake(documents):
    """The check above would fail on a typo (guards against a vacuous validation)."""
    role = copy.deepcopy(documents[1])
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, K8S_VERSION, strict=True)


def allowed(role: dict, group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in role["rules"])


@pytest.mark.parametrize(
    ("group", "resource", "verbs"),
    [
        ("", "pods", ("create", "get", "list", "watch", "delete", "patch")),  # KubernetesPodOperator
        ("", "pods/log", ("get",)),
        ("", "pods/exec", ("create",)),  # the XCom sidecar
        ("", "events", ("list", "watch")),
        ("", "secrets", ("get",)),  # preflight: the S3 Secret's keys
        ("batch", "jobs", ("create", "get", "watch", "delete")),  # Indexed Job
        ("", "services", ("create", "delete")),  # its headless Service
        ("kubeflow.org", "tfjobs", ("create", "get", "watch", "delete")),
        ("trainer.kubeflow.org", "trainjobs", ("create", "get", "watch", "delete")),
    ],
)
def test_role_grants_what_the_operators_do(documents, group, resource, verbs):
    role = documents[1]
    for verb in verbs:
        assert allowed(role, group, resource, verb), f"the Role does not allow {verb} on {group or 'core'}/{resource}"


def test_role_never_writes_secrets_and_lives_in_the_default_namespace(documents):
    role, binding = documents[1], documents[2]
    for verb in ("create", "update", "patch", "delete", "list"):
        assert not allowed(role, "", "secrets", verb)
    namespace = SETTINGS["namespace"].default
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
