"""Kueue's queues as API objects on the dev stack's stand-in: the stack starts with the queues a cluster
gets (deploy/kueue/queues.yaml, applied as `kubectl apply` applies it), and a ClusterQueue, LocalQueue or
WorkloadPriorityClass created, changed or deleted through the API counts for admission from then on, with
Kueue's messages when a queue is missing, too small or closed to the namespace."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from kubernetes import client

from include.devstack.stack import KUEUE_CONFIG, REPO

from .support import simple_pod, start_server, stop_server, wait_for

NS = "default"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
GATE = "kueue.x-k8s.io/admission"
# no pod here needs its image: admission is seen on the pod (its gate goes), not in a running container
NO_MIRROR = "127.0.0.1:9"
OUTSIDER = "kueue-outsider-token"
PLURALS = {
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
    "WorkloadPriorityClass": "workloadpriorityclasses",
    "ResourceFlavor": "resourceflavors",
}
SHIPPED = [d for d in yaml.safe_load_all((REPO / "deploy" / "kueue" / "queues.yaml").read_text()) if d]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A local API started with the dev stack's own Kueue configuration."""
    tmp = tmp_path_factory.mktemp("kueue-objects")
    api, proc = start_server(
        tmp, "--kueue-config", str(KUEUE_CONFIG), mirror=NO_MIRROR, users={OUTSIDER: "outsider"}
    )
    try:
        yield api
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api.api_client())


@pytest.fixture(scope="module")
def custom(api) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api.api_client())


def cluster_queue(name: str, cpu: str, namespace_selector: dict | None = None) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {} if namespace_selector is None else namespace_selector,
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": "default-flavor",
                            "resources": [
                                {"name": "cpu", "nominalQuota": cpu},
                                {"name": "memory", "nominalQuota": "1Gi"},
                            ],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(name: str, cq: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"clusterQueue": cq},
    }


def apply_queues(custom: client.CustomObjectsApi, cq: dict, lq: dict) -> None:
    custom.create_cluster_custom_object(GROUP, VERSION, "clusterqueues", cq)
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, "localqueues", lq)


def queued(core: client.CoreV1Api, name: str, queue: str, cpu: str = "500m") -> None:
    core.create_namespaced_pod(
        NS,
        simple_pod(
            name,
            "true",
            metadata={"labels": {"kueue.x-k8s.io/queue-name": queue}},
            container={"resources": {"requests": {"cpu": cpu, "memory": "64Mi"}}},
        ),
    )


def gated(core: client.CoreV1Api, name: str) -> bool:
    pod = core.read_namespaced_pod(name, NS)
    return any(g.name == GATE for g in pod.spec.scheduling_gates or [])


def admitted(core: client.CoreV1Api, name: str) -> None:
    wait_for(lambda: not gated(core, name), 60, what=f"Kueue to admit pod {name}")


def waiting(custom: client.CustomObjectsApi, core: client.CoreV1Api, name: str, text: str) -> dict:
    """The pod's Workload once its QuotaReserved condition says ``text``; the pod is still gated."""
    uid = core.read_namespaced_pod(name, NS).metadata.uid

    def find():
        for w in custom.list_namespaced_custom_object(GROUP, VERSION, NS, "workloads")["items"]:
            if any(o["uid"] == uid for o in w["metadata"]["ownerReferences"]):
                cond = next(
                    (c for c in w.get("status", {}).get("conditions", []) if c["type"] == "QuotaReserved"), {}
                )
                if text in cond.get("message", ""):
                    return cond
        return None

    cond = wait_for(find, 60, what=f"pod {name}'s Workload to say {text!r}")
    assert cond["status"] == "False"
    assert gated(core, name)
    return cond


def test_the_stack_starts_with_the_shipped_queues_sized_to_its_one_gpu(custom):
    for doc in SHIPPED:
        plural = PLURALS[doc["kind"]]
        meta = doc["metadata"]
        if "namespace" in meta:
            got = custom.get_namespaced_custom_object(GROUP, VERSION, meta["namespace"], plural, meta["name"])
        else:
            got = custom.get_cluster_custom_object(GROUP, VERSION, plural, meta["name"])
        expected = copy.deepcopy(doc.get("spec"))
        if doc["kind"] == "ClusterQueue":
            for resource in expected["resourceGroups"][0]["flavors"][0]["resources"]:
                if resource["name"] == "nvidia.com/gpu":
                    resource["nominalQuota"] = "1"
        assert got.get("spec") == expected, doc["kind"]
        assert got.get("value") == doc.get("value")


