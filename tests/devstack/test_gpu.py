"""nvidia.com/gpu requests: matched to local GPUs, run on CPU with a warning, or Pending in strict mode."""

from __future__ import annotations

import pytest
from kubernetes import client

from include.devstack.kubeapi.cluster import count_gpus

from .support import simple_pod, start_server, stop_server, unschedulable, wait_for, wait_phase

NS = "default"
GPUS = count_gpus()


def gpu_pod(name: str, count: int) -> dict:
    return simple_pod(
        name,
        'echo "cuda=[${CUDA_VISIBLE_DEVICES-unset}]"',
        container={"resources": {"limits": {"nvidia.com/gpu": str(count)}}},
    )


@pytest.fixture(scope="module")
def strict_core(tmp_path_factory, mirror):
    api, proc = start_server(tmp_path_factory.mktemp("strict"), "--strict-gpu", mirror=mirror)
    try:
        yield client.CoreV1Api(api.api_client())
    finally:
        stop_server(proc)


def test_gpu_request_without_enough_gpus_runs_on_cpu_with_a_warning(core):
    want = len(GPUS) + 1
    core.create_namespaced_pod(NS, gpu_pod("cpu-fallback", want))
    wait_phase(core, "cpu-fallback")
    out = core.read_namespaced_pod_log("cpu-fallback", NS, _preload_content=False).data.decode()
    assert out == "cuda=[]\n"
    warnings = [
        e
        for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=cpu-fallback").items
        if e.type == "Warning"
    ]
    assert [e.reason for e in warnings] == ["GPUNotAvailable"]
    assert (
        f"requests {want} nvidia.com/gpu" in warnings[0].message
        and "CUDA_VISIBLE_DEVICES" in warnings[0].message
    )
    core.delete_namespaced_pod("cpu-fallback", NS)


def test_containers_without_a_gpu_request_see_no_gpu(core):
    core.create_namespaced_pod(NS, simple_pod("no-gpu", 'echo "cuda=[${CUDA_VISIBLE_DEVICES-unset}]"'))
    wait_phase(core, "no-gpu")
    assert core.read_namespaced_pod_log("no-gpu", NS, _preload_content=False).data.decode() == "cuda=[]\n"
    core.delete_namespaced_pod("no-gpu", NS)


@pytest.mark.skipif(not GPUS, reason="needs a local NVIDIA GPU (nvidia-smi -L)")
def test_gpu_request_gets_local_devices(core):
    core.create_namespaced_pod(NS, gpu_pod("on-gpu", 1))
    wait_phase(core, "on-gpu")
    assert core.read_namespaced_pod_log("on-gpu", NS, _preload_content=False).data.decode() == "cuda=[0]\n"
    node = core.read_node("kubetrain-dev")
    assert node.status.capacity["nvidia.com/gpu"] == str(len(GPUS))
    core.delete_namespaced_pod("on-gpu", NS)


def test_strict_mode_keeps_the_pod_pending_like_a_cluster(strict_core):
    strict_core.create_namespaced_pod(NS, gpu_pod("wants-gpus", len(GPUS) + 1))

    cond = unschedulable(strict_core, "wants-gpus")
    assert cond.reason == "Unschedulable"
    assert cond.message.startswith("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    pod = strict_core.read_namespaced_pod("wants-gpus", NS)
    assert pod.status.phase == "Pending" and not pod.spec.node_name and not pod.status.container_statuses
    events = strict_core.list_namespaced_event(NS, field_selector="involvedObject.name=wants-gpus").items
    assert [(e.type, e.reason) for e in events] == [("Warning", "FailedScheduling")]
    assert events[0].message.startswith("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    assert events[0].source.component == "default-scheduler"
    strict_core.delete_namespaced_pod("wants-gpus", NS)
    wait_for(lambda: not strict_core.list_namespaced_pod(NS).items, 10, what="pending pod deletion")
