"""deploy/rbac.yaml: valid Kubernetes objects that grant what kubetrain's workers, builds and triggerer do, and no more.

The grants are evaluated with the dev stack's authorizer (include/devstack/kubeapi/rbac.py: Kubernetes' RBAC
semantics, resourceNames and subresources included); the e2e tests then run under these grants alone.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from include.devstack.kubeapi import rbac
from include.devstack.kubeapi.store import Store
from kubetrain.settings import SETTINGS

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"
NS = SETTINGS["namespace"].default
WORKER = rbac.service_account_identity("airflow", "airflow-worker")
TRIGGERER = rbac.service_account_identity("airflow", "airflow-triggerer")


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()) if d]


@pytest.fixture(scope="module")
def authorizer(documents) -> rbac.Authorizer:
    store = Store()
    plural = {
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ClusterRole": "clusterroles",
        "ClusterRoleBinding": "clusterrolebindings",
        "ServiceAccount": "serviceaccounts",
    }
    for resource, obj in rbac.bootstrap_objects():
        store.create(resource, obj)
    for doc in documents:
        store.create(plural[doc["kind"]], copy.deepcopy(doc))
    return rbac.Authorizer(store)


def test_every_object_is_valid_kubernetes(documents):
    assert [d["kind"] for d in documents] == [
        "ServiceAccount",
        "Role",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
    ]
    for doc in documents:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_mistake(documents):
    """The check above would fail on a typo (guards against a vacuous validation)."""
    role = copy.deepcopy(documents[1])
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, K8S_VERSION, strict=True)


def can(authorizer, who, verb: str, group: str, resource: str, name: str = "", namespace: str = NS) -> bool:
    base, _, sub = resource.partition("/")
    return authorizer.allowed(who, rbac.Attributes(verb, group, base, sub, name, namespace))


@pytest.mark.parametrize(
    ("group", "resource", "verbs"),
    [
        ("", "pods", ("create", "get", "list", "watch", "delete", "patch")),  # KubernetesPodOperator
        ("", "pods/log", ("get",)),
        ("", "events", ("list", "watch")),
        ("batch", "jobs", ("create", "get", "watch", "delete")),  # Indexed Job
        ("", "services", ("create", "delete")),  # its headless Service
        ("kubeflow.org", "tfjobs", ("create", "get", "watch", "delete")),
        ("trainer.kubeflow.org", "trainjobs", ("create", "get", "watch", "delete")),
        ("trainer.kubeflow.org", "trainingruntimes", ("create", "get", "delete")),  # one per trainjob run
        (
            "authorization.k8s.io",
            "selfsubjectaccessreviews",
            ("create",),
        ),  # the preflight (a bootstrap grant)
    ],
)
def test_the_workers_may_do_what_the_operators_do(authorizer, group, resource, verbs):
    namespace = "" if resource == "selfsubjectaccessreviews" else NS
    for verb in verbs:
        assert can(authorizer, WORKER, verb, group, resource, namespace=namespace), (
            f"{verb} {group}/{resource}"
        )


def test_secrets_only_the_s3_one_and_only_to_read(authorizer):
    assert can(authorizer, WORKER, "get", "", "secrets", name="kubetrain-s3")
    assert not can(authorizer, WORKER, "get", "", "secrets", name="some-other-teams-secret")
    for verb in ("list", "watch", "create", "update", "patch", "delete"):
        assert not can(authorizer, WORKER, verb, "", "secrets", name="kubetrain-s3")


def test_exec_only_for_the_builds_role(documents, authorizer):
    by_name = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Role"}
    exec_rules = [r for d in by_name.values() for r in d["rules"] if "pods/exec" in r["resources"]]
    assert len(exec_rules) == 1 and exec_rules[0] in by_name["kubetrain-build"]["rules"]
    assert can(authorizer, WORKER, "create", "", "pods/exec", name="builder")
    assert not can(authorizer, TRIGGERER, "create", "", "pods/exec", name="builder")


@pytest.mark.parametrize(
    ("verb", "group", "resource"),
    [
        ("get", "", "pods"),
        ("watch", "", "pods"),
        ("list", "", "pods"),
        ("get", "", "pods/log"),
        ("list", "", "events"),
        ("get", "batch", "jobs/status"),
        ("delete", "batch", "jobs"),
        ("delete", "", "services"),
        ("delete", "", "pods"),
        ("get", "kubeflow.org", "tfjobs"),
        ("delete", "trainer.kubeflow.org", "trainjobs"),
        ("delete", "trainer.kubeflow.org", "trainingruntimes"),
    ],
)
def test_the_triggerer_may_follow_and_clean_up(authorizer, verb, group, resource):
    assert can(authorizer, TRIGGERER, verb, group, resource, name="x")


def test_the_triggerer_creates_nothing(authorizer):
    for group, resource in (
        ("", "pods"),
        ("batch", "jobs"),
        ("", "services"),
        ("trainer.kubeflow.org", "trainjobs"),
    ):
        assert not can(authorizer, TRIGGERER, "create", group, resource)


def test_roles_live_in_the_default_namespace(documents):
    namespaced = [d for d in documents if d["kind"] in ("Role", "RoleBinding")]
    assert {d["metadata"]["namespace"] for d in namespaced} == {NS}
    roles = {d["metadata"]["name"] for d in namespaced if d["kind"] == "Role"}
    assert {d["roleRef"]["name"] for d in namespaced if d["kind"] == "RoleBinding"} == roles


def test_the_manifest_grants_exactly_what_the_preflight_reviews(documents, authorizer):
    """The preflight's access lists (what kubetrain does) and the Roles agree both ways: nothing missing, nothing more."""
    from kubetrain.preflight.cluster import TRIGGERER_ACCESS, WORKER_ACCESS, access_attributes

    for who, access in ((WORKER, WORKER_ACCESS), (TRIGGERER, TRIGGERER_ACCESS)):
        for attrs in access_attributes(access, NS, "kubetrain-s3"):
            allowed = authorizer.allowed(
                who,
                rbac.Attributes(
                    attrs["verb"], attrs["group"], attrs["resource"], attrs["subresource"], attrs["name"], NS
                ),
            )
            assert allowed, f"{who.user} is not granted {attrs}"
    reviewed = {(v, g, r) for v, g, r, _ in (*WORKER_ACCESS, *TRIGGERER_ACCESS)}
    extra = set()
    for role in (d for d in documents if d["kind"] == "Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        if (verb, group, resource) not in reviewed and not resource.endswith("/status"):
                            extra.add((role["metadata"]["name"], verb, group, resource))
    # the Kubeflow engines' cluster-wide runtimes and a few reads that only `kubectl` users need
    allowed_extra = {
        ("kubetrain-airflow", v, "trainer.kubeflow.org", "clustertrainingruntimes") for v in ("get", "list")
    }
    allowed_extra |= {
        (role, v, g, r) for role, v, g, r in extra if role == "kubetrain-triggerer" and v == "list"
    }
    allowed_extra |= {("kubetrain-triggerer", "get", "", "services")}
    assert extra <= allowed_extra, sorted(extra - allowed_extra)
