"""How a training pod gets from created to running, phase by phase, and when to give up.

A training pod starts in four phases, each with its own budget, so that a 10 GB dataset
being staged never looks like a hung image pull, and in a fifth before them on a cluster with
Kueue::

    queued       until Kueue admits it    queue_timeout: the pod is held by the scheduling gate
                                          kueue.x-k8s.io/admission (PodScheduled False, reason
                                          SchedulingGated) while its LocalQueue has no quota
    scheduling   until PodScheduled       schedule_timeout, from admission; an unschedulable pod
                                          fails fast
    start-up     until stage-in runs      startup_timeout: the sync image is pulled
    stage-in     until stage-in ends      stage_in_timeout: the dataset is downloaded
    start-up     until the pod runs       startup_timeout again: the sidecar starts and the
                                          training image is pulled

:class:`PodStartup` judges one observation of the pod (and, while it is unscheduled, its
events) at a time; the synchronous operator and the deferred trigger feed it the same way.
The clock of each phase starts at the pod's own timestamps (creation, PodScheduled, the
stage-in container's start and end), so a restarted triggerer does not reset it; admission has no
timestamp on the pod, so scheduling counts from when this watcher first saw the gate gone.

A failure is an exception class, never a message to parse: :class:`PodUnschedulableError`
and :class:`ImagePullError` fail the task without retries (a retry would wait for the same
missing node or image), :class:`PodStartupTimeout` and :class:`StageInError` may be retried.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from kubetrain.operators.interruption import exit_code, terminated_state

# Events of autoscalers that have asked for a node for the pod (cluster-autoscaler, Karpenter).
SCALE_UP_REASONS = ("TriggeredScaleUp", "Nominated")
# Waiting reasons that no amount of waiting fixes.
FATAL_WAITING_REASONS = ("InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError")
PULL_WAITING_REASONS = ("ErrImagePull", "ImagePullBackOff")
EVENT_KEY = "kubetrain_startup"


class PodStartupTimeout(AirflowException):
    """The pod did not reach the next start-up phase within its budget (retried like any failure)."""


class StageInError(PodStartupTimeout):
    """The stage-in container failed or ran past ``stage_in_timeout``."""


class PodUnschedulableError(AirflowFailException):
    """No node can take the pod (e.g. no free GPU); the scheduler's reason is in the message.

    Not retried: a retry would wait for the same node again.
    """


class ImagePullError(AirflowFailException):
    """An image of the pod cannot be pulled, or a container cannot be created from it; not retried."""


class QueueTimeout(AirflowFailException):
    """Kueue did not admit the pod within ``queue_timeout``; not retried (a retry queues again, last)."""


class QueueRefused(QueueTimeout):
    """Kueue will not admit the pod as it is (more than the queue's quota, a priority class that does not
    exist, no Workload at all): waiting would not help; not retried."""


FAILURES: dict[str, type[AirflowException]] = {
    "unschedulable": PodUnschedulableError,
    "image": ImagePullError,
    "stage_in": StageInError,
    "timeout": PodStartupTimeout,
    "queue": QueueTimeout,
    "queue_refused": QueueRefused,
}
# How long a queued pod may be without a Kueue Workload before the run fails: Kueue makes one within seconds of
# the pod's creation when it manages the pod (the pod integration, the namespace selector).
NO_WORKLOAD_AFTER_S = 60.0
# How often a queued pod's Workload is looked at for a reason that waiting cannot cure.
QUEUE_CHECK_S = 10.0
STARTUP_FAILURES = tuple(FAILURES.values())


def failure_kind(exc: BaseException) -> str:
    """The name under which a start-up failure travels in a trigger event."""
    for kind, cls in FAILURES.items():
        if type(exc) is cls:
            return kind
    raise TypeError(f"{type(exc).__name__} is not a pod start-up failure")


def failure_from_event(event: dict[str, Any]) -> AirflowException | None:
    """The start-up failure a :class:`~kubetrain.triggers.pod.TrainingPodTrigger` event reports, if any."""
    kind = event.get(EVENT_KEY)
    if kind is None:
        return None
    cls = FAILURES.get(kind)
    if cls is None:
        raise ValueError(
            f"unknown pod start-up failure {kind!r} in a trigger event: expected one of {', '.join(FAILURES)}"
        )
    return cls(str(event.get("message") or kind))


def _timestamp(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _condition(pod: Any, kind: str) -> Any:
    for condition in getattr(pod.status, "conditions", None) or []:
        if condition.type == kind:
            return condition
    return None


KUEUE_GROUP = "kueue.x-k8s.io"
# The versions of Kueue's API that kubetrain reads, the preferred first: Kueue v0.19 stores v1beta2 and
# still serves v1beta1; the fields read here (a Workload's owners and conditions, a LocalQueue's
# spec.clusterQueue and status.pendingWorkloads, a WorkloadPriorityClass's name) are the same in both.
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
# discovered versions, per API client (or per hook, for clients made per request)
_kueue_versions: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def choose_kueue_version(groups: Iterable[Any]) -> str:
    """The version of ``kueue.x-k8s.io`` to use, from the discovery API's groups (``GET /apis``): the
    first of :data:`KUEUE_VERSIONS` the cluster serves, else the group's preferred version.

    :raises LookupError: the cluster does not serve Kueue's API.
    """
    for group in groups:
        if _field(group, "name") != KUEUE_GROUP:
            continue
        served = [_field(v, "version") for v in _field(group, "versions") or []]
        for version in KUEUE_VERSIONS:
            if version in served:
                return version
        preferred = _field(_field(group, "preferredVersion") or _field(group, "preferred_version"), "version")
        if preferred:
            return preferred
        raise LookupError(
            f"the cluster serves {KUEUE_GROUP} in no version (expected one of {KUEUE_VERSIONS})"
        )
    raise LookupError(f"the cluster does not serve {KUEUE_GROUP}: Kueue is not installed")


def kueue_version(api_client: Any, owner: Any = None) -> str:
    """The Kueue API version to use through ``api_client`` (a ``kubernetes`` client), discovered once per
    ``owner`` (default: the client).

    :raises LookupError: the cluster does not serve Kueue's API.
    """
    key = api_client if owner is None else owner
    version = _kueue_versions.get(key)
    if version is None:
        from kubernetes.client import ApisApi

        version = choose_kueue_version(ApisApi(api_client).get_api_versions(_request_timeout=10).groups or [])
        _kueue_versions[key] = version
    return version


async def kueue_version_async(api_client: Any, owner: Any = None) -> str:
    """:func:`kueue_version` for a ``kubernetes_asyncio`` client; pass the hook as ``owner`` where a client
    is made per request."""
    key = api_client if owner is None else owner
    version = _kueue_versions.get(key)
    if version is None:
        from kubernetes_asyncio.client import ApisApi

        listing = await ApisApi(api_client).get_api_versions(_request_timeout=10)
        version = choose_kueue_version(listing.groups or [])
        _kueue_versions[key] = version
    return version


KUEUE_GATE = "kueue.x-k8s.io/admission"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Kueue's webhook labels each pod it manages (and gates it at creation)
KUEUE_MANAGED_LABEL = "kueue.x-k8s.io/managed"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def _kueue_managed(pod: Any) -> bool:
    return (getattr(pod.metadata, "labels", None) or {}).get(KUEUE_MANAGED_LABEL) == "true"


def queue_name(pod: Any) -> str | None:
    """The Kueue LocalQueue the pod is labelled for."""
    return (getattr(pod.metadata, "labels", None) or {}).get(QUEUE_LABEL)


def queued(pod: Any) -> bool:
    """Whether Kueue still holds the pod: its admission gate is on (the scheduler has not seen it)."""
    gates = getattr(pod.spec, "scheduling_gates", None) or []
    return any(getattr(g, "name", None) == KUEUE_GATE for g in gates)


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def queue_message(pod: Any, waited_s: float, workloads: Iterable[Any] = (), local_queue: Any = None) -> str:
    """A line for the task log about a pod Kueue holds: how long, and why, where Kueue says.

    :param pod: the pod.
    :param waited_s: seconds it has waited.
    :param workloads: the namespace's ``Workload`` objects (``kueue.x-k8s.io``), as read from the API.
    :param local_queue: its ``LocalQueue`` object, if it could be read.
    """
    text = f"pod {pod.metadata.name} is queued in Kueue LocalQueue {queue_name(pod)!r} for {waited_s:.0f} s"
    uid = pod.metadata.uid
    for workload in workloads:
        meta = _field(workload, "metadata") or {}
        owners = _field(meta, "ownerReferences") or _field(meta, "owner_references") or []
        if any(_field(owner, "uid") == uid for owner in owners):
            status = _field(workload, "status") or {}
            for condition in _field(status, "conditions") or []:
                if _field(condition, "type") == "QuotaReserved" and _field(condition, "status") == "False":
                    text += f": {_field(condition, 'reason')}: {_field(condition, 'message')}"
            text += f" (Workload {_field(meta, 'name')})"
            break
    pending = _field(_field(local_queue, "status") or {}, "pendingWorkloads") if local_queue else None
    if pending:
        text += f"; {pending} workload(s) pending in the queue"
    return text


def pod_workload(pod: Any, workloads: Iterable[Any]) -> Any:
    """The ``Workload`` that Kueue made for ``pod`` (its owner is the pod), else None."""
    uid = pod.metadata.uid
    for workload in workloads:
        meta = _field(workload, "metadata") or {}
        owners = _field(meta, "ownerReferences") or _field(meta, "owner_references") or []
        if any(_field(owner, "uid") == uid for owner in owners):
            return workload
    return None


def queue_refusal(
    pod: Any, waited_s: float, workloads: Iterable[Any] | None, events: Iterable[Any] = ()
) -> QueueRefused | None:
    """Why Kueue will never admit ``pod`` as it is, as the failure to raise; None while waiting can help.

    :param pod: the queued pod.
    :param waited_s: seconds it has been queued.
    :param workloads: the namespace's ``Workload`` objects, or None when they could not be read.
    :param events: the pod's events (Kueue reports a missing priority class there, and makes no Workload).
    """
    name, queue = pod.metadata.name, queue_name(pod)
    for event in events:
        if _field(event, "reason") == "WorkloadPriorityClassNotFound":
            return QueueRefused(
                f"Kueue will not queue pod {name}: {_field(event, 'message')}. Create the WorkloadPriorityClass "
                "(kubectl get workloadpriorityclasses lists those that exist) or fix the run's priority_class"
            )
    if workloads is None:
        return None  # not readable (the Role's Kueue rule): the queue_timeout still bounds the wait
    workload = pod_workload(pod, workloads)
    if workload is None:
        if waited_s < NO_WORKLOAD_AFTER_S:
            return None
        return QueueRefused(
            f"Kueue made no Workload for pod {name} (LocalQueue {queue!r}) in {waited_s:.0f} s, so nothing will "
            "admit it: check that Kueue runs with its pod integration enabled (integrations.frameworks lists "
            '"pod") and that its managedJobsNamespaceSelector selects namespace '
            f"{pod.metadata.namespace!r}"
        )
    for condition in _field(_field(workload, "status") or {}, "conditions") or []:
        if _field(condition, "type") != "QuotaReserved" or _field(condition, "status") != "False":
            continue
        message = str(_field(condition, "message") or "")
        if "maximum capacity" in message or "unavailable in ClusterQueue" in message:
            return QueueRefused(
                f"Kueue cannot admit pod {name} in LocalQueue {queue!r}, however long it waits: {message}. Ask "
                "for less (gpus, cpu, memory, data_size) or give the ClusterQueue more nominalQuota"
            )
    return None


def _container_status(pod: Any, name: str) -> Any:
    for status in getattr(pod.status, "init_container_statuses", None) or []:
        if status.name == name:
            return status
    return None


def _waiting(pod: Any) -> list[tuple[str, str, str]]:
    """``(container, reason, message)`` of every container that waits, init containers first."""
    found = []
    for status in [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]:
        waiting = getattr(status.state, "waiting", None) if status.state else None
        if waiting is not None and waiting.reason:
            found.append((status.name, waiting.reason, waiting.message or ""))
    return found


@dataclass
class PodStartup:
    """Judge a starting pod: :meth:`observe` returns True once it runs, else raises when it never will.

    :param schedule_timeout: seconds from creation until a node is found while an autoscaler
        adds one (a ``TriggeredScaleUp`` event), or while no verdict is given yet.
    :param unschedulable_grace: seconds a pod may stay unschedulable with no autoscaler
        coming to help before it fails.
    :param startup_timeout: seconds for each start-up phase: pulling the sync image (until
        the stage-in container runs), then starting the sidecar and pulling the training image.
    :param stage_in_timeout: seconds the stage-in container may run.
    :param stage_in_container: name of the stage-in init container.
    :param queue_timeout: seconds a pod that Kueue holds may wait to be admitted; the scheduling
        budget counts from its admission.
    """

    schedule_timeout: float
    unschedulable_grace: float
    startup_timeout: float
    stage_in_timeout: float
    stage_in_container: str = "stage-in"
    queue_timeout: float = 86400.0
    first_seen: dict[str, datetime] = field(default_factory=dict)
    #: seconds the pod waited for admission, once it was seen queued (None: never seen queued)
    queued_s: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "schedule_timeout",
            "unschedulable_grace",
            "startup_timeout",
            "stage_in_timeout",
            "queue_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} is not valid: expected a number of seconds > 0")

    def _since(self, key: str, stated: Any, now: datetime) -> float:
        """Seconds since the pod's own timestamp, else since this watcher first saw the phase."""
        start = _timestamp(stated) or self.first_seen.setdefault(key, now)
        return (now - start).total_seconds()

    def needs_events(self, pod: Any) -> bool:
        """Whether :meth:`observe` wants the pod's events with this observation (only while unscheduled)."""
        scheduled = _condition(pod, "PodScheduled")
        return pod.status.phase in (None, "Pending") and not (scheduled and scheduled.status == "True")

    def observe(self, pod: Any, events: Iterable[Any] = (), now: datetime | None = None) -> bool:
        """Return True when the pod has left ``Pending``, False to keep waiting; raise when it cannot start.

        :param pod: the pod as just read from the API (``kubernetes`` or ``kubernetes_asyncio`` model).
        :param events: its events, oldest first (only looked at while it is unscheduled).
        :param now: the current time (UTC).
        """
        now = now or datetime.now(UTC)
        name = pod.metadata.name
        phase = pod.status.phase
        stage_in = _container_status(pod, self.stage_in_container)
        terminated = terminated_state(stage_in)
        code = exit_code(pod, self.stage_in_container)
        if code not in (0, None):
            detail = (terminated.message or terminated.reason or "").strip()
            raise StageInError(
                f"the {self.stage_in_container} container of pod {name} exited with {code}"
                + (f": {detail}" if detail else "")
            )
        if (
            not queued(pod)
            and "admitted" not in self.first_seen
            and (self.queued_s is not None or _kueue_managed(pod))
        ):
            # Admitted. The watcher may have missed the gated pod altogether (Kueue admitted it between two
            # looks), so the time queued is the pod's own: from its creation until the scheduler bound it
            # (PodScheduled's transition; an upper bound by the bind's latency), or until now. Both
            # timestamps have whole seconds: a wait under a second can read 0 from them, so a wait this
            # watcher saw gated keeps what it saw as its least.
            self.first_seen["admitted"] = now
            scheduled = _condition(pod, "PodScheduled")
            bound = (
                _timestamp(scheduled.last_transition_time)
                if scheduled and scheduled.status == "True"
                else None
            )
            created = _timestamp(pod.metadata.creation_timestamp)
            if created is not None:
                stamped = max((min(bound or now, now) - created).total_seconds(), 0.0)
                self.queued_s = max(stamped, self.queued_s or 0.0)
        if phase not in (None, "Pending", "Unknown"):
            return True
        waiting = _waiting(pod)
        for container, reason, message in waiting:
            if reason in FATAL_WAITING_REASONS:
                raise ImagePullError(
                    f"container {container} of pod {name} cannot start: {reason}: {message}".rstrip(": ")
                )

        if queued(pod):
            self.queued_s = self._since("queued", pod.metadata.creation_timestamp, now)
            if self.queued_s > self.queue_timeout:
                raise QueueTimeout(
                    f"pod {name} was not admitted by Kueue within queue_timeout={self.queue_timeout:g} s "
                    f"(LocalQueue {queue_name(pod)!r}); its quota stayed in use"
                )
            return False
        scheduled = _condition(pod, "PodScheduled")
        if not (scheduled and scheduled.status == "True"):
            self._check_scheduling(pod, scheduled, list(events), now)
            return False

        if stage_in is not None and terminated is None:
            running = getattr(stage_in.state, "running", None) if stage_in.state else None
            if running is None:
                waited = self._since("pull", scheduled.last_transition_time, now)
                self._check_pull(name, waited, "the stage-in container to start (sync image pull)", waiting)
                return False
            if self._since("stage-in", running.started_at, now) > self.stage_in_timeout:
                raise StageInError(
                    f"the {self.stage_in_container} container of pod {name} ran longer than "
                    f"stage_in_timeout={self.stage_in_timeout:g} s: the dataset did not finish downloading"
                )
            return False
        since = terminated.finished_at if terminated is not None else scheduled.last_transition_time
        waited = self._since("start", since, now)
        self._check_pull(name, waited, "the training container to start (training image pull)", waiting)
        return False

    def _check_scheduling(self, pod: Any, scheduled: Any, events: list[Any], now: datetime) -> None:
        name = pod.metadata.name
        reason = None
        if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
            reason = scheduled.message or "Unschedulable"
        for event in reversed(events):
            if event.reason == "FailedScheduling" and event.message:
                reason = event.message
                break
        scaling_up = any(event.reason in SCALE_UP_REASONS for event in events)
        admitted = self.first_seen.get("admitted")
        waited = (
            (now - admitted).total_seconds()
            if admitted
            else self._since("created", pod.metadata.creation_timestamp, now)
        )
        if reason is not None and not scaling_up:
            stuck = self._since("unschedulable", scheduled.last_transition_time if scheduled else None, now)
            if stuck >= self.unschedulable_grace:
                raise PodUnschedulableError(
                    f"pod {name} cannot be scheduled: FailedScheduling: {reason} (no autoscaler added a node "
                    f"within {self.unschedulable_grace:g} s)"
                )
        if waited >= self.schedule_timeout:
            if reason is not None:
                raise PodUnschedulableError(
                    f"pod {name} was not scheduled within {self.schedule_timeout:g} s: FailedScheduling: {reason}"
                )
            raise PodStartupTimeout(f"pod {name} was not scheduled within {self.schedule_timeout:g} s")

    def _check_pull(self, name: str, waited: float, what: str, waiting: list[tuple[str, str, str]]) -> None:
        if waited < self.startup_timeout:
            return
        # ErrImagePull and ImagePullBackOff that outlast the budget mean the image is not
        # coming: the kubelet has retried the pull all along.
        failure: type[AirflowException] = PodStartupTimeout
        detail = ""
        for container, reason, message in waiting:
            detail = f": container {container} is {reason}: {message}".rstrip(": ")
            if reason in PULL_WAITING_REASONS:
                failure = ImagePullError
        raise failure(
            f"pod {name} waited longer than startup_timeout={self.startup_timeout:g} s for {what}{detail}"
        )


