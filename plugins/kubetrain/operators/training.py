"""Run one training pod: the KubernetesPodOperator with kubetrain's pod contract."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from kubetrain.s3_layout import DEFAULT_S3_SECRET, run_from_context

if TYPE_CHECKING:
    import jinja2
    from airflow.sdk import Context
    from kubernetes.client import models as k8s

    from kubetrain import pod_spec
    from kubetrain.operators._training_pod import TrainingPod

# The arguments of KubernetesPodOperator (cncf-kubernetes 10.25), so that a DAG can pass any
# of them while its file never imports that operator; tests/plugins/test_training_pod.py
# checks both lists against the installed provider.
POD_OPERATOR_ARGUMENTS = frozenset(
    """
    kubernetes_conn_id namespace image name random_name_suffix cmds arguments ports volume_mounts
    volumes env_vars env_from secrets in_cluster cluster_context labels reattach_on_restart durable
    startup_timeout_seconds startup_check_interval_seconds schedule_timeout_seconds get_logs
    base_container_name base_container_status_polling_interval init_container_logs container_logs
    image_pull_policy annotations container_resources affinity config_file runtime_class_name
    node_selector image_pull_secrets service_account_name automount_service_account_token hostnetwork
    host_aliases tolerations security_context container_security_context
    xcom_sidecar_container_security_context dnspolicy dns_config hostname subdomain schedulername
    full_pod_spec init_containers log_events_on_failure log_events_on_startup do_xcom_push
    pod_template_file pod_template_dict priority_class_name pod_runtime_info_envs
    termination_grace_period configmaps skip_on_exit_code deferrable poll_interval
    log_pod_spec_on_failure on_finish_action on_kill_action is_delete_operator_pod
    termination_message_policy active_deadline_seconds callbacks progress_callback logging_interval
    trigger_kwargs container_name_log_prefix_enabled log_formatter
    """.split()
)
POD_OPERATOR_TEMPLATE_FIELDS: tuple[str, ...] = (
    "image",
    "name",
    "hostname",
    "cmds",
    "annotations",
    "arguments",
    "env_vars",
    "labels",
    "config_file",
    "pod_template_file",
    "pod_template_dict",
    "namespace",
    "container_resources",
    "volumes",
    "volume_mounts",
    "cluster_context",
    "env_from",
    "configmaps",
    "node_selector",
    "kubernetes_conn_id",
    "base_container_name",
    "trigger_kwargs",
)
# Template fields inside Kubernetes objects, as KubernetesPodOperator renders them, keyed by
# class name so that nothing needs the kubernetes client to decide.
_NESTED_TEMPLATE_FIELDS = {
    "V1EnvVar": ("value", "name"),
    "V1ResourceRequirements": ("limits", "requests"),
    "V1Volume": ("name", "persistent_volume_claim", "config_map"),
    "V1VolumeMount": ("name", "sub_path"),
    "V1PersistentVolumeClaimVolumeSource": ("claim_name",),
    "V1ConfigMapVolumeSource": ("name",),
    "V1EnvFromSource": ("config_map_ref",),
    "V1ConfigMapEnvSource": ("name",),
}
# Parts of the pod that kubetrain.pod_spec owns; the base class must not set them a second
# time, or its values would replace ours when the two are reconciled.
_OWNED = ("container_resources", "security_context", "container_security_context", "full_pod_spec")


class PodUnschedulableError(AirflowException):
    """The training pod stayed Pending because no node can take it (e.g. no free GPU)."""


def scheduling_problem(pod: k8s.V1Pod | None, events: Sequence[Any] = ()) -> str | None:
    """Why a Pending pod was not scheduled, from its FailedScheduling events or PodScheduled condition.

    :param pod: the pod as last read from the API.
    :param events: the pod's events (``CoreV1Event``), oldest first.
    :return: ``"FailedScheduling: <scheduler message>"``, or ``None`` when the pod was scheduled.
    """
    status = getattr(pod, "status", None)
    if status is None or status.phase not in (None, "Pending"):
        return None
    conditions = status.conditions or []
    if any(c.type == "PodScheduled" and c.status == "True" for c in conditions):
        return None
    for event in reversed(list(events)):
        if event.reason == "FailedScheduling" and event.message:
            return f"FailedScheduling: {event.message}"
    for condition in conditions:
        if condition.type == "PodScheduled" and condition.status == "False" and condition.message:
            return f"{condition.reason or 'Unschedulable'}: {condition.message}"
    return None


def string_list(name: str, value: Any) -> list[str] | None:
    """A command or argument list; a string must be a JSON array (``{{ params.args | tojson }}``).

    Lets a DAG take the whole command or argument list from an array Param.

    :param name: the operator argument, for the error message.
    :param value: a list of strings, a JSON array of strings, or empty.
    """
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                f"{name} {value!r} is not a list: expected a list of strings or a JSON array such as "
                "'{{ params.args | tojson }}'"
            ) from None
    if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
        raise ValueError(f"{name} {value!r} is not a list of strings")
    return [str(v) for v in value]


class TrainingPodOperator(BaseOperator):
    """Run a training container in a pod built by :mod:`kubetrain.pod_spec`.

    The pod gets the stage-in init container, the checkpoint-sync native sidecar and the base
    container with ``DATA_DIR``, ``CHECKPOINT_DIR``, ``OUTPUT_DIR`` and the ``KUBETRAIN_*``
    variables. Its run prefix is ``s3://<training>/runs/<dag_id>/<run_id>`` (plus
    ``/trials/<trial>`` for sweeps): the same for every try, so a retried task resumes from its
    checkpoints. The run URI is pushed as XCom ``run_uri``.

    The pod is run by a KubernetesPodOperator (:class:`kubetrain.operators._training_pod.TrainingPod`)
    that this task builds when it runs, so that a DAG file parses without loading the Kubernetes
    clients; every KubernetesPodOperator argument is accepted and passed on. By default the task
    defers while the pod runs, streams the base container's logs and deletes the pod when it
    ends, success or failure. A pod that cannot be scheduled (no node with a free GPU) fails after
    ``schedule_timeout_seconds`` with the scheduler's FailedScheduling message in the error.

    Images are resolved when the task runs: ``image`` else Variable ``kubetrain_trainer_image``
    else env ``KUBETRAIN_TRAINER_IMAGE`` else ``<KUBETRAIN_REGISTRY>/kubetrain/trainer:latest``;
    the sync image likewise (``kubetrain_sync_image``, ``KUBETRAIN_SYNC_IMAGE``, ``kubetrain/sync``).

    :param image: training image (default: see above). (templated)
    :param sync_image: image of the stage-in and checkpoint-sync containers. (templated)
    :param cmds: base container command. (templated)
    :param arguments: base container arguments. (templated)
    :param dataset_manifest: ``s3://`` URI of the staged manifest, e.g. from StageDatasetOperator's XCom. (templated)
    :param dataset_version: version of that manifest. (templated)
    :param experiment: experiment name, a pod label. (templated)
    :param trial: sweep trial name; mapped tasks default to their map index. (templated)
    :param run_uri: explicit run URI instead of the layout's. (templated)
    :param code_version: recorded in params.json (default: image tag or digest). (templated)
    :param gpus: ``nvidia.com/gpu`` count, request == limit. (templated)
    :param cpu: CPU request of the base container. (templated)
    :param memory: memory request of the base container. (templated)
    :param cpu_limit: CPU limit (default: the request). (templated)
    :param memory_limit: memory limit (default: the request). (templated)
    :param s3_secret: Secret with the AWS_* variables; ``None`` for workload identity. (templated)
    :param image_pull_secrets: registry Secret names (list or comma-separated).
    :param tolerations: extra tolerations; GPU pods always tolerate ``nvidia.com/gpu:NoSchedule``.
    :param container_user: numeric non-root user of all containers (default 10001, the user of the trainer and sync
        images); not Airflow's own ``run_as_user``, which names the Unix user that runs the task.
    :param sync_interval: seconds between checkpoint uploads. (templated)
    :param sync_quiet: seconds a file must stay unmodified before upload.
    :param sync_grace_period_seconds: pod termination grace period, the time the final sync pass gets.
    :param cache_claim: PersistentVolumeClaim for the stage-in cache.
    :param scratch_size_limit: sizeLimit of the emptyDir volumes.
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param extra_env: plain environment for the base container (no secrets). (templated)
    :param kwargs: BaseOperator arguments (task_id, pool, retries, ...) and everything
        KubernetesPodOperator accepts (namespace, kubernetes_conn_id, ...).
    """

    template_fields: Sequence[str] = (
        *POD_OPERATOR_TEMPLATE_FIELDS,
        "sync_image",
        "dataset_manifest",
        "dataset_version",
        "experiment",
        "trial",
        "run_uri",
        "code_version",
        "gpus",
        "cpu",
        "memory",
        "cpu_limit",
        "memory_limit",
        "s3_secret",
        "training_bucket",
        "extra_env",
        "sync_interval",
    )
    template_fields_renderers = {"env_vars": "py", "extra_env": "py"}

    def __init__(
        self,
        *,
        image: str | None = None,
        sync_image: str | None = None,
        dataset_manifest: str | None = None,
        dataset_version: str | None = None,
        experiment: str | None = None,
        trial: str | None = None,
        run_uri: str | None = None,
        code_version: str | None = None,
        gpus: int | str = 0,
        cpu: str = "1",
        memory: str = "2Gi",
        cpu_limit: str | None = None,
        memory_limit: str | None = None,
        s3_secret: str | None = DEFAULT_S3_SECRET,
        image_pull_secrets: list[str] | str | None = None,
        tolerations: list[k8s.V1Toleration] | None = None,
        container_user: int = 10001,
        sync_interval: int | str = 30,
        sync_quiet: int = 2,
        sync_grace_period_seconds: int = 300,
        cache_claim: str | None = None,
        scratch_size_limit: str | None = None,
        training_bucket: str | None = None,
        extra_env: dict[str, str] | None = None,
        deferrable: bool = True,
        on_finish_action: str = "delete_pod",
        get_logs: bool = True,
        startup_timeout_seconds: int = 600,
        schedule_timeout_seconds: int = 300,
        termination_message_policy: str = "FallbackToLogsOnError",
        do_xcom_push: bool = False,
        **kwargs: Any,
    ) -> None:
        for owned in _OWNED:
            if owned in kwargs:
                raise ValueError(f"TrainingPodOperator builds {owned} itself: remove the {owned}= argument")
        pod_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if name in POD_OPERATOR_ARGUMENTS}
        super().__init__(do_xcom_push=do_xcom_push, **kwargs)
        pod_kwargs.update(
            image=image,
            deferrable=deferrable,
            on_finish_action=on_finish_action,
            get_logs=get_logs,
            startup_timeout_seconds=startup_timeout_seconds,
            schedule_timeout_seconds=schedule_timeout_seconds,
            # A crashed trainer's last log lines become the task's error message.
            termination_message_policy=termination_message_policy,
        )
        # Every pod argument is an attribute, as on the pod operator itself, so that the
        # template fields among them render here and show in the UI's rendered view.
        for name in POD_OPERATOR_TEMPLATE_FIELDS:
            setattr(self, name, None)
        for name, value in pod_kwargs.items():
            setattr(self, name, value)
        self._pod_arguments = tuple(pod_kwargs)
        self.sync_image = sync_image
        self.dataset_manifest = dataset_manifest
        self.dataset_version = dataset_version
        self.experiment = experiment
        self.trial = trial
        self.run_uri = run_uri
        self.code_version = code_version
        self.gpus = gpus
        self.cpu = cpu
        self.memory = memory
        self.cpu_limit = cpu_limit
        self.memory_limit = memory_limit
        self.s3_secret = s3_secret
        self.training_image_pull_secrets = (
            [s.strip() for s in image_pull_secrets.split(",") if s.strip()]
            if isinstance(image_pull_secrets, str)
            else list(image_pull_secrets or [])
        )
        self.extra_tolerations = list(tolerations or [])
        self.container_user = container_user
        self.sync_interval = sync_interval
        self.sync_quiet = sync_quiet
        self.sync_grace_period_seconds = sync_grace_period_seconds
        self.cache_claim = cache_claim
        self.scratch_size_limit = scratch_size_limit
        self.training_bucket = training_bucket
        self.extra_env = extra_env or {}
        self._pod: TrainingPod | None = None

    def _render_nested_template_fields(
        self, content: Any, context: Context, jinja_env: jinja2.Environment, seen_oids: set[int]
    ) -> None:
        fields = _NESTED_TEMPLATE_FIELDS.get(type(content).__name__)
        if fields and id(content) not in seen_oids:
            seen_oids.add(id(content))
            self._do_render_template_fields(content, fields, context, jinja_env, seen_oids)
            return
        super()._render_nested_template_fields(content, context, jinja_env, seen_oids)

    def pod_operator(self) -> TrainingPod:
        """A new KubernetesPodOperator for this task, from its (rendered) arguments."""
        from kubetrain.operators._training_pod import TrainingPod

        kwargs = {name: getattr(self, name) for name in self._pod_arguments}
        self._pod = TrainingPod(training=self, **kwargs)
        return self._pod

    def execute(self, context: Context) -> Any:
        pod = self.pod_operator()
        # Run it as the task runner runs an operator, so that it does not warn of being
        # called from outside the runner.
        from airflow.sdk.bases.operator import ExecutorSafeguard

        return pod.execute(context, **{f"{type(pod).__name__}__sentinel": ExecutorSafeguard.sentinel_value})

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> Any:
        """Where the deferred task resumes: the pod ended, or its logs are due."""
        return self.pod_operator().trigger_reentry(context, event)

    def execute_complete(self, context: Context, event: dict[str, Any], **kwargs: Any) -> Any:
        return self.trigger_reentry(context, event)

    def on_kill(self) -> None:
        if self._pod is not None:
            self._pod.on_kill()

    def build_pod_request_obj(self, context: Context | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        """The pod this task asks for (see KubernetesPodOperator.build_pod_request_obj)."""
        return self.pod_operator().build_pod_request_obj(context, dry_run=dry_run)

    def dry_run(self) -> None:
        self.pod_operator().dry_run()

    def pod_config(self, context: Context | None) -> pod_spec.TrainingPodConfig:
        """The pod's settings for the task instance in ``context`` (images resolved now)."""
        from kubetrain import pod_spec

        if context is not None:
            run = run_from_context(
                context, run_uri=self.run_uri, trial=self.trial, training_bucket=self.training_bucket
            )
            run_id = context["run_id"]
        else:  # dry_run() renders the pod without a task instance
            from kubetrain.s3_layout import RunLocation, S3Layout

            run = (
                RunLocation.from_uri(self.run_uri) if self.run_uri else S3Layout().run(self.dag_id, "dry-run")
            )
            run_id = "dry-run"
        image = pod_spec.resolve_image(
            self.image,
            variable="kubetrain_trainer_image",
            env="KUBETRAIN_TRAINER_IMAGE",
            repository="kubetrain/trainer",
        )
        sync_image = pod_spec.resolve_image(
            self.sync_image,
            variable="kubetrain_sync_image",
            env="KUBETRAIN_SYNC_IMAGE",
            repository="kubetrain/sync",
        )
        labels = {"kubetrain.io/dag-id": self.dag_id, "kubetrain.io/run-id": run_id}
        if self.experiment:
            labels["kubetrain.io/experiment"] = self.experiment
        if self.trial not in (None, ""):
            labels["kubetrain.io/trial"] = str(self.trial)
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
            cpu=self.cpu,
            memory=self.memory,
            cpu_limit=self.cpu_limit or None,
            memory_limit=self.memory_limit or None,
            s3_secret=self.s3_secret or None,
            service_account_name=getattr(self, "service_account_name", None),
            image_pull_secrets=tuple(self.training_image_pull_secrets),
            node_selector=self.node_selector or None,
            tolerations=tuple(self.extra_tolerations),
            run_as_user=self.container_user,
            sync_interval=self.sync_interval,
            sync_quiet=self.sync_quiet,
            termination_grace_period=self.sync_grace_period_seconds,
            cache_claim=self.cache_claim,
            scratch_size_limit=self.scratch_size_limit,
            env=dict(self.extra_env),
            labels=labels,
        )
