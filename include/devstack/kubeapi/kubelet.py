"""The local kubelet: runs one pod's containers as processes and reports their status like a real kubelet.

Lifecycle: Pending -> scheduled (GPU check) -> volumes -> init containers one at a time (native
sidecars, i.e. init containers with restartPolicy Always, start in order and keep running) ->
main containers in parallel, restarted per restartPolicy with exponential back-off -> sidecars
get SIGTERM once every main container has exited -> Succeeded/Failed. While the pod runs, its local
storage is measured as the eviction manager does (localstorage.py): an emptyDir past its sizeLimit or
more disk than the ephemeral-storage limits allow evicts it (Failed, reason Evicted).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

from include.devstack.kubeapi import localstorage, oci, podnet, runtime
from include.devstack.kubeapi.images import DEFAULT_PATH, Image, PullError, pull_secret_auths
from include.devstack.kubeapi.logs import LogFile, read_entries
from include.devstack.kubeapi.meta import NODE_IP, NODE_NAME, rfc3339
from include.devstack.kubeapi.validation import ENV_NAME, parse_quantity

if TYPE_CHECKING:
    from include.devstack.kubeapi.cluster import Cluster

log = logging.getLogger("kubeapi.kubelet")
MAX_BACKOFF = 300.0
PRELOAD_PATH = "/.kubetrain/podbind.so"  # podnet.py's bind() wrapper, inside each container


class ConfigError(Exception):
    """A container's configuration references something missing (CreateContainerConfigError)."""


class MountError(Exception):
    """A volume cannot be set up yet (FailedMount)."""


class Container:
    """One container of the pod: its spec and the status the kubelet reports for it."""

    def __init__(self, spec: dict, kind: str, initial_reason: str, backoff: float) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.kind = kind  # "init", "sidecar" or "main"
        self.restart_count = 0
        self.state: dict = {"waiting": {"reason": initial_reason}}
        self.last_state: dict = {}
        self.ready = False
        self.started = False
        self.container_id = ""
        self.image_id = ""
        self.proc: runtime.Proc | None = None
        self.log: LogFile | None = None
        self.runtime_id = ""  # the runc container of the current instance
        self.upperdir: Path | None = None  # the writable layer of the current instance's root file system
        self.done = False
        self.ever_ran = False
        self.last_exit: int | None = None
        self.initial_backoff = backoff
        self.backoff = backoff
        self.run_started = 0.0
        self.first_start = asyncio.Event()
        self.log_read_ns = 0  # when its current log was last read whole (an attach continues from there)

    @property
    def field_path(self) -> str:
        return f"spec.{'initContainers' if self.kind != 'main' else 'containers'}{{{self.name}}}"

    def log_path(self, pod_dir: Path, restart: int) -> Path:
        return pod_dir / "containers" / self.name / f"{restart}.log"

    def next_backoff(self) -> float:
        if self.run_started and time.time() - self.run_started > 600:
            self.backoff = self.initial_backoff  # ran long enough: a fresh failure, as the kubelet resets
        delay = self.backoff
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        return delay

    def status(self) -> dict:
        out = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "ready": self.ready,
            "restartCount": self.restart_count,
            "started": self.started,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


