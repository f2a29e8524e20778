"""The cluster state around the store: pod workers, deletion, events, GPUs, mount points, memory cgroups."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from include.devstack.kubeapi import podnet, rbac, runtime
from include.devstack.kubeapi.images import ImageStore
from include.devstack.kubeapi.kubelet import PodWorker
from include.devstack.kubeapi.meta import NODE_IP, NODE_NAME, SERVER_VERSION, rfc3339
from include.devstack.kubeapi.store import Store

log = logging.getLogger("kubeapi.cluster")
MAX_EVENTS = 5000


def count_gpus() -> list[int]:
    """Indices of the local NVIDIA GPUs (``nvidia-smi -L``); none when the tool is absent."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(range(sum(1 for line in out.splitlines() if line.startswith("GPU "))))


def cgroup_hierarchies() -> list[Path]:
    """The cgroup mounts runc places a container in: every v1 controller hierarchy, or the v2 root."""
    base = Path("/sys/fs/cgroup")
    if (base / "memory" / "memory.limit_in_bytes").exists():
        return [
            p for p in base.iterdir() if p.is_dir() and (p / "cgroup.procs").exists() and p.name != "unified"
        ]
    return [base]


def memory_cgroup_usable() -> bool:
    """Whether this machine lets the kubelet put a container in a memory cgroup of its own (a writable v1
    memory hierarchy, or a v2 root with the memory controller): where not, memory limits go unenforced."""
    base = Path("/sys/fs/cgroup")
    v1, v2 = base / "memory", base / "cgroup.controllers"
    if (v1 / "memory.limit_in_bytes").exists():
        return os.access(v1, os.W_OK)
    return v2.exists() and "memory" in v2.read_text().split() and os.access(base, os.W_OK)


