"""Kueue's API in two versions, as Kueue v0.19 serves it: the stand-in answers ``kueue.x-k8s.io/v1beta2``
(preferred, stored) beside ``v1beta1`` with the same objects, converted where the schemas differ, and
kubetrain reads whichever the cluster serves (v1beta2 where it can; v1beta1 from an older Kueue, which the
stand-in plays with ``servedVersions: [v1beta1]``)."""

from __future__ import annotations

import asyncio
import json
import urllib.error

import pytest
from kubernetes import client

from kubetrain.pod_startup import choose_kueue_version, kueue_version, kueue_version_async, queue_message

from .support import simple_pod, start_server, stop_server, wait_for

NS = "default"
GROUP = "kueue.x-k8s.io"
CONFIG = """
integrations:
  frameworks: [batch/job, pod]
clusterQueues:
  - name: tiny
    nominalQuota: {cpu: 100m, memory: 1Gi}
localQueues:
  - {namespace: default, name: tiny, clusterQueue: tiny}
workloadPriorityClasses:
  - {name: high, value: 1000}
"""
# pods here stay gated (bigger than the queue's quota), so no image is ever pulled
NO_MIRROR = "127.0.0.1:9"


def start(tmp_path_factory, name: str, extra: str = ""):
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "kueue.yaml").write_text(CONFIG + extra)
    return start_server(tmp, "--kueue-config", str(tmp / "kueue.yaml"), mirror=NO_MIRROR)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    api, proc = start(tmp_path_factory, "kueue-both")
    try:
        yield api
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def v1beta1_only(tmp_path_factory):
    api, proc = start(tmp_path_factory, "kueue-v1beta1", "servedVersions: [v1beta1]\n")
    try:
        yield api
    finally:
        stop_server(proc)


def get_json(api, path: str) -> dict:
    with api.urlopen(f"{api.url}{path}") as resp:
        return json.load(resp)


def queued_pod(api, name: str) -> client.V1Pod:
    """A pod Kueue holds: it asks for more CPU than its queue has, so its Workload says why."""
    core = client.CoreV1Api(api.api_client())
    labels = {"kueue.x-k8s.io/queue-name": "tiny", "kueue.x-k8s.io/priority-class": "high"}
    body = simple_pod(
        name,
        "true",
        metadata={"labels": labels},
        container={"resources": {"requests": {"cpu": "1", "memory": "64Mi"}}},
    )
    core.create_namespaced_pod(NS, body)
    return core.read_namespaced_pod(name, NS)


def workload(api, version: str, owner_uid: str) -> dict:
    custom = client.CustomObjectsApi(api.api_client())

    def find():
        items = custom.list_namespaced_custom_object(GROUP, version, NS, "workloads")["items"]
        return next(
            (w for w in items if any(o["uid"] == owner_uid for o in w["metadata"]["ownerReferences"])), None
        )

    return wait_for(find, 60, what=f"the pod's Workload in {version}")


def test_discovery_serves_v1beta2_preferred_beside_v1beta1(both):
    group = get_json(both, f"/apis/{GROUP}")
    assert group["preferredVersion"] == {"groupVersion": f"{GROUP}/v1beta2", "version": "v1beta2"}
    assert [v["version"] for v in group["versions"]] == ["v1beta2", "v1beta1"]
    listed = next(g for g in get_json(both, "/apis")["groups"] if g["name"] == GROUP)
    assert [v["version"] for v in listed["versions"]] == ["v1beta2", "v1beta1"]
    for version in ("v1beta2", "v1beta1"):
        resources = get_json(both, f"/apis/{GROUP}/{version}")
        assert resources["groupVersion"] == f"{GROUP}/{version}"
        assert {"workloads", "localqueues", "clusterqueues", "workloadpriorityclasses"} <= {
            r["name"] for r in resources["resources"]
        }


