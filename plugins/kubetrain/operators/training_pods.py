"""The training pod's manager: the provider's PodManager waiting on watches, and what it reads about a pod.

Besides the provider's waits, done on a watch of the pod (:class:`TrainingPodManager`), it waits for
the pod's start with kubetrain's start-up budgets (:class:`kubetrain.pod_startup.PodStartup`), says
why a queued pod waits (its Kueue Workload) and whether a GPU request was served on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from airflow.providers.cncf.kubernetes.utils.container import container_is_completed, container_is_running
from airflow.providers.cncf.kubernetes.utils.pod_manager import (
    PodManager,
    PodPhase,
    detect_pod_terminate_early_issues,
)
from kubernetes import watch
from kubernetes.client import models as k8s
from kubernetes.client.rest import ApiException

from kubetrain.pod_startup import (
    KUEUE_GROUP,
    QUEUE_CHECK_S,
    PodStartup,
    gpu_served_on_cpu,
    kueue_version,
    queue_message,
    queue_name,
    queue_refusal,
    queued,
    requested_gpus,
)

__all__ = ["TrainingPodManager"]


class TrainingPodManager(PodManager):
    """The provider's PodManager, waiting on a watch of the pod instead of reading it every few seconds.

    The provider's ``await_pod_completion`` reads the pod every 2 s, and a task that does not
    defer checks its start every ``startup_check_interval_seconds`` (5 s by default). A training
    pod ends some time after its training container, when the checkpoint-sync sidecar's final
    pass is done, and each sweep trial waits for that moment and for its start; a watch from the
    pod's resourceVersion returns as soon as the pod's status changes.
    """

    # Seconds one watch request lasts before the pod is read again and a new watch starts.
    watch_seconds = 60

    def await_pod_change(self, remote: k8s.V1Pod, timeout_seconds: int | None = None) -> k8s.V1Pod:
        """The pod's next version after ``remote``, or the pod read again when ``timeout_seconds`` pass without one.

        A deleted pod raises the API's 404, as reading it would; a 410 (``remote``'s
        resourceVersion is too old) reads the pod again.
        """
        stream = watch.Watch()
        try:
            for event in stream.stream(
                self._client.list_namespaced_pod,
                remote.metadata.namespace,
                field_selector=f"metadata.name={remote.metadata.name}",
                resource_version=remote.metadata.resource_version,
                timeout_seconds=timeout_seconds or self.watch_seconds,
            ):
                stream.stop()
                if event["type"] != "DELETED":
                    return event["object"]
                break  # the read below answers 404, as the provider's loop would
        except ApiException as exc:
            if exc.status != 410:  # 410: the resourceVersion is too old; read the pod again
                raise
        return self.read_pod(remote)

    # Seconds a log stream that ended waits for its container's status to say why.
    log_end_wait_seconds = 1.0

    def container_is_running(self, pod: k8s.V1Pod, container_name: str) -> bool:
        """Whether the container still runs, waiting briefly on a watch when the pod still says so.

        The provider asks this when a followed log stream ends. A container's log ends when its
        process exits, a moment before the kubelet reports it terminated; reading "running" then,
        the provider sleeps a second and reads the log again from a second before its last line,
        logging the container's last lines twice. A watch returns as soon as the status changes,
        within the second the provider would have slept anyway.
        """
        remote = self.read_pod(pod)
        deadline = time.monotonic() + self.log_end_wait_seconds
        while container_is_running(pod=remote, container_name=container_name):
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            remote = self.await_pod_change(remote, max(1, round(left)))
        return False

    def await_pod_completion(
        self,
        pod: k8s.V1Pod,
        istio_enabled: bool = False,
        container_name: str = "base",
        do_xcom_push: bool = False,
    ) -> k8s.V1Pod:
        def done(remote: k8s.V1Pod) -> bool:
            if remote.status is not None and remote.status.phase in PodPhase.terminal_states:
                return True
            if (istio_enabled or do_xcom_push) and container_is_completed(remote, container_name):
                return True  # the provider's rule: a sidecar keeps the pod running
            return bool(detect_pod_terminate_early_issues(remote))

        remote = self.read_pod(pod)
        phase = None
        while not done(remote):
            if remote.status is not None and remote.status.phase != phase:
                phase = remote.status.phase
                self.log.info("Pod %s has phase %s", pod.metadata.name, phase)
            remote = self.await_pod_change(remote)
        return remote

    # -- start-up and what the cluster says about the pod ------------------------------------

    def await_start(
        self, pod: k8s.V1Pod, startup: PodStartup, check_interval: int, queue_log_interval: float
    ) -> k8s.V1Pod:
        """Wait until the pod runs, each start-up phase within its budget; the pod as last read.

        Raises the start-up failure :meth:`PodStartup.observe` raises; ``startup.queued_s`` says how
        long the pod waited for Kueue's admission, whichever way this ends. A queued pod's wait is
        logged every ``queue_log_interval`` seconds, with its Workload's reason.
        """
        queue_due = check_due = 0.0
        remote = self.read_pod(pod)
        while True:
            events = self.read_pod_events(pod).items if startup.needs_events(remote) else []
            if startup.observe(remote, events or [], datetime.now(UTC)):
                return remote
            if queued(remote) and time.monotonic() >= check_due:
                waited = startup.queued_s or 0.0
                workloads, local_queue = self.kueue_objects(remote)
                refusal = queue_refusal(remote, waited, workloads, self.read_pod_events(remote).items or [])
                if refusal is not None:
                    raise refusal
                if time.monotonic() >= queue_due:
                    self.log.info("%s", queue_message(remote, waited, workloads or [], local_queue))
                    queue_due = time.monotonic() + queue_log_interval
                check_due = time.monotonic() + min(QUEUE_CHECK_S, queue_log_interval)
            # the next change of the pod, or the pod again after the interval (the budgets run on)
            remote = self.await_pod_change(remote, check_interval)

    def kueue_objects(self, remote: k8s.V1Pod) -> tuple[list[Any] | None, Any]:
        """The namespace's Kueue Workloads (None when they cannot be read) and the pod's LocalQueue."""
        from kubernetes.client import CustomObjectsApi

        workloads: list[Any] | None = None
        local_queue = None
        try:
            api = CustomObjectsApi(self._client.api_client)
            namespace = remote.metadata.namespace
            version = kueue_version(self._client.api_client)
            listing = api.list_namespaced_custom_object(KUEUE_GROUP, version, namespace, "workloads")
            workloads = list(listing.get("items") or [])
            name = queue_name(remote)
            if name:
                local_queue = api.get_namespaced_custom_object(
                    KUEUE_GROUP, version, namespace, "localqueues", name
                )
        except Exception as exc:  # Kueue's objects need a Role rule (deploy/rbac.yaml grants it)
            self.log.debug("Could not read the Kueue workload of pod %s: %s", remote.metadata.name, exc)
        return workloads, local_queue

    def gpu_note(self, remote: k8s.V1Pod, gpu_resource: str) -> str | None:
        """The line saying that the pod's GPU request was served on CPU, else None."""
        if not requested_gpus(remote, gpu_resource):
            return None
        try:
            events = self.read_pod_events(remote).items or []
        except Exception as exc:
            self.log.debug("Could not read the events of pod %s: %s", remote.metadata.name, exc)
            events = []
        node = None
        if remote.spec.node_name:
            try:
                node = self._client.read_node(remote.spec.node_name)
            except (
                Exception
            ) as exc:  # reading nodes needs a cluster role that a namespace's Role does not give
                self.log.debug("Could not read node %s: %s", remote.spec.node_name, exc)
        return gpu_served_on_cpu(remote, gpu_resource, events, node)

    def log_containers_once(
        self, remote_pod: k8s.V1Pod, containers: Iterable[str], **log_options: Any
    ) -> None:
        """Log the lines of ``containers`` once, to their end (an ended pod's sidecar, before the pod goes).

        :param log_options: the provider's ``fetch_container_logs`` options (log prefix, formatter).
        """
        for name in containers:
            try:
                self.fetch_container_logs(remote_pod, name, follow=False, **log_options)
            except (
                Exception
            ) as exc:  # a pod already gone has no log; the task's outcome does not depend on it
                self.log.info(
                    "The log of container %s of pod %s could not be read: %s",
                    name,
                    remote_pod.metadata.name,
                    exc,
                )
