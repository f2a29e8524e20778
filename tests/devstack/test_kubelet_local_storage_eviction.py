"""The local kubelet evicts a pod past its local storage limits, as a real kubelet's eviction manager does.

Upstream (pkg/kubelet/eviction, localStorageEviction): an emptyDir past its ``sizeLimit``, a pod past the
sum of its containers' ``ephemeral-storage`` limits, or a container whose writable layer and logs pass
its own limit ends Failed, reason Evicted, with the eviction manager's message and a Warning event.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from include.devstack.kubeapi import localstorage
from include.devstack.kubeapi.localstorage import Usage, canonical, eviction_message, pod_limit

from .support import simple_pod, wait_phase

NS = "default"
MI = 1024 * 1024
# long enough for a few measurements on a loaded machine; the evicted pods would sleep on for an hour
EVICTION_TIMEOUT = 20 * localstorage.MONITORING_PERIOD


# -- the rules, without a stack ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "fmt", "printed"),
    [
        (MI, "BinarySI", "1Mi"),
        (3 * MI, "BinarySI", "3Mi"),
        (1536, "BinarySI", "1536"),
        (512, "BinarySI", "512"),
        (12 * MI + 512 * 1024, "BinarySI", "12800Ki"),
        (2_000_000, "DecimalSI", "2M"),
        (1500, "DecimalSI", "1500"),
        (MI, "DecimalSI", "1048576"),
        (3_000_000, "DecimalExponent", "3e6"),
        (0, "BinarySI", "0"),
    ],
)
def test_quantities_print_as_kubernetes_prints_them(value, fmt, printed):
    assert canonical(value, fmt) == printed


def limited(name: str, limit: str | None, **extra) -> dict:
    resources = {"limits": {"ephemeral-storage": limit}} if limit else {}
    return {"name": name, "resources": resources, **extra}


def test_the_pod_limit_sums_containers_and_sidecars_or_takes_a_larger_init_container():
    spec = {
        "initContainers": [limited("stage-in", "6Mi"), limited("sync", "1Mi", restartPolicy="Always")],
        "containers": [limited("base", "2Mi"), limited("other", None)],
    }
    assert str(pod_limit(spec)) == "6Mi"  # stage-in alone is larger than base + sync
    spec["initContainers"][0] = limited("stage-in", "1Mi")
    assert str(pod_limit(spec)) == "3Mi"
    assert pod_limit({"containers": [limited("base", None)]}) is None
    # the sum keeps the first spelling's format, as resource.Quantity's Add
    assert str(pod_limit({"containers": [limited("a", "2M"), limited("b", "1Mi")]})) == "3048576"


def storage_spec() -> dict:
    return {
        "volumes": [
            {"name": "data", "emptyDir": {"sizeLimit": "1Mi"}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "secret", "secret": {"secretName": "s"}},
        ],
        "containers": [limited("writer", "2Mi"), limited("idle", "10Mi")],
    }


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        (Usage(volumes={"data": MI}), None),  # at the limit is not past it
        (Usage(volumes={"data": MI + 4096}), 'Usage of EmptyDir volume "data" exceeds the limit "1Mi". '),
        # a memory-backed emptyDir counts against memory, a secret volume is tmpfs on a node
        (Usage(volumes={"shm": 64 * MI, "secret": 64 * MI}), None),
        (
            Usage(volumes={"scratch": 13 * MI}),
            "Pod ephemeral local storage usage exceeds the total limit of containers 12Mi. ",
        ),
        (
            Usage(rootfs={"writer": MI, "idle": 0}, logs={"writer": MI + 1}),
            'Container writer exceeded its local ephemeral storage limit "2Mi". ',
        ),
        (Usage(rootfs={"writer": MI}, logs={"writer": MI}, other=10 * MI), None),  # 12Mi: at the pod limit
        # the emptyDir is checked first, as upstream
        (
            Usage(volumes={"data": 2 * MI}, rootfs={"writer": 20 * MI}),
            'Usage of EmptyDir volume "data" exceeds the limit "1Mi". ',
        ),
    ],
)
def test_which_usage_evicts_and_with_which_message(usage, message):
    assert eviction_message(storage_spec(), usage) == message


def test_nothing_to_enforce_means_nothing_to_measure():
    assert not localstorage.wants_measuring(
        {"containers": [{"name": "c"}], "volumes": [{"name": "v", "emptyDir": {}}]}
    )
    assert not localstorage.wants_measuring(
        {
            "containers": [{"name": "c"}],
            "volumes": [{"name": "v", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
        }
    )
    assert localstorage.wants_measuring(storage_spec())


def test_disk_usage_counts_allocated_blocks_and_hard_links_once(tmp_path):
    data, layer = tmp_path / "data", tmp_path / "layer"
    (data / "sub").mkdir(parents=True)
    layer.mkdir()
    (data / "sub" / "full").write_bytes(os.urandom(MI))
    os.link(data / "sub" / "full", data / "again")
    with open(layer / "sparse", "wb") as f:
        f.truncate(64 * MI)  # apparent size only: du counts no blocks for it
    (layer / "small").write_bytes(b"x" * 10)
    sizes = asyncio.run(localstorage.disk_usage([data, layer, tmp_path / "missing"]))
    assert set(sizes) == {data, layer}
    assert MI <= sizes[data] < MI + 64 * 1024
    assert 4096 <= sizes[layer] < 64 * 1024


def test_the_writable_layer_is_the_overlay_upperdir():
    mountinfo = (
        "36 35 98:0 / /mnt/other rw - ext4 /dev/root rw\n"
        "812 29 0:77 / /var/lib/x/overlay/abc/merged rw,relatime - overlay overlay "
        "rw,lowerdir=/var/lib/x/overlay/l/A:/var/lib/x/overlay/l/B,upperdir=/var/lib/x/overlay/abc/diff,"
        "workdir=/var/lib/x/overlay/abc/work\n"
    )
    found = localstorage.overlay_upperdir("/var/lib/x/overlay/abc/merged", mountinfo)
    assert str(found) == "/var/lib/x/overlay/abc/diff"
    assert localstorage.overlay_upperdir("/mnt/other", mountinfo) is None


# -- pods on the local kubelet -----------------------------------------------------------------


def write(path: str, mib: float) -> str:
    return f"dd if=/dev/zero of={path} bs=1024 count={int(mib * 1024)} 2>/dev/null"


HOLD = f"sleep {int(2 * localstorage.MONITORING_PERIOD + 5)}"  # past two measurements, then done


def storage_pods() -> dict[str, dict]:
    def volume(name: str, **empty_dir) -> dict:
        return {"name": name, "emptyDir": empty_dir}

    def mount(name: str, path: str) -> dict:
        return {"volumeMounts": [{"name": name, "mountPath": path}]}

    return {
        "emptydir-over": simple_pod(
            "emptydir-over",
            f"{write('/data/blob', 4)} && sleep 3600",
            volumes=[volume("data", sizeLimit="1Mi")],
            container=mount("data", "/data"),
        ),
        # under its sizeLimit, and the image's own layers (busybox: 4 MiB) are not its writable layer
        "emptydir-under": simple_pod(
            "emptydir-under",
            f"{write('/data/blob', 0.5)} && {HOLD}",
            volumes=[volume("data", sizeLimit="1Mi")],
            container={
                **mount("data", "/data"),
                "resources": {
                    "requests": {"ephemeral-storage": "3Mi"},
                    "limits": {"ephemeral-storage": "3Mi"},
                },
            },
        ),
        # an emptyDir without a sizeLimit still counts against the pod's limit
        "pod-over": simple_pod(
            "pod-over",
            f"{write('/scratch/blob', 4)} && sleep 3600",
            volumes=[volume("scratch")],
            container={**mount("scratch", "/scratch"), "resources": {"limits": {"ephemeral-storage": "2Mi"}}},
        ),
        # the container's own writes (its writable layer) against its own limit, the pod's total below its sum
        "container-over": simple_pod(
            "container-over",
            f"{write('/tmp/blob', 4)} && sleep 3600",
            container={"name": "writer", "resources": {"limits": {"ephemeral-storage": "2Mi"}}},
        ),
    }


@pytest.fixture(scope="module")
def evicting_pods(core):
    pods = storage_pods()
    pods["container-over"]["spec"]["containers"].append(
        {
            "name": "idle",
            "image": "busybox:1.36",
            "command": ["sleep", "3600"],
            "resources": {"limits": {"ephemeral-storage": "10Mi"}},
        }
    )
    for body in pods.values():
        core.create_namespaced_pod(NS, body)
    yield pods
    for name in pods:
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def evicted_events(core, name: str) -> list:
    return [
        e
        for e in core.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
        if e.reason == "Evicted"
    ]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("emptydir-over", 'Usage of EmptyDir volume "data" exceeds the limit "1Mi". '),
        ("pod-over", "Pod ephemeral local storage usage exceeds the total limit of containers 2Mi. "),
        ("container-over", 'Container writer exceeded its local ephemeral storage limit "2Mi". '),
    ],
)
def test_a_pod_past_its_local_storage_limit_is_evicted(core, evicting_pods, name, message):
    pod = wait_phase(core, name, timeout=EVICTION_TIMEOUT)
    assert (pod.status.phase, pod.status.reason, pod.status.message) == ("Failed", "Evicted", message)
    for status in pod.status.container_statuses:
        assert status.state.terminated is not None, status
        assert status.state.terminated.exit_code in (137, 143), status  # killed, not finished
    events = evicted_events(core, name)
    assert [(e.type, e.message, e.source.component) for e in events] == [("Warning", message, "kubelet")]


def test_a_pod_within_its_limits_runs_to_completion(core, evicting_pods):
    pod = wait_phase(core, "emptydir-under", timeout=EVICTION_TIMEOUT)
    assert pod.status.phase == "Succeeded", (pod.status.reason, pod.status.message)
    assert pod.status.reason is None
    assert evicted_events(core, "emptydir-under") == []
