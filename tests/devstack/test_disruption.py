"""What Kueue and a node drain rely on: scheduling gates hold a pod, the Eviction API ends one with the
DisruptionTarget condition, as a real API server and kubelet do."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from .support import first_line, simple_pod

NS = "default"


def until(core: client.CoreV1Api, name: str, predicate: Callable[[str, client.V1Pod], bool]) -> client.V1Pod:
    """Watch the pod from its current resourceVersion until ``predicate(event_type, pod)`` holds."""
    pod = core.read_namespaced_pod(name, NS)
    if predicate("CURRENT", pod):
        return pod
    stream = watch.Watch().stream(
        core.list_namespaced_pod,
        NS,
        field_selector=f"metadata.name={name}",
        resource_version=pod.metadata.resource_version,
        timeout_seconds=180,
    )
    for event in stream:
        if predicate(event["type"], event["object"]):
            return event["object"]
    raise AssertionError(f"pod {name} never reached the awaited state")


def condition(pod: client.V1Pod, kind: str) -> client.V1PodCondition | None:
    return next((c for c in pod.status.conditions or [] if c.type == kind), None)


def api_error(fn, *args, **kwargs) -> tuple[int, dict]:
    with pytest.raises(ApiException) as err:
        fn(*args, **kwargs)
    return err.value.status, json.loads(err.value.body)


def test_a_gated_pod_waits_until_its_last_gate_is_removed(core):
    gates = [{"name": "kueue.x-k8s.io/admission"}, {"name": "example.com/other"}]
    core.create_namespaced_pod(NS, simple_pod("gated", "echo ran", schedulingGates=gates))
    pod = until(
        core,
        "gated",
        lambda _, p: (c := condition(p, "PodScheduled")) is not None and c.reason == "SchedulingGated",
    )
    assert pod.status.phase == "Pending" and pod.spec.node_name is None
    assert condition(pod, "PodScheduled").message == "Scheduling is blocked due to non-empty scheduling gates"

    pod.spec.scheduling_gates = [*pod.spec.scheduling_gates, client.V1PodSchedulingGate(name="late")]
    status, body = api_error(core.replace_namespaced_pod, "gated", NS, pod)
    assert (
        status == 422 and "only deletion is allowed, but found new scheduling gate 'late'" in body["message"]
    )

    pod = core.read_namespaced_pod("gated", NS)
    pod.spec.scheduling_gates = [client.V1PodSchedulingGate(name="example.com/other")]
    pod.spec.node_selector = {"pool": "a100"}  # what an admission may add while the pod is gated
    core.replace_namespaced_pod("gated", NS, pod)
    assert core.read_namespaced_pod("gated", NS).status.phase == "Pending"

    pod = core.read_namespaced_pod("gated", NS)
    pod.spec.scheduling_gates = []
    core.replace_namespaced_pod("gated", NS, pod)
    done = until(core, "gated", lambda _, p: p.status.phase in ("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded" and condition(done, "PodScheduled").status == "True"
    core.delete_namespaced_pod("gated", NS)


def test_a_scheduling_gate_must_be_a_valid_unique_name(core):
    body = simple_pod("bad-gates", "true", schedulingGates=[{"name": "a"}, {"name": "a"}, {"name": "-x"}])
    status, error = api_error(core.create_namespaced_pod, NS, body)
    assert status == 422
    fields = {c["field"]: c["message"] for c in error["details"]["causes"]}
    assert fields["spec.schedulingGates[1].name"] == 'Duplicate value: "a"'
    assert "spec.schedulingGates[2].name" in fields


def test_an_eviction_marks_the_pod_a_disruption_target_and_ends_it_gracefully(core):
    script = "trap 'echo term; exit 0' TERM; echo trapped; while true; do sleep 0.1; done"
    core.create_namespaced_pod(NS, simple_pod("evicted", script, terminationGracePeriodSeconds=30))
    until(core, "evicted", lambda _, p: p.status.phase == "Running")
    assert first_line(core, "evicted") == "trapped"  # its trap is set: the SIGTERM finds it
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="evicted", namespace=NS))
    core.create_namespaced_pod_eviction("evicted", NS, eviction)
    marked = until(core, "evicted", lambda _, p: condition(p, "DisruptionTarget") is not None)
    target = condition(marked, "DisruptionTarget")
    assert (target.status, target.reason) == ("True", "EvictionByEvictionAPI")
    gone = until(core, "evicted", lambda kind, _: kind == "DELETED")
    terminated = gone.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 0  # the container had its SIGTERM and its grace period
    assert condition(gone, "DisruptionTarget").reason == "EvictionByEvictionAPI"


def test_an_eviction_names_a_pod_that_exists_and_its_own_name(core):
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="nobody", namespace=NS))
    status, _ = api_error(core.create_namespaced_pod_eviction, "nobody", NS, eviction)
    assert status == 404
    core.create_namespaced_pod(NS, simple_pod("named", "sleep 600"))
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="other", namespace=NS))
    status, error = api_error(core.create_namespaced_pod_eviction, "named", NS, eviction)
    assert status == 400 and "does not match name in Eviction object" in error["message"]
    core.delete_namespaced_pod("named", NS, grace_period_seconds=0)
