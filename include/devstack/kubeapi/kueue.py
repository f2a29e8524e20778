"""A small stand-in for Kueue: the parts of its contracts kubetrain relies on, for tests.

Users run Kueue itself; this admits the dev stack's workloads the way Kueue does, so that kubetrain's
queueing and preemption handling is exercised against the same objects and signals
(include/devstack/KUBEAPI.md, "Kueue", lists what it reproduces and what it does not):

* the pod webhook: a pod labelled ``kueue.x-k8s.io/queue-name`` (and not owned by a Job) is created
  with the scheduling gate ``kueue.x-k8s.io/admission`` and the label ``kueue.x-k8s.io/managed``;
  pods labelled ``kueue.x-k8s.io/pod-group-name`` with the annotation
  ``kueue.x-k8s.io/pod-group-total-count`` form one workload, admitted all or nothing;
* the Job webhook: a Job labelled with a queue is created suspended;
* one ``Workload`` per pod, pod group or Job, with the conditions QuotaReserved, Admitted, Evicted
  and Finished;
* ``kueue.x-k8s.io`` served as Kueue v0.19 serves it: ``v1beta2`` (the storage and preferred version)
  beside ``v1beta1``, one object read through either, converted where the schemas differ in what the
  stand-in fills (see :func:`present`); ``servedVersions`` narrows it to one, as an older Kueue serves;
* admission in priority (``kueue.x-k8s.io/priority-class`` naming a WorkloadPriorityClass), then
  creation order, within each ClusterQueue's nominal quota; a workload that asks for a resource its
  ClusterQueue does not cover (``ephemeral-storage`` unless excluded, as Kueue) is inadmissible;
* preemption within a ClusterQueue (``withinClusterQueue: LowerPriority``): a pending workload that
  would fit without lower-priority admitted ones evicts the fewest of them, the lowest priority and
  the newest first; an evicted pod gets the ``TerminationTarget`` condition (reason
  ``WorkloadEvictedDueToPreempted``) and is deleted, an evicted Job is suspended and re-queued.

* ``LocalQueue``, ``ClusterQueue``, ``WorkloadPriorityClass`` and ``ResourceFlavor`` served as API
  objects (create, get, list, watch, update, patch, delete); admission reads the ones that exist at each
  pass, so a queue created, changed or deleted counts at once. A workload whose LocalQueue or
  ClusterQueue does not exist waits with Kueue's ``LocalQueue x doesn't exist``; a ClusterQueue's
  ``namespaceSelector`` (null selects no namespace) keeps other namespaces' workloads out.

Configuration: a YAML file (``--kueue-config``): ``apply`` (``files``: queue manifests, relative to the
file, created at start as ``kubectl apply`` creates them; ``nominalQuota``: resources whose quota is
resized in every ClusterQueue), and in short ``clusterQueues`` (name, ``nominalQuota``, ``preemption``,
``queueingStrategy``), ``localQueues`` (namespace, name, clusterQueue), ``workloadPriorityClasses``
(name, value); ``excludeResourcePrefixes``, ``integrations.frameworks``,
``managedJobsNamespaceSelector`` and ``servedVersions`` (default ``[v1beta2, v1beta1]``).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import logging
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from include.devstack.kubeapi.meta import ALSO_SERVED, CRUD, GROUPS, RESOURCES, ApiError, Resource, rfc3339
from include.devstack.kubeapi.openapi import schema_check
from include.devstack.kubeapi.selectors import match_label_selector_object
from include.devstack.kubeapi.store import Change, Watcher
from include.devstack.kubeapi.validation import parse_quantity

if TYPE_CHECKING:
    from collections.abc import Callable

    from include.devstack.kubeapi.cluster import Cluster
    from include.devstack.kubeapi.jobs import JobController

log = logging.getLogger("kubeapi.kueue")

GROUP = "kueue.x-k8s.io"
# Kueue v0.19's CRDs serve both and store v1beta2 (config/components/crd/bases); the API server prefers the
# highest version (kube-aware version order), which is the order here
VERSIONS = ("v1beta2", "v1beta1")
STORAGE_VERSION = "v1beta2"
WORKLOAD_PRIORITY_CLASS_SOURCE = "kueue.x-k8s.io/workloadpriorityclass"  # v1beta1's priorityClassSource
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"
GATE = "kueue.x-k8s.io/admission"
FINALIZER = "kueue.x-k8s.io/managed"
DEFAULT_FRAMEWORKS = ("batch/job",)
DEFAULT_NAMESPACE_SELECTOR = {
    "matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system"]}
    ]
}
READ = ("get", "list", "watch")


def register_resources(versions: tuple[str, ...] = VERSIONS) -> None:
    """Serve Kueue's resources in ``versions``: Workloads read-only (the stand-in writes them), the queue
    objects as a platform engineer applies them (create, get, list, watch, update, patch, delete)."""
    served = tuple(v for v in VERSIONS if v in versions)
    GROUPS[GROUP] = served[0]
    ALSO_SERVED[GROUP] = served[1:]
    for name, kind, namespaced, verbs in (
        ("workloads", "Workload", True, READ),
        ("localqueues", "LocalQueue", True, CRUD),
        ("clusterqueues", "ClusterQueue", False, CRUD),
        ("workloadpriorityclasses", "WorkloadPriorityClass", False, CRUD),
        ("resourceflavors", "ResourceFlavor", False, CRUD),
    ):
        RESOURCES[(GROUP, name)] = Resource(name, kind, GROUP, served[0], namespaced, verbs, (), ())


def present(obj: dict, version: str) -> dict:
    """A stored object (kept in the storage version, v1beta2) as ``version`` shows it: Kueue's conversion
    (apis/kueue/v1beta1/*_conversion.go) for the fields the stand-in fills. A Workload's v1beta2
    ``spec.priorityClassRef`` ({group, kind, name}) is v1beta1's ``priorityClassSource`` and
    ``priorityClassName``; a ClusterQueue's ``cohortName`` is v1beta1's ``cohort``; a LocalQueue's
    ``status.flavorsUsage`` is v1beta1's ``flavorUsage``."""
    out = copy.deepcopy(obj)
    out["apiVersion"] = f"{GROUP}/{version}"
    if version != "v1beta1":
        return out
    spec = out.get("spec")
    if out.get("kind") == "Workload" and isinstance(spec, dict):
        ref = spec.pop("priorityClassRef", None)
        if ref and ref.get("group") == GROUP and ref.get("kind") == "WorkloadPriorityClass":
            spec["priorityClassSource"] = WORKLOAD_PRIORITY_CLASS_SOURCE
            spec["priorityClassName"] = ref.get("name", "")
        elif ref and ref.get("group") == "scheduling.k8s.io":
            spec["priorityClassSource"] = "scheduling.k8s.io/priorityclass"
            spec["priorityClassName"] = ref.get("name", "")
    if out.get("kind") == "ClusterQueue" and isinstance(spec, dict) and "cohortName" in spec:
        spec["cohort"] = spec.pop("cohortName")
    status = out.get("status")
    if out.get("kind") == "LocalQueue" and isinstance(status, dict) and "flavorsUsage" in status:
        status["flavorUsage"] = status.pop("flavorsUsage")
    return out


@dataclass
class ClusterQueue:
    name: str
    quota: dict[str, Decimal]  # each covered resource's nominal quota in its first flavor
    preempt_lower: bool
    strict_fifo: bool = False  # queueingStrategy StrictFIFO; Kueue's default is BestEffortFIFO
    namespace_selector: dict | None = None  # None selects no namespace, {} every one (as Kueue's)
    flavors: dict[str, str] = field(default_factory=dict)  # resource -> the flavor that gives its quota


class _Wake:
    """A store watcher's queue that, instead of keeping a change, schedules an admission pass: a queue
    object created, changed or deleted counts at once, as in Kueue's queue manager."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake

    def put_nowait(self, change: Change) -> None:
        old = change.old or {}
        if change.type != "MODIFIED" or any(change.obj.get(k) != old.get(k) for k in ("spec", "value")):
            self.wake()  # not for a status the stand-in itself writes


def cluster_queue(obj: dict) -> ClusterQueue:
    """A stored ClusterQueue (v1beta2) as admission reads it. Each resource group's first flavor gives
    its resources' quota: the stand-in tries no second flavor (KUBEAPI.md, "Kueue")."""
    spec = obj.get("spec") or {}
    quota: dict[str, Decimal] = {}
    flavors: dict[str, str] = {}
    for group in spec.get("resourceGroups") or []:
        first = (group.get("flavors") or [{}])[0]
        given = {
            r["name"]: parse_quantity(str(r.get("nominalQuota", "0"))) for r in first.get("resources") or []
        }
        for resource in group.get("coveredResources") or []:
            quota[resource] = given.get(resource, Decimal(0))
            flavors[resource] = first.get("name", "")
    preemption = spec.get("preemption") or {}
    return ClusterQueue(
        obj["metadata"]["name"],
        quota,
        preemption.get("withinClusterQueue") in ("LowerPriority", "LowerOrNewerEqualPriority"),
        spec.get("queueingStrategy") == "StrictFIFO",
        spec.get("namespaceSelector"),
        flavors,
    )


RESOURCE_OF_KIND = {
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
    "WorkloadPriorityClass": "workloadpriorityclasses",
    "ResourceFlavor": "resourceflavors",
}
QUEUE_RESOURCES = tuple(RESOURCE_OF_KIND.values())


def storage_form(obj: dict) -> dict:
    """``obj`` as stored (v1beta2): Kueue's conversion of the fields that differ, the reverse of
    :func:`present`."""
    out = copy.deepcopy(obj)
    if out.get("apiVersion") == f"{GROUP}/v1beta1":
        spec = out.get("spec")
        if out.get("kind") == "ClusterQueue" and isinstance(spec, dict) and "cohort" in spec:
            spec["cohortName"] = spec.pop("cohort")
    out["apiVersion"] = f"{GROUP}/{STORAGE_VERSION}"
    if out.get("kind") == "ClusterQueue":
        spec = out.setdefault("spec", {})
        spec.setdefault("queueingStrategy", "BestEffortFIFO")  # the CRD's defaults
        spec.setdefault("preemption", {}).setdefault("withinClusterQueue", "Never")
    if out.get("kind") == "LocalQueue":
        out.setdefault("status", {"pendingWorkloads": 0, "admittedWorkloads": 0})
    return out


def shorthand_objects(config: dict) -> list[dict]:
    """The queue objects a configuration names in short (``clusterQueues``, ``localQueues``,
    ``workloadPriorityClasses``): one flavor, ``default-flavor``, and every namespace selected."""
    objects: list[dict] = []
    for cq in config.get("clusterQueues") or []:
        strategy = cq.get("queueingStrategy") or "BestEffortFIFO"
        if strategy not in ("BestEffortFIFO", "StrictFIFO"):
            raise ValueError(
                f"clusterQueue {cq['name']!r}: queueingStrategy {strategy!r} is not BestEffortFIFO or StrictFIFO"
            )
        quota = [{"name": k, "nominalQuota": str(v)} for k, v in (cq.get("nominalQuota") or {}).items()]
        within = ((cq.get("preemption") or {}).get("withinClusterQueue")) or "Never"
        spec = {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": within},
            "queueingStrategy": strategy,
            "resourceGroups": [
                {
                    "coveredResources": [q["name"] for q in quota],
                    "flavors": [{"name": "default-flavor", "resources": quota}],
                }
            ],
        }
        objects.append({"kind": "ClusterQueue", "metadata": {"name": cq["name"]}, "spec": spec})
    for lq in config.get("localQueues") or []:
        objects.append(
            {
                "kind": "LocalQueue",
                "metadata": {"name": lq["name"], "namespace": lq["namespace"]},
                "spec": {"clusterQueue": lq["clusterQueue"]},
            }
        )
    for p in config.get("workloadPriorityClasses") or []:
        objects.append(
            {"kind": "WorkloadPriorityClass", "metadata": {"name": p["name"]}, "value": int(p["value"])}
        )
    return objects


def manifest_objects(config: dict, base: Path) -> list[dict]:
    """The objects of the manifests a configuration applies (``apply``: paths relative to the
    configuration's file), as `kubectl apply -f` would create them; ``nominalQuota`` replaces the
    nominal quota of the named resources in every ClusterQueue (the dev stack's one GPU)."""
    spec = config.get("apply") or {}
    if not isinstance(spec, dict) or not isinstance(spec.get("files", []), list):
        raise ValueError(
            f"apply {spec!r}: expected {{files: [path, ...], nominalQuota: {{resource: quantity}}}}"
        )
    resize = {k: str(v) for k, v in (spec.get("nominalQuota") or {}).items()}
    objects: list[dict] = []
    for name in spec.get("files") or []:
        path = (base / name).resolve()
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if (
                doc.get("apiVersion") not in (f"{GROUP}/{v}" for v in VERSIONS)
                or doc.get("kind") not in RESOURCE_OF_KIND
            ):
                raise ValueError(
                    f"{path}: {doc.get('apiVersion')} {doc.get('kind')} is not a Kueue queue object "
                    f"({', '.join(RESOURCE_OF_KIND)} in {GROUP}/{', '.join(VERSIONS)})"
                )
            for group in (
                (doc.get("spec") or {}).get("resourceGroups") or [] if doc["kind"] == "ClusterQueue" else []
            ):
                for flavor in group.get("flavors") or []:
                    for resource in flavor.get("resources") or []:
                        if resource.get("name") in resize:
                            resource["nominalQuota"] = resize[resource["name"]]
            objects.append(doc)
    return objects


@dataclass
class Workload:
    """A unit of admission: one pod, a pod group, or a Job."""

    namespace: str
    name: str
    kind: str  # "pod", "group", "job"
    key: str  # the pod's, group's or Job's name
    queue: str
    priority: int
    seq: int
    requests: dict[str, Decimal] = field(default_factory=dict)
    uid: str = ""  # a single pod's
    admitted: bool = False
    admitted_seq: int = 0
    evicting: bool = False  # preempted; its pods still hold the quota until their processes are gone
    finished: bool = False


def container_requests(spec: dict) -> dict[str, Decimal]:
    """A pod's requests as Kueue counts them, which is how Kubernetes counts them (``resourcehelper``):
    the larger of the running pod's (its containers and its sidecars, the init containers with
    ``restartPolicy: Always``) and each init container's with the sidecars started before it. A limit
    without a request is the request."""

    def of(c: dict) -> dict[str, Decimal]:
        res = c.get("resources") or {}
        return {
            name: parse_quantity(value)
            for name, value in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items()
        }

    def add(a: dict[str, Decimal], b: dict[str, Decimal]) -> dict[str, Decimal]:
        return {k: a.get(k, Decimal(0)) + b.get(k, Decimal(0)) for k in {*a, *b}}

    def peak(a: dict[str, Decimal], b: dict[str, Decimal]) -> dict[str, Decimal]:
        return {k: max(a.get(k, Decimal(0)), b.get(k, Decimal(0))) for k in {*a, *b}}

    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            sidecars = add(sidecars, of(c))
            init_peak = peak(init_peak, sidecars)
        else:
            init_peak = peak(init_peak, add(sidecars, of(c)))
    running = sidecars
    for c in spec.get("containers") or []:
        running = add(running, of(c))
    return peak(init_peak, running)


def quantity(resource: str, value: Decimal) -> str:
    """A quantity as Kueue prints it (resource.Quantity's canonical form): CPU in cores or millicores,
    other resources in bytes with the largest binary suffix that divides them."""
    if resource == "cpu":
        return f"{value.normalize():f}" if value == value.to_integral_value() else f"{int(value * 1000)}m"
    if value != value.to_integral_value():
        return f"{value.normalize():f}"
    number = int(value)
    for suffix, scale in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if number and number % scale == 0:
            return f"{number // scale}{suffix}"
    return str(number)


class Kueue:
    def __init__(self, cluster: Cluster, jobs: JobController, config_path: Path) -> None:
        self.cluster = cluster
        self.store = cluster.store
        self.jobs = jobs
        config = yaml.safe_load(config_path.read_text()) or {}
        served = config.get("servedVersions", list(VERSIONS))
        if not isinstance(served, list) or not served or not set(served) <= set(VERSIONS):
            raise ValueError(f"servedVersions {served!r}: expected a list of {', '.join(VERSIONS)}")
        self.excluded: tuple[str, ...] = tuple(config.get("excludeResourcePrefixes") or ())
        # Kueue's Configuration: the integrations are enabled one by one (its built-in default, when the
        # configuration names none, is batch/job alone: pkg/config/defaults.go), and the namespaces whose
        # jobs and pods it manages (managedJobsNamespaceSelector; the default leaves kube-system and
        # kueue-system out)
        self.frameworks: frozenset[str] = frozenset(
            ((config.get("integrations") or {}).get("frameworks")) or DEFAULT_FRAMEWORKS
        )
        self.namespace_selector: dict = (
            config["managedJobsNamespaceSelector"]
            if config.get("managedJobsNamespaceSelector") is not None
            else DEFAULT_NAMESPACE_SELECTOR
        )
        objects = [*shorthand_objects(config), *manifest_objects(config, config_path.parent)]
        self.queues: dict[str, ClusterQueue] = {}
        self.workloads: dict[tuple[str, str], Workload] = {}
        self.seq = itertools.count(1)
        self._scheduled = False
        self._queues_changed = False
        register_resources(tuple(served))
        # the queues exist as API objects, as `kubectl apply` leaves them on a cluster; admission reads
        # the ones that exist at each pass, so a queue created, changed or deleted later counts from then
        for obj in objects:
            stored = storage_form(obj)
            resource = RESOURCES[(GROUP, RESOURCE_OF_KIND[obj["kind"]])]
            try:
                schema_check(replace(resource, version=STORAGE_VERSION), stored, "Strict")
            except ApiError as exc:
                raise ValueError(
                    f"{config_path}: {obj['kind']} {obj['metadata'].get('name')!r}: {exc.message}"
                ) from None
            self.store.create(resource.name, stored, GROUP)
        for resource in QUEUE_RESOURCES:
            self.store.watchers.add(Watcher(resource, None, _Wake(self.queues_changed)))  # type: ignore[arg-type]
        cluster.pod_finished_hooks.append(lambda worker: self.soon())
        cluster.pod_finalizing_hooks.append(lambda namespace, name: self.soon())

    # -- the queue objects -------------------------------------------------------------------

    def read_queues(self) -> dict[str, ClusterQueue]:
        """The ClusterQueues that exist now, as admission reads them."""
        return {
            obj["metadata"]["name"]: cluster_queue(obj)
            for obj in self.store.list("clusterqueues", None)
            if not obj["metadata"].get("deletionTimestamp")
        }

    def priority_value(self, name: str) -> int | None:
        obj = self.store.get("workloadpriorityclasses", "", name)
        return None if obj is None else int(obj.get("value") or 0)

    def local_queue(self, namespace: str, name: str) -> str | None:
        """The ClusterQueue a LocalQueue points at (None when no such LocalQueue exists)."""
        obj = self.store.get("localqueues", namespace, name)
        return None if obj is None else ((obj.get("spec") or {}).get("clusterQueue") or "")

    # -- webhooks ----------------------------------------------------------------------------

    def managed_namespace(self, namespace: str) -> bool:
        """Whether ``managedJobsNamespaceSelector`` selects the namespace (``{}`` selects every one)."""
        if not self.namespace_selector:
            return True
        ns = self.store.get("namespaces", "", namespace) or {}
        labels = (ns.get("metadata") or {}).get("labels") or {"kubernetes.io/metadata.name": namespace}
        return match_label_selector_object(self.namespace_selector, labels)

    def mutate_pod(self, pod: dict) -> None:
        """Kueue's pod webhook (the ``pod`` integration): gate a queued pod in a managed namespace that no
        job of an enabled integration owns, and hold it with Kueue's finalizer."""
        meta = pod.setdefault("metadata", {})
        labels = meta.get("labels") or {}
        if "pod" not in self.frameworks or QUEUE_LABEL not in labels:
            return
        if not self.managed_namespace(meta.get("namespace") or "default"):
            return
        owners = meta.get("ownerReferences") or []
        if "batch/job" in self.frameworks and any(o.get("kind") == "Job" for o in owners):
            return  # the Job's workload holds its pods
        meta.setdefault("labels", {})[MANAGED_LABEL] = "true"
        finalizers = meta.setdefault("finalizers", [])
        if FINALIZER not in finalizers:
            finalizers.append(FINALIZER)
        gates = pod.setdefault("spec", {}).setdefault("schedulingGates", [])
        if not any(g.get("name") == GATE for g in gates):
            gates.append({"name": GATE})

    def mutate_job(self, job: dict) -> None:
        """Kueue's Job webhook (the ``batch/job`` integration): a queued Job in a managed namespace is
        created suspended."""
        meta = job.get("metadata") or {}
        if "batch/job" not in self.frameworks or QUEUE_LABEL not in (meta.get("labels") or {}):
            return
        if self.managed_namespace(meta.get("namespace") or "default"):
            job.setdefault("spec", {})["suspend"] = True

    # -- workloads ---------------------------------------------------------------------------

    def pod_created(self, pod: dict) -> None:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if labels.get(MANAGED_LABEL) != "true":
            return
        group = labels.get(GROUP_LABEL)
        kind, key = ("group", group) if group else ("pod", meta["name"])
        self.ensure(meta["namespace"], kind, key, labels, meta, pod)
        self.soon()

    def job_created(self, job: dict) -> None:
        meta = job["metadata"]
        labels = meta.get("labels") or {}
        if (
            QUEUE_LABEL in labels
            and "batch/job" in self.frameworks
            and self.managed_namespace(meta["namespace"])
        ):
            self.ensure(meta["namespace"], "job", meta["name"], labels, meta, job)
            self.soon()

    def ensure(
        self, namespace: str, kind: str, key: str, labels: dict, meta: dict, obj: dict | None = None
    ) -> Workload | None:
        found = next(
            (w for w in self.workloads.values() if (w.namespace, w.kind, w.key) == (namespace, kind, key)),
            None,
        )
        if found is not None and not found.finished:
            return found
        priority_name = labels.get(PRIORITY_LABEL, "")
        priority = self.priority_value(priority_name) if priority_name else 0
        if priority is None:
            # Kueue creates no Workload and says why on the object that carries the label
            # (jobframework: ReasonWorkloadPriorityClassNotFound); the pod stays gated, the Job suspended
            self.cluster.record_event(
                obj or {"apiVersion": "v1", "kind": "Pod", "metadata": meta},
                "Warning",
                "WorkloadPriorityClassNotFound",
                f'WorkloadPriorityClass "{priority_name}" not found',
                component="kueue-admission",
            )
            return None
        suffix = hashlib.sha256(f"{meta.get('uid')}".encode()).hexdigest()[:5]
        name = f"{kind}-{key}-{suffix}" if kind != "group" else key
        workload = Workload(
            namespace,
            name,
            kind,
            key,
            labels.get(QUEUE_LABEL, ""),
            priority,
            next(self.seq),
        )
        workload.uid = meta.get("uid", "") if kind == "pod" else ""
        self.workloads[(namespace, name)] = workload
        owner = {
            "apiVersion": "batch/v1" if kind == "job" else "v1",
            "kind": "Job" if kind == "job" else "Pod",
        }
        body = {
            "apiVersion": f"{GROUP}/{STORAGE_VERSION}",
            "kind": "Workload",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"kueue.x-k8s.io/job-uid": meta.get("uid", "")},
                "ownerReferences": [
                    {**owner, "name": key if kind != "group" else meta["name"], "uid": meta.get("uid")}
                ],
            },
            "spec": {
                "queueName": workload.queue,
                "priority": workload.priority,
                **(
                    {
                        "priorityClassRef": {
                            "group": GROUP,
                            "kind": "WorkloadPriorityClass",
                            "name": priority_name,
                        }
                    }
                    if priority_name
                    else {}
                ),
            },
            "status": {},
        }
        existing = self.store.get("workloads", namespace, name)
        if existing is not None:
            self.store.remove("workloads", namespace, name)
        self.store.create("workloads", body, GROUP)
        return workload

    def members(self, w: Workload) -> list[dict]:
        pods = self.store.list("pods", w.namespace)
        if w.kind == "pod":
            return [p for p in pods if p["metadata"].get("uid") == w.uid]
        if w.kind == "group":
            return [p for p in pods if (p["metadata"].get("labels") or {}).get(GROUP_LABEL) == w.key]
        return []

    def requests_of(self, w: Workload) -> tuple[dict[str, Decimal], str | None]:
        """What ``w`` asks for, and why it cannot be admitted yet (None when it is complete)."""
        if w.kind == "job":
            job = self.store.get("jobs", w.namespace, w.key)
            if job is None:
                return {}, "the Job is gone"
            spec = job["spec"]
            per_pod = container_requests(spec["template"].get("spec") or {})
            count = int(spec.get("parallelism", 1))
            return {k: v * count for k, v in per_pod.items()}, None
        pods = [p for p in self.members(w) if not p["metadata"].get("deletionTimestamp")]
        if w.kind == "group":
            total = int((pods[0]["metadata"].get("annotations") or {}).get(GROUP_COUNT, "1")) if pods else 1
            if len(pods) < total:
                return {}, f"waiting for all pods of the group: {len(pods)} of {total} exist"
        summed: dict[str, Decimal] = {}
        for p in pods:
            for k, v in container_requests(p["spec"]).items():
                summed[k] = summed.get(k, Decimal(0)) + v
        return summed, None

    def finished(self, w: Workload) -> bool:
        if w.kind == "job":
            job = self.store.get("jobs", w.namespace, w.key)
            conds = {
                c["type"]: c["status"] for c in ((job or {}).get("status") or {}).get("conditions") or []
            }
            return job is None or conds.get("Complete") == "True" or conds.get("Failed") == "True"
        members = self.members(w)
        if not members:
            return True
        if w.kind == "group" and not w.admitted and not w.evicting:
            return False  # a group still forming is not finished by its first pods ending
        return all(self.ended(p) for p in members)

    def ended(self, pod: dict) -> bool:
        """Whether a pod's processes are gone (it can no longer use what its workload was given)."""
        worker = self.cluster.worker_for(pod)
        return worker is None or worker.finished.is_set()

    # -- admission ---------------------------------------------------------------------------

    def queues_changed(self) -> None:
        self._queues_changed = True
        self.soon()

    def retry_unqueued(self) -> None:
        """Kueue's job reconcilers retry an object they could not make a Workload for (its priority
        class did not exist): once the queue objects change, a gated pod or suspended Job of a queue
        that has no Workload is tried again."""
        for pod in self.store.list("pods", None):
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            if labels.get(MANAGED_LABEL) == "true" and not meta.get("deletionTimestamp"):
                group = labels.get(GROUP_LABEL)
                kind, key = ("group", group) if group else ("pod", meta["name"])
                if not any(
                    (w.namespace, w.kind, w.key) == (meta["namespace"], kind, key)
                    for w in self.workloads.values()
                ):
                    self.ensure(meta["namespace"], kind, key, labels, meta, pod)
        if "batch/job" not in self.frameworks:
            return
        for job in self.store.list("jobs", None):
            meta = job["metadata"]
            labels = meta.get("labels") or {}
            if QUEUE_LABEL in labels and self.managed_namespace(meta["namespace"]):
                if not any(
                    (w.namespace, w.kind, w.key) == (meta["namespace"], "job", meta["name"])
                    for w in self.workloads.values()
                ):
                    self.ensure(meta["namespace"], "job", meta["name"], labels, meta, job)

    def soon(self) -> None:
        """Schedule once the current request and the other controllers have run."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_event_loop().call_soon(self.schedule)

    def counted(self, requests: dict[str, Decimal]) -> dict[str, Decimal]:
        return {k: v for k, v in requests.items() if v and not k.startswith(self.excluded)}

    def release_finalizers(self) -> None:
        """Kueue's pod reconciler takes its finalizer off a managed pod whose processes are gone once the
        pod is being deleted or has ended (its workload has then finished)."""
        for pod in self.store.list("pods", None):
            meta = pod["metadata"]
            if FINALIZER not in (meta.get("finalizers") or []) or not self.ended(pod):
                continue
            if not meta.get("deletionTimestamp") and (pod.get("status") or {}).get("phase") not in (
                "Succeeded",
                "Failed",
            ):
                continue

            def drop(p: dict) -> None:
                p["metadata"]["finalizers"] = [
                    f for f in p["metadata"].get("finalizers") or [] if f != FINALIZER
                ]
                if not p["metadata"]["finalizers"]:
                    del p["metadata"]["finalizers"]

            stored = self.store.mutate("pods", meta["namespace"], meta["name"], drop)
            if stored is not None:
                self.cluster.release_if_finalized(meta["namespace"], meta["name"])

    def schedule(self) -> None:
        self._scheduled = False
        if self._queues_changed:
            self._queues_changed = False
            self.retry_unqueued()
        self.queues = self.read_queues()
        self.release_finalizers()
        for w in list(self.workloads.values()):
            if not w.finished and self.finished(w):
                w.finished, w.admitted = True, False
                if not w.evicting:
                    self.condition(w, "Finished", "True", "Succeeded", "the workload finished")
        for w in self.workloads.values():
            if not w.admitted and not w.finished and self.queue_of(w) is None:
                # Kueue's workload reconciler (getQueueBlocker; its legacy reason, the default in v0.19)
                cq_name = self.local_queue(w.namespace, w.queue)
                missing = f"LocalQueue {w.queue}" if cq_name is None else f"ClusterQueue {cq_name}"
                self.condition(w, "QuotaReserved", "False", "Inadmissible", f"{missing} doesn't exist")
        for cq in self.queues.values():
            self.schedule_queue(cq)
        self.publish_queues()

    def queue_of(self, w: Workload) -> ClusterQueue | None:
        name = self.local_queue(w.namespace, w.queue)
        return self.queues.get(name) if name else None

    def selects(self, cq: ClusterQueue, namespace: str) -> bool:
        """Whether the ClusterQueue's ``namespaceSelector`` lets the namespace's workloads in."""
        if cq.namespace_selector is None:
            return False
        if not cq.namespace_selector:
            return True  # {} selects every namespace
        ns = self.store.get("namespaces", "", namespace) or {}
        labels = (ns.get("metadata") or {}).get("labels") or {"kubernetes.io/metadata.name": namespace}
        return match_label_selector_object(cq.namespace_selector, labels)

    def used(self, cq: ClusterQueue, without: tuple[Workload, ...] = ()) -> dict[str, Decimal]:
        used: dict[str, Decimal] = {}
        for w in self.workloads.values():
            if w.admitted and w not in without and self.queue_of(w) is cq:
                for k, v in self.counted(w.requests).items():
                    used[k] = used.get(k, Decimal(0)) + v
        return used

    def fits(self, cq: ClusterQueue, requests: dict[str, Decimal], used: dict[str, Decimal]) -> str | None:
        for k, v in self.counted(requests).items():
            if k not in cq.quota:
                return f"resource {k} unavailable in ClusterQueue"
            flavor = cq.flavors.get(k, "default-flavor")
            if v > cq.quota[k]:  # no cohort here: the maximum capacity is the nominal quota
                return (
                    f"couldn't assign flavors to pod set main: insufficient quota for {k} in flavor "
                    f"{flavor}, request > maximum capacity ({quantity(k, v)} > {quantity(k, cq.quota[k])})"
                )
            if used.get(k, Decimal(0)) + v > cq.quota[k]:
                more = used.get(k, Decimal(0)) + v - cq.quota[k]
                return (
                    f"couldn't assign flavors to pod set main: insufficient unused quota for {k} in flavor "
                    f"{flavor}, {quantity(k, more)} more needed"
                )
        return None

    def schedule_queue(self, cq: ClusterQueue) -> None:
        pending = sorted(
            (
                w
                for w in self.workloads.values()
                if not w.admitted and not w.finished and self.queue_of(w) is cq
            ),
            key=lambda w: (-w.priority, w.seq),
        )
        for w in pending:
            requests, waiting = self.requests_of(w)
            if waiting:
                self.condition(w, "QuotaReserved", "False", "Pending", waiting)
                continue
            w.requests = requests
            if not self.selects(cq, w.namespace):
                # pkg/workload/resources.go (ErrNamespaceMismatch): inadmissible, it blocks nothing
                self.condition(
                    w,
                    "QuotaReserved",
                    "False",
                    "Pending",
                    "workload namespace doesn't match ClusterQueue selector",
                )
                continue
            why = self.fits(cq, requests, self.used(cq))
            if why is None:
                self.admit(w, cq)
                continue
            never = why.startswith("resource ") or "maximum capacity" in why
            if cq.preempt_lower and not never:
                evicting = tuple(v for v in self.workloads.values() if v.evicting and self.queue_of(v) is cq)
                if evicting and self.fits(cq, requests, self.used(cq, evicting)) is None:
                    why = "waiting for the preempted workloads to end"
                else:
                    victims = self.victims(cq, w, evicting)
                    for victim in victims or ():
                        self.evict(victim, w)
                    if victims:
                        why = "waiting for the preempted workloads to end"
            self.condition(w, "QuotaReserved", "False", "Pending", why)
            if cq.strict_fifo or why == "waiting for the preempted workloads to end":
                return  # nothing behind the head is admitted (StrictFIFO), nor into the room it is making
            # BestEffortFIFO: a workload that cannot be admitted now does not block those behind it

    def victims(self, cq: ClusterQueue, w: Workload, evicting: tuple[Workload, ...]) -> list[Workload] | None:
        """The fewest lower-priority admitted workloads whose eviction makes room for ``w``: the lowest
        priority first, the most recently admitted first among equals."""
        candidates = sorted(
            (
                v
                for v in self.workloads.values()
                if v.admitted and not v.evicting and self.queue_of(v) is cq and v.priority < w.priority
            ),
            key=lambda v: (v.priority, -v.admitted_seq),
        )
        chosen: list[Workload] = []
        for victim in candidates:
            chosen.append(victim)
            if self.fits(cq, w.requests, self.used(cq, (*evicting, *chosen))) is None:
                return chosen
        return None

    def admit(self, w: Workload, cq: ClusterQueue) -> None:
        w.admitted, w.admitted_seq = True, next(self.seq)
        message = f"Quota reserved in ClusterQueue {cq.name}"
        self.condition(w, "QuotaReserved", "True", "QuotaReserved", message)
        self.condition(w, "Admitted", "True", "Admitted", "The workload is admitted")
        self.condition(w, "Evicted", "False", "Admitted", "The workload is admitted", only_if_present=True)
        if w.kind == "job":

            def resume(job: dict) -> None:
                job["spec"]["suspend"] = False

            self.store.mutate("jobs", w.namespace, w.key, resume)
            self.jobs.reconcile(w.namespace, w.key)
            return
        for pod in self.members(w):

            def ungate(p: dict) -> None:
                p["spec"]["schedulingGates"] = [
                    g for g in p["spec"].get("schedulingGates") or [] if g.get("name") != GATE
                ]

            stored = self.store.mutate("pods", w.namespace, pod["metadata"]["name"], ungate)
            if stored is not None:
                self.cluster.pod_updated(stored)
        log.info("kueue: admitted %s/%s in %s", w.namespace, w.name, cq.name)

    def evict(self, w: Workload, by: Workload) -> None:
        message = f"Preempted to accommodate a higher priority Workload ({by.namespace}/{by.name})"
        self.condition(w, "Evicted", "True", "Preempted", message)
        self.condition(w, "QuotaReserved", "False", "Preempted", message)
        self.condition(w, "Admitted", "False", "Preempted", message)
        log.info("kueue: preempting %s/%s for %s/%s", w.namespace, w.name, by.namespace, by.name)
        if w.kind == "job":
            w.admitted = False

            def suspend(job: dict) -> None:
                job["spec"]["suspend"] = True

            self.store.mutate("jobs", w.namespace, w.key, suspend)
            self.jobs.reconcile(w.namespace, w.key)
            return
        # plain pods: marked, then deleted; their quota stays reserved until their processes are gone
        w.evicting = True
        for pod in self.members(w):
            worker = self.cluster.worker_for(pod)
            if worker is not None:
                worker.mark("TerminationTarget", "WorkloadEvictedDueToPreempted", message)
            self.cluster.delete_pod(w.namespace, pod["metadata"]["name"], None)

    def condition(
        self, w: Workload, kind: str, status: str, reason: str, message: str, only_if_present: bool = False
    ) -> None:
        def apply(obj: dict) -> None:
            conds = obj.setdefault("status", {}).setdefault("conditions", [])
            old = next((c for c in conds if c["type"] == kind), None)
            if old is None and only_if_present:
                return
            new = {"type": kind, "status": status, "reason": reason, "message": message}
            if old is not None and all(old.get(k) == v for k, v in new.items()):
                return
            new["lastTransitionTime"] = rfc3339()
            if old is not None:
                conds[conds.index(old)] = new
            else:
                conds.append(new)

        self.store.mutate("workloads", w.namespace, w.name, apply)

    def publish_queues(self) -> None:
        for lq in self.store.list("localqueues", None):
            ns, name = lq["metadata"]["namespace"], lq["metadata"]["name"]
            mine = [
                w for w in self.workloads.values() if (w.namespace, w.queue) == (ns, name) and not w.finished
            ]
            status = {
                "pendingWorkloads": sum(1 for w in mine if not w.admitted),
                "admittedWorkloads": sum(1 for w in mine if w.admitted),
            }

            def apply(obj: dict, status: dict = status) -> None:
                obj["status"] = copy.deepcopy(status)

            self.store.mutate("localqueues", ns, name, apply)
