"""Run a multi-worker training job on an engine the cluster has: TFJob, TrainJob or Indexed Jobs."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from kubernetes.client.exceptions import ApiException

from kubetrain import pod_spec
from kubetrain.distributed import builders
from kubetrain.distributed.backends import choose_backend, served_backends
from kubetrain.distributed.cleanup import delete_sync
from kubetrain.distributed.spec import DistributedSpec
from kubetrain.distributed.submit import create_retrying
from kubetrain.operators.resumable import DISRUPTIONS_XCOM_KEY, NOTES_XCOM_KEY
from kubetrain.operators.training import TrainingPodOperator
from kubetrain.pod_startup import QUEUE_LABEL, QUEUED_KEY, failure_from_event
from kubetrain.triggers.distributed import DistributedJobTrigger

# The job kinds kubetrain hands to Kueue, by the name of the Kueue integration that queues them.
KUEUE_FRAMEWORKS = {
    "Job": "batch/job",
    "TFJob": "kubeflow.org/tfjob",
    "TrainJob": "trainer.kubeflow.org/trainjob",
}

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from airflow.sdk import Context

__all__ = ["DistributedTrainingOperator", "DistributedTrainingError"]


class DistributedTrainingError(AirflowException):
    """A replica failed or the job timed out; the message names the replica, its reason and last lines."""


def job_name(dag_id: str, run_id: str, try_number: int) -> str:
    """``kt-<dag>-<hash of the run>-<try>``: a DNS label that leaves room for ``-<role>-<index>``."""
    stem = re.sub(r"[^a-z0-9]+", "-", dag_id.lower()).strip("-")[:18].strip("-") or "job"
    digest = hashlib.sha256(f"{dag_id}/{run_id}".encode()).hexdigest()[:8]
    return f"kt-{stem}-{digest}-{int(try_number)}"


class DistributedTrainingOperator(TrainingPodOperator):
    """Train with several workers (or parameter servers) as one job of an engine the cluster already has.

    The job is a Kubeflow TFJob, a Kubeflow Trainer TrainJob, or one Indexed Job per role behind a
    headless Service (:mod:`kubetrain.distributed.builders`). Every replica's pod follows the training
    pod contract of :class:`TrainingPodOperator` (stage-in on every replica, the checkpoint-sync sidecar
    on the chief only, S3 by Secret reference, GPU requests and tolerations, non-root), with the same
    arguments and settings; each role gets its own resources. The trainer computes TF_CONFIG from the
    variables the job passes (or takes the TFJob operator's), and only the chief writes checkpoints
    and outputs.

    The task defers while the job runs: :class:`~kubetrain.triggers.distributed.DistributedJobTrigger`
    follows the job's conditions and its replicas' start-up and streams the chief's log lines into the
    task log. The task fails with the first failed replica's reason, last log lines and events (a
    replica that cannot be scheduled fails it at once, without retries), and deletes the job, its pods
    and its Service on success, failure, timeout and kill. The run prefix is the DAG run's, so a
    retried task resumes from the chief's checkpoints. XCom ``run_uri`` as for the single pod; the
    return value says where and how it ran.

    :param backend: ``tfjob``, ``trainjob``, ``indexed_job`` or ``auto`` (the first of these that the
        cluster serves; ``indexed_job`` always). (templated)
    :param workers: training replicas, 1-64. (templated)
    :param ps_replicas: parameter servers, 0-16; more than 0 runs in parameter-server mode. (templated)
    :param gpus_per_worker: GPUs of each training replica (default: ``gpus``). (templated)
    :param gpus_per_ps: GPUs of each parameter server. (templated)
    :param worker_cpu: CPU of each training replica (default: ``cpu``). (templated)
    :param worker_memory: memory of each training replica (default: ``memory``). (templated)
    :param ps_cpu: CPU of each parameter server. (templated)
    :param ps_memory: memory of each parameter server. (templated)
    :param chief_cpu: CPU of the chief in parameter-server mode, where it coordinates and trains
        nothing (default: ``worker_cpu``). (templated)
    :param chief_memory: memory of the chief in parameter-server mode (default: ``worker_memory``). (templated)
    :param port: the TensorFlow server's port in every replica.
    :param max_restarts: replacements a role's pods may get within one try.
    :param poll_interval: seconds between looks at the job.
    :param kwargs: everything :class:`TrainingPodOperator` accepts.
    """

    template_fields: Sequence[str] = (
        *TrainingPodOperator.template_fields,
        "backend",
        "workers",
        "ps_replicas",
        "gpus_per_worker",
        "gpus_per_ps",
        "worker_cpu",
        "worker_memory",
        "ps_cpu",
        "ps_memory",
        "chief_cpu",
        "chief_memory",
    )
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        backend: str = "auto",
        workers: int | str = 2,
        ps_replicas: int | str = 0,
        gpus_per_worker: int | str | None = None,
        gpus_per_ps: int | str = 0,
        worker_cpu: str | None = None,
        worker_memory: str | None = None,
        ps_cpu: str = "1",
        ps_memory: str = "2Gi",
        chief_cpu: str | None = None,
        chief_memory: str | None = None,
        port: int = 2222,
        max_restarts: int = 3,
        poll_interval: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.workers = workers
        self.ps_replicas = ps_replicas
        self.gpus_per_worker = gpus_per_worker
        self.gpus_per_ps = gpus_per_ps
        self.worker_cpu = worker_cpu
        self.worker_memory = worker_memory
        self.ps_cpu = ps_cpu
        self.ps_memory = ps_memory
        self.chief_cpu = chief_cpu
        self.chief_memory = chief_memory
        self.port = port
        self.max_restarts = max_restarts
        self.poll_interval = poll_interval
        self._submission: builders.Submission | None = None

    @property
    def kube_hook(self) -> KubernetesHook:
        """The provider's hook, a :class:`KubernetesHook`: the provider types it as the protocol of its pod
        calls, and a job needs the batch and custom-object clients too."""
        return cast("KubernetesHook", self.hook)

    def distributed_spec(self) -> DistributedSpec:
        """The replicas and their resources, checked (a bad count fails before anything is created)."""
        gpus = self.gpus if _unset_is_none(self.gpus_per_worker) is None else self.gpus_per_worker
        # templated counts arrive as strings ("2"): the spec checks each and keeps it as an int, and its
        # error shows the value as given
        counts: dict[str, Any] = {
            "workers": self.workers,
            "ps_replicas": self.ps_replicas,
            "gpus_per_worker": gpus,
            "gpus_per_ps": self.gpus_per_ps,
        }
        return DistributedSpec(
            **counts,
            worker_cpu=str(self.worker_cpu or self.cpu),
            worker_memory=str(self.worker_memory or self.memory),
            ps_cpu=str(self.ps_cpu),
            ps_memory=str(self.ps_memory),
            chief_cpu=_unset_is_none(self.chief_cpu),
            chief_memory=_unset_is_none(self.chief_memory),
            port=self.port,
            max_restarts=self.max_restarts,
        )

    def submission(
        self, context: Context, spec: DistributedSpec, *, backend: str, pin: bool = True
    ) -> builders.Submission:
        """The objects of this task's job on ``backend``."""
        config = self.pod_config(context, pin=pin)
        namespace = config.namespace or self.hook.get_namespace() or "default"
        ti = context["ti"]
        name = job_name(ti.dag_id, context["run_id"], getattr(ti, "try_number", 1) or 1)
        labels = {
            "kubetrain.io/dag-id": ti.dag_id,
            "kubetrain.io/run-id": context["run_id"],
            "kubetrain.io/task-id": ti.task_id,
        }
        if self.experiment:
            labels["kubetrain.io/experiment"] = self.experiment
        ti.xcom_push(key="run_uri", value=config.run_uri)
        return builders.build(
            backend, config, spec, name=name, namespace=namespace, labels=labels, queue=self.queue_labels()
        )

    def execute(self, context: Context) -> Any:
        spec = self.distributed_spec()
        backend = choose_backend(self.backend, served_backends(self.kube_hook.api_client))
        submission = self.submission(context, spec, backend=backend)
        self._submission = submission
        self.log.info(
            "Distributed training: %s on %s %s/%s; cluster %s",
            spec.describe(),
            backend,
            submission.namespace,
            submission.name,
            submission.cluster(),
        )
        resources = [[r.api_version, r.kind, r.plural, r.name] for r in submission.resources]
        delete_sync(self.hook, submission.namespace, resources, self.log)  # leftovers of an earlier attempt
        try:
            for resource in submission.resources:
                # a TrainJob right after its TrainingRuntime can meet the Trainer's not-yet-seen refusal
                create_retrying(self._create, submission.namespace, resource, logger=self.log)
        except Exception:
            delete_sync(self.hook, submission.namespace, resources, self.log)
            raise
        deadline = None
        if isinstance(self.execution_timeout, timedelta):
            deadline = time.time() + self.execution_timeout.total_seconds() - 30
        self.defer(
            trigger=DistributedJobTrigger(
                backend=backend,
                name=submission.name,
                namespace=submission.namespace,
                resources=resources,
                roles=submission.job_roles,
                gang=submission.gang,
                container=submission.container,
                pod_selector=submission.pod_selector,
                deadline=deadline,
                poll_interval=self.poll_interval,
                startup={
                    "schedule_timeout": self.schedule_timeout_seconds,
                    "unschedulable_grace": self.unschedulable_grace_seconds,
                    "startup_timeout": self.startup_timeout_seconds,
                    "stage_in_timeout": self.stage_in_timeout_seconds,
                    "stage_in_container": pod_spec.STAGE_IN_CONTAINER,
                    "queue_timeout": self._queue_timeout(),
                },
                queue_log_interval=self.queue_log_interval_seconds,
                kubernetes_conn_id=self.kubernetes_conn_id,
                config_file=self.config_file,
                cluster_context=self.cluster_context,
                in_cluster=self.in_cluster,
            ),
            method_name="execute_complete",
            kwargs={"resources": resources, "cluster": submission.cluster(), "spec": spec.describe()},
        )

    def _create(self, namespace: str, resource: builders.Resource) -> None:
        if resource.kind in KUEUE_FRAMEWORKS and QUEUE_LABEL in (
            resource.body["metadata"].get("labels") or {}
        ):
            self._check_queued(namespace, resource)
        if resource.api_version == "v1" and resource.kind == "Service":
            self.hook.core_v1_client.create_namespaced_service(namespace, resource.body)
        elif resource.api_version == "batch/v1" and resource.kind == "Job":
            self.kube_hook.batch_v1_client.create_namespaced_job(namespace, resource.body)
        else:
            self.kube_hook.create_custom_object(
                group=resource.group,
                version=resource.version,
                plural=resource.plural,
                body=resource.body,
                namespace=namespace,
            )
        self.log.info("Created %s %s/%s", resource.kind, namespace, resource.name)

    def _check_queued(self, namespace: str, resource: builders.Resource) -> None:
        """Refuse a queued job that Kueue would not hold: its webhook makes a job of an integration it has
        enabled suspended on creation, so a dry run of the creation shows whether it would run unqueued."""
        if resource.kind == "Job":
            created = self.kube_hook.batch_v1_client.create_namespaced_job(
                namespace, resource.body, dry_run="All"
            )
            suspended = bool(created.spec.suspend)
        else:
            from kubernetes.client import CustomObjectsApi

            api = CustomObjectsApi(self.kube_hook.api_client)
            created = api.create_namespaced_custom_object(
                resource.group, resource.version, namespace, resource.plural, resource.body, dry_run="All"
            )
            spec = created.get("spec") or {}
            suspended = bool((spec.get("runPolicy") or {}).get("suspend") or spec.get("suspend"))
        if not suspended:
            framework = KUEUE_FRAMEWORKS[resource.kind]
            raise AirflowFailException(
                f"Kueue would not queue {resource.kind} {resource.name}: its {framework!r} integration is not "
                "enabled (Kueue's webhook leaves the job unsuspended), so it would start at once, ignoring the "
                f"queue's quota. Add {framework!r} to integrations.frameworks of Kueue's configuration, or run "
                "without a queue"
            )

    def execute_complete(
        self,
        context: Context,
        event: dict[str, Any],
        resources: list[list[str]] | None = None,
        cluster: dict[str, list[str]] | None = None,
        spec: str | None = None,
    ) -> dict[str, Any]:
        namespace = event["namespace"]
        resources = resources or event.get("resources") or []
        # the report task reads XCom ``notes`` of every training task, as the single pod pushes it
        context["ti"].xcom_push(key=NOTES_XCOM_KEY, value=[str(note) for note in event.get("notes") or []])
        # the record step reads XCom ``disruptions`` of every training task, as the single pod pushes it
        queued = float(event.get(QUEUED_KEY) or 0.0)
        context["ti"].xcom_push(key=DISRUPTIONS_XCOM_KEY, value={"interruptions": [], "queued_s": queued})
        if spec is None:
            spec = self.distributed_spec().describe()
        try:
            delete_sync(self.hook, namespace, resources, self.log)
            self._wait_pods_gone(namespace, f"{builders.JOB_LABEL}={event['name']}")
        except Exception as exc:  # the outcome of training matters more than a failed clean-up
            self.log.warning("Cleaning up %s failed: %s", event["name"], exc)
        status = event.get("status")
        if status == "success":
            self.log.info("%s %s succeeded: %s", event["backend"], event["name"], event.get("message"))
            return {
                "backend": event["backend"],
                "job": event["name"],
                "namespace": namespace,
                "cluster": cluster,
                "replicas": spec,
                "run_uri": context["ti"].xcom_pull(task_ids=self.task_id, key="run_uri"),
            }
        if status == "startup":
            failure = failure_from_event(event)
            if failure is not None:
                raise failure
        replica = event.get("replica") or {}
        detail = ""
        if replica:
            detail = (
                f"; first failed replica: {replica.get('role')} pod {replica.get('pod')} exited "
                f"{replica.get('exit_code')} ({replica.get('reason')})"
            )
            if replica.get("last_lines"):
                detail += "\nlast log lines:\n  " + "\n  ".join(replica["last_lines"])
            if replica.get("events"):
                detail += "\nevents:\n  " + "\n  ".join(replica["events"])
        raise DistributedTrainingError(f"{event.get('message')}{detail}")

    def _wait_pods_gone(self, namespace: str, selector: str, timeout: float = 90.0) -> None:
        """Wait until the job's pods are gone (their DELETED events), so that a retry starts on a clean slate.

        A watch from the list's resourceVersion: no event is missed between the list and the
        watch, and nothing polls. Bounded by ``timeout`` (pods whose containers ignore SIGTERM
        last their grace period).
        """
        from kubernetes import watch

        core = self.hook.core_v1_client
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = core.list_namespaced_pod(namespace, label_selector=selector)
            left = {pod.metadata.name for pod in listed.items}
            if not left:
                return
            w = watch.Watch()
            try:
                for event in w.stream(
                    core.list_namespaced_pod,
                    namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=max(1, int(deadline - time.monotonic())),
                ):
                    if event["type"] == "DELETED":
                        left.discard(event["object"].metadata.name)
                    if not left:
                        return
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: the resourceVersion is too old; list again
                    raise
            finally:
                w.stop()
        self.log.warning("Pods of %s still terminating after %.0f s", selector, timeout)

    def on_kill(self) -> None:
        submission = self._submission
        if submission is None:
            return
        resources = [[r.api_version, r.kind, r.plural, r.name] for r in submission.resources]
        delete_sync(self.hook, submission.namespace, resources, self.log)


def _unset_is_none(value: Any) -> str | None:
    """A templated optional setting: empty, None or its rendering "None" means unset."""
    return None if value in (None, "", "None") else str(value)
