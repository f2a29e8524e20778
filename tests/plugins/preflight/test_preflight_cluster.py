"""The cluster's lines without a cluster: the access lists and their lines, the api line's cases and the GPU
nodes' (test_preflight_devstack.py asks a real API server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kubernetes.client import models as k8s

from kubetrain.preflight.check import Check
from kubetrain.preflight.cluster import (
    CPU_FALLBACK_ANNOTATION,
    TRIGGERER_ACCESS,
    WORKER_ACCESS,
    ClusterChecks,
    access_attributes,
    access_check,
    triggerer_check,
)
from kubetrain.settings import Deployment


def test_access_attributes_name_the_s3_secret_and_split_subresources():
    attributes = access_attributes(WORKER_ACCESS, "team", "team-s3")
    assert {
        "namespace": "team",
        "verb": "get",
        "group": "",
        "resource": "secrets",
        "subresource": "",
        "name": "team-s3",
    } in attributes
    assert {
        "namespace": "team",
        "verb": "get",
        "group": "batch",
        "resource": "jobs",
        "subresource": "status",
        "name": "",
    } in attributes
    # workload identity: no Secret to read, so no review of it
    without = access_attributes(WORKER_ACCESS, "team", None)
    assert len(without) == len(attributes) - 1 and all(a["resource"] != "secrets" for a in without)


def test_the_triggerer_follows_and_cleans_up_what_the_workers_create():
    worker = {(verb, group, resource) for verb, group, resource, _ in WORKER_ACCESS}
    triggerer = {(verb, group, resource) for verb, group, resource, _ in TRIGGERER_ACCESS}
    assert triggerer < worker
    assert not [access for access in triggerer if access[0] in ("create", "patch")]


def test_an_access_line_passes_or_names_what_is_refused_and_the_manifest():
    refused = access_attributes(WORKER_ACCESS, "kubetrain", "kubetrain-s3")[:8]
    assert access_check("access", "the workers' account", [], 40, "kubetrain") == Check(
        "access", "PASS", "the workers' account may do all 40 things kubetrain does in namespace 'kubetrain'"
    )
    failed = access_check("access", "the workers' account", refused, 40, "kubetrain")
    assert failed.status == "FAIL"
    assert failed.detail == (
        "the workers' account may not create pods, get pods, list pods, watch pods, patch pods, delete pods "
        "(+2 more) in namespace 'kubetrain'"
    )
    assert failed.fix.startswith("kubectl apply -f deploy/rbac.yaml in namespace kubetrain")
    secret = access_attributes([("get", "", "secrets", "<s3_secret>")], "kubetrain", "team-s3")
    assert "may not get secrets 'team-s3' in" in access_check("access", "a", secret, 1, "kubetrain").detail


def test_the_triggerers_line_comes_from_its_trigger_event():
    assert triggerer_check({"refused": [], "total": 19}, "kubetrain").status == "PASS"
    failed = triggerer_check({"error": "Unauthorized"}, "kubetrain")
    assert (failed.name, failed.status) == ("access:triggerer", "FAIL")
    assert failed.detail == "the triggerer could not ask the API what it may do: Unauthorized"


@pytest.fixture
def api_checks(fake_cluster):
    """ClusterChecks whose server reports ``version`` and answers the namespace calls given."""

    def make(version=("v1.31.0 at https://k8s", (1, 31)), **answers) -> ClusterChecks:
        checks = ClusterChecks(fake_cluster(Deployment(namespace="team"), **answers))
        if isinstance(version, BaseException):

            def unreachable():
                raise version

            checks._version = unreachable
        else:
            checks._version = lambda: version
        return checks

    return make


def test_the_api_line(api_checks, api_error):
    ok = api_checks(read_namespace={}).check_api()
    assert ok == Check("api", "PASS", "API v1.31.0 at https://k8s answers and namespace 'team' exists")

    old = api_checks(("v1.28.9 at https://k8s", (1, 28)), read_namespace={}).check_api()
    assert old.status == "FAIL" and "older than 1.29" in old.detail and "native sidecar" in old.detail
    assert old.fix == "upgrade the cluster to Kubernetes 1.29 or later"

    down = api_checks(ConnectionRefusedError("[Errno 111] refused")).check_api()
    assert down.status == "FAIL" and down.detail == (
        "the Kubernetes API of connection 'kubernetes_default' does not answer: "
        "ConnectionRefusedError: [Errno 111] refused"
    )

    missing = api_checks(read_namespace=api_error(404)).check_api()
    assert missing.detail == "API v1.31.0 at https://k8s answers, but namespace 'team' does not exist"
    assert missing.fix == "kubectl create namespace team, or set KUBETRAIN_NAMESPACE to an existing one"

    # a Role in the namespace need not read the namespace: listing its pods is enough
    listed = api_checks(read_namespace=api_error(403), list_namespaced_pod={}).check_api()
    assert listed.status == "PASS"
    refused = api_checks(
        read_namespace=api_error(403), list_namespaced_pod=api_error(403, reason="Forbidden")
    ).check_api()
    assert refused.status == "FAIL" and refused.detail.endswith(
        "namespace 'team' is not usable: 403 Forbidden"
    )


def node(name: str, allocatable: dict[str, str], taints=(), annotations=None) -> k8s.V1Node:
    return k8s.V1Node(
        metadata=k8s.V1ObjectMeta(name=name, annotations=annotations),
        spec=k8s.V1NodeSpec(taints=[k8s.V1Taint(**t) for t in taints] or None),
        status=k8s.V1NodeStatus(allocatable=allocatable),
    )


CPU = {"cpu": "8", "memory": "32Gi"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("nodes", "status", "detail"),
    [
        (
            [node("cpu-1", CPU), node("gpu-1", {**CPU, "nvidia.com/gpu": "4"}, [GPU_TAINT])],
            "PASS",
            "1 of 2 node(s): gpu-1 (4 nvidia.com/gpu; nvidia.com/gpu=present:NoSchedule)",
        ),
        (
            [node("gpu-0", {**CPU, "nvidia.com/gpu": "0"}), node("cpu-1", CPU)],
            "WARN",
            "none of 2 node(s) offers nvidia.com/gpu: training pods that ask for GPUs stay Pending",
        ),
        (
            [node("dev", CPU, annotations={CPU_FALLBACK_ANNOTATION: "nvidia.com/gpu"})],
            "INFO",
            "none of 1 node(s) offers nvidia.com/gpu; node(s) dev serve GPU requests on CPU",
        ),
        (
            [
                node(
                    "dev",
                    {**CPU, "nvidia.com/gpu": "1"},
                    annotations={CPU_FALLBACK_ANNOTATION: "nvidia.com/gpu"},
                )
            ],
            "PASS",
            "1 of 1 node(s): dev (1 nvidia.com/gpu; no taints; requests beyond them are served on CPU)",
        ),
    ],
)
def test_the_gpu_nodes_line(fake_cluster, nodes, status, detail):
    check = ClusterChecks(fake_cluster(list_node=SimpleNamespace(items=nodes))).check_gpu_nodes()
    assert check.status == status and check.detail.startswith(detail), check


def test_nodes_a_namespaced_role_cannot_list_leave_the_gpu_nodes_unknown(fake_cluster, api_error):
    check = ClusterChecks(fake_cluster(list_node=api_error(403, reason="Forbidden"))).check_gpu_nodes()
    assert check.status == "INFO" and check.detail.endswith("; GPU nodes unknown")


def test_no_queue_configured_asks_no_api(fake_cluster):
    cluster = fake_cluster(Deployment(queue=None))
    assert ClusterChecks(cluster).check_queue() == Check(
        "queue", "INFO", "no Kueue queue configured (KUBETRAIN_QUEUE): pods go to the scheduler"
    )
    assert cluster.core.calls == []
