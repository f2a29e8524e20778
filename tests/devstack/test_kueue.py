"""The dev stack's Kueue stand-in: queued pods are gated and admitted within quota, in priority then
creation order; a higher-priority workload preempts a lower one; pod groups and Jobs are admitted all
or nothing; a resource the ClusterQueue does not cover keeps a workload out, as Kueue does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kubernetes import client, watch

from .support import first_line, simple_pod, start_server, stop_server

NS = "default"
CONFIG = """
clusterQueues:
  - name: team
    nominalQuota: {cpu: "4", memory: 8Gi, nvidia.com/gpu: 1, ephemeral-storage: 20Gi}
    preemption: {withinClusterQueue: LowerPriority}
  - name: narrow
    nominalQuota: {cpu: "4", memory: 8Gi}
localQueues:
  - {namespace: default, name: gpus, clusterQueue: team}
  - {namespace: default, name: narrow, clusterQueue: narrow}
workloadPriorityClasses:
  - {name: low, value: 100}
  - {name: high, value: 1000}
"""


@pytest.fixture(scope="module")
def kueue_api(tmp_path_factory, mirror):
    tmp = tmp_path_factory.mktemp("kueue")
    (tmp / "kueue.yaml").write_text(CONFIG)
    api, proc = start_server(tmp, "--kueue-config", str(tmp / "kueue.yaml"), mirror=mirror)
    try:
        yield api
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def core(kueue_api) -> client.CoreV1Api:
    return client.CoreV1Api(kueue_api.api_client())


@pytest.fixture(scope="module")
def custom(kueue_api) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kueue_api.api_client())


def queued_pod(
    name: str, script: str, queue: str = "gpus", gpus: int = 1, priority: str = "", **extra
) -> dict:
    labels = {"kueue.x-k8s.io/queue-name": queue, **extra.pop("labels", {})}
    if priority:
        labels["kueue.x-k8s.io/priority-class"] = priority
    requests = {"cpu": "100m", "memory": "64Mi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return simple_pod(
        name,
        script,
        metadata={"labels": labels, "annotations": extra.pop("annotations", {})},
        container={"resources": {"requests": requests, "limits": limits}},
        **extra,
    )


def until(core: client.CoreV1Api, name: str, predicate: Callable[[str, client.V1Pod], bool]) -> client.V1Pod:
    pod = core.read_namespaced_pod(name, NS)
    if predicate("CURRENT", pod):
        return pod
    for event in watch.Watch().stream(
        core.list_namespaced_pod,
        NS,
        field_selector=f"metadata.name={name}",
        resource_version=pod.metadata.resource_version,
        timeout_seconds=180,
    ):
        if predicate(event["type"], event["object"]):
            return event["object"]
    raise AssertionError(f"pod {name} never reached the awaited state")


def workload_of(custom: client.CustomObjectsApi, owner: str) -> dict:
    items = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", NS, "workloads")["items"]
    found = [w for w in items if any(o["name"] == owner for o in w["metadata"]["ownerReferences"])]
    assert found, f"no Workload owned by {owner}: {[w['metadata']['name'] for w in items]}"
    return found[-1]


def wl_condition(workload: dict, kind: str) -> dict:
    return next((c for c in workload.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def gated(pod: client.V1Pod) -> bool:
    return any(g.name == "kueue.x-k8s.io/admission" for g in pod.spec.scheduling_gates or [])


def phase_in(*phases: str) -> Callable[[str, client.V1Pod], bool]:
    return lambda _, p: p.status.phase in phases


def test_a_second_run_waits_for_quota_and_starts_when_the_first_ends(core, custom):
    core.create_namespaced_pod(NS, queued_pod("first", "sleep 3"))
    first = until(core, "first", phase_in("Running", "Succeeded"))
    assert not gated(first) and first.metadata.labels["kueue.x-k8s.io/managed"] == "true"
    core.create_namespaced_pod(NS, queued_pod("second", "echo second"))
    second = core.read_namespaced_pod("second", NS)
    assert gated(second)
    assert core.read_namespaced_pod("first", NS).status.phase in ("Running", "Succeeded")
    done = until(core, "second", phase_in("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded"
    first = core.read_namespaced_pod("first", NS)
    assert first.status.phase == "Succeeded"
    assert done.status.start_time >= first.status.container_statuses[0].state.terminated.finished_at
    assert wl_condition(workload_of(custom, "second"), "Admitted")["status"] == "True"
    for name in ("first", "second"):
        core.delete_namespaced_pod(name, NS)


def test_a_waiting_workload_names_the_quota_it_waits_for(core, custom):
    core.create_namespaced_pod(NS, queued_pod("holder", "sleep 600"))
    until(core, "holder", phase_in("Running"))
    core.create_namespaced_pod(NS, queued_pod("blocked", "true"))
    # the Workload's condition is written once the controller has looked at it: watch for it
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object, "kueue.x-k8s.io", "v1beta1", NS, "workloads", timeout_seconds=60
    )
    message = ""
    for event in stream:
        owner = event["object"]["metadata"]["ownerReferences"][0]["name"]
        cond = wl_condition(event["object"], "QuotaReserved")
        if owner == "blocked" and cond.get("status") == "False":
            message = cond["message"]
            break
    assert "insufficient unused quota for nvidia.com/gpu in flavor default-flavor, 1 more needed" in message
    queue = custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", NS, "localqueues", "gpus")
    assert queue["spec"]["clusterQueue"] == "team" and queue["status"]["pendingWorkloads"] >= 1
    core.delete_namespaced_pod("holder", NS, grace_period_seconds=0)
    until(core, "blocked", phase_in("Succeeded"))
    core.delete_namespaced_pod("blocked", NS)


def test_a_higher_priority_run_preempts_a_lower_one(core, custom):
    script = "trap 'echo checkpointed; exit 0' TERM; echo trapped; while true; do sleep 0.1; done"
    core.create_namespaced_pod(
        NS, queued_pod("low", script, priority="low", terminationGracePeriodSeconds=30)
    )
    until(core, "low", phase_in("Running"))
    assert first_line(core, "low") == "trapped"  # its trap is set before the preemption's SIGTERM
    core.create_namespaced_pod(NS, queued_pod("high", "echo high", priority="high"))
    marked = until(
        core, "low", lambda _, p: any(c.type == "TerminationTarget" for c in p.status.conditions or [])
    )
    target = next(c for c in marked.status.conditions if c.type == "TerminationTarget")
    assert target.reason == "WorkloadEvictedDueToPreempted" and "higher priority" in target.message
    gone = until(core, "low", lambda kind, _: kind == "DELETED")
    assert gone.status.container_statuses[0].state.terminated.exit_code == 0  # SIGTERM, then its grace
    evicted = wl_condition(workload_of(custom, "low"), "Evicted")
    assert (evicted["status"], evicted["reason"]) == ("True", "Preempted")
    assert until(core, "high", phase_in("Succeeded", "Failed")).status.phase == "Succeeded"
    core.delete_namespaced_pod("high", NS)


def test_a_pod_group_is_admitted_all_or_nothing(core):
    group = {"labels": {"kueue.x-k8s.io/pod-group-name": "pair"}}
    count = {"kueue.x-k8s.io/pod-group-total-count": "2"}
    core.create_namespaced_pod(
        NS, queued_pod("pair-0", "echo 0", queue="narrow", gpus=0, annotations=count, **group)
    )
    assert gated(core.read_namespaced_pod("pair-0", NS))
    core.create_namespaced_pod(
        NS, queued_pod("pair-1", "echo 1", queue="narrow", gpus=0, annotations=count, **group)
    )
    for name in ("pair-0", "pair-1"):
        assert until(core, name, phase_in("Succeeded", "Failed")).status.phase == "Succeeded"
    # two GPUs against a quota of one: neither pod of the group starts
    core.create_namespaced_pod(
        NS, queued_pod("big-0", "echo 0", annotations=count, labels={"kueue.x-k8s.io/pod-group-name": "big"})
    )
    core.create_namespaced_pod(
        NS, queued_pod("big-1", "echo 1", annotations=count, labels={"kueue.x-k8s.io/pod-group-name": "big"})
    )
    core.create_namespaced_pod(NS, queued_pod("after-big", "echo after", queue="narrow", gpus=0))
    until(core, "after-big", phase_in("Succeeded"))  # the narrow queue moved on meanwhile
    for name in ("big-0", "big-1"):
        pod = core.read_namespaced_pod(name, NS)
        assert gated(pod) and pod.status.phase == "Pending"
    for name in ("pair-0", "pair-1", "big-0", "big-1", "after-big"):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def test_a_queued_job_is_created_suspended_and_resumed_on_admission(kueue_api, core):
    batch = client.BatchV1Api(kueue_api.api_client())
    job = {
        "metadata": {"name": "queued-job", "labels": {"kueue.x-k8s.io/queue-name": "narrow"}},
        "spec": {
            "template": queued_pod("x", "echo job", queue="narrow", gpus=0)["spec"]
            | {"restartPolicy": "Never"}
        },
    }
    job["spec"]["template"] = {"spec": job["spec"]["template"]}
    batch.create_namespaced_job(NS, job)
    stream = watch.Watch().stream(
        batch.list_namespaced_job, NS, field_selector="metadata.name=queued-job", timeout_seconds=120
    )
    for event in stream:
        conds = {c.type: c.status for c in event["object"].status.conditions or []}
        if conds.get("Complete") == "True":
            break
    final = batch.read_namespaced_job("queued-job", NS)
    assert final.spec.suspend is False and final.status.succeeded == 1
    batch.delete_namespaced_job("queued-job", NS, propagation_policy="Background")


def test_a_resource_the_cluster_queue_does_not_cover_keeps_the_workload_out(core, custom):
    body = queued_pod("storage", "true", queue="narrow", gpus=0)
    body["spec"]["containers"][0]["resources"]["requests"]["ephemeral-storage"] = "1Gi"
    core.create_namespaced_pod(NS, body)
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object, "kueue.x-k8s.io", "v1beta1", NS, "workloads", timeout_seconds=60
    )
    for event in stream:
        owner = event["object"]["metadata"]["ownerReferences"][0]["name"]
        cond = wl_condition(event["object"], "QuotaReserved")
        if owner == "storage" and cond.get("status") == "False":
            assert cond["message"] == "resource ephemeral-storage unavailable in ClusterQueue"
            break
    else:
        raise AssertionError("the workload was never found waiting")
    assert gated(core.read_namespaced_pod("storage", NS))
    core.delete_namespaced_pod("storage", NS, grace_period_seconds=0)
