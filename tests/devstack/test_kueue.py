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
integrations:
  frameworks: [batch/job, pod]
managedJobsNamespaceSelector:
  matchExpressions:
    - {key: kubernetes.io/metadata.name, operator: NotIn, values: [kube-system, kueue-system, outside]}
clusterQueues:
  - name: team
    nominalQuota: {cpu: "4", memory: 8Gi, nvidia.com/gpu: 1, ephemeral-storage: 20Gi}
    preemption: {withinClusterQueue: LowerPriority}
  - name: narrow
    nominalQuota: {cpu: "4", memory: 8Gi}
  - name: besteffort
    nominalQuota: {cpu: "1", memory: 8Gi}
  - name: strict
    nominalQuota: {cpu: "1", memory: 8Gi}
    queueingStrategy: StrictFIFO
localQueues:
  - {namespace: default, name: gpus, clusterQueue: team}
  - {namespace: default, name: narrow, clusterQueue: narrow}
  - {namespace: default, name: besteffort, clusterQueue: besteffort}
  - {namespace: default, name: strict, clusterQueue: strict}
  - {namespace: outside, name: gpus, clusterQueue: team}
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
    created = batch.create_namespaced_job(NS, job)
    assert created.spec.suspend is True  # by the webhook, before any pod exists
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


# -- where the stand-in follows Kueue v0.19 (include/devstack/KUBEAPI.md, "Kueue") -------------------


def waiting_message(custom: client.CustomObjectsApi, owner: str) -> str:
    """The QuotaReserved=False message of the Workload that ``owner`` owns, once the controller wrote it."""
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object, "kueue.x-k8s.io", "v1beta1", NS, "workloads", timeout_seconds=60
    )
    for event in stream:
        if event["object"]["metadata"]["ownerReferences"][0]["name"] != owner:
            continue
        cond = wl_condition(event["object"], "QuotaReserved")
        if cond.get("status") == "False":
            return cond["message"]
    raise AssertionError(f"the workload of {owner} was never seen waiting")


def delete_and_wait(core: client.CoreV1Api, name: str, ns: str = NS, grace: int | None = 0) -> client.V1Pod:
    """Delete a pod and return its last state, watched from before the deletion (it may go at once)."""
    since = core.read_namespaced_pod(name, ns).metadata.resource_version
    core.delete_namespaced_pod(name, ns, grace_period_seconds=grace)
    for event in watch.Watch().stream(
        core.list_namespaced_pod,
        ns,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=120,
    ):
        if event["type"] == "DELETED":
            return event["object"]
    raise AssertionError(f"pod {ns}/{name} was never removed")


def cpu_pod(name: str, queue: str, cpu: str, script: str = "echo done", **extra) -> dict:
    body = queued_pod(name, script, queue=queue, gpus=0, **extra)
    body["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu, "memory": "64Mi"}}
    return body


def test_sidecars_count_toward_quota_and_an_oversized_workload_is_told_it_never_fits(core, custom):
    # 600m in the main container fits the queue's 1 CPU; the sidecar's 500m runs beside it, so the pod
    # needs 1100m, as the scheduler and Kueue count it: more than the queue will ever have
    body = cpu_pod("with-sidecar", "besteffort", "600m")
    body["spec"]["initContainers"] = [
        {
            "name": "sync",
            "image": "busybox:1.36",
            "command": ["sh", "-c", "sleep 600"],
            "restartPolicy": "Always",
            "resources": {"requests": {"cpu": "500m", "memory": "64Mi"}},
        }
    ]
    core.create_namespaced_pod(NS, body)
    message = waiting_message(custom, "with-sidecar")
    assert message == (
        "couldn't assign flavors to pod set main: insufficient quota for cpu in flavor default-flavor, "
        "request > maximum capacity (1100m > 1)"
    )
    assert gated(core.read_namespaced_pod("with-sidecar", NS))
    delete_and_wait(core, "with-sidecar")


@pytest.mark.parametrize(("queue", "small_admitted"), [("besteffort", True), ("strict", False)])
def test_a_waiting_workload_blocks_smaller_ones_behind_it_only_under_strict_fifo(
    core, custom, queue, small_admitted
):
    core.create_namespaced_pod(NS, cpu_pod(f"{queue}-holder", queue, "600m", "sleep 600"))
    until(core, f"{queue}-holder", phase_in("Running"))
    core.create_namespaced_pod(NS, cpu_pod(f"{queue}-big", queue, "800m"))
    assert "400m more needed" in waiting_message(custom, f"{queue}-big")
    core.create_namespaced_pod(NS, cpu_pod(f"{queue}-small", queue, "300m"))
    if small_admitted:  # BestEffortFIFO, Kueue's default: the small one goes ahead of the big one
        assert until(core, f"{queue}-small", phase_in("Succeeded", "Failed")).status.phase == "Succeeded"
        assert gated(core.read_namespaced_pod(f"{queue}-big", NS))
        delete_and_wait(core, f"{queue}-holder")
        assert until(core, f"{queue}-big", phase_in("Succeeded", "Failed")).status.phase == "Succeeded"
    else:  # StrictFIFO: it waits behind the big one although it fits, and starts only after it
        delete_and_wait(core, f"{queue}-holder")
        small = until(core, f"{queue}-small", phase_in("Succeeded", "Failed"))
        big = core.read_namespaced_pod(f"{queue}-big", NS)
        assert small.status.phase == big.status.phase == "Succeeded"
        assert small.status.start_time >= big.status.container_statuses[0].state.terminated.finished_at
    for name in ("big", "small"):
        delete_and_wait(core, f"{queue}-{name}", grace=None)


def test_a_missing_priority_class_creates_no_workload_and_says_so_on_the_pod(core, custom):
    core.create_namespaced_pod(NS, queued_pod("misspelt", "echo never", priority="hihg"))
    stream = watch.Watch().stream(
        core.list_namespaced_event,
        NS,
        field_selector="involvedObject.name=misspelt",
        timeout_seconds=60,
    )
    event = next(e["object"] for e in stream if e["object"].reason == "WorkloadPriorityClassNotFound")
    assert event.type == "Warning" and event.message == 'WorkloadPriorityClass "hihg" not found'
    items = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", NS, "workloads")["items"]
    assert not [w for w in items if w["metadata"]["ownerReferences"][0]["name"] == "misspelt"]
    pod = core.read_namespaced_pod("misspelt", NS)
    assert gated(pod) and pod.status.phase == "Pending"
    # Kueue's finalizer does not keep a deleted pod that never ran
    assert "kueue.x-k8s.io/managed" in pod.metadata.finalizers
    delete_and_wait(core, "misspelt", grace=None)


def test_kueue_holds_its_pods_with_a_finalizer_until_they_end(core):
    core.create_namespaced_pod(NS, queued_pod("held", "sleep 600", gpus=0, queue="narrow"))
    running = until(core, "held", phase_in("Running"))
    assert running.metadata.finalizers == ["kueue.x-k8s.io/managed"]
    gone = delete_and_wait(core, "held", grace=1)
    assert not gone.metadata.finalizers  # taken off once the processes were gone, then the pod went
    core.create_namespaced_pod(NS, queued_pod("ends", "echo ok", gpus=0, queue="narrow"))
    ended = until(core, "ends", lambda _, p: p.status.phase == "Succeeded" and not p.metadata.finalizers)
    assert ended.metadata.labels["kueue.x-k8s.io/managed"] == "true"
    core.delete_namespaced_pod("ends", NS)


def test_pods_outside_the_managed_namespaces_are_not_queued(core):
    core.create_namespace({"metadata": {"name": "outside"}})
    core.create_namespaced_pod("outside", queued_pod("free", "echo free"))
    pod = core.read_namespaced_pod("free", "outside")
    assert not gated(pod) and "kueue.x-k8s.io/managed" not in (pod.metadata.labels or {})
    assert not pod.metadata.finalizers
    done = until_in(core, "outside", "free")
    assert done.status.phase == "Succeeded"
    core.delete_namespaced_pod("free", "outside")


def until_in(core: client.CoreV1Api, ns: str, name: str) -> client.V1Pod:
    for event in watch.Watch().stream(
        core.list_namespaced_pod, ns, field_selector=f"metadata.name={name}", timeout_seconds=120
    ):
        if event["object"].status.phase in ("Succeeded", "Failed"):
            return event["object"]
    raise AssertionError(f"pod {ns}/{name} never ended")


@pytest.fixture(scope="module")
def pods_not_integrated(tmp_path_factory, mirror):
    """A Kueue configured as by default: batch/job only, so plain pods are not its business."""
    tmp = tmp_path_factory.mktemp("kueue-jobs-only")
    config = CONFIG.replace("frameworks: [batch/job, pod]", "frameworks: [batch/job]")
    (tmp / "kueue.yaml").write_text(config)
    api, proc = start_server(tmp, "--kueue-config", str(tmp / "kueue.yaml"), mirror=mirror)
    try:
        yield client.CoreV1Api(api.api_client())
    finally:
        stop_server(proc)


def test_without_the_pod_integration_a_queued_pod_runs_unqueued(pods_not_integrated):
    core = pods_not_integrated
    core.create_namespaced_pod(NS, queued_pod("unqueued", "echo ran"))
    pod = core.read_namespaced_pod("unqueued", NS)
    assert not gated(pod) and not pod.metadata.finalizers
    assert until(core, "unqueued", phase_in("Succeeded", "Failed")).status.phase == "Succeeded"