class Cluster:
    def __init__(
        self,
        state_dir: Path,
        *,
        port: int,
        image_store: Path,
        mirror: str | None,
        strict_gpu: bool,
        backoff: float,
    ) -> None:
        self.state_dir = state_dir
        self.port = port
        self.strict_gpu = strict_gpu
        self.backoff = backoff
        self.runc = runtime.find_runc()
        self.runc_root = state_dir / "runc"
        # one name per state directory: a restarted server finds what its killed predecessor left
        self.instance = "kt-" + hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
        self.images = ImageStore(image_store, mirror, self.instance)
        self.cgroup_parent = f"/kubetrain/{self.instance}"
        self.store = Store()
        self.workers: dict[str, PodWorker] = {}
        self.gpus = count_gpus()
        self.gpu_alloc: dict[str, list[int]] = {}
        self._gpu_released = asyncio.Event()
        self.shm_dir = Path("/dev/shm") / f"kubetrain-{os.getpid()}"
        self._event_index: dict[tuple, str] = {}
        self.jobs = None  # set by jobs.JobController
        self.pod_finished_hooks: list = []
        # called with (namespace, name) when a deleted pod's processes are gone but finalizers keep its object
        self.pod_finalizing_hooks: list = []
        self.deleting: dict[str, asyncio.Task] = {}
        self.addresses = podnet.Addresses(port)
        self.preload = podnet.build_preload(state_dir / "lib")
        self._bootstrap()

    def memory_cgroup(self, cgroups_path: str) -> str:
        """Where the memory controller keeps a container's cgroup (its OOM kill count is read there)."""
        base = Path("/sys/fs/cgroup")
        root = base / "memory" if (base / "memory" / "memory.limit_in_bytes").exists() else base
        return str(root / cgroups_path.lstrip("/"))

    def gpu_hooks(self) -> dict | None:
        """The NVIDIA container toolkit's prestart hook, when installed: it gives the container the devices
        and driver libraries of NVIDIA_VISIBLE_DEVICES, as nvidia-container-runtime does on a GPU node."""
        hook = shutil.which("nvidia-container-runtime-hook")
        return {"prestart": [{"path": hook, "args": [hook, "prestart"]}]} if hook else None

    async def remove_stale(self) -> None:
        """Delete the containers and file systems a killed predecessor on this state directory left."""
        if self.runc_root.exists():
            proc = await asyncio.create_subprocess_exec(
                self.runc,
                "--root",
                str(self.runc_root),
                "list",
                "--quiet",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            out, _ = await proc.communicate()
            for cid in out.decode().split():
                kill = await asyncio.create_subprocess_exec(
                    self.runc,
                    "--root",
                    str(self.runc_root),
                    "delete",
                    "--force",
                    cid,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                await kill.wait()
        await self.images.remove_stale()

    def _bootstrap(self) -> None:
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.store.create("namespaces", namespace_object(ns))
            self.create_default_service_account(ns)
        self.store.create("nodes", self.node_object())
        for resource, obj in rbac.bootstrap_objects():
            self.store.create(resource, obj, rbac.RBAC_GROUP)

    def create_default_service_account(self, namespace: str) -> None:
        """The ``default`` service account that every namespace gets."""
        if self.store.get("serviceaccounts", namespace, "default") is None:
            self.store.create(
                "serviceaccounts",
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": "default", "namespace": namespace},
                },
            )

    def storage_capacity(self) -> int:
        """Bytes of the node's file system (where the pods' emptyDirs, logs and writable layers live)."""
        return shutil.disk_usage(self.state_dir).total

    def allocatable_storage(self) -> int:
        """What the scheduler may hand out: the capacity less the kubelet's default hard eviction
        threshold (``nodefs.available<10%``), as a kubelet without reservations reports it."""
        return self.storage_capacity() * 9 // 10

    def node_object(self) -> dict:
        cpu = str(os.cpu_count() or 1)
        try:
            mem = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 1024}Ki"
        except (ValueError, OSError):
            mem = "0"
        capacity = {
            "cpu": cpu,
            "memory": mem,
            "pods": "110",
            "ephemeral-storage": f"{self.storage_capacity() // 1024}Ki",
        }
        if self.gpus:
            capacity["nvidia.com/gpu"] = str(len(self.gpus))
        allocatable = {**capacity, "ephemeral-storage": f"{self.allocatable_storage() // 1024}Ki"}
        now = rfc3339()
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE_NAME,
                "labels": {
                    "kubernetes.io/hostname": NODE_NAME,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": {"x86_64": "amd64", "aarch64": "arm64"}.get(
                        platform.machine(), platform.machine()
                    ),
                    "node-role.kubernetes.io/control-plane": "",
                },
                # what no real node does, said where clients can read it (the preflight's gpu-nodes line):
                # a pod asking for more nvidia.com/gpu than is free runs on CPU instead of staying Pending
                **(
                    {}
                    if self.strict_gpu
                    else {"annotations": {"kubetrain.io/gpu-requests-served-on-cpu": "nvidia.com/gpu"}}
                ),
            },
            "spec": {},
            "status": {
                "capacity": capacity,
                "allocatable": allocatable,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "local kubelet is posting ready status",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    },
                ],
                "addresses": [
                    {"type": "InternalIP", "address": NODE_IP},
                    {"type": "Hostname", "address": NODE_NAME},
                ],
                "nodeInfo": {
                    "architecture": platform.machine(),
                    "bootID": "",
                    "containerRuntimeVersion": f"runc://{runtime.runc_version(self.runc)}",
                    "kernelVersion": platform.release(),
                    "kubeProxyVersion": SERVER_VERSION["gitVersion"],
                    "kubeletVersion": SERVER_VERSION["gitVersion"],
                    "machineID": "",
                    "operatingSystem": "linux",
                    "osImage": platform.platform(),
                    "systemUUID": "",
                },
            },
        }

    # -- events ------------------------------------------------------------------------------

    def record_event(
        self,
        obj: dict,
        type_: str,
        reason: str,
        message: str,
        field_path: str = "",
        component: str = "kubelet",
    ) -> None:
        meta = obj["metadata"]
        namespace = meta.get("namespace") or "default"
        key = (meta.get("uid"), type_, reason, message, field_path)
        now = rfc3339()
        existing = self._event_index.get(key)
        if existing and self.store.get("events", namespace, existing):

            def bump(ev: dict) -> None:
                ev["count"] = ev.get("count", 1) + 1
                ev["lastTimestamp"] = now

            self.store.mutate("events", namespace, existing, bump)
            return
        name = f"{meta['name']}.{time.time_ns():x}"
        involved = {
            "apiVersion": obj.get("apiVersion", "v1"),
            "kind": obj.get("kind", ""),
            "name": meta["name"],
            "namespace": namespace,
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        }
        if field_path:
            involved["fieldPath"] = field_path
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "source": {"component": component, **({"host": NODE_NAME} if component == "kubelet" else {})},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "type": type_,
            "eventTime": None,
            "reportingComponent": component,
            "reportingInstance": NODE_NAME if component == "kubelet" else "",
        }
        self.store.create("events", event)
        self._event_index[key] = name
        events = [k for k in self.store.objects if k[0] == "events"]
        if len(events) > MAX_EVENTS:
            for k in events[: len(events) - MAX_EVENTS]:
                self.store.remove(*k)

    # -- GPUs --------------------------------------------------------------------------------

    def free_gpus(self) -> list[int]:
        used = {g for gs in self.gpu_alloc.values() for g in gs}
        return [g for g in self.gpus if g not in used]

    def allocate_gpus(self, uid: str, gpus: list[int]) -> None:
        if gpus:
            self.gpu_alloc[uid] = gpus

    def release_gpus(self, uid: str) -> None:
        if self.gpu_alloc.pop(uid, None):
            self._gpu_released.set()
            self._gpu_released = asyncio.Event()

    async def wait_gpu_release(self, stop: asyncio.Event) -> None:
        waiters = {asyncio.ensure_future(self._gpu_released.wait()), asyncio.ensure_future(stop.wait())}
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()

    # -- pods --------------------------------------------------------------------------------

    def start_pod(self, pod: dict) -> None:
        worker = PodWorker(self, pod)
        self.workers[pod["metadata"]["uid"]] = worker
        worker.start()
        deadline = pod["spec"].get("activeDeadlineSeconds")
        if deadline:
            asyncio.ensure_future(worker.active_deadline(float(deadline)))

    def on_pod_finished(self, worker: PodWorker) -> None:
        self.release_gpus(worker.uid)
        self.addresses.release(worker.uid)  # the sandbox is gone; status.podIP stays, as on a cluster
        self.refresh_hosts()
        for hook in self.pod_finished_hooks:
            hook(worker)

    def refresh_hosts(self) -> None:
        """Rewrite the /etc/hosts of every running pod whose view of the headless Services' pods changed."""
        records = podnet.dns_records(self.store.list("pods", None), self.store.list("services", None))
        for worker in list(self.workers.values()):
            worker.write_hosts(records)

    def worker_for(self, pod: dict) -> PodWorker | None:
        return self.workers.get(pod["metadata"].get("uid", ""))

    def pod_updated(self, pod: dict) -> None:
        """An update was stored: a pod waiting on its scheduling gates looks at them again, and a deleted
        pod whose last finalizer went is removed."""
        worker = self.worker_for(pod)
        if worker is not None:
            worker.gates_changed.set()
        self.release_if_finalized(pod["metadata"].get("namespace") or "default", pod["metadata"]["name"])

    def release_if_finalized(self, namespace: str, name: str) -> None:
        """Remove a deleted pod once its processes are gone and no finalizer holds it (kube-apiserver
        removes an object whose deletionTimestamp is set when its finalizers list becomes empty)."""
        pod = self.store.get("pods", namespace, name)
        if pod is None or not pod["metadata"].get("deletionTimestamp") or pod["metadata"].get("finalizers"):
            return
        if pod["metadata"]["uid"] in self.deleting:
            return  # the graceful deletion in flight removes it when the processes are gone
        self.store.remove("pods", namespace, name)

    def evict(self, namespace: str, name: str, grace: int | None) -> dict:
        """The Eviction API's effect on a pod no PodDisruptionBudget covers: the DisruptionTarget
        condition (reason EvictionByEvictionAPI), then graceful deletion."""
        pod = self.store.must_get("pods", namespace, name)
        worker = self.worker_for(pod)
        phase = (pod.get("status") or {}).get("phase")
        if worker is not None and phase not in ("Succeeded", "Failed"):
            worker.mark("DisruptionTarget", "EvictionByEvictionAPI", "Eviction API: evicting")
        return self.delete_pod(namespace, name, grace)

    def delete_pod(self, namespace: str, name: str, grace: int | None) -> dict:
        """Graceful deletion: mark, signal, and remove once every process is gone."""
        pod = self.store.must_get("pods", namespace, name)
        worker = self.worker_for(pod)
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        phase = (pod.get("status") or {}).get("phase")
        running = worker is not None and any(
            c.proc and not c.proc.finished.is_set() for c in worker.containers
        )
        if not running or phase in ("Succeeded", "Failed"):
            grace = 0
        if pod["metadata"].get("deletionTimestamp"):
            current = pod["metadata"].get("deletionGracePeriodSeconds", grace)
            if grace >= current:
                return pod

        def mark(p: dict) -> None:
            p["metadata"]["deletionTimestamp"] = rfc3339(time.time() + grace)
            p["metadata"]["deletionGracePeriodSeconds"] = grace

        pod = self.store.mutate("pods", namespace, name, mark) or pod
        uid = pod["metadata"]["uid"]
        if uid in self.deleting and grace > 0:
            return pod
        old = self.deleting.get(uid)
        if old is not None:
            old.cancel()
        self.deleting[uid] = asyncio.ensure_future(self._finish_delete(namespace, name, uid, worker, grace))
        return pod

    async def _finish_delete(
        self, namespace: str, name: str, uid: str, worker: PodWorker | None, grace: int
    ) -> None:
        try:
            if worker is not None:
                await worker.terminate(float(grace))
            current = self.store.get("pods", namespace, name)
            if current is not None and current["metadata"]["uid"] == uid:
                if current["metadata"].get("finalizers"):
                    for hook in self.pod_finalizing_hooks:  # whoever owns a finalizer removes it
                        hook(namespace, name)
                else:
                    self.store.remove("pods", namespace, name)
        finally:
            if worker is not None:
                worker.cleanup()
                self.workers.pop(uid, None)
            self.deleting.pop(uid, None)

    async def shutdown(self) -> None:
        """Kill every container process (the server is stopping: no orphans)."""
        workers = list(self.workers.values())
        for w in workers:
            w.stopping = True
            w.stop_event.set()
        await asyncio.gather(*(w.kill_all() for w in workers), return_exceptions=True)
        for w in workers:
            with contextlib.suppress(Exception):
                w.cleanup()
        for w in workers:
            for c in w.containers:
                if c.runtime_id:
                    with contextlib.suppress(Exception):
                        await self.images.remove_rootfs(f"{w.uid[:8]}-{c.name}-{c.restart_count}")
        await self.remove_stale()
        for hierarchy in cgroup_hierarchies():
            for path in (hierarchy / self.cgroup_parent.lstrip("/"), hierarchy / "kubetrain"):
                with contextlib.suppress(OSError):
                    path.rmdir()  # only when empty: runc removed each container's own
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def namespace_object(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }
