"""The trigger that follows a deferred training pod: kubetrain's start-up phases, then the provider's wait.

While the task is deferred, the pod's log lines reach the task log through the triggerer, as
the provider's ``logging_interval`` does it for the base container: every ``logging_interval``
seconds the trigger reads what each container wrote since its last read and logs it, each
line marked by its container (``[stage-in] ...``, ``[checkpoint-sync] ...``, ``[base] ...``).
When the pod ends, the trigger reads the rest of every container's log before it hands the
task back, so a failed pod's last lines are in the log however it failed.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.pod_manager import AsyncPodManager, parse_log_line
from airflow.triggers.base import TriggerEvent

from kubetrain.operators.interruption import exit_code, interruption
from kubetrain.pod_startup import (
    EVENT_KEY,
    INTERRUPTED_EXIT_KEY,
    INTERRUPTED_KEY,
    KUEUE_GROUP,
    NOTES_KEY,
    QUEUE_CHECK_S,
    QUEUED_KEY,
    STARTUP_FAILURES,
    PodStartup,
    failure_kind,
    gpu_served_on_cpu,
    kueue_version_async,
    queue_message,
    queue_name,
    queue_refusal,
    queued,
    requested_gpus,
    started_containers,
)

# The trigger read every container's log to its end before it handed the task back: the task
# need not read the base container's log again.
LOGS_FLUSHED_KEY = "kubetrain_logs_flushed"
# Each read asks for a little more than the time since the last line it logged (clock skew
# between Airflow and the cluster); lines already logged are recognised by their timestamps.
READ_OVERLAP = timedelta(seconds=10)


class PodLogFollower(AsyncPodManager):
    """The provider's :class:`AsyncPodManager`, whose periodic log read covers every container of the pod.

    :meth:`fetch_container_logs_before_current_sec` is what the provider's trigger calls every
    ``logging_interval`` seconds for the base container; here it reads the ``containers``
    first (those that have started), then the base container. Each line is logged once: the
    follower keeps, per container, the timestamp of the last line it logged and how many
    lines carried that timestamp.

    :param async_hook: the trigger's hook.
    :param containers: containers whose lines go to the task log besides the base container.
    """

    def __init__(self, async_hook: Any, *, containers: Sequence[str] = ()) -> None:
        super().__init__(async_hook=async_hook)
        self.kube = async_hook
        self.containers = tuple(containers)
        self.last_line: dict[str, tuple[datetime, int]] = {}

    # the provider annotates pendulum's DateTime, but its trigger only hands the value back to this method and
    # serializes it: any aware datetime serves
    async def fetch_container_logs_before_current_sec(  # type: ignore[override]
        self, pod: Any, container_name: str, since_time: datetime | None = None
    ) -> datetime:
        now = datetime.now(UTC)
        await self.follow(pod, [*self.containers, container_name], since_time=since_time)
        return now

    async def follow(self, pod: Any, containers: Sequence[str], since_time: datetime | None = None) -> int:
        """Log the lines ``containers`` wrote since their last read; return how many were logged.

        The containers are read at once (one request each, side by side) and their new lines
        logged in the order the kubelet stamped them: each container's in the order it wrote them,
        and across containers by time, so that a sidecar's last lines come after the trainer's
        that preceded them. Containers that have not started are skipped (their log cannot be
        read yet).

        :param pod: the pod as last read.
        :param containers: container names; lines stamped at the same instant come in this order.
        :param since_time: where to start for a container read for the first time (``None``: its whole log).
        """
        started = started_containers(pod)
        names = [name for name in dict.fromkeys(containers) if name in started]
        reads = await asyncio.gather(*(self._read(pod, name, since_time) for name in names))
        return await asyncio.to_thread(
            self._log_merged,
            {name: lines for name, lines in zip(names, reads, strict=True) if lines is not None},
        )

    async def _read(self, pod: Any, name: str, since_time: datetime | None) -> Sequence[str] | None:
        last = self.last_line.get(name)
        start = last[0] if last else since_time
        since_seconds = None
        if start is not None:
            since_seconds = max(1, math.ceil((datetime.now(UTC) - start + READ_OVERLAP).total_seconds()))
        try:
            return await self.kube.read_logs(
                name=pod.metadata.name,
                namespace=pod.metadata.namespace,
                container_name=name,
                since_seconds=since_seconds,
            )
        except Exception as exc:  # a log read must never fail the wait for the pod
            self.log.warning(
                "Could not read the log of container %s of pod %s: %s", name, pod.metadata.name, exc
            )
            return None

    def _log_lines(self, container: str, lines: Sequence[str]) -> int:
        """Log the lines of one container's read that were not logged before; return how many."""
        return self._log_merged({container: lines})

    def _log_merged(self, reads: Mapping[str, Sequence[str]]) -> int:
        """Log the new lines of each container's read, merged in timestamp order; return how many."""
        fresh = [self._new_lines(container, lines) for container, lines in reads.items()]
        logged = 0
        for _stamp, container, message, continued in heapq.merge(*fresh, key=lambda line: line[0]):
            self.log.info("[%s] %s", container, message)
            logged += 0 if continued else 1
        return logged

    def _new_lines(self, container: str, lines: Sequence[str]) -> list[tuple[datetime, str, str, bool]]:
        """The lines of a read that were not logged before, as ``(stamp, container, message,
        continued)`` in the read's order; a continuation line (no timestamp) carries the stamp of
        the line it belongs to. Moves the container's place past them."""
        last_time, seen_at_last = self.last_line.get(container, (None, 0))
        skip_at_last = seen_at_last
        out: list[tuple[datetime, str, str, bool]] = []
        emitting = False
        for line in lines:
            stamp, message = parse_log_line(line)
            if stamp is None:  # not a timestamped line: the continuation of the one before
                if emitting and out:
                    out.append((out[-1][0], container, line.rstrip("\n"), True))
                continue
            stamp = stamp.astimezone(UTC)
            emitting = False
            if last_time is not None and stamp < last_time:
                continue
            if last_time is not None and stamp == last_time:
                if skip_at_last:
                    skip_at_last -= 1
                    continue
                seen_at_last += 1
            else:
                last_time, seen_at_last, skip_at_last = stamp, 1, 0
            out.append((stamp, container, message, False))
            emitting = True
        if last_time is not None:
            self.last_line[container] = (last_time, seen_at_last)
        return out


class PodTriggerByReference(KubernetesPodTrigger):
    """The provider's pod trigger, whose arguments name the cluster's credentials instead of holding them.

    A trigger's arguments are stored in the metadata database's trigger table, and Airflow 3 stores
    them as the worker's Task SDK sends them: a dict, which the API server writes as JSON without
    encrypting it (it encrypts only a string), whatever the Fernet key. The provider's operator hands
    its trigger the kubeconfig it read (``config_dict``, with the worker's token) and the
    connection's extras; this trigger carries the kubeconfig's path and the connection's id, and the
    triggerer reads both itself.

    :param config_file: the kubeconfig the task used (its ``config_file``, else ``KUBECONFIG``);
        the triggerer reads the same path.
    :param kwargs: KubernetesPodTrigger arguments, without ``config_dict`` and ``connection_extras``.
    """

    def __init__(self, *, config_file: str | None = None, **kwargs: Any) -> None:
        for name in ("config_dict", "connection_extras"):
            if kwargs.get(name):
                raise ValueError(
                    f"{type(self).__name__} takes no {name}: its arguments are stored in the metadata "
                    "database, which must hold no credential; give config_file (a kubeconfig's path) and "
                    "the connection's id"
                )
        super().__init__(**kwargs)
        self.config_file = config_file

    @classmethod
    def of(
        cls, trigger: KubernetesPodTrigger, config_file: str | None, **kwargs: Any
    ) -> PodTriggerByReference:
        """This class's trigger for the provider's ``trigger``, without what it carries of the credentials."""
        _, arguments = trigger.serialize()
        arguments.pop("config_dict", None)
        arguments.pop("connection_extras", None)
        return cls(**arguments, config_file=config_file or os.environ.get("KUBECONFIG") or None, **kwargs)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        for name in ("config_dict", "connection_extras"):
            kwargs.pop(name, None)
        kwargs["config_file"] = self.config_file
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    @cached_property
    def hook(self) -> AsyncKubernetesHook:
        """The provider's async hook, with the kubeconfig read here, in the triggerer, and the connection by id."""
        config_dict = None
        if self.config_file:
            import yaml

            try:
                with open(self.config_file) as f:
                    config_dict = yaml.safe_load(f)
            except OSError as exc:
                raise OSError(
                    f"the kubeconfig {self.config_file} that the task used cannot be read by the triggerer "
                    f"({exc.strerror}): give the triggerer the same file, or use a connection with in_cluster"
                ) from exc
        return AsyncKubernetesHook(
            conn_id=self.kubernetes_conn_id,
            in_cluster=self.in_cluster,
            config_dict=config_dict,
            cluster_context=self.cluster_context,
        )


# The start-up budgets TrainingPodTrigger adds to the provider's (schedule_timeout, startup_timeout)
STARTUP_BUDGETS = ("stage_in_timeout", "unschedulable_grace", "stage_in_container", "queue_timeout")