def test_a_queue_applied_through_the_api_admits_a_pod(custom, core):
    apply_queues(custom, cluster_queue("applied", "1"), local_queue("applied", "applied"))
    listed = custom.list_cluster_custom_object(GROUP, VERSION, "clusterqueues")["items"]
    assert "applied" in {q["metadata"]["name"] for q in listed}
    queued(core, "in-applied", "applied")
    admitted(core, "in-applied")


def test_a_queue_with_too_little_quota_says_the_request_exceeds_its_maximum_capacity(custom, core):
    apply_queues(custom, cluster_queue("small", "100m"), local_queue("small", "small"))
    queued(core, "too-big", "small", cpu="500m")
    cond = waiting(custom, core, "too-big", "request > maximum capacity")
    assert (
        "insufficient quota for cpu in flavor default-flavor, request > maximum capacity (500m > 100m)"
        in (cond["message"])
    )
    # more quota, set through the API, admits it
    custom.patch_cluster_custom_object(GROUP, VERSION, "clusterqueues", "small", cluster_queue("small", "1"))
    admitted(core, "too-big")


def test_a_pod_naming_a_missing_local_queue_waits_until_the_queue_exists(custom, core):
    queued(core, "early", "later")
    cond = waiting(custom, core, "early", "LocalQueue later doesn't exist")
    assert cond["reason"] == "Inadmissible"
    apply_queues(custom, cluster_queue("later", "1"), local_queue("later", "later"))
    admitted(core, "early")


def test_a_deleted_queue_admits_nothing_more(custom, core):
    apply_queues(custom, cluster_queue("gone", "2"), local_queue("gone", "gone"))
    custom.delete_cluster_custom_object(GROUP, VERSION, "clusterqueues", "gone")
    queued(core, "after-cq", "gone")
    waiting(custom, core, "after-cq", "ClusterQueue gone doesn't exist")
    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "localqueues", "gone")
    queued(core, "after-lq", "gone")
    waiting(custom, core, "after-lq", "LocalQueue gone doesn't exist")


def test_a_cluster_queue_admits_only_the_namespaces_it_selects(custom, core):
    elsewhere = {"matchLabels": {"kubernetes.io/metadata.name": "elsewhere"}}
    apply_queues(custom, cluster_queue("closed", "1", elsewhere), local_queue("closed", "closed"))
    queued(core, "not-selected", "closed")
    waiting(custom, core, "not-selected", "workload namespace doesn't match ClusterQueue selector")
    opened = custom.get_cluster_custom_object(GROUP, VERSION, "clusterqueues", "closed")
    opened["spec"]["namespaceSelector"] = {}  # every namespace
    custom.replace_cluster_custom_object(GROUP, VERSION, "clusterqueues", "closed", opened)
    admitted(core, "not-selected")


def test_a_priority_class_created_later_lets_kueue_create_the_workload(custom, core):
    apply_queues(custom, cluster_queue("prioritized", "1"), local_queue("prioritized", "prioritized"))
    labels = {"kueue.x-k8s.io/queue-name": "prioritized", "kueue.x-k8s.io/priority-class": "urgent"}
    core.create_namespaced_pod(
        NS,
        simple_pod(
            "prioritized",
            "true",
            metadata={"labels": labels},
            container={"resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
        ),
    )
    events = wait_for(
        lambda: (
            core.list_namespaced_event(
                NS, field_selector="involvedObject.name=prioritized,reason=WorkloadPriorityClassNotFound"
            ).items
        ),
        60,
        what="the WorkloadPriorityClassNotFound event",
    )
    assert events[0].message == 'WorkloadPriorityClass "urgent" not found' and gated(core, "prioritized")
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": "urgent"},
        "value": 5000,
    }
    custom.create_cluster_custom_object(GROUP, VERSION, "workloadpriorityclasses", body)
    admitted(core, "prioritized")
    uid = core.read_namespaced_pod("prioritized", NS).metadata.uid
    (workload,) = [
        w
        for w in custom.list_namespaced_custom_object(GROUP, VERSION, NS, "workloads")["items"]
        if any(o["uid"] == uid for o in w["metadata"]["ownerReferences"])
    ]
    assert workload["spec"]["priority"] == 5000