class PodWorker:
    def __init__(self, cluster: Cluster, pod: dict) -> None:
        self.cluster = cluster
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.spec: dict = pod["spec"]
        self.dir = cluster.state_dir / "pods" / self.namespace / f"{self.name}-{self.uid[:8]}"
        backoff = cluster.backoff
        has_init = bool(self.spec.get("initContainers"))
        self.inits = [
            Container(
                c, "sidecar" if c.get("restartPolicy") == "Always" else "init", "PodInitializing", backoff
            )
            for c in self.spec.get("initContainers") or []
        ]
        self.mains = [
            Container(c, "main", "PodInitializing" if has_init else "ContainerCreating", backoff)
            for c in self.spec.get("containers") or []
        ]
        self.scheduled: bool | None = None  # None: not tried yet, False: unschedulable
        self.sched_message = ""
        self.sched_reason = "Unschedulable"
        self.gates_changed = asyncio.Event()  # set by the API server when an update removes a gate
        self.sandbox = False
        self.inits_done = False
        self.init_failed = False
        self.sidecars_running = False
        self.final: tuple[str, str, str] | None = None  # (phase, reason, message) set by the kubelet itself
        self.start_time: str | None = None
        self.conditions: dict[str, dict] = {}
        self.stopping = False
        self.stop_event = asyncio.Event()
        self.sidecar_stop = False
        self.finished = asyncio.Event()
        self.gpus: list[int] = []
        self.volume_paths: dict[str, Path] = {}
        self.task: asyncio.Task | None = None
        self.pod_ip: str | None = None
        self.hosts_text = ""
        self.dns_state: tuple = ()

    # -- utilities ---------------------------------------------------------------------------

    @property
    def pod(self) -> dict | None:
        return self.cluster.store.get("pods", self.namespace, self.name)

    @property
    def containers(self) -> list[Container]:
        return self.inits + self.mains

    def container(self, name: str) -> Container | None:
        return next((c for c in self.containers if c.name == name), None)

    def event(
        self, type_: str, reason: str, message: str, field_path: str = "", component: str = "kubelet"
    ) -> None:
        pod = self.pod
        if pod is not None:
            self.cluster.record_event(pod, type_, reason, message, field_path, component)

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless the pod is stopping; False when interrupted."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), seconds)
            return False
        except TimeoutError:
            return not self.stopping

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.run())

    # -- status ------------------------------------------------------------------------------

    def phase(self) -> str:
        if self.final and (self.finished.is_set() or not self.containers_left()):
            # a terminal phase only once every container has stopped, as the kubelet reports it
            return self.final[0]
        if self.init_failed:
            return "Failed"
        if not self.scheduled or not self.inits_done:
            return "Pending"
        if any(not c.ever_ran and not c.done for c in self.mains):
            return "Pending"
        if any("running" in c.state for c in self.mains):
            return "Running"
        if not all(c.done for c in self.mains) or self.sidecars_running:
            return "Running"
        return "Succeeded" if all(c.last_exit == 0 for c in self.mains) else "Failed"

    def containers_left(self) -> bool:
        """Whether a container still runs (its process, or a status that has not yet recorded its end)."""
        return any(
            "running" in c.state or (c.proc is not None and not c.proc.finished.is_set())
            for c in self.containers
        )

    def _condition(self, type_: str, status: bool, reason: str = "", message: str = "") -> None:
        value = "True" if status else "False"
        old = self.conditions.get(type_)
        cond = {"type": type_, "status": value, "lastProbeTime": None}
        cond["lastTransitionTime"] = (
            old["lastTransitionTime"] if old and old["status"] == value else rfc3339()
        )
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        self.conditions[type_] = cond

    def publish(self) -> None:
        phase = self.phase()
        if self.scheduled is False:
            self._condition("PodScheduled", False, self.sched_reason, self.sched_message)
        elif self.scheduled:
            self._condition("PodScheduled", True)
        if self.scheduled:
            self._condition("PodReadyToStartContainers", self.sandbox)
            incomplete = [
                c.name
                for c in self.inits
                if not (c.done and c.last_exit == 0) and not (c.kind == "sidecar" and c.started)
            ]
            self._condition(
                "Initialized",
                not incomplete,
                "" if not incomplete else "ContainersNotInitialized",
                "" if not incomplete else f"containers with incomplete status: [{' '.join(incomplete)}]",
            )
            unready = [
                c.name for c in self.mains + [s for s in self.inits if s.kind == "sidecar"] if not c.ready
            ]
            if phase in ("Succeeded", "Failed"):
                reason, message = "PodCompleted", ""
            elif unready:
                reason, message = (
                    "ContainersNotReady",
                    f"containers with unready status: [{' '.join(unready)}]",
                )
            else:
                reason, message = "", ""
            self._condition("ContainersReady", not unready and phase == "Running", reason, message)
            self._condition("Ready", not unready and phase == "Running", reason, message)
        order = [
            "PodReadyToStartContainers",
            "Initialized",
            "Ready",
            "ContainersReady",
            "PodScheduled",
            "DisruptionTarget",
            "TerminationTarget",
        ]
        status: dict = {
            "phase": phase,
            "conditions": [self.conditions[t] for t in order if t in self.conditions],
            "qosClass": qos_class(self.spec),
        }
        if self.scheduled:
            status.update(hostIP=NODE_IP, hostIPs=[{"ip": NODE_IP}])
            if self.sandbox:
                ip = self.pod_ip or NODE_IP
                status.update(podIP=ip, podIPs=[{"ip": ip}])
            if self.start_time:
                status["startTime"] = self.start_time
            if self.inits:
                status["initContainerStatuses"] = [c.status() for c in self.inits]
            status["containerStatuses"] = [c.status() for c in self.mains]
        if self.final and self.final[1] and phase == self.final[0]:
            status["reason"], status["message"] = self.final[1], self.final[2]

        def apply(pod: dict) -> None:
            pod["status"] = status

        self.cluster.store.mutate("pods", self.namespace, self.name, apply)
        # a pod that becomes ready, or stops, changes what the headless Services' names resolve to
        ready = self.conditions.get("Ready", {}).get("status") == "True"
        dns_state = (self.pod_ip if self.sandbox else None, ready, phase in ("Succeeded", "Failed"))
        if dns_state != self.dns_state:
            self.dns_state = dns_state
            if self.spec.get("subdomain"):
                self.cluster.refresh_hosts()

    def write_hosts(self, records: list) -> None:
        """This pod's /etc/hosts (bind-mounted in each container), rewritten in place when it changes."""
        pod = self.pod
        if pod is None or not self.pod_ip or self.finished.is_set():
            return
        text = podnet.hosts_file(pod, self.pod_ip, records)
        if text != self.hosts_text:
            podnet.write_in_place(self.dir / "etc" / "hosts", text)
            self.hosts_text = text

    # -- the pod's life ----------------------------------------------------------------------

    async def run(self) -> None:
        watch: asyncio.Future | None = None
        try:
            if await self.schedule() and await self.prepare_volumes():
                watch = asyncio.ensure_future(self.watch_local_storage())
                if await self.run_init_containers():
                    await self.run_main_containers()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("pod %s/%s failed in the local kubelet", self.namespace, self.name)
            self.final = ("Failed", "KubeletError", f"the local kubelet failed: {exc}")
        finally:
            await self.kill_all()
            self.sidecars_running = False
            self.finished.set()
            if watch is not None:
                watch.cancel()
            with contextlib.suppress(Exception):
                self.publish()
            self.cluster.on_pod_finished(self)

    def mark(self, type_: str, reason: str, message: str) -> None:
        """A condition a controller adds before it ends the pod on purpose: DisruptionTarget (reasons
        EvictionByEvictionAPI, PreemptionByScheduler, DeletionByTaintManager, TerminationByKubelet) or
        Kueue's TerminationTarget (WorkloadEvictedDueToPreempted)."""
        self._condition(type_, True, reason, message)
        with contextlib.suppress(Exception):
            self.publish()

    async def wait_gates(self) -> bool:
        """Hold a pod with ``spec.schedulingGates`` Pending (PodScheduled False, reason SchedulingGated)
        until an update removes its last gate, as the scheduler does; False when it is deleted meanwhile."""
        while True:
            pod = self.pod
            gates = ((pod or {}).get("spec") or {}).get("schedulingGates") or []
            if not gates:
                self.sched_reason = "Unschedulable"
                if pod is not None:
                    self.spec = pod["spec"]
                return True
            if self.scheduled is not False or self.sched_reason != "SchedulingGated":
                self.scheduled = False
                self.sched_reason = "SchedulingGated"
                self.sched_message = "Scheduling is blocked due to non-empty scheduling gates"
                self.publish()
            self.gates_changed.clear()
            waiters = {
                asyncio.ensure_future(self.gates_changed.wait()),
                asyncio.ensure_future(self.stop_event.wait()),
            }
            _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            if self.stopping:
                return False

    async def schedule(self) -> bool:
        if not await self.wait_gates():
            return False
        wanted = gpu_request(self.spec)
        self.publish()
        # An extended resource the node does not advertise at all (amd.com/gpu, a MIG profile, ...) is
        # never satisfied, as on a real scheduler; nvidia.com/gpu keeps the GPU rules below.
        missing = unadvertised_resources(self.spec)
        if missing:
            message = (
                f"0/1 nodes are available: 1 Insufficient {missing[0]}. preemption: 0/1 nodes are available: "
                "1 No preemption victims found for incoming pod."
            )
            self.scheduled = False
            self.sched_message = message
            self.event("Warning", "FailedScheduling", message, component="default-scheduler")
            self.publish()
            await self.stop_event.wait()
            return False
        storage, allocatable = pod_request(self.spec, "ephemeral-storage"), self.cluster.allocatable_storage()
        if (
            storage > allocatable
        ):  # the pod alone does not fit the node: Unschedulable, as the scheduler's NodeResourcesFit
            message = (
                "0/1 nodes are available: 1 Insufficient ephemeral-storage. preemption: 0/1 nodes are available: "
                "1 No preemption victims found for incoming pod."
            )
            self.scheduled = False
            self.sched_message = message
            self.event("Warning", "FailedScheduling", message, component="default-scheduler")
            log.info(
                "pod %s/%s requests %d bytes of ephemeral-storage, the node has %d",
                self.namespace,
                self.name,
                storage,
                allocatable,
            )
            self.publish()
            await self.stop_event.wait()
            return False
        while True:
            if self.stopping:
                return False
            free = self.cluster.free_gpus()
            if wanted and len(free) < wanted and self.cluster.strict_gpu:
                have = len(self.cluster.gpus)
                message = (
                    "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available: "
                    "1 No preemption victims found for incoming pod."
                )
                if self.scheduled is not False:
                    self.scheduled = False
                    self.sched_message = message
                    self.event("Warning", "FailedScheduling", message, component="default-scheduler")
                    log.info(
                        "pod %s/%s unschedulable: wants %d GPU(s), %d present",
                        self.namespace,
                        self.name,
                        wanted,
                        have,
                    )
                    self.publish()
                await self.cluster.wait_gpu_release(self.stop_event)
                continue
            break
        if wanted:
            self.gpus = free[:wanted] if len(free) >= wanted else []
            self.cluster.allocate_gpus(self.uid, self.gpus)

        def bind(pod: dict) -> None:
            pod["spec"]["nodeName"] = NODE_NAME

        self.cluster.store.mutate("pods", self.namespace, self.name, bind)
        self.scheduled = True
        self.event(
            "Normal",
            "Scheduled",
            f"Successfully assigned {self.namespace}/{self.name} to {NODE_NAME}",
            component="default-scheduler",
        )
        if wanted and not self.gpus:
            self.event(
                "Warning",
                "GPUNotAvailable",
                f"the pod requests {wanted} nvidia.com/gpu but this machine has {len(self.cluster.gpus)} free GPU(s): "
                'its containers run on CPU (CUDA_VISIBLE_DEVICES=""); start the dev stack with --strict-gpu '
                "to keep such pods Pending as a real cluster would",
            )
        self.start_time = rfc3339()
        self.publish()
        return True

    async def prepare_volumes(self) -> bool:
        while not self.stopping:
            try:
                self.volume_paths = setup_volumes(self.cluster, self.spec, self.dir, self.pod or {})
                # a hostNetwork pod has the node's address and /etc/hosts, as on a cluster
                self.pod_ip = (
                    NODE_IP if self.spec.get("hostNetwork") else self.cluster.addresses.allocate(self.uid)
                )
                etc = self.dir / "etc"
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hostname").write_text((self.spec.get("hostname") or self.name[:63]) + "\n")
                self.sandbox = True
                self.publish()
                self.cluster.refresh_hosts()
                return True
            except MountError as exc:
                self.event("Warning", "FailedMount", str(exc))
                self.publish()
                if not await self.sleep(2.0):
                    return False
        return False

    async def run_init_containers(self) -> bool:
        policy = self.spec.get("restartPolicy", "Always")
        for c in self.inits:
            if c.kind == "sidecar":
                asyncio.ensure_future(self.sidecar_loop(c))
                waiter = asyncio.ensure_future(c.first_start.wait())
                stopper = asyncio.ensure_future(self.stop_event.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                if self.stopping:
                    return False
                self.sidecars_running = True
                continue
            while True:
                code = await self.run_container(c)
                if code is None:
                    return False
                if code == 0:
                    c.done = True
                    break
                if policy == "Never":
                    c.done = True
                    self.init_failed = True
                    self.publish()
                    return False
                if not await self.back_off(c):
                    return False
        self.inits_done = True
        for c in self.mains:
            if c.state.get("waiting", {}).get("reason") == "PodInitializing":
                c.state = {"waiting": {"reason": "ContainerCreating"}}
        self.publish()
        return True

    async def sidecar_loop(self, c: Container) -> None:
        while not self.stopping and not self.sidecar_stop:
            code = await self.run_container(c)
            if code is None or self.stopping or self.sidecar_stop:
                c.done = True
                self.publish()
                return
            if not await self.back_off(c):
                c.done = True
                return

    async def run_main_containers(self) -> None:
        policy = self.spec.get("restartPolicy", "Always")

        async def loop(c: Container) -> None:
            while True:
                code = await self.run_container(c)
                if code is None or self.stopping:
                    c.done = True
                    return
                if policy == "Never" or (policy == "OnFailure" and code == 0):
                    c.done = True
                    self.publish()
                    return
                if not await self.back_off(c):
                    c.done = True
                    return

        await asyncio.gather(*(loop(c) for c in self.mains))
        await self.stop_sidecars()
        self.publish()

    async def back_off(self, c: Container) -> bool:
        delay = c.next_backoff()
        c.last_state = {"terminated": c.state.get("terminated", {})}
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {int(delay)}s restarting failed container={c.name} "
                f"pod={self.name}_{self.namespace}({self.uid})",
            }
        }
        c.ready = False
        self.event(
            "Warning",
            "BackOff",
            f"Back-off restarting failed container {c.name} in pod {self.name}_{self.namespace}({self.uid})",
            c.field_path,
        )
        self.publish()
        if not await self.sleep(delay):
            return False
        c.restart_count += 1
        return True

    async def stop_sidecars(self) -> None:
        self.sidecar_stop = True
        grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        deadline = time.monotonic() + grace
        for c in reversed([s for s in self.inits if s.kind == "sidecar"]):
            if c.proc and not c.proc.finished.is_set():
                self.event("Normal", "Killing", f"Stopping container {c.name}", c.field_path)
                c.proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(c.proc.finished.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    c.proc.send_signal(signal.SIGKILL)
                    await c.proc.finished.wait()
        # let the sidecar loops record the terminated states before the phase is final
        for _ in range(50):
            if all(s.done or not s.ever_ran for s in self.inits if s.kind == "sidecar"):
                break
            await asyncio.sleep(0.02)
        self.sidecars_running = False

    async def terminate(self, grace: float) -> None:
        """Graceful deletion, as the kubelet does it since native sidecars exist.

        SIGTERM to the main (and init) containers first; the native sidecars get theirs only
        once those have exited, so a sidecar can still ship what the main container wrote on
        its way out; SIGKILL to whatever still runs when ``grace`` seconds are up.
        """
        self.stopping = True
        self.stop_event.set()
        deadline = time.monotonic() + grace

        def running(kinds: tuple[str, ...]) -> list[Container]:
            return [c for c in self.containers if c.kind in kinds and c.proc and not c.proc.finished.is_set()]

        for kinds in (("main", "init"), ("sidecar",)):
            group = running(kinds)
            if kinds == ("sidecar",):
                group.reverse()
            for c in group:
                self.event("Normal", "Killing", f"Stopping container {c.name}", c.field_path)
                c.proc.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
            if not group:
                continue
            waits = [asyncio.ensure_future(c.proc.finished.wait()) for c in group]
            timeout = max(0.0, deadline - time.monotonic()) if grace > 0 else None
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for c in group:
                if not c.proc.finished.is_set():
                    c.proc.send_signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending)
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.finished.wait()

    async def kill_all(self) -> None:
        procs = [c.proc for c in self.containers if c.proc and not c.proc.finished.is_set()]
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            await p.finished.wait()

    async def active_deadline(self, seconds: float) -> None:
        if await self.sleep(seconds) and not self.finished.is_set():
            self.final = (
                "Failed",
                "DeadlineExceeded",
                "Pod was active on the node longer than the specified deadline",
            )
            self.event(
                "Normal", "DeadlineExceeded", "Pod was active on the node longer than the specified deadline"
            )
            self.stopping = True
            self.stop_event.set()
            for c in self.containers:
                if c.proc and not c.proc.finished.is_set():
                    c.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(float(self.spec.get("terminationGracePeriodSeconds", 30)))
            for c in self.containers:
                if c.proc and not c.proc.finished.is_set():
                    c.proc.send_signal(signal.SIGKILL)

    async def watch_local_storage(self) -> None:
        """The eviction manager's local-storage check (localstorage.py), every MONITORING_PERIOD seconds
        from the volumes' set-up to the pod's end, for a pod that limits its local storage at all."""
        if not localstorage.wants_measuring(self.spec):
            return
        while await self.sleep(localstorage.MONITORING_PERIOD):
            if self.finished.is_set():
                return
            usage = await self.measure_local_storage()
            if self.stopping or self.finished.is_set():
                return
            message = localstorage.eviction_message(self.spec, usage)
            if message:
                await self.evict_for_local_storage(message)
                return

    async def measure_local_storage(self) -> localstorage.Usage:
        """This pod's local storage now: its disk-backed volumes, its containers' writable layers and logs."""
        volumes = {
            v["name"]: self.volume_paths[v["name"]]
            for v in self.spec.get("volumes") or []
            if v["name"] in self.volume_paths and (localstorage.disk_backed_empty_dir(v) or "configMap" in v)
        }
        layers = {c.name: c.upperdir for c in self.containers if c.upperdir is not None}
        logs = {
            c.name: self.dir / "containers" / c.name
            for c in self.containers
            if c.ever_ran or c.name in layers
        }
        hosts = self.dir / "etc" / "hosts"
        sizes = await localstorage.disk_usage([*volumes.values(), *layers.values(), *logs.values(), hosts])
        return localstorage.Usage(
            volumes={name: sizes.get(path, 0) for name, path in volumes.items()},
            rootfs={name: sizes.get(path, 0) for name, path in layers.items()},
            logs={name: sizes.get(path, 0) for name, path in logs.items()},
            other=sizes.get(hosts, 0),
        )

    async def evict_for_local_storage(self, message: str) -> None:
        """Evict as the eviction manager does: a Warning event Evicted, then the containers killed with a
        grace period of EVICTION_GRACE seconds, phase Failed with reason Evicted and ``message``."""
        log.info("evicting pod %s/%s: %s", self.namespace, self.name, message)
        self.event("Warning", "Evicted", message)
        self.final = ("Failed", "Evicted", message)
        await self.terminate(localstorage.EVICTION_GRACE)

    # -- one container run -------------------------------------------------------------------

    def pull_auths(self) -> dict:
        """Registry credentials from the pod's imagePullSecrets (missing Secrets are skipped, as the kubelet does)."""
        found = []
        for ref in self.spec.get("imagePullSecrets") or []:
            secret = self.cluster.store.get("secrets", self.namespace, ref.get("name") or "")
            if secret is not None:
                found.append(secret)
        return pull_secret_auths(found)

    async def pull_image(self, c: Container) -> Image | None:
        """The container's image, pulled as its imagePullPolicy says; None when the pod stops while it fails."""
        image = c.spec.get("image", "")
        policy = c.spec.get("imagePullPolicy") or "IfNotPresent"
        delay = self.cluster.backoff  # the kubelet's image back-off starts as its crash back-off
        while True:
            if self.stopping or (c.kind == "sidecar" and self.sidecar_stop):
                return None
            started = time.monotonic()
            if policy != "Never" and not self.cluster.images.has(image, policy):
                self.event("Normal", "Pulling", f'Pulling image "{image}"', c.field_path)
            try:
                found, pulled = await self.cluster.images.pull(image, policy, self.pull_auths())
            except PullError as exc:
                problem, reason = str(exc), exc.reason
            else:
                if pulled:
                    took = time.monotonic() - started
                    self.event(
                        "Normal",
                        "Pulled",
                        f'Successfully pulled image "{image}" in {took:.3f}s ({found.image_id})',
                        c.field_path,
                    )
                else:
                    self.event(
                        "Normal",
                        "Pulled",
                        f'Container image "{image}" already present on machine',
                        c.field_path,
                    )
                return found
            c.state = {"waiting": {"reason": reason, "message": problem}}
            if reason == "ErrImageNeverPull":
                self.event("Warning", "ErrImageNeverPull", problem, c.field_path)
            else:
                self.event("Warning", "Failed", f'Failed to pull image "{image}": {problem}', c.field_path)
            self.event("Warning", "Failed", f"Error: {reason}", c.field_path)
            self.publish()
            if not await self.sleep(min(delay, 2.0)):
                return None
            if reason == "ErrImagePull":
                c.state = {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": f'Back-off pulling image "{image}": ErrImagePull: {problem}',
                    }
                }
                self.event("Normal", "BackOff", f'Back-off pulling image "{image}"', c.field_path)
                self.event("Warning", "Failed", "Error: ImagePullBackOff", c.field_path)
                self.publish()
                if not await self.sleep(delay):
                    return None
                delay = min(delay * 2, MAX_BACKOFF)

    async def run_container(self, c: Container) -> int | None:
        """Pull, configure and run one instance of ``c``; its exit code, or None when stopping."""
        while True:
            image = await self.pull_image(c)
            if image is None:
                return None
            rootfs = None
            instance = f"{self.uid[:8]}-{c.name}-{c.restart_count}"
            try:
                refusal = oci.non_root_problem(self.pod or {}, c.spec, image.user)
                if refusal:
                    raise ConfigError(refusal)
                env, argv, cwd, mounts = self.container_config(c, image)
                rootfs = await self.cluster.images.create_rootfs(instance, image)
                c.upperdir = writable_layer(rootfs)
                pod_sc = self.spec.get("securityContext") or {}
                user = oci.resolve_user(rootfs, image.user, pod_sc, c.spec.get("securityContext") or {})
            except (ConfigError, oci.UserError, PullError) as exc:
                if rootfs is not None:
                    c.upperdir = None
                    await self.cluster.images.remove_rootfs(instance)
                reason = (
                    "CreateContainerConfigError" if isinstance(exc, ConfigError) else "CreateContainerError"
                )
                c.state = {"waiting": {"reason": reason, "message": str(exc)}}
                self.event("Warning", "Failed", f"Error: {exc}", c.field_path)
                self.publish()
                if not await self.sleep(2.0):
                    return None
                continue
            break
        if self.stopping or (c.kind == "sidecar" and self.sidecar_stop):
            c.upperdir = None
            await self.cluster.images.remove_rootfs(instance)  # deleted while its image was being pulled
            return None
        oci.home_env(env, user)
        c.image_id = image.image_id
        c.runtime_id = os.urandom(32).hex()
        c.container_id = f"containerd://{c.runtime_id}"
        c.log = LogFile(c.log_path(self.dir, c.restart_count))
        bundle = self.dir / "bundles" / c.runtime_id[:12]
        bundle.mkdir(parents=True, exist_ok=True)
        gpus = self.gpus_for(c)
        spec = oci.runtime_spec(
            rootfs=rootfs,
            argv=argv,
            env=env,
            cwd=cwd,
            user=user,
            hostname=self.spec.get("hostname") or self.name[:63],
            mounts=mounts,
            container=c.spec,
            cgroups_path=f"{self.cluster.cgroup_parent}/{c.runtime_id[:12]}",
            hooks=self.cluster.gpu_hooks() if gpus else None,
        )
        (bundle / "config.json").write_text(json.dumps(spec))
        self.event("Normal", "Created", f"Created container: {c.name}", c.field_path)
        shim_spec = {
            "mode": "run",
            "runc": self.cluster.runc,
            "root": str(self.cluster.runc_root),
            "id": c.runtime_id,
            "bundle": str(bundle),
            "log": str(bundle / "runc.log"),
            "memory_cgroup": self.cluster.memory_cgroup(spec["linux"]["cgroupsPath"]),
        }
        c.proc = await runtime.spawn(shim_spec, self.dir / "run", c.log.write)
        error = await c.proc.started
        if self.stopping and not error:
            # the pod was deleted while this container was being created: its termination missed the process
            c.proc.send_signal(signal.SIGKILL)
        now = rfc3339()
        if error:
            await c.proc.wait()
            c.upperdir = None
            await self.cluster.images.remove_rootfs(instance)
            shutil.rmtree(bundle, ignore_errors=True)
            c.log.close()
            c.state = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": error,
                    "startedAt": "1970-01-01T00:00:00Z",
                    "finishedAt": now,
                    "containerID": c.container_id,
                }
            }
            c.last_exit, c.ever_ran, c.ready = 128, True, False
            self.event(
                "Warning",
                "Failed",
                f"Error: failed to create containerd task: failed to create shim task: {error}",
                c.field_path,
            )
            self.publish()
            return 128
        c.run_started = time.time()
        c.state = {"running": {"startedAt": now}}
        c.started, c.ready, c.ever_ran = True, True, True
        c.first_start.set()
        self.event("Normal", "Started", f"Started container {c.name}", c.field_path)
        self.publish()
        code = await c.proc.wait()
        c.log.close()
        c.upperdir = None
        await self.cluster.images.remove_rootfs(instance)
        shutil.rmtree(bundle, ignore_errors=True)
        reason = "OOMKilled" if c.proc.oom else ("Completed" if code == 0 else "Error")
        term = {
            "exitCode": code,
            "reason": reason,
            "startedAt": now,
            "finishedAt": rfc3339(),
            "containerID": c.container_id,
        }
        if c.proc.signal:
            term["signal"] = c.proc.signal
        if code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            entries, _ = read_entries(c.log.path)
            text = "\n".join(e.content.decode(errors="replace") for e in entries[-80:])
            if text:
                term["message"] = text[-2048:]
        c.state = {"terminated": term}
        c.last_exit, c.started, c.ready = code, False, False
        self.publish()
        return code

    def container_config(
        self, c: Container, image: Image
    ) -> tuple[dict[str, str], list[str], str, list[dict]]:
        """The process's environment, argv and working directory, and the bind mounts (volumes, kubelet files)."""
        pod = self.pod or {}
        env = container_env(self.cluster, pod, c.spec, image, self.gpus_for(c))
        mounts: list[dict] = []
        for m in c.spec.get("volumeMounts") or []:
            src = self.volume_paths[m["name"]]
            if m.get("subPath"):
                src = src / expand_subpath(m["subPath"], env)
                if not src.exists():
                    src.mkdir(parents=True, exist_ok=True)
                    src.chmod(0o777)
            mounts.append({"src": str(src), "dst": m["mountPath"], "ro": bool(m.get("readOnly"))})
        # a container's command replaces the image's ENTRYPOINT and CMD, its args replace CMD
        command = list(c.spec.get("command") or image.entrypoint)
        if c.spec.get("args") is not None:
            args = list(c.spec["args"])
        else:
            args = [] if c.spec.get("command") else image.cmd
        argv = [runtime.expand(a, env) for a in command + args]
        if not argv:
            raise ConfigError(
                f'no command specified: image "{c.spec.get("image")}" has no ENTRYPOINT or CMD, '
                "so the container must set command"
            )
        cwd = c.spec.get("workingDir") or image.working_dir
        if self.cluster.preload is not None:
            # at a path of its own in the container's root: a volume at /work or /usr must not hide it
            mounts.append({"src": str(self.cluster.preload), "dst": PRELOAD_PATH, "ro": True})
        # the kubelet's managed files, unless the container mounts its own
        etc = {"hosts": self.dir / "etc" / "hosts", "hostname": self.dir / "etc" / "hostname"}
        if self.spec.get("hostNetwork"):
            etc["hosts"] = Path("/etc/hosts")
        for name, src in etc.items():
            if not any(m["dst"].rstrip("/") == f"/etc/{name}" for m in mounts):
                mounts.append(
                    {
                        "src": str(src),
                        "dst": f"/etc/{name}",
                        "ro": self.spec.get("hostNetwork", False) and name == "hosts",
                    }
                )
        return env, argv, cwd, mounts

    def gpus_for(self, c: Container) -> list[int] | None:
        """GPU indices for ``c``: None when it requests none; [] when it requests some but runs on CPU."""
        want = container_gpus(c.spec)
        if not want:
            return None
        if not self.gpus:
            return []
        # hand out the pod's devices in container order, as the device plugin assigns per container
        offset = 0
        for other in self.mains:
            if other is c:
                break
            offset += container_gpus(other.spec)
        if c.kind != "main":
            offset = 0
        return self.gpus[offset : offset + want]

    # -- exec --------------------------------------------------------------------------------

    async def exec(
        self, container: str, argv: list[str], on_output, stdin: bool
    ) -> tuple[runtime.Proc, bytes]:
        """``runc exec`` of ``argv`` in the running ``container``: its namespaces, root, user and environment."""
        c = self.container(container)
        assert c is not None and c.proc is not None and c.proc.pid
        spec = {
            "mode": "exec",
            "runc": self.cluster.runc,
            "root": str(self.cluster.runc_root),
            "id": c.runtime_id,
            "argv": argv,
            "log": str(self.dir / "run" / f"exec-{os.urandom(6).hex()}.log"),
        }
        proc = await runtime.spawn(spec, self.dir / "run", on_output, stdin=stdin)
        return proc, b""

    def cleanup(self) -> None:
        self.cluster.release_gpus(self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)
        shm = self.cluster.shm_dir / self.uid
        shutil.rmtree(shm, ignore_errors=True)


