"""The trigger that follows a multi-worker job: its conditions, its replicas' start-up, the chief's log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
from airflow.triggers.base import BaseTrigger, TriggerEvent

from kubetrain.operators.interruption import exit_code, terminated
from kubetrain.pod_startup import QUEUED_KEY, STARTUP_FAILURES, PodStartup, QueueTimeout, failure_kind

ROLE_LABEL = "kubetrain.io/replica-role"
# Kubernetes labels each pod of an Indexed Job with its completion index.
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# The one Indexed Job of a queued multi-worker run (kubetrain.distributed.builders.gang_job).
GANG_ROLE = "all"


def _true(conditions: list[Any] | None, kind: str) -> Any:
    for c in conditions or []:
        ctype = c.get("type") if isinstance(c, dict) else c.type
        status = c.get("status") if isinstance(c, dict) else c.status
        if ctype == kind and status == "True":
            return c
    return None


def _message(condition: Any) -> str:
    if condition is None:
        return ""
    get = condition.get if isinstance(condition, dict) else lambda k: getattr(condition, k, None)
    return ": ".join(str(x) for x in (get("reason"), get("message")) if x)


class DistributedJobTrigger(BaseTrigger):
    """Wait for a multi-worker job to succeed or fail, streaming the chief's log into the task log.

    Yields one event: ``success``; ``error`` with the first failed replica's pod, reason and last log
    lines; ``startup`` when a replica cannot start (``kubetrain_startup`` names the failure class, as
    :class:`~kubetrain.triggers.pod.TrainingPodTrigger` does); or ``timeout`` at ``deadline``.

    :param backend: ``tfjob``, ``trainjob`` or ``indexed_job``.
    :param name: the job's name.
    :param namespace: its namespace.
    :param resources: ``[api_version, kind, plural, name]`` of every object submitted (deleted on kill).
    :param roles: the roles of the job (``indexed_job``: one Job ``<name>-<role>`` each).
    :param container: the base container of every replica.
    :param pod_selector: label selector of every replica's pods.
    :param deadline: epoch seconds after which the job times out (``None``: never).
    :param poll_interval: seconds between looks at the job.
    :param startup: :class:`~kubetrain.pod_startup.PodStartup` budgets (schedule_timeout, unschedulable_grace,
        startup_timeout, stage_in_timeout, queue_timeout). While Kueue holds the job suspended it has no
        pods and no start-up budget runs; ``queue_timeout`` bounds that wait.
    :param gang: every replica is in the one Indexed Job ``<name>-all`` (its index 0 the chief).
    :param queue_log_interval: seconds between the task log's lines about a job Kueue holds.
    :param kubernetes_conn_id: Airflow connection of the cluster.
    :param config_file: kubeconfig path, as the pod operator passes it (read in the triggerer).
    :param cluster_context: kubeconfig context.
    :param in_cluster: use the in-cluster configuration.
    """

    def __init__(
        self,
        *,
        backend: str,
        name: str,
        namespace: str,
        resources: list[list[str]],
        roles: list[str],
        container: str,
        pod_selector: str,
        deadline: float | None,
        poll_interval: float = 5.0,
        startup: dict[str, float | str] | None = None,
        kubernetes_conn_id: str | None = None,
        config_file: str | None = None,
        cluster_context: str | None = None,
        in_cluster: bool | None = None,
        gang: bool = False,
        queue_log_interval: float = 60.0,
    ) -> None:
        super().__init__()
        self.gang = gang
        self.queue_log_interval = queue_log_interval
        self.backend = backend
        self.name = name
        self.namespace = namespace
        self.resources = [list(r) for r in resources]
        self.roles = list(roles)
        self.container = container
        self.pod_selector = pod_selector
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.startup = dict(startup or {})
        self.kubernetes_conn_id = kubernetes_conn_id
        self.config_file = config_file
        self.cluster_context = cluster_context
        self.in_cluster = in_cluster
        self._log_seen: dict[str, str] = {}  # pod -> timestamp of the last chief line logged

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            "backend": self.backend,
            "name": self.name,
            "namespace": self.namespace,
            "resources": self.resources,
            "roles": self.roles,
            "container": self.container,
            "pod_selector": self.pod_selector,
            "deadline": self.deadline,
            "poll_interval": self.poll_interval,
            "startup": self.startup,
            "kubernetes_conn_id": self.kubernetes_conn_id,
            "config_file": self.config_file,
            "cluster_context": self.cluster_context,
            "in_cluster": self.in_cluster,
            "gang": self.gang,
            "queue_log_interval": self.queue_log_interval,
        }

    @cached_property
    def hook(self) -> AsyncKubernetesHook:
        # The async hook ignores ``config_file`` (it reads a config dict, the connection or the
        # default kubeconfig): the file is read here, in the triggerer, which must have it.
        config_dict = None
        if self.config_file:
            import yaml

            with open(self.config_file) as f:
                config_dict = yaml.safe_load(f)
        return AsyncKubernetesHook(
            conn_id=self.kubernetes_conn_id,
            in_cluster=self.in_cluster,
            config_dict=config_dict,
            cluster_context=self.cluster_context,
        )

    # -- reading the job -----------------------------------------------------------------------

    async def job_state(self) -> tuple[str, str]:
        """``(queued|running|succeeded|failed, detail)`` from the job objects' conditions; ``queued``
        while Kueue holds a job object suspended."""
        from kubernetes_asyncio import client as aclient

        async with self.hook.get_conn() as conn:
            if self.backend == "indexed_job":
                batch = aclient.BatchV1Api(conn)
                suspended = []
                for role in self.roles:
                    job = await batch.read_namespaced_job_status(f"{self.name}-{role}", self.namespace)
                    failed = _true(job.status.conditions, "Failed")
                    if failed is not None:
                        return "failed", f"Job {self.name}-{role} failed: {_message(failed)}"
                    if job.spec.suspend:
                        suspended.append(f"Job {self.name}-{role}")
                done = f"{self.name}-{GANG_ROLE if self.gang else 'chief'}"
                last = await batch.read_namespaced_job_status(done, self.namespace)
                if _true(last.status.conditions, "Complete") is not None:
                    return "succeeded", f"Job {done} completed"
                if suspended:
                    return "queued", ", ".join(suspended)
                return "running", ""
            api_version, kind, plural, name = self.resources[-1]
            group, _, version = api_version.rpartition("/")
            obj = await aclient.CustomObjectsApi(conn).get_namespaced_custom_object(
                group, version, self.namespace, plural, name
            )
            conditions = (obj.get("status") or {}).get("conditions") or []
            failed = _true(conditions, "Failed")
            if failed is not None:
                return "failed", f"{kind} {name} failed: {_message(failed)}"
            done = _true(conditions, "Succeeded") or _true(conditions, "Complete")
            if done is not None:
                return "succeeded", f"{kind} {name}: {_message(done)}"
            spec = obj.get("spec") or {}
            if spec.get("suspend") or (spec.get("runPolicy") or {}).get("suspend"):
                return "queued", f"{kind} {name}"
            return "running", ""

    async def pods(self) -> list[Any]:
        from kubernetes_asyncio import client as aclient

        async with self.hook.get_conn() as conn:
            listing = await aclient.CoreV1Api(conn).list_namespaced_pod(
                self.namespace, label_selector=self.pod_selector
            )
        return sorted(
            listing.items, key=lambda p: p.metadata.creation_timestamp or datetime.min.replace(tzinfo=UTC)
        )

    async def stream_chief(self, pods: list[Any]) -> None:
        """Log the chief's new trainer lines (each pod of the chief in turn, restarts included)."""
        for pod in pods:
            labels = pod.metadata.labels or {}
            chief = labels.get(INDEX_LABEL) == "0" if self.gang else labels.get(ROLE_LABEL) == "chief"
            if not chief:
                continue
            statuses = pod.status.container_statuses or []
            if not any(
                s.name == self.container and (s.state.running or s.state.terminated) for s in statuses
            ):
                continue
            name = pod.metadata.name
            try:
                lines = await self.hook.read_logs(
                    name=name, namespace=self.namespace, container_name=self.container
                )
            except Exception as exc:  # the pod may be going away; the next poll tries again
                self.log.debug("cannot read the log of %s: %s", name, exc)
                continue
            last = self._log_seen.get(name, "")
            for line in lines:
                stamp, _, text = line.partition(" ")
                if stamp > last:
                    self.log.info("[chief %s] %s", name, text.rstrip())
                    last = stamp
            self._log_seen[name] = last

    async def failure_detail(self, pods: list[Any]) -> dict[str, Any]:
        """The first replica that failed: pod, role, exit code and reason, its last log lines and events."""
        failed = []
        for pod in pods:
            code = exit_code(pod, self.container)
            if code not in (0, None):
                term = terminated(pod, self.container)
                failed.append((term.finished_at or datetime.max.replace(tzinfo=UTC), pod, term))
        if not failed:
            return {}
        _, pod, term = min(failed, key=lambda item: item[0])
        name = pod.metadata.name
        try:
            lines = await self.hook.read_logs(
                name=name, namespace=self.namespace, container_name=self.container
            )
        except Exception:
            lines = []
        try:
            events = (await self.hook.get_pod_events(name=name, namespace=self.namespace)).items or []
        except Exception:
            events = []
        return {
            "pod": name,
            "role": (pod.metadata.labels or {}).get(ROLE_LABEL),
            "exit_code": term.exit_code,
            "reason": term.reason,
            "last_lines": [line.partition(" ")[2].rstrip() for line in lines[-20:]],
            "events": [f"{e.type} {e.reason}: {e.message}" for e in events[-10:]],
        }

    # -- the wait ------------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[TriggerEvent]:
        judges: dict[str, PodStartup] = {}
        queued_since: float | None = None
        queued_before = 0.0  # seconds of earlier waits (a preempted job is suspended again)
        queue_logged = 0.0
        queue_timeout = float(self.startup.get("queue_timeout") or 86400.0)
        # PodStartup's budgets in seconds, by name (its __post_init__ refuses a value it does not take)
        budgets: dict[str, Any] = {k: v for k, v in self.startup.items() if k != "queue_timeout"}
        # The objects to delete travel in the event too: `airflow dags test` resumes the task with the event
        # alone, without the kwargs given to defer().
        base: dict[str, Any] = {  # the event's JSON fields
            "name": self.name,
            "namespace": self.namespace,
            "backend": self.backend,
            "resources": [list(r) for r in self.resources],
        }
        while True:
            try:
                pods = await self.pods()
                await self.stream_chief(pods)
                for pod in pods:
                    if pod.status.phase not in (None, "Pending") or pod.metadata.deletion_timestamp:
                        continue
                    judge = judges.setdefault(
                        pod.metadata.name, PodStartup(**budgets, queue_timeout=queue_timeout)
                    )
                    events: list[Any] = []
                    if judge.needs_events(pod):
                        events = (
                            await self.hook.get_pod_events(name=pod.metadata.name, namespace=self.namespace)
                        ).items or []
                    judge.observe(pod, events, datetime.now(UTC))
                state, detail = await self.job_state()
                if state == "queued":
                    now = time.monotonic()
                    queued_since = queued_since if queued_since is not None else now
                    waited = now - queued_since
                    if waited > queue_timeout:
                        raise QueueTimeout(
                            f"{detail} was not admitted by Kueue within queue_timeout={queue_timeout:g} s: "
                            "it stayed suspended; its queue's quota stayed in use"
                        )
                    if now - queue_logged >= self.queue_log_interval:
                        self.log.info(
                            "%s is queued in Kueue (suspended until admitted, all replicas at once) for %.0f s",
                            detail,
                            waited,
                        )
                        queue_logged = now
                elif queued_since is not None and state == "running":
                    self.log.info("%s %s was admitted by Kueue", self.backend, self.name)
                    queued_before += time.monotonic() - queued_since
                    queued_since = None
                base[QUEUED_KEY] = round(
                    queued_before + (time.monotonic() - queued_since if queued_since is not None else 0.0), 3
                )
            except STARTUP_FAILURES as exc:
                self.log.warning("A replica of %s cannot start: %s", self.name, exc)
                yield TriggerEvent(
                    {**base, "status": "startup", "message": str(exc), "kubetrain_startup": failure_kind(exc)}
                )
                return
            if state == "succeeded":
                await self.stream_chief(await self.pods())
                yield TriggerEvent({**base, "status": "success", "message": detail})
                return
            if state == "failed":
                pods = await self.pods()
                await self.stream_chief(pods)
                yield TriggerEvent(
                    {**base, "status": "error", "message": detail, "replica": await self.failure_detail(pods)}
                )
                return
            if self.deadline is not None and time.time() >= self.deadline:
                yield TriggerEvent(
                    {
                        **base,
                        "status": "timeout",
                        "message": f"{self.backend} {self.name} did not finish within the task's execution_timeout",
                    }
                )
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """The task was killed while deferred: delete the job, its pods and its Service."""
        from kubetrain.distributed.cleanup import delete_async

        await delete_async(self.hook, self.namespace, self.resources, self.log)