class TrainingPodTrigger(PodTriggerByReference):
    """A :class:`PodTriggerByReference` that judges the pod's start-up with :class:`~kubetrain.pod_startup.PodStartup`.

    Scheduling, image pulls and stage-in each get their own budget; a pod that cannot start
    yields one ``timeout`` event whose ``kubetrain_startup`` names the failure class. Once
    the pod runs, the provider's trigger waits for its base container as usual.

    With ``logging_interval`` (seconds), the lines of the base container and of ``log_containers``
    reach the task log while the task is deferred, from the stage-in on (:class:`PodLogFollower`);
    without it, they all arrive when the pod ends. The event the task resumes with says that
    the logs were read to their end (``kubetrain_logs_flushed``), and carries the lines the
    task should record (``kubetrain_notes``), such as a GPU request served on CPU.

    :param stage_in_timeout: seconds the stage-in container may run.
    :param unschedulable_grace: seconds an unschedulable pod waits for an autoscaler.
    :param stage_in_container: name of the stage-in init container.
    :param log_containers: containers whose log lines go to the task log besides the base container.
    :param gpu_resource: the extended resource the pod's GPUs are requested as.
    :param queue_timeout: seconds a pod that Kueue holds may wait for admission.
    :param queue_log_interval: seconds between the task log's lines about a queued pod.
    :param kwargs: :class:`PodTriggerByReference` arguments.
    """

    def __init__(
        self,
        *,
        stage_in_timeout: float,
        unschedulable_grace: float,
        stage_in_container: str = "stage-in",
        log_containers: Sequence[str] = (),
        gpu_resource: str | None = None,
        queue_timeout: float = 86400.0,
        queue_log_interval: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.stage_in_timeout = stage_in_timeout
        self.unschedulable_grace = unschedulable_grace
        self.stage_in_container = stage_in_container
        self.log_containers = list(log_containers)
        self.gpu_resource = gpu_resource
        self.queue_timeout = queue_timeout
        self.queue_log_interval = queue_log_interval
        self.notes: list[str] = []
        self.queued_s: float | None = None

    def _startup_budgets(self) -> dict[str, Any]:
        """What this trigger adds to the provider's start-up budgets, by name: its arguments, and
        :class:`PodStartup`'s."""
        return {name: getattr(self, name) for name in STARTUP_BUDGETS}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        kwargs.update(
            self._startup_budgets(),
            log_containers=list(self.log_containers),
            gpu_resource=self.gpu_resource,
            queue_log_interval=self.queue_log_interval,
        )
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    @cached_property
    def pod_manager(self) -> PodLogFollower:
        return PodLogFollower(self.hook, containers=self.log_containers)

    def startup(self) -> PodStartup:
        """A judge of this pod's start-up: the provider's budgets (scheduling, each image pull) and ours."""
        return PodStartup(
            schedule_timeout=self.schedule_timeout,
            startup_timeout=self.startup_timeout,
            **self._startup_budgets(),
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        startup = self.startup()
        pod = None
        logging_interval = self.logging_interval or 0
        logs_due = time.monotonic() + logging_interval if logging_interval else None
        queue_due = check_due = 0.0
        try:
            while True:
                pod = await self.hook.get_pod(name=self.pod_name, namespace=self.pod_namespace)
                events = []
                if startup.needs_events(pod):
                    listing = await self.hook.get_pod_events(name=self.pod_name, namespace=self.pod_namespace)
                    events = list(listing.items or [])
                started = startup.observe(pod, events, datetime.now(UTC))
                self.queued_s = startup.queued_s
                if queued(pod) and time.monotonic() >= check_due:
                    waited = startup.queued_s or 0.0
                    workloads, local_queue = await self._kueue_objects(pod)
                    if not events:
                        listing = await self.hook.get_pod_events(
                            name=self.pod_name, namespace=self.pod_namespace
                        )
                        events = list(listing.items or [])
                    refusal = queue_refusal(pod, waited, workloads, events)
                    if refusal is not None:
                        raise refusal
                    if time.monotonic() >= queue_due:
                        self.log.info("%s", queue_message(pod, waited, workloads or [], local_queue))
                        queue_due = time.monotonic() + self.queue_log_interval
                    check_due = time.monotonic() + min(QUEUE_CHECK_S, self.queue_log_interval)
                if self.get_logs and logs_due is not None and time.monotonic() >= logs_due:
                    await self.pod_manager.follow(pod, self.log_containers, since_time=self.last_log_time)
                    logs_due = time.monotonic() + logging_interval
                if started:
                    break
                await asyncio.sleep(self.startup_check_interval)
        except STARTUP_FAILURES as exc:
            self.log.warning("Pod %s/%s cannot start: %s", self.pod_namespace, self.pod_name, exc)
            payload = {
                "status": "timeout",
                "namespace": self.pod_namespace,
                "name": self.pod_name,
                "message": str(exc),
                EVENT_KEY: failure_kind(exc),
                **self.trigger_kwargs,
            }
            self._fired_event = True
            yield TriggerEvent(await self._finish(payload))
            return
        except Exception as exc:  # the provider's own wait below reads the pod again and reports errors
            self.log.warning(
                "Could not follow the start-up of pod %s/%s: %s", self.pod_namespace, self.pod_name, exc
            )
        else:
            await self._check_gpus(pod)
            if self.get_logs and self.logging_interval:
                self.log.info(
                    "Pod %s/%s is running: its containers' lines follow, each marked [container], within about "
                    "%.0f s of being written",
                    self.pod_namespace,
                    self.pod_name,
                    self.logging_interval + self.poll_interval,
                )
        async for event in super().run():
            yield TriggerEvent(await self._finish(dict(event.payload)))

    async def _kueue_objects(self, pod: Any) -> tuple[list[Any] | None, Any]:
        """The namespace's Kueue Workloads (None when they cannot be read) and the pod's LocalQueue."""
        from kubernetes_asyncio.client import CustomObjectsApi

        workloads: list[Any] | None = None
        local_queue = None
        try:
            async with self.hook.get_conn() as connection:
                api = CustomObjectsApi(connection)
                version = await kueue_version_async(connection, owner=self.hook)
                listing = await api.list_namespaced_custom_object(
                    KUEUE_GROUP, version, self.pod_namespace, "workloads"
                )
                workloads = list(listing.get("items") or [])
                name = queue_name(pod)
                if name:
                    local_queue = await api.get_namespaced_custom_object(
                        KUEUE_GROUP, version, self.pod_namespace, "localqueues", name
                    )
        except Exception as exc:  # Kueue's objects need a Role rule (deploy/rbac.yaml grants it)
            self.log.debug("Could not read the Kueue workload of pod %s: %s", self.pod_name, exc)
        return workloads, local_queue

    async def _check_gpus(self, pod: Any) -> None:
        """Log, once, that the pod's GPU request was served on CPU (only a development cluster does that)."""
        if not self.gpu_resource or pod is None or not requested_gpus(pod, self.gpu_resource):
            return
        try:
            listing = await self.hook.get_pod_events(name=self.pod_name, namespace=self.pod_namespace)
            events = list(listing.items or [])
        except Exception as exc:
            self.log.debug("Could not read the events of pod %s: %s", self.pod_name, exc)
            events = []
        node = await self._read_node(getattr(pod.spec, "node_name", None))
        note = gpu_served_on_cpu(pod, self.gpu_resource, events, node)
        if note:
            self.log.warning("%s", note)
            self.notes.append(note)

    async def _read_node(self, name: str | None) -> Any:
        if not name:
            return None
        from kubernetes_asyncio.client import CoreV1Api

        try:
            async with self.hook.get_conn() as connection:
                return await CoreV1Api(connection).read_node(name)
        except Exception as exc:  # reading nodes needs a cluster role that a namespace's Role does not give
            self.log.debug("Could not read node %s: %s", name, exc)
            return None

    async def _finish(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The event's payload, once every container's log has been read to its end, with why the pod
        was ended from outside if it was (it may be gone by the time the task resumes)."""
        if self.notes:
            # after the notes of the try's earlier pods, which travel in the trigger's kwargs
            payload[NOTES_KEY] = [*(payload.get(NOTES_KEY) or []), *self.notes]
        if self.queued_s is not None:
            payload[QUEUED_KEY] = round(self.queued_s, 3)
        try:
            pod = await self.hook.get_pod(name=self.pod_name, namespace=self.pod_namespace)
        except Exception as exc:
            self.log.warning(
                "Could not read pod %s/%s for its last log lines: %s", self.pod_namespace, self.pod_name, exc
            )
            return payload
        reason = interruption(pod, self.base_container_name)
        if reason is not None:
            payload[INTERRUPTED_KEY] = reason
            payload[INTERRUPTED_EXIT_KEY] = exit_code(pod, self.base_container_name)
        if not self.get_logs:
            return payload
        await self.pod_manager.follow(
            pod, [*self.log_containers, self.base_container_name], since_time=self.last_log_time
        )
        payload[LOGS_FLUSHED_KEY] = True
        return payload