# -- pod-level functions ---------------------------------------------------------------------


def writable_layer(rootfs: Path) -> Path | None:
    """The writable layer of a container's root file system: its overlay's upperdir (containers/storage
    mounts ``<layer>/merged`` over ``<layer>/diff``)."""
    upper = localstorage.overlay_upperdir(rootfs)
    if upper is None and rootfs.name == "merged" and (rootfs.parent / "diff").is_dir():
        upper = rootfs.parent / "diff"
    return upper


def container_gpus(spec: dict) -> int:
    res = spec.get("resources") or {}
    value = (res.get("limits") or {}).get("nvidia.com/gpu") or (res.get("requests") or {}).get(
        "nvidia.com/gpu"
    )
    return int(parse_quantity(value)) if value is not None else 0


def unadvertised_resources(spec: dict) -> list[str]:
    """Extended resources (``domain/name``) that containers request but the node never has (not nvidia.com/gpu)."""
    found = []
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        res = c.get("resources") or {}
        for name in {**(res.get("requests") or {}), **(res.get("limits") or {})}:
            if (
                "/" in name
                and name != "nvidia.com/gpu"
                and not name.startswith(("kubernetes.io/", "hugepages-"))
                and name not in found
            ):
                found.append(name)
    return found


def pod_request(spec: dict, resource: str) -> int:
    """The pod's effective request of ``resource`` as the scheduler computes it (sidecars included): the larger of
    the running pod's (containers and sidecars) and each init container's with the sidecars started before it."""

    def of(c: dict) -> int:
        value = ((c.get("resources") or {}).get("requests") or {}).get(resource)
        if value is None:  # a limit alone is also the request
            value = ((c.get("resources") or {}).get("limits") or {}).get(resource)
        return int(parse_quantity(value)) if value is not None else 0

    sidecars = peak = 0
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            sidecars += of(c)
            peak = max(peak, sidecars)
        else:
            peak = max(peak, sidecars + of(c))
    return max(peak, sum(of(c) for c in spec.get("containers") or []) + sidecars)


