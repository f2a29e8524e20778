"""ephemeral-storage: the node reports its disk, and a pod whose request exceeds it stays Unschedulable."""

from __future__ import annotations

import shutil

from include.devstack.kubeapi.kubelet import pod_request
from include.devstack.kubeapi.validation import parse_quantity

from .support import simple_pod, unschedulable, wait_phase

NS = "default"


def storage_pod(name: str, request: str) -> dict:
    return simple_pod(
        name,
        "echo ran",
        container={
            "resources": {
                "requests": {"ephemeral-storage": request},
                "limits": {"ephemeral-storage": request},
            }
        },
    )


def test_the_node_reports_its_disk_less_the_eviction_threshold(core, kubeapi):
    node = core.read_node("kubetrain-dev")
    capacity = int(parse_quantity(node.status.capacity["ephemeral-storage"]))
    allocatable = int(parse_quantity(node.status.allocatable["ephemeral-storage"]))
    assert capacity > 0 and allocatable == capacity * 9 // 10 // 1024 * 1024
    assert abs(capacity - shutil.disk_usage(kubeapi.state_dir).total) < 1024


def test_a_pod_that_asks_more_disk_than_the_node_has_stays_unschedulable(core):
    node = core.read_node("kubetrain-dev")
    too_much = f"{int(parse_quantity(node.status.allocatable['ephemeral-storage'])) // 1024**3 + 1}Gi"
    core.create_namespaced_pod(NS, storage_pod("too-much-disk", too_much))
    core.create_namespaced_pod(NS, storage_pod("some-disk", "1Gi"))

    cond = unschedulable(core, "too-much-disk")
    assert cond.reason == "Unschedulable"
    assert cond.message.startswith("0/1 nodes are available: 1 Insufficient ephemeral-storage.")
    assert wait_phase(core, "some-disk").status.phase == "Succeeded"
    pod = core.read_namespaced_pod("too-much-disk", NS)
    assert pod.status.phase == "Pending" and not pod.status.container_statuses
    for name in ("too-much-disk", "some-disk"):
        core.delete_namespaced_pod(name, NS)


def test_the_pod_request_counts_sidecars_as_the_scheduler_does():
    def c(size: str, **extra) -> dict:
        return {"resources": {"requests": {"ephemeral-storage": size}}, **extra}

    # a training pod: stage-in (init), checkpoint-sync (sidecar), base
    spec = {"initContainers": [c("5Gi"), c("256Mi", restartPolicy="Always")], "containers": [c("8Gi")]}
    assert pod_request(spec, "ephemeral-storage") == 8 * 1024**3 + 256 * 1024**2
    # an init container larger than the running pod decides, with the sidecars started before it
    spec = {"initContainers": [c("1Gi", restartPolicy="Always"), c("20Gi")], "containers": [c("2Gi")]}
    assert pod_request(spec, "ephemeral-storage") == 21 * 1024**3
    # a limit alone is the request
    assert (
        pod_request(
            {"containers": [{"resources": {"limits": {"ephemeral-storage": "3Gi"}}}]}, "ephemeral-storage"
        )
        == 3 * 1024**3
    )