def test_a_stand_in_for_an_older_kueue_serves_only_v1beta1(v1beta1_only):
    group = get_json(v1beta1_only, f"/apis/{GROUP}")
    assert [v["version"] for v in group["versions"]] == ["v1beta1"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        get_json(v1beta1_only, f"/apis/{GROUP}/v1beta2/namespaces/{NS}/localqueues")
    assert refused.value.code == 404


def test_one_workload_read_through_either_version(both):
    pod = queued_pod(both, "either-version")
    new = workload(both, "v1beta2", pod.metadata.uid)
    old = workload(both, "v1beta1", pod.metadata.uid)
    assert new["metadata"] == old["metadata"]  # one object: same name, uid, resourceVersion
    assert (new["apiVersion"], old["apiVersion"]) == (f"{GROUP}/v1beta2", f"{GROUP}/v1beta1")
    # the priority class: v1beta2's reference, v1beta1's source and name (Kueue's workload_conversion.go)
    assert new["spec"]["priorityClassRef"] == {
        "group": GROUP,
        "kind": "WorkloadPriorityClass",
        "name": "high",
    }
    assert "priorityClassName" not in new["spec"] and "priorityClassSource" not in new["spec"]
    assert old["spec"]["priorityClassName"] == "high"
    assert old["spec"]["priorityClassSource"] == "kueue.x-k8s.io/workloadpriorityclass"
    assert "priorityClassRef" not in old["spec"]
    assert new["spec"]["priority"] == old["spec"]["priority"] == 1000
    assert new["status"] == old["status"]
    custom = client.CustomObjectsApi(both.api_client())
    for plural, name in (("localqueues", "tiny"),):
        a = custom.get_namespaced_custom_object(GROUP, "v1beta2", NS, plural, name)
        b = custom.get_namespaced_custom_object(GROUP, "v1beta1", NS, plural, name)
        assert a["metadata"] == b["metadata"] and a["spec"] == b["spec"] == {"clusterQueue": "tiny"}
    for plural, name in (("clusterqueues", "tiny"), ("workloadpriorityclasses", "high")):
        a = custom.get_cluster_custom_object(GROUP, "v1beta2", plural, name)
        b = custom.get_cluster_custom_object(GROUP, "v1beta1", plural, name)
        assert {**a, "apiVersion": None} == {**b, "apiVersion": None}
        assert a["apiVersion"] == f"{GROUP}/v1beta2" and b["apiVersion"] == f"{GROUP}/v1beta1"


@pytest.mark.parametrize(("server", "expected"), [("both", "v1beta2"), ("v1beta1_only", "v1beta1")])
def test_kubetrain_reads_kueue_in_the_version_the_cluster_serves(request, server, expected):
    api = request.getfixturevalue(server)
    api_client = api.api_client()
    assert kueue_version(api_client) == expected

    async def discover() -> str:
        from kubernetes_asyncio import config as aconfig

        async with await aconfig.new_client_from_config(str(api.kubeconfig)) as aclient:
            return await kueue_version_async(aclient)

    assert asyncio.run(discover()) == expected
    # and what kubetrain reads through it says why the pod waits
    pod = queued_pod(api, f"reads-{expected}")
    found = workload(api, expected, pod.metadata.uid)
    custom = client.CustomObjectsApi(api_client)
    local_queue = custom.get_namespaced_custom_object(GROUP, expected, NS, "localqueues", "tiny")

    def told() -> str | None:
        items = custom.list_namespaced_custom_object(GROUP, expected, NS, "workloads")["items"]
        line = queue_message(pod, 5, items, local_queue)
        return line if "maximum capacity" in line else None

    line = wait_for(told, 60, what="the Workload's reason in the queue line")
    assert f"(Workload {found['metadata']['name']})" in line


@pytest.mark.parametrize(
    ("versions", "preferred", "expected"),
    [
        (["v1beta2", "v1beta1"], "v1beta2", "v1beta2"),
        (["v1beta1", "v1beta2"], "v1beta1", "v1beta2"),  # kubetrain prefers v1beta2 wherever it is served
        (["v1beta1"], "v1beta1", "v1beta1"),
        (["v1"], "v1", "v1"),  # a version kubetrain does not know: the cluster's preferred one
    ],
)
def test_choose_kueue_version(versions, preferred, expected):
    groups = [
        {"name": "batch", "versions": [{"version": "v1"}], "preferredVersion": {"version": "v1"}},
        {
            "name": GROUP,
            "versions": [{"version": v} for v in versions],
            "preferredVersion": {"version": preferred},
        },
    ]
    assert choose_kueue_version(groups) == expected


def test_choose_kueue_version_without_kueue_says_so():
    with pytest.raises(LookupError, match="does not serve kueue.x-k8s.io"):
        choose_kueue_version([{"name": "batch", "versions": [{"version": "v1"}]}])


@pytest.mark.parametrize("served", ["[v1beta3]", "[]", "v1beta1"])
def test_a_served_versions_setting_kueue_does_not_have_is_refused(tmp_path, served):
    from types import SimpleNamespace

    from include.devstack.kubeapi.kueue import Kueue

    (tmp_path / "kueue.yaml").write_text(f"servedVersions: {served}\n")
    with pytest.raises(ValueError, match=r"servedVersions .*: expected a list of v1beta2, v1beta1"):
        Kueue(SimpleNamespace(store=None), None, tmp_path / "kueue.yaml")
