"""deploy/rbac-build.yaml: the namespace of in-cluster builds and the least its two identities need there.

The workers run the builder pod with the provider's pod operator (create, follow, read the log, exec into
the XCom sidecar, delete); the triggerer follows it while the task is deferred. Evaluated with the dev
stack's authorizer (Kubernetes' RBAC semantics); tests/plugins/operators/test_build.py builds under
these grants alone.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from include.devstack.kubeapi import rbac
from include.devstack.kubeapi.store import Store

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"
BUILD_NS = "kubetrain-build"
WORKER = rbac.service_account_identity("airflow", "airflow-worker")
TRIGGERER = rbac.service_account_identity("airflow", "airflow-triggerer")
# what the provider's KubernetesPodOperator does with a builder pod, by identity
WORKER_CALLS = [
    *((verb, "pods", "") for verb in ("create", "get", "list", "watch", "patch", "delete")),
    ("get", "pods", "log"),
    ("create", "pods", "exec"),
    ("get", "pods", "exec"),
    *((verb, "events", "") for verb in ("get", "list", "watch")),
]
TRIGGERER_CALLS = [
    *((verb, "pods", "") for verb in ("get", "list", "watch", "delete")),
    ("get", "pods", "log"),
    *((verb, "events", "") for verb in ("get", "list", "watch")),
]


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac-build.yaml").read_text()) if d]


@pytest.fixture(scope="module")
def authorizer(documents) -> rbac.Authorizer:
    store = Store()
    plural = {"Role": "roles", "RoleBinding": "rolebindings", "Namespace": "namespaces"}
    for resource, obj in rbac.bootstrap_objects():
        store.create(resource, obj)
    for doc in documents:
        store.create(plural[doc["kind"]], copy.deepcopy(doc))
    return rbac.Authorizer(store)


def allowed(authorizer, who, verb, resource, sub="", ns=BUILD_NS, name="", group="") -> bool:
    return authorizer.allowed(who, rbac.Attributes(verb, group, resource, sub, name, ns))


def test_every_object_is_valid_kubernetes(documents):
    for doc in documents:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_namespace_admits_the_rootless_builder_and_nothing_else_lives_elsewhere(documents):
    (namespace,) = [d for d in documents if d["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == BUILD_NS
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert {d["metadata"]["namespace"] for d in documents if d["kind"] != "Namespace"} == {BUILD_NS}


@pytest.mark.parametrize(("verb", "resource", "sub"), WORKER_CALLS)
def test_the_workers_may_run_a_builder_pod(authorizer, verb, resource, sub):
    assert allowed(authorizer, WORKER, verb, resource, sub)


@pytest.mark.parametrize(("verb", "resource", "sub"), TRIGGERER_CALLS)
def test_the_triggerer_may_follow_it(authorizer, verb, resource, sub):
    assert allowed(authorizer, TRIGGERER, verb, resource, sub)


@pytest.mark.parametrize(
    ("who", "verb", "resource", "sub", "ns", "group"),
    [
        (WORKER, "get", "secrets", "", BUILD_NS, ""),  # the kubelet mounts them; nobody reads them
        (WORKER, "list", "secrets", "", BUILD_NS, ""),
        (WORKER, "create", "jobs", "", BUILD_NS, "batch"),
        (WORKER, "create", "pods", "", "kubetrain", ""),  # nothing outside the build namespace
        (WORKER, "create", "rolebindings", "", BUILD_NS, "rbac.authorization.k8s.io"),
        (TRIGGERER, "create", "pods", "", BUILD_NS, ""),
        (TRIGGERER, "create", "pods", "exec", BUILD_NS, ""),
        (TRIGGERER, "get", "secrets", "", BUILD_NS, ""),
    ],
)
def test_and_no_more(authorizer, who, verb, resource, sub, ns, group):
    assert not allowed(authorizer, who, verb, resource, sub, ns=ns, group=group)


def test_each_role_grants_exactly_its_calls(documents):
    roles = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Role"}
    for role, calls in (("kubetrain-builder", WORKER_CALLS), ("kubetrain-build-triggerer", TRIGGERER_CALLS)):
        granted = {
            (verb, resource.partition("/")[0], resource.partition("/")[2])
            for rule in roles[role]["rules"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }
        assert granted == set(calls), (role, granted ^ set(calls))