# -- after start-up --------------------------------------------------------------------------

# Why the trigger saw the pod end from outside, when it did (the pod may be gone when the task resumes);
# kubetrain.operators.interruption says what an ended pod means.
INTERRUPTED_KEY = "kubetrain_interrupted"
# An interrupted pod's training container exit code, as the trigger last saw it.
INTERRUPTED_EXIT_KEY = "kubetrain_interrupted_exit"
# Seconds the pod waited for Kueue's admission (the trigger's start-up watch), in the event.
QUEUED_KEY = "kubetrain_queued_s"
GPU_NOT_AVAILABLE = "GPUNotAvailable"
NOTES_KEY = "kubetrain_notes"


def started_containers(pod: Any) -> list[str]:
    """Names of the containers (init containers first) that have started, so their log can be read."""
    names = []
    status = pod.status
    for item in [
        *(getattr(status, "init_container_statuses", None) or []),
        *(getattr(status, "container_statuses", None) or []),
    ]:
        state = item.state
        if state is not None and (state.running is not None or state.terminated is not None):
            names.append(item.name)
    return names


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def requested_gpus(pod: Any, gpu_resource: str) -> int:
    """The number of ``gpu_resource`` that the pod's containers ask for (limits; requests where no limit)."""
    total = 0
    for container in getattr(pod.spec, "containers", None) or []:
        resources = container.resources
        if resources is None:
            continue
        limits = resources.limits or {}
        requests = resources.requests or {}
        total += _quantity(limits.get(gpu_resource, requests.get(gpu_resource, 0)))
    return total


