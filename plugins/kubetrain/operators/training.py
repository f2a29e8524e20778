"""Run one training pod: the KubernetesPodOperator with kubetrain's pod contract."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.container import container_is_completed, container_is_running
from airflow.providers.cncf.kubernetes.utils.pod_manager import (
    PodManager,
    PodNotFoundException,
    PodPhase,
    detect_pod_terminate_early_issues,
)
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from kubernetes import watch
from kubernetes.client import models as k8s
from kubernetes.client.rest import ApiException

from kubetrain import pod_spec, settings
from kubetrain.doc_md import class_doc_md
from kubetrain.hooks.registry import RegistryHook
from kubetrain.images import pin_image
from kubetrain.pod_startup import (
    INTERRUPTED_EXIT_KEY,
    INTERRUPTED_KEY,
    KUEUE_GROUP,
    KUEUE_VERSION,
    NOTES_KEY,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    QUEUED_KEY,
    STARTUP_FAILURES,
    ImagePullError,
    PodStartup,
    PodStartupTimeout,
    PodUnschedulableError,
    QueueTimeout,
    StageInError,
    exit_code,
    failure_from_event,
    gpu_served_on_cpu,
    interruption,
    queue_message,
    queue_name,
    queued,
    requested_gpus,
)
from kubetrain.s3_layout import RunLocation, S3Layout, run_from_context
from kubetrain.triggers.pod import LOGS_FLUSHED_KEY, TrainingPodTrigger
from kubetrain_contract.exit_codes import final_exit_codes

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = [
    "DISRUPTIONS_XCOM_KEY",
    "NOTES_XCOM_KEY",
    "NO_RETRY_EXIT_CODES",
    "ImagePullError",
    "PodInterrupted",
    "PodStartupTimeout",
    "QueueTimeout",
    "PodUnschedulableError",
    "StageInError",
    "TrainingPodManager",
    "TrainingPodOperator",
    "string_list",
]

# Parts of the pod that kubetrain.pod_spec owns; the base class must not set them a second
# time, or its values would replace the contract's when the two are reconciled.
_OWNED = ("container_resources", "security_context", "container_security_context", "full_pod_spec")
_EMPTY = (None, "", [], {}, ())
# A Kueue LocalQueue or WorkloadPriorityClass name (a DNS subdomain).
_KUEUE_NAME = re.compile(settings.DNS_SUBDOMAIN)
# The interruptions of this try so far, carried from one pod's trigger to the next.
INTERRUPTIONS_KEY = "kubetrain_interruptions"


class PodInterrupted(AirflowException):
    """The training pod was ended from outside before its training finished: preempted, evicted,
    drained or deleted. The task submits a new pod in the same try, which resumes from the last
    checkpoint; it is not a failure and costs no retry.

    :param message: which pod and why.
    :param exit_code: the training container's exit code, when it had ended (75: checkpointed on SIGTERM).
    """

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# XCom of the lines a run's report shows at the top (e.g. a GPU request served on CPU).
NOTES_XCOM_KEY = "notes"
# XCom of what the cluster did to the try: ``{"interruptions": [{"pod", "reason", "at", "queued_s",
# "exit_code"}, ...], "queued_s": seconds all its pods waited for Kueue's admission}``; the report
# and the run record count preemptions, time queued and steps lost from it.
DISRUPTIONS_XCOM_KEY = "disruptions"
# Exit codes of the training container that a retry would only repeat (kubetrain_contract.exit_codes, the table the
# trainers follow); any other failure, 75 (stopped by SIGTERM after a checkpoint) included, is retried.
NO_RETRY_EXIT_CODES = final_exit_codes()


def _native_hint(param: str) -> str:
    return (
        f"a template must render the object itself: '{{{{ params.{param} }}}}' in a DAG with "
        "render_template_as_native_obj=True"
    )


def string_list(name: str, value: Any) -> list[str] | None:
    """A command or argument list, each item as text.

    A DAG that renders templates as native objects (``render_template_as_native_obj=True``)
    renders ``{{ params.epochs }}`` as the integer 5, and ``{{ params.args }}`` as the Param's
    list: both become the strings the container gets.

    :param name: the operator argument, for the error message.
    :param value: a list (or tuple) of strings and numbers, or empty.
    """
    if value in (None, "", [], ()):
        return None
    if isinstance(value, str):
        raise ValueError(
            f"{name} {value!r} is not a list: expected a list of strings; "
            + _native_hint({"cmds": "command", "arguments": "args"}.get(name, name))
        )
    if not isinstance(value, list | tuple) or not all(isinstance(v, str | int | float) for v in value):
        raise ValueError(f"{name} {value!r} is not a list of strings")
    return [str(v) for v in value]


def _text(name: str, value: Any) -> str | None:
    """A name-like setting (experiment, trial) as text: a number (a trial's, a native rendering of 2024) too."""
    if value in (None, ""):
        return None
    if not isinstance(value, str | int | float):
        raise ValueError(f"{name} {value!r} is not text: expected a string such as 'digits'")
    return str(value)


def _names(value: Any) -> tuple[str, ...]:
    """Secret names from a list (of names or V1LocalObjectReference), or ``a,b`` (the setting's form)."""
    if value in _EMPTY:
        return ()
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            raise ValueError(
                f"image_pull_secrets {value!r} is text, not a list: expected e.g. ['regcred'] or regcred,mirror; "
                + _native_hint("image_pull_secrets")
            )
        return settings.parse_list("image_pull_secrets", value)
    if isinstance(value, list | tuple):
        return tuple(str(getattr(v, "name", v)) for v in value if getattr(v, "name", v))
    raise ValueError(f"image_pull_secrets {value!r} is not a list of Secret names: expected e.g. ['regcred']")


def _node_selector(value: Any) -> dict[str, str]:
    """Node labels from a mapping, or ``k=v,k2=v2`` (the setting's form); checked by :mod:`kubetrain.settings`."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        raise ValueError(
            f"node_selector {value!r} is text, not a mapping: expected e.g. {{'gpu-type': 'a100'}} or "
            f"gpu-type=a100; {_native_hint('node_selector')}"
        )
    if not isinstance(value, Mapping | str):
        raise ValueError(
            f"node_selector {value!r} is not a mapping of node labels: expected e.g. {{'gpu-type': 'a100'}}"
        )
    return settings.parse_node_selector(value)


def _tolerations(value: Any) -> tuple[Any, ...]:
    """Tolerations as given (V1Toleration objects or mappings, checked by :mod:`kubetrain.pod_spec`)."""
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"tolerations {value!r} is not a list: expected V1Toleration objects or mappings such as "
            f"[{{'key': 'spot', 'operator': 'Exists'}}]; {_native_hint('tolerations')}"
        )
    return tuple(value)


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


class TrainingPodOperator(KubernetesPodOperator):
    """Run a training container in a pod built by :mod:`kubetrain.pod_spec`.

    The pod gets the stage-in init container, the checkpoint-sync native sidecar and the base
    container with ``DATA_DIR``, ``CHECKPOINT_DIR``, ``OUTPUT_DIR`` and the ``KUBETRAIN_*``
    variables. Its run prefix is ``s3://<training>/runs/<dag_id>/<run_id>`` (plus
    ``/trials/<trial>`` for sweeps): the same for every try, so a retried task resumes from its
    checkpoints. The run URI is pushed as XCom ``run_uri``.

    Both images are pinned to their digest in the registry when the pod is submitted
    (:func:`kubetrain.images.pin_image`), so the pod, ``KUBETRAIN_IMAGE`` and
    ``KUBETRAIN_CODE_VERSION`` name exactly what ran. The deployment's settings
    (:mod:`kubetrain.settings`: namespace, S3 Secret, service account, image pull secrets,
    node selector, tolerations, GPU resource) apply where an argument is not given.

    Start-up has its own budgets (:mod:`kubetrain.pod_startup`): ``schedule_timeout_seconds``
    to find a node, ``startup_timeout_seconds`` for each image pull, ``stage_in_timeout_seconds``
    for the dataset download. A pod that no node can take fails at once, without retries, with
    the scheduler's reason (:class:`PodUnschedulableError`), unless an autoscaler is adding a
    node; so does an image that cannot be pulled (:class:`ImagePullError`).

    By default the task defers while the pod runs and deletes the pod when it ends, success or
    failure. While it is deferred, the lines of the stage-in, checkpoint-sync and training
    containers reach the task log every ``logging_interval`` seconds, each marked by its
    container (:class:`~kubetrain.triggers.pod.TrainingPodTrigger`); a failed pod's last lines,
    its containers' states and its events are logged when it ends. With ``deferrable=False`` the
    task process waits on watches of the pod instead, follows the training container's log as
    it is written, logs the stage-in container's lines when the pod starts and the sidecar's when
    it ends; that saves the hand-off back from the triggerer (a few seconds per pod, which sweeps
    of short trials feel) at the price of a worker slot for the whole training.

    A GPU request that the cluster served on CPU (a development cluster without GPUs, such as
    the dev stack, runs the pod anyway) is logged in one line and pushed, with any other line
    the run's report should show, as XCom ``notes`` (a list of strings).

    A training container that exits with a code that says a retry would fail the same way (2 bad
    parameters, 3 training diverged, 65 unusable data, 66 DATA_DIR missing: :data:`NO_RETRY_EXIT_CODES`) fails the
    task without retries; any other failure, 75 (stopped by SIGTERM after a checkpoint)
    included, is retried as usual and the next try resumes from the checkpoints.

    :param image: training image (default: the setting ``trainer_image``, else
        ``<registry>/kubetrain/trainer:latest``). (templated)
    :param sync_image: image of the stage-in and checkpoint-sync containers (default: the setting
        ``sync_image``, else ``<registry>/kubetrain/sync:latest``). (templated)
    :param registry_conn_id: registry connection used to resolve digests of the configured registry's images.
    :param cmds: base container command: a list; numbers become text. (templated)
    :param arguments: base container arguments: a list; numbers become text (a DAG that renders native
        objects renders ``{{ params.epochs }}`` as 5, ``{{ params.args }}`` as the Param's list). (templated)
    :param dataset_manifest: ``s3://`` URI of the staged manifest, e.g. ``stage.output["manifest_uri"]``. (templated)
    :param dataset_version: version of that manifest. (templated)
    :param experiment: experiment name, a pod label. (templated)
    :param trial: sweep trial name; mapped tasks default to their map index. (templated)
    :param run_uri: explicit run URI instead of the layout's. (templated)
    :param code_version: recorded in params.json (default: the image digest). (templated)
    :param gpus: GPU count, request == limit. (templated)
    :param gpu_resource: extended resource GPUs are requested as (default: the setting). (templated)
    :param cpu: CPU request of the base container. (templated)
    :param memory: memory request of the base container. (templated)
    :param cpu_limit: CPU limit (default: the request). (templated)
    :param memory_limit: memory limit (default: the request). (templated)
    :param s3_secret: Secret with the AWS_* variables (default: the setting); ``""`` for workload
        identity, which needs a service account. (templated)
    :param service_account_name: service account of the pod (default: the setting). (templated)
    :param image_pull_secrets: registry Secret names: a list or ``a,b`` (default: the setting); kept as
        ``pod_image_pull_secrets``. (templated)
    :param node_selector: node labels: a dict or ``k=v,k2=v2`` (default: the setting); kept as
        ``pod_node_selector``. (templated)
    :param tolerations: extra tolerations: V1Toleration objects or dicts (default: the setting); GPU pods
        always tolerate their GPU vendor's taint; kept as ``pod_tolerations``. (templated)
    :param namespace: namespace of the pod (default: the setting ``namespace``). (templated)
    :param container_user: numeric non-root user of all containers (default 10001, the user of the trainer and sync
        images); not Airflow's own ``run_as_user``, which names the Unix user that runs the task.
    :param sync_interval: seconds between checkpoint uploads. (templated)
    :param sync_quiet: seconds a file must stay unmodified before upload.
    :param sync_grace_period_seconds: pod termination grace period, the time the final sync pass gets.
    :param cache_claim: PersistentVolumeClaim for the stage-in cache.
    :param dataset_bytes: the staged manifest's ``total_bytes``, e.g. ``stage.output["total_bytes"]``:
        sizes the /data volume and the pod's ephemeral-storage request
        (:func:`kubetrain.pod_spec.scratch_sizes`). (templated)
    :param data_size: sizeLimit of the /data volume, e.g. ``50Gi``, instead of the size derived from
        ``dataset_bytes`` (archives that expand more than twice their size); empty: derived. (templated)
    :param checkpoint_size: sizeLimit of the /checkpoints volume (when the data size is known). (templated)
    :param output_size: sizeLimit of the /output volume (when the data size is known). (templated)
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param extra_env: plain environment for the base container (no secrets). (templated)
    :param startup_timeout_seconds: seconds for each image pull phase (sync image, training image).
    :param stage_in_timeout_seconds: seconds the stage-in container may download the dataset.
    :param schedule_timeout_seconds: seconds to find a node while an autoscaler adds one.
    :param unschedulable_grace_seconds: seconds an unschedulable pod waits for an autoscaler before it fails.
    :param local_queue: Kueue LocalQueue the pod waits in (the ``kueue.x-k8s.io/queue-name`` label);
        empty: the deployment's (``KUBETRAIN_QUEUE``), none when that is empty too (``queue`` is
        BaseOperator's executor queue). (templated)
    :param priority_class: Kueue WorkloadPriorityClass of the pod (``kueue.x-k8s.io/priority-class``);
        empty: the queue's default. (templated)
    :param queue_timeout_seconds: seconds the pod may wait for Kueue's admission (default: the
        deployment's ``KUBETRAIN_QUEUE_TIMEOUT``); the start-up budgets count from admission.
    :param queue_log_interval_seconds: seconds between the task log's lines about a queued pod.
    :param max_preemptions: pods of one try that may be ended from outside (preempted, evicted,
        drained, deleted) and replaced by a new pod that resumes from the last checkpoint; one more
        fails the task.
    :param deferrable: defer to the triggerer while the pod runs (default); ``False`` waits in the
        task process.
    :param logging_interval: seconds between reads of the pod's logs while the task is deferred
        (the provider's argument; ``None``: every line arrives when the pod ends). The task log
        is at most this, plus ``poll_interval``, behind ``kubectl logs``: with the defaults (3 s
        and 2 s), 5 s. Each read is one request per container that has started, since its last
        line (``sinceTime``), so a run costs the API server about one small request a second.
    :param log_containers: containers whose lines go to the task log besides the training container
        (default: the stage-in and checkpoint-sync containers).
    :param kwargs: everything KubernetesPodOperator and BaseOperator accept (kubernetes_conn_id,
        env_vars, labels, pool, retries, ...).
    """

    template_fields: Sequence[str] = (
        *KubernetesPodOperator.template_fields,
        "sync_image",
        "dataset_manifest",
        "dataset_version",
        "experiment",
        "trial",
        "run_uri",
        "code_version",
        "gpus",
        "gpu_resource",
        "cpu",
        "memory",
        "cpu_limit",
        "memory_limit",
        "s3_secret",
        "service_account_name",
        "pod_image_pull_secrets",
        "pod_node_selector",
        "pod_tolerations",
        "training_bucket",
        "extra_env",
        "sync_interval",
        "dataset_bytes",
        "data_size",
        "checkpoint_size",
        "output_size",
        "local_queue",
        "priority_class",
    )
    template_fields_renderers = {**KubernetesPodOperator.template_fields_renderers, "extra_env": "py"}
    # Exit codes of the training container that fail the task without retries, with their meaning.
    no_retry_exit_codes: dict[int, str] = NO_RETRY_EXIT_CODES

    def __init__(
        self,
        *,
        image: str | None = None,
        sync_image: str | None = None,
        registry_conn_id: str = RegistryHook.default_conn_name,
        dataset_manifest: str | None = None,
        dataset_version: str | None = None,
        experiment: str | None = None,
        trial: str | None = None,
        run_uri: str | None = None,
        code_version: str | None = None,
        gpus: int | str = 0,
        gpu_resource: str | None = None,
        cpu: str = "1",
        memory: str = "2Gi",
        cpu_limit: str | None = None,
        memory_limit: str | None = None,
        s3_secret: str | None = None,
        service_account_name: str | None = None,
        image_pull_secrets: list[str] | str | None = None,
        node_selector: dict[str, str] | str | None = None,
        tolerations: list[k8s.V1Toleration] | list[dict[str, Any]] | None = None,
        container_user: int = 10001,
        sync_interval: int | str = 30,
        sync_quiet: int = 2,
        sync_grace_period_seconds: int = 300,
        cache_claim: str | None = None,
        dataset_bytes: int | str | None = None,
        data_size: str | None = None,
        checkpoint_size: str = "4Gi",
        output_size: str = "2Gi",
        training_bucket: str | None = None,
        extra_env: dict[str, str] | None = None,
        startup_timeout_seconds: int = 600,
        stage_in_timeout_seconds: int = 3600,
        schedule_timeout_seconds: int = 900,
        unschedulable_grace_seconds: int = 60,
        local_queue: str | None = None,
        priority_class: str | None = None,
        queue_timeout_seconds: float | None = None,
        queue_log_interval_seconds: float = 60,
        max_preemptions: int = 20,
        deferrable: bool = True,
        on_finish_action: str = "delete_pod",
        get_logs: bool = True,
        logging_interval: int | None = 3,
        log_containers: Sequence[str] = (pod_spec.STAGE_IN_CONTAINER, pod_spec.SYNC_CONTAINER),
        log_events_on_failure: bool = True,
        termination_message_policy: str = "FallbackToLogsOnError",
        **kwargs: Any,
    ) -> None:
        if "scratch_size_limit" in kwargs:
            raise TypeError(
                "scratch_size_limit= was replaced: data_size= sizes the /data volume (default: derived from "
                "dataset_bytes=), checkpoint_size= and output_size= the other two"
            )
        for owned in _OWNED:
            if owned in kwargs:
                raise ValueError(f"TrainingPodOperator builds {owned} itself: remove the {owned}= argument")
        kwargs.setdefault("doc_md", class_doc_md(type(self)))
        super().__init__(
            image=image,
            service_account_name=service_account_name,
            deferrable=deferrable,
            on_finish_action=on_finish_action,
            get_logs=get_logs,
            logging_interval=logging_interval,
            log_events_on_failure=log_events_on_failure,
            startup_timeout_seconds=startup_timeout_seconds,
            schedule_timeout_seconds=schedule_timeout_seconds,
            # A crashed trainer's last log lines become the task's error message.
            termination_message_policy=termination_message_policy,
            termination_grace_period=sync_grace_period_seconds,
            **kwargs,
        )
        # The run's choices (an argument or a Param: templated) under names of our own; the base
        # class's image_pull_secrets, node_selector and tolerations keep their Kubernetes types and
        # are set from the contract pod when it is built (build_pod_request_obj).
        self.pod_image_pull_secrets = image_pull_secrets
        self.pod_node_selector = node_selector
        self.pod_tolerations = tolerations
        self.sync_image = sync_image
        self.registry_conn_id = registry_conn_id
        self.dataset_manifest = dataset_manifest
        self.dataset_version = dataset_version
        self.experiment = experiment
        self.trial = trial
        self.run_uri = run_uri
        self.code_version = code_version
        self.gpus = gpus
        self.gpu_resource = gpu_resource
        self.cpu = cpu
        self.memory = memory
        self.cpu_limit = cpu_limit
        self.memory_limit = memory_limit
        self.s3_secret = s3_secret
        self.container_user = container_user
        self.sync_interval = sync_interval
        self.sync_quiet = sync_quiet
        self.sync_grace_period_seconds = sync_grace_period_seconds
        self.cache_claim = cache_claim
        self.dataset_bytes = dataset_bytes
        self.data_size = data_size
        self.checkpoint_size = checkpoint_size
        self.output_size = output_size
        self.training_bucket = training_bucket
        self.extra_env = extra_env or {}
        self.stage_in_timeout_seconds = stage_in_timeout_seconds
        self.unschedulable_grace_seconds = unschedulable_grace_seconds
        self.local_queue = local_queue
        self.priority_class = priority_class
        self.queue_timeout_seconds = queue_timeout_seconds
        self.queue_log_interval_seconds = queue_log_interval_seconds
        self.max_preemptions = max_preemptions
        self._interruptions: list[dict[str, Any]] = []
        # seconds the current pod waited for Kueue's admission (None: it never queued)
        self._pod_queued_s: float | None = None
        self.log_containers = list(log_containers)
        if (
            not self.deferrable
            and not self.init_container_logs
            and pod_spec.STAGE_IN_CONTAINER in self.log_containers
        ):
            # The task follows the training container's log itself; the stage-in container's
            # log, complete by then, comes first (the sidecar's comes when the pod ends: cleanup()).
            self.init_container_logs = [pod_spec.STAGE_IN_CONTAINER]
        self._startup_failure: AirflowException | None = None
        self._notes: list[str] = []

    @cached_property
    def pod_manager(self) -> TrainingPodManager:
        return TrainingPodManager(kube_client=self.client, callbacks=self.callbacks)

    # -- the pod -----------------------------------------------------------------------------

    def pod_config(self, context: Context | None, *, pin: bool = True) -> pod_spec.TrainingPodConfig:
        """The pod's settings for the task instance in ``context``: settings read and images resolved now.

        :param context: the task's context; ``None`` for a dry run (run ``dry-run``).
        :param pin: resolve the images to their digests in the registry.
        """
        if context is not None:
            run = run_from_context(
                context, run_uri=self.run_uri, trial=self.trial, training_bucket=self.training_bucket
            )
            run_id = context["run_id"]
        else:
            run = (
                RunLocation.from_uri(self.run_uri) if self.run_uri else S3Layout().run(self.dag_id, "dry-run")
            )
            run_id = "dry-run"
        image = pod_spec.resolve_image(self.image, "trainer")
        sync_image = pod_spec.resolve_image(self.sync_image, "sync")
        if pin:
            image = pin_image(image, registry_conn_id=self.registry_conn_id)
            sync_image = pin_image(sync_image, registry_conn_id=self.registry_conn_id)
        labels = {"kubetrain.io/dag-id": self.dag_id, "kubetrain.io/run-id": run_id}
        experiment = _text("experiment", self.experiment)
        if experiment:
            labels["kubetrain.io/experiment"] = experiment
        trial = _text("trial", self.trial)
        if trial is not None:
            labels["kubetrain.io/trial"] = trial
        labels.update(self.queue_labels())
        s3_secret = settings.get("s3_secret") if self.s3_secret is None else self.s3_secret
        return pod_spec.TrainingPodConfig(
            image=image,
            sync_image=sync_image,
            run_uri=run.uri,
            command=string_list("cmds", self.cmds),
            args=string_list("arguments", self.arguments),
            dataset_manifest=self.dataset_manifest or None,
            dataset_version=self.dataset_version or None,
            code_version=self.code_version or None,
            gpus=self.gpus,
            gpu_resource=self.gpu_resource or settings.get("gpu_resource"),
            cpu=self.cpu,
            memory=self.memory,
            cpu_limit=self.cpu_limit or None,
            memory_limit=self.memory_limit or None,
            s3_secret=s3_secret or None,
            service_account_name=self.service_account_name or settings.get("service_account") or None,
            image_pull_secrets=_names(self.pod_image_pull_secrets)
            or _names(settings.get("image_pull_secrets")),
            node_selector=(
                _node_selector(self.pod_node_selector)
                if self.pod_node_selector not in _EMPTY
                else settings.parse_node_selector(settings.get("node_selector"))
            )
            or None,
            tolerations=_tolerations(self.pod_tolerations)
            if self.pod_tolerations not in _EMPTY
            else tuple(settings.parse_tolerations(settings.get("tolerations"))),
            namespace=self.namespace or settings.get("namespace"),
            run_as_user=self.container_user,
            sync_interval=self.sync_interval,
            sync_quiet=self.sync_quiet,
            termination_grace_period=self.sync_grace_period_seconds,
            cache_claim=self.cache_claim,
            dataset_bytes=self.dataset_bytes,
            data_size=self.data_size or None,
            checkpoint_size=self.checkpoint_size,
            output_size=self.output_size,
            env=dict(self.extra_env),
            labels=labels,
        )

    def build_pod_request_obj(self, context: Context | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        config = self.pod_config(context, pin=not dry_run)
        # The contract pod is the template; the base class adds its name, task labels and any
        # extra env, volumes or secrets passed to the operator. Its own fields that overlap the
        # contract are set to the contract's values, so that reconciling the two changes nothing.
        template = pod_spec.training_pod(config)
        self.full_pod_spec = template
        self.image = config.image
        self.cmds = list(config.command or [])
        self.arguments = list(config.args or [])
        self.namespace = config.namespace
        self.service_account_name = config.service_account_name
        self.image_pull_secrets = template.spec.image_pull_secrets or []
        self.node_selector = template.spec.node_selector or {}
        self.tolerations = template.spec.tolerations or []
        if context is not None:
            context["ti"].xcom_push(key="run_uri", value=config.run_uri)
            context["ti"].xcom_push(key=NOTES_XCOM_KEY, value=[])
            if not self._interruptions:
                self._push_disruptions(context)
        self.log.info(
            "Training pod: image %s, run %s, %d x %s",
            config.image,
            config.run_uri,
            config.gpus,
            config.gpu_resource,
        )
        return super().build_pod_request_obj(context, dry_run=dry_run)

    def queue_labels(self) -> dict[str, str]:
        """Kueue's labels for the pod: its LocalQueue and priority class, when it has a queue."""
        queue = _text("local_queue", self.local_queue) or settings.get("queue")
        priority = _text("priority_class", self.priority_class)
        labels: dict[str, str] = {}
        for what, value in (("queue", queue), ("priority", priority)):
            if value and not _KUEUE_NAME.match(value):
                raise ValueError(
                    f"{what} {value!r} is not a Kueue object name: expected lowercase letters, digits, "
                    "'-' and '.', starting and ending with a letter or digit (at most 253 characters)"
                )
        if priority and not queue:
            raise ValueError(
                f"priority {priority!r} needs a queue: Kueue orders the workloads of a queue; set the queue "
                "Param or KUBETRAIN_QUEUE"
            )
        if queue:
            labels[QUEUE_LABEL] = queue
        if priority:
            labels[PRIORITY_LABEL] = priority
        return labels

    def _queue_timeout(self) -> float:
        value = self.queue_timeout_seconds
        if value is None:
            value = settings.get("queue_timeout")
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if seconds <= 0:
            raise ValueError(f"queue_timeout {value!r} is not valid: expected a number of seconds > 0")
        return seconds

    # -- start-up ----------------------------------------------------------------------------

    def pod_startup(self) -> PodStartup:
        """The start-up judge with this task's budgets."""
        return PodStartup(
            schedule_timeout=self.schedule_timeout_seconds,
            unschedulable_grace=self.unschedulable_grace_seconds,
            startup_timeout=self.startup_timeout_seconds,
            stage_in_timeout=self.stage_in_timeout_seconds,
            stage_in_container=pod_spec.STAGE_IN_CONTAINER,
            queue_timeout=self._queue_timeout(),
        )

    def await_pod_start(self, pod: k8s.V1Pod) -> None:
        """Wait until the pod runs, each start-up phase within its budget (the task is not deferred)."""
        startup = self.pod_startup()
        queue_due = 0.0
        try:
            remote = self.pod_manager.read_pod(pod)
            while True:
                events = self.pod_manager.read_pod_events(pod).items if startup.needs_events(remote) else []
                started = startup.observe(remote, events or [], datetime.now(UTC))
                self._pod_queued_s = startup.queued_s
                if started:
                    break
                if queued(remote) and time.monotonic() >= queue_due:
                    self.log.info("%s", self._queue_message(remote, startup.queued_s or 0.0))
                    queue_due = time.monotonic() + self.queue_log_interval_seconds
                # the next change of the pod, or the pod again after the interval (the budgets run on)
                remote = self.pod_manager.await_pod_change(remote, self.startup_check_interval_seconds)
        except STARTUP_FAILURES as exc:
            self._startup_failure = exc
            raise
        self._check_gpus(remote)

    def _queue_message(self, remote: k8s.V1Pod, waited_s: float) -> str:
        """What the task log says about a queued pod, with its Workload's reason where it can be read."""
        from kubernetes.client import CustomObjectsApi

        workloads: list[Any] = []
        local_queue = None
        try:
            api = CustomObjectsApi(self.client.api_client)
            namespace = remote.metadata.namespace
            listing = api.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads")
            workloads = list(listing.get("items") or [])
            name = queue_name(remote)
            if name:
                local_queue = api.get_namespaced_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, namespace, "localqueues", name
                )
        except Exception as exc:  # Kueue's objects need a Role rule (deploy/rbac.yaml grants it)
            self.log.debug("Could not read the Kueue workload of pod %s: %s", remote.metadata.name, exc)
        return queue_message(remote, waited_s, workloads, local_queue)

    def _gpu_resource(self) -> str:
        return str(self.gpu_resource or settings.get("gpu_resource"))

    def _check_gpus(self, remote: k8s.V1Pod) -> None:
        """Log, and keep for the report, that the pod's GPU request was served on CPU."""
        gpu_resource = self._gpu_resource()
        if not requested_gpus(remote, gpu_resource):
            return
        try:
            events = self.pod_manager.read_pod_events(remote).items or []
        except Exception as exc:
            self.log.debug("Could not read the events of pod %s: %s", remote.metadata.name, exc)
            events = []
        node = None
        if remote.spec.node_name:
            try:
                node = self.client.read_node(remote.spec.node_name)
            except (
                Exception
            ) as exc:  # reading nodes needs a cluster role that a namespace's Role does not give
                self.log.debug("Could not read node %s: %s", remote.spec.node_name, exc)
        note = gpu_served_on_cpu(remote, gpu_resource, events, node)
        if note:
            self.log.warning("%s", note)
            self._notes.append(note)

    # -- interruptions -----------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        while True:
            try:
                return super().execute(context)
            except (PodInterrupted, PodNotFoundException) as exc:
                if self.deferrable:
                    raise  # the trigger's resumption handles it (trigger_reentry)
                self._replace_interrupted(context, exc)

    def _replace_interrupted(
        self, context: Context, exc: BaseException, pod_name: str | None = None, code: int | None = None
    ) -> None:
        """Count an interruption and forget the pod, so that the next execution submits a new one;
        fail past ``max_preemptions``.

        :param code: the training container's exit code, when it was seen (75: it checkpointed on SIGTERM).
        """
        name = pod_name or (self.pod.metadata.name if self.pod is not None else None)
        reason = str(exc)
        if code is None:
            code = getattr(exc, "exit_code", None)
        self._interruptions.append(
            {
                "pod": name,
                "reason": reason,
                "at": datetime.now(UTC).isoformat(),
                "queued_s": self._pod_queued_s,
                "exit_code": code,
            }
        )
        self._pod_queued_s = None
        self._push_disruptions(context)
        count = len(self._interruptions)
        if count > self.max_preemptions:
            raise AirflowFailException(
                f"the training pod was ended from outside {count} times in this try (last: {reason}), more "
                f"than max_preemptions={self.max_preemptions}: the cluster keeps preempting or evicting it; "
                "raise the run's priority, its queue's quota or max_preemptions"
            ) from exc
        note = (
            f"pod {name} was ended from outside ({reason}); a new pod resumes from the last checkpoint "
            f"in the same try (interruption {count} of at most {self.max_preemptions})"
        )
        self.log.warning("%s", note)
        self._notes.append(note)
        self.trigger_kwargs = {
            k: v
            for k, v in (self.trigger_kwargs or {}).items()
            if k not in ("_redefer_count", INTERRUPTIONS_KEY)
        }
        self.trigger_kwargs[INTERRUPTIONS_KEY] = list(self._interruptions)
        self.trigger_kwargs[NOTES_KEY] = list(self._notes)
        self.pod = None
        self.pod_request_obj = None
        self.remote_pod = None
        self._startup_failure = None

    def defer(
        self, *, trigger: Any, method_name: str, kwargs: dict[str, Any] | None = None, timeout: Any = None
    ) -> None:
        """Defer as the base class does, with its pod trigger extended by kubetrain's start-up phases and logs."""
        if type(trigger) is KubernetesPodTrigger:
            # without the kubeconfig the provider read (its token) and the connection's extras
            trigger = TrainingPodTrigger.of(
                trigger,
                self.config_file,
                stage_in_timeout=self.stage_in_timeout_seconds,
                unschedulable_grace=self.unschedulable_grace_seconds,
                stage_in_container=pod_spec.STAGE_IN_CONTAINER,
                log_containers=self.log_containers,
                gpu_resource=self._gpu_resource(),
                queue_timeout=self._queue_timeout(),
                queue_log_interval=self.queue_log_interval_seconds,
            )
        super().defer(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)

    def _push_disruptions(self, context: Context | None) -> None:
        """XCom ``disruptions``: this try's interruptions and the time its pods waited in the queue."""
        if context is None:
            return
        queued_total = sum(float(i.get("queued_s") or 0.0) for i in self._interruptions)
        queued_total += self._pod_queued_s or 0.0
        context["ti"].xcom_push(
            key=DISRUPTIONS_XCOM_KEY,
            value={"interruptions": list(self._interruptions), "queued_s": round(queued_total, 3)},
        )

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> Any:
        self._startup_failure = failure_from_event(event)
        self._interruptions = list(event.get(INTERRUPTIONS_KEY) or [])
        if event.get(QUEUED_KEY) is not None:
            self._pod_queued_s = float(event[QUEUED_KEY])
        # the notes of earlier pods of this try (interruptions) come back in the event, then this pod's
        self._notes = [str(note) for note in event.get(NOTES_KEY) or []]
        # The trigger read every container's log to its end: reading the training container's
        # log again from the last interval would repeat its last lines.
        get_logs = self.get_logs
        if event.get(LOGS_FLUSHED_KEY):
            self.get_logs = False
        try:
            return super().trigger_reentry(context, event)
        except (PodInterrupted, PodNotFoundException) as exc:
            if isinstance(exc, PodNotFoundException) and event.get("status") == "success":
                # the trigger saw the training container exit 0 before the pod went: it finished
                self.log.warning(
                    "pod %s was deleted after its training container finished (exit 0): taken as finished",
                    event.get("name"),
                )
                return None
            if isinstance(exc, PodNotFoundException):  # gone already: the trigger saw why, if it could
                reason = event.get(INTERRUPTED_KEY) or "deleted"
                exc = PodInterrupted(f"pod {event.get('name')}: {reason}")
            self._replace_interrupted(context, exc, event.get("name"), event.get(INTERRUPTED_EXIT_KEY))
            self.get_logs = get_logs
            return self.execute(context)  # a new pod: defers again
        except AirflowException as exc:
            if event.get(INTERRUPTED_KEY) and self.pod is None and not isinstance(exc, STARTUP_FAILURES):
                # The trigger saw the pod ended from outside, and it was gone (deleted by Kueue or a drain)
                # before the base class's wait for its completion: that wait forgot the pod, so the cleanup
                # that tells an interruption from a failure never ran, and "Container state failed" is not
                # this task's failure.
                interrupted = PodInterrupted(f"pod {event.get('name')}: {event[INTERRUPTED_KEY]}")
                self._replace_interrupted(
                    context, interrupted, event.get("name"), event.get(INTERRUPTED_EXIT_KEY)
                )
                self.get_logs = get_logs
                return self.execute(context)  # a new pod: defers again
            if self._startup_failure is None or isinstance(exc, STARTUP_FAILURES):
                raise
            raise self._startup_failure from exc
        finally:
            self.get_logs = get_logs

    def cleanup(
        self,
        pod: k8s.V1Pod,
        remote_pod: k8s.V1Pod,
        xcom_result: dict | None = None,
        context: Context | None = None,
    ) -> None:
        if context is not None:
            context["ti"].xcom_push(key=NOTES_XCOM_KEY, value=list(self._notes))
            self._push_disruptions(context)
        if not self.deferrable and self.get_logs and remote_pod is not None:
            self._log_sidecar_lines(remote_pod)
        # A training container that exited 0 finished its training, whatever happens to its pod next: a
        # preemption or a drain that deletes the pod afterwards (read again below: gone, or marked with
        # a DisruptionTarget) does not make it an interruption to run again.
        finished = exit_code(remote_pod, self.base_container_name) == 0
        if self._startup_failure is None and not self._killed and remote_pod is not None and not finished:
            # the pod as it is now: a task that waited in the worker holds an older copy, and a pod
            # deleted meanwhile is gone (a pod never created has no remote_pod and is not read)
            try:
                remote_pod = self.pod_manager.read_pod(remote_pod)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                remote_pod = None
            reason = interruption(remote_pod, self.base_container_name)
            if reason is not None:
                # the base class deletes (or marks as checked) the old pod; its "returned a failure" is
                # not this task's failure
                with contextlib.suppress(AirflowException):
                    super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)
                name = remote_pod.metadata.name if remote_pod is not None else pod.metadata.name
                raise PodInterrupted(f"pod {name}: {reason}", exit_code(remote_pod, self.base_container_name))
        # The base class deletes the pod that never started and fails with "Pod ... returned a
        # failure"; the start-up failure says why, and its class says whether to retry.
        try:
            super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)
        except AirflowException as exc:
            if isinstance(exc, STARTUP_FAILURES):
                raise
            if self._startup_failure is not None:
                raise self._startup_failure from exc
            final = self._no_retry_failure(remote_pod)
            if final is None:
                raise
            raise final from exc

    def _log_sidecar_lines(self, remote_pod: k8s.V1Pod) -> None:
        """Log the lines of the containers that ran beside the training container (a task that did not defer).

        The base class follows only the training container's log while the pod runs; the
        checkpoint-sync sidecar's lines (uploads, its final pass, an early stop) are read once
        the pod has ended, before it is deleted.
        """
        init = self.init_container_logs  # the provider's: a name, names, or True for every init container
        if init is True:
            return  # the sidecar, a native sidecar, is an init container: its lines were followed already
        followed = {self.base_container_name, *([init] if isinstance(init, str) else init or ())}
        for name in self.log_containers:
            if name in followed:
                continue
            try:
                self.pod_manager.fetch_container_logs(
                    remote_pod,
                    name,
                    follow=False,
                    container_name_log_prefix_enabled=self.container_name_log_prefix_enabled,
                    log_formatter=self.log_formatter,
                )
            except (
                Exception
            ) as exc:  # a pod already gone has no log; the task's outcome does not depend on it
                self.log.info(
                    "The log of container %s of pod %s could not be read: %s",
                    name,
                    remote_pod.metadata.name,
                    exc,
                )

    def _no_retry_failure(self, remote_pod: k8s.V1Pod) -> AirflowFailException | None:
        """The failure that ends the task without retries, when the training container's exit code says so."""
        statuses = (remote_pod.status.container_statuses if remote_pod.status else None) or []
        status = next((s for s in statuses if s.name == self.base_container_name), None)
        terminated = status.state.terminated if status is not None and status.state else None
        if terminated is None or terminated.exit_code not in self.no_retry_exit_codes:
            return None
        code = terminated.exit_code
        return AirflowFailException(
            f"the {self.base_container_name} container of pod {remote_pod.metadata.name} exited with {code}: "
            f"{self.no_retry_exit_codes[code]}; not retried, a retry would fail the same way "
            "(its last lines are in the log above)"
        )