def gpu_request(spec: dict) -> int:
    mains = sum(container_gpus(c) for c in spec.get("containers") or [])
    inits = max([container_gpus(c) for c in spec.get("initContainers") or []] or [0])
    return max(mains, inits)


def qos_class(spec: dict) -> str:
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for r in ("cpu", "memory"):
            if r in req or r in lim:
                any_set = True
            if r not in lim or (r in req and parse_quantity(req[r]) != parse_quantity(lim[r])):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def expand_subpath(sub: str, env: dict[str, str]) -> str:
    return runtime.expand(sub, env)


def _field_ref(pod: dict, path: str) -> str:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName") or NODE_NAME,
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": NODE_IP,
        "status.hostIPs": NODE_IP,
        "status.podIP": (pod.get("status") or {}).get("podIP") or NODE_IP,
        "status.podIPs": (pod.get("status") or {}).get("podIP") or NODE_IP,
    }
    if path in simple:
        return simple[path]
    for kind in ("labels", "annotations"):
        values = meta.get(kind) or {}
        if path == f"metadata.{kind}":
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return values.get(path[len(prefix) : -2], "")
    raise ConfigError(f'unsupported fieldRef fieldPath "{path}"')


NODE_CPU = Decimal(os.cpu_count() or 1)


def _node_memory() -> Decimal:
    try:
        return Decimal(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return Decimal(0)


def _resource_field(spec: dict, ref: dict) -> str:
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    res = spec.get("resources") or {}
    raw = (res.get(kind) or {}).get(name)
    if raw is None and kind == "limits":
        value = NODE_CPU if name == "cpu" else _node_memory()
    elif raw is None:
        value = Decimal(0)
    else:
        value = parse_quantity(raw)
    divisor = parse_quantity(ref.get("divisor") or "1")
    out = value / divisor
    return str(int(out.to_integral_value(rounding="ROUND_CEILING")))


def _lookup(
    cluster: Cluster, kind: str, namespace: str, ref: dict, optional_default: bool = False
) -> dict | None:
    resource = "secrets" if kind == "Secret" else "configmaps"
    obj = cluster.store.get(resource, namespace, ref.get("name", ""))
    if obj is None and not ref.get("optional", optional_default):
        raise ConfigError(f'{kind.lower()} "{ref.get("name", "")}" not found')
    return obj


def _data(obj: dict, kind: str) -> dict[str, str]:
    if kind == "Secret":
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
    return dict(obj.get("data") or {})


def container_env(
    cluster: Cluster, pod: dict, spec: dict, image: Image, gpus: list[int] | None
) -> dict[str, str]:
    """The environment as containerd builds it: HOSTNAME, the image's Env (PATH by default), then the kubelet's."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {
        "PATH": DEFAULT_PATH,
        "HOSTNAME": pod.get("spec", {}).get("hostname") or pod["metadata"]["name"][:63],
        **image.env,
    }
    # the kubernetes Service variables are set in every container, whatever enableServiceLinks says
    port = str(cluster.port)
    env.update(
        KUBERNETES_SERVICE_HOST="127.0.0.1",
        KUBERNETES_SERVICE_PORT=port,
        KUBERNETES_SERVICE_PORT_HTTPS=port,
        KUBERNETES_PORT=f"tcp://127.0.0.1:{port}",
        KUBERNETES_PORT_443_TCP=f"tcp://127.0.0.1:{port}",
        KUBERNETES_PORT_443_TCP_PROTO="tcp",
        KUBERNETES_PORT_443_TCP_PORT=port,
        KUBERNETES_PORT_443_TCP_ADDR="127.0.0.1",
    )
    pod_ip = (pod.get("status") or {}).get("podIP")
    if pod_ip and pod_ip != NODE_IP and cluster.preload is not None:
        # wildcard binds go to the pod's own address (podnet.py); set before the container's env, as a runtime's
        env["KUBETRAIN_POD_IP"] = pod_ip
        env["LD_PRELOAD"] = PRELOAD_PATH
    # the GPUs a container sees are the ones it was given: none unless it asked for some
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus) if gpus else ""
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus) if gpus else "void"
    for src in spec.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            ref = src.get(key)
            if ref is None:
                continue
            obj = _lookup(cluster, kind, namespace, ref)
            if obj is None:
                continue
            for k, v in _data(obj, kind).items():
                if ENV_NAME.match(prefix + k):
                    env[prefix + k] = v
    for item in spec.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item or item.get("valueFrom") is None:
            env[name] = runtime.expand(item.get("value") or "", env)
            continue
        vf = item["valueFrom"]
        if vf.get("fieldRef"):
            env[name] = _field_ref(pod, vf["fieldRef"]["fieldPath"])
        elif vf.get("resourceFieldRef"):
            env[name] = _resource_field(spec, vf["resourceFieldRef"])
        else:
            kind, ref = (
                ("Secret", vf["secretKeyRef"])
                if vf.get("secretKeyRef")
                else ("ConfigMap", vf["configMapKeyRef"])
            )
            obj = _lookup(cluster, kind, namespace, ref)
            if obj is None:
                continue
            data = _data(obj, kind)
            if ref.get("key") not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(
                    f"couldn't find key {ref.get('key')} in {kind} {namespace}/{ref.get('name')}"
                )
            env[name] = data[ref["key"]]
    return env


def setup_volumes(cluster: Cluster, spec: dict, pod_dir: Path, pod: dict) -> dict[str, Path]:
    namespace = pod.get("metadata", {}).get("namespace", "default")
    uid = pod.get("metadata", {}).get("uid", "pod")
    out: dict[str, Path] = {}
    for vol in spec.get("volumes") or []:
        name = vol["name"]
        target = pod_dir / "volumes" / name
        if "emptyDir" in vol:
            if (vol.get("emptyDir") or {}).get("medium") == "Memory" and cluster.shm_dir.parent.exists():
                target = cluster.shm_dir / uid / name
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o777)  # as the kubelet makes an emptyDir: writable by the containers' users
        elif "hostPath" in vol:
            hp = vol["hostPath"]
            path, kind = Path(hp["path"]), hp.get("type") or ""
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            elif kind == "Directory" and not path.is_dir():
                raise MountError(
                    f'MountVolume.SetUp failed for volume "{name}" : hostPath type check failed: {path} is not a directory'
                )
            elif kind == "File" and not path.is_file():
                raise MountError(
                    f'MountVolume.SetUp failed for volume "{name}" : hostPath type check failed: {path} is not a file'
                )
            elif kind == "" and not path.exists():
                path.mkdir(parents=True, exist_ok=True)  # as the kubelet does for an unset type
            target = path
        elif "secret" in vol or "configMap" in vol:
            kind = "Secret" if "secret" in vol else "ConfigMap"
            src = vol.get("secret") or vol.get("configMap") or {}
            ref = {
                "name": src.get("secretName") if kind == "Secret" else src.get("name"),
                "optional": src.get("optional"),
            }
            files = _projection_files(cluster, kind, namespace, ref, src.get("items"), name)
            _write_files(target, files, src.get("defaultMode", 0o644))
        elif "downwardAPI" in vol:
            files = _downward_files(pod, vol["downwardAPI"].get("items") or [], name)
            _write_files(target, files, vol["downwardAPI"].get("defaultMode", 0o644))
        elif "projected" in vol:
            files: dict[str, tuple[bytes, int | None]] = {}
            for source in vol["projected"].get("sources") or []:
                if "secret" in source or "configMap" in source:
                    kind = "Secret" if "secret" in source else "ConfigMap"
                    src = source.get("secret") or source.get("configMap") or {}
                    files.update(
                        _projection_files(
                            cluster,
                            kind,
                            namespace,
                            {"name": src.get("name"), "optional": src.get("optional")},
                            src.get("items"),
                            name,
                        )
                    )
                elif "downwardAPI" in source:
                    files.update(_downward_files(pod, source["downwardAPI"].get("items") or [], name))
                elif "serviceAccountToken" in source:
                    # no token issuer here: a placeholder so that readers find a file where they expect one
                    files[source["serviceAccountToken"].get("path", "token")] = (
                        b"kubetrain-local-no-token",
                        None,
                    )
            _write_files(target, files, vol["projected"].get("defaultMode", 0o644))
        out[name] = target
    return out


def _projection_files(
    cluster: Cluster, kind: str, namespace: str, ref: dict, items: list | None, volume: str
) -> dict[str, tuple[bytes, int | None]]:
    resource = "secrets" if kind == "Secret" else "configmaps"
    obj = cluster.store.get(resource, namespace, ref.get("name") or "")
    if obj is None:
        if ref.get("optional"):
            return {}
        raise MountError(
            f'MountVolume.SetUp failed for volume "{volume}" : {kind.lower()} "{ref.get("name")}" not found'
        )
    data: dict[str, bytes] = {}
    if kind == "Secret":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    else:
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    if not items:
        return {k: (v, None) for k, v in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            if ref.get("optional"):
                continue
            raise MountError(
                f'MountVolume.SetUp failed for volume "{volume}" : configmap references non-existent config key: {item["key"]}'
                if kind == "ConfigMap"
                else f'MountVolume.SetUp failed for volume "{volume}" : references non-existent secret key: {item["key"]}'
            )
        out[item.get("path") or item["key"]] = (data[item["key"]], item.get("mode"))
    return out


def _downward_files(pod: dict, items: list, volume: str) -> dict[str, tuple[bytes, int | None]]:
    out = {}
    for item in items:
        try:
            if item.get("fieldRef"):
                value = _field_ref(pod, item["fieldRef"]["fieldPath"])
            else:
                container = next(
                    (
                        c
                        for c in pod["spec"].get("containers", [])
                        if c["name"] == item["resourceFieldRef"].get("containerName")
                    ),
                    {},
                )
                value = _resource_field(container, item["resourceFieldRef"])
        except ConfigError as exc:
            raise MountError(f'MountVolume.SetUp failed for volume "{volume}" : {exc}') from None
        out[item["path"]] = (value.encode(), item.get("mode"))
    return out


def _write_files(target: Path, files: dict[str, tuple[bytes, int | None]], default_mode: int) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for rel, (content, mode) in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        os.chmod(tmp, mode if mode is not None else default_mode)
        os.replace(tmp, path)