def gpu_served_on_cpu(
    pod: Any, gpu_resource: str, events: Iterable[Any] = (), node: Any = None
) -> str | None:
    """One line saying that the pod's GPU request was served on CPU, or None when it was not.

    A real cluster never starts a GPU pod on a node without GPUs; a development cluster such
    as kubetrain's dev stack does, and says so: its node reports no ``gpu_resource`` in its
    capacity, and the pod gets a ``GPUNotAvailable`` event. Either is enough.

    :param pod: the scheduled pod.
    :param gpu_resource: the extended resource GPUs are requested as (``nvidia.com/gpu``, ...).
    :param events: the pod's events.
    :param node: the node the pod runs on, when it could be read (reading nodes needs a cluster role).
    """
    wanted = requested_gpus(pod, gpu_resource)
    if not wanted:
        return None
    node_name = getattr(pod.spec, "node_name", None) or "its node"
    if node is not None:
        status = node.status
        capacity = (
            (getattr(status, "allocatable", None) or getattr(status, "capacity", None) or {})
            if status
            else {}
        )
        if _quantity(capacity.get(gpu_resource, 0)) == 0:
            return (
                f"GPU request served on CPU: pod {pod.metadata.name} asked for {wanted} {gpu_resource}, but node "
                f"{node_name} has none (its capacity lists no {gpu_resource}), so it trains on CPU"
            )
    for event in events:
        if event.reason == GPU_NOT_AVAILABLE:
            return (
                f"GPU request served on CPU: pod {pod.metadata.name} asked for {wanted} {gpu_resource}, but node "
                f"{node_name} gave it none (event {GPU_NOT_AVAILABLE}), so it trains on CPU"
            )
    return None