def test_queues_are_authorized_like_any_resource(api):
    configuration = client.Configuration()
    configuration.host = api.url
    configuration.ssl_ca_cert = str(api.ca)
    configuration.api_key = {"authorization": f"Bearer {OUTSIDER}"}
    with pytest.raises(client.ApiException) as refused:
        client.CustomObjectsApi(client.ApiClient(configuration)).create_cluster_custom_object(
            GROUP, VERSION, "clusterqueues", cluster_queue("sneaky", "64")
        )
    assert refused.value.status == 403
    assert (
        'User "outsider" cannot create resource "clusterqueues" in API group "kueue.x-k8s.io"'
        in (json.loads(refused.value.body)["message"])
    )


@pytest.mark.parametrize("version", ["v1beta2", "v1beta1"])
def test_openapi_v3_publishes_every_served_kueue_version(api, version):
    with api.urlopen(f"{api.url}/openapi/v3") as resp:
        index = json.load(resp)["paths"]
    entry = index[f"apis/{GROUP}/{version}"]
    with api.urlopen(f"{api.url}{entry['serverRelativeURL']}") as resp:
        document = json.load(resp)
    post = document["paths"][f"/apis/{GROUP}/{version}/clusterqueues"]["post"]
    assert post["x-kubernetes-group-version-kind"] == {
        "group": GROUP,
        "version": version,
        "kind": "ClusterQueue",
    }
    assert f"/apis/{GROUP}/{version}/namespaces/{{namespace}}/localqueues/{{name}}" in document["paths"]
    assert f"apis/{GROUP}/v1" not in index


def test_a_queue_object_is_checked_against_kueues_crd_schema(custom):
    bad = cluster_queue("misspelt", "1")
    bad["spec"]["queueingStrategy"] = "FIFO"
    with pytest.raises(client.ApiException) as refused:
        custom.create_cluster_custom_object(GROUP, VERSION, "clusterqueues", bad)
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert (
        'ClusterQueue.kueue.x-k8s.io "misspelt" is invalid: spec.queueingStrategy: Unsupported value: "FIFO"'
        in (message)
    )
    # v1beta1's name of the cohort field is unknown in v1beta2: refused under strict field validation
    old = cluster_queue("old-field", "1")
    old["spec"]["cohort"] = "team"
    with pytest.raises(client.ApiException) as strict:
        custom.api_client.call_api(
            f"/apis/{GROUP}/{VERSION}/clusterqueues",
            "POST",
            query_params=[("fieldValidation", "Strict")],
            body=old,
            header_params={"Content-Type": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
        )
    assert strict.value.status == 400
    assert 'unknown field "spec.cohort"' in json.loads(strict.value.body)["message"]
    # a change is checked too
    custom.create_cluster_custom_object(GROUP, VERSION, "clusterqueues", cluster_queue("changed", "1"))
    with pytest.raises(client.ApiException) as patched:
        custom.patch_cluster_custom_object(
            GROUP,
            VERSION,
            "clusterqueues",
            "changed",
            {"spec": {"preemption": {"withinClusterQueue": "Always"}}},
        )
    assert patched.value.status == 422


@pytest.fixture(scope="module")
def pods_only(tmp_path_factory):
    """A Kueue whose configuration enables the pod integration and not batch/job."""
    tmp = tmp_path_factory.mktemp("kueue-pods-only")
    (tmp / "kueue.yaml").write_text(
        "integrations: {frameworks: [pod]}\n"
        "clusterQueues: [{name: team, nominalQuota: {cpu: '1', memory: 1Gi}}]\n"
        "localQueues: [{namespace: default, name: team, clusterQueue: team}]\n"
    )
    api, proc = start_server(tmp, "--kueue-config", str(tmp / "kueue.yaml"), mirror=NO_MIRROR)
    try:
        yield api
    finally:
        stop_server(proc)


def test_without_the_job_integration_a_queued_job_is_not_suspended_and_its_pods_are_the_pod_integrations(
    pods_only,
):
    batch = client.BatchV1Api(pods_only.api_client())
    core = client.CoreV1Api(pods_only.api_client())
    labels = {"kueue.x-k8s.io/queue-name": "team"}
    template = simple_pod(
        "x",
        "true",
        container={"resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
    )
    template["metadata"] = {"labels": labels}
    job = {"metadata": {"name": "unmanaged-job", "labels": labels}, "spec": {"template": template}}
    created = batch.create_namespaced_job(NS, job)
    assert not created.spec.suspend
    (pod,) = wait_for(
        lambda: core.list_namespaced_pod(NS, label_selector="job-name=unmanaged-job").items,
        60,
        what="the Job's pod",
    )
    # the pod integration takes a pod whose owner's integration is off
    assert pod.metadata.labels.get("kueue.x-k8s.io/managed") == "true"
    assert "kueue.x-k8s.io/managed" in (pod.metadata.finalizers or [])
