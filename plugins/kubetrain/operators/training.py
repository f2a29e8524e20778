"""Run one training pod: the KubernetesPodOperator with kubetrain's pod contract."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from kubernetes.client import models as k8s

from kubetrain import pod_spec, settings
from kubetrain.doc_md import class_doc_md
from kubetrain.hooks.registry import RegistryHook
from kubetrain.images import pin_image
from kubetrain.operators import training_args as args
from kubetrain.operators.resumable import NOTES_XCOM_KEY, ResumablePodOperator
from kubetrain.pod_sizing import checked_int, dataset_bytes_of, prepared_bytes_given
from kubetrain.pod_startup import (
    ImagePullError,
    PodStartupTimeout,
    PodUnschedulableError,
    QueueTimeout,
    StageInError,
)
from kubetrain.s3_layout import RunLocation, S3Layout, run_from_context

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = [
    "ImagePullError",
    "PodStartupTimeout",
    "PodUnschedulableError",
    "QueueTimeout",
    "StageInError",
    "TrainingPodOperator",
]

# Parts of the pod that kubetrain.pod_spec owns; the base class must not set them a second
# time, or its values would replace the contract's when the two are reconciled.
_OWNED = ("container_resources", "security_context", "container_security_context", "full_pod_spec")


class TrainingPodOperator(ResumablePodOperator):
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
    parameters, 3 training diverged, 65 unusable data, 66 DATA_DIR missing) fails the task without
    retries; any other failure, 75 (stopped by SIGTERM after a checkpoint) included, is retried as
    usual and the next try resumes from the checkpoints. A pod ended from outside (preempted, evicted,
    drained, deleted) is replaced in the same try by a new pod that resumes from the last checkpoint,
    up to ``max_preemptions`` times. Both rules are :func:`kubetrain.operators.interruption.pod_end`'s.

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
    :param image_pull_secrets: registry Secret names: a list or ``a,b`` (default: the setting). (templated)
    :param node_selector: node labels: a dict or ``k=v,k2=v2`` (default: the setting). (templated)
    :param tolerations: extra tolerations: V1Toleration objects or dicts (default: the setting); GPU pods
        always tolerate their GPU vendor's taint. (templated)
    :param namespace: namespace of the pod (default: the setting ``namespace``). (templated)
    :param container_user: numeric non-root user of all containers (default 10001, the user of the trainer and sync
        images); not Airflow's own ``run_as_user``, which names the Unix user that runs the task.
    :param sync_interval: seconds between checkpoint uploads. (templated)
    :param sync_quiet: seconds a file must stay unmodified before upload.
    :param termination_grace_period: the pod's termination grace period (the provider's argument), the time
        the final sync pass gets after SIGTERM.
    :param cache_claim: PersistentVolumeClaim for the stage-in cache.
    :param dataset_bytes: the staged manifest's ``total_bytes``, e.g. ``stage.output["total_bytes"]``:
        sizes the /data volume and the pod's ephemeral-storage request
        (:func:`kubetrain.pod_sizing.scratch_sizes`). (templated)
    :param prepared_bytes: bytes of the prepared copy the trainer keeps beside the dataset in /data (the
        image classifier's decoded, resized records: :func:`kubetrain.pod_sizing.prepared_bytes_of` of the
        dataset's image count and the run's image size and channels), added to the /data size derived from
        ``dataset_bytes``; empty: none counted. (templated)
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
        "image_pull_secrets",
        "tolerations",
        "training_bucket",
        "extra_env",
        "sync_interval",
        "dataset_bytes",
        "prepared_bytes",
        "data_size",
        "checkpoint_size",
        "output_size",
        "local_queue",
        "priority_class",
    )
    template_fields_renderers = {**KubernetesPodOperator.template_fields_renderers, "extra_env": "py"}

    # Kept as given, not as the provider's Kubernetes objects: a template renders into them (text, or the
    # native object); pod_config turns them into what the pod gets, and build_pod_request_obj lends the
    # provider their Kubernetes form while it builds the pod.
    image_pull_secrets: list[str] | str | None  # type: ignore[assignment]  # as given (above)
    node_selector: dict[str, str] | str | None  # type: ignore[assignment]  # as given (above)
    tolerations: list[k8s.V1Toleration] | list[dict[str, Any]] | str | None  # type: ignore[assignment]  # as given

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
        tolerations: list[k8s.V1Toleration] | list[dict[str, Any]] | str | None = None,
        container_user: int = 10001,
        sync_interval: int | str = 30,
        sync_quiet: int = 2,
        termination_grace_period: int = 300,
        cache_claim: str | None = None,
        dataset_bytes: int | str | None = None,
        prepared_bytes: int | str | None = None,
        data_size: str | None = None,
        checkpoint_size: str = "4Gi",
        output_size: str = "2Gi",
        training_bucket: str | None = None,
        extra_env: dict[str, str] | None = None,
        local_queue: str | None = None,
        priority_class: str | None = None,
        **kwargs: Any,
    ) -> None:
        for owned in _OWNED:
            if owned in kwargs:
                raise ValueError(f"TrainingPodOperator builds {owned} itself: remove the {owned}= argument")
        kwargs.setdefault("doc_md", class_doc_md(type(self)))
        super().__init__(
            image=image,
            service_account_name=service_account_name,
            termination_grace_period=termination_grace_period,
            **kwargs,
        )
        # As given (a template renders into them); the pod gets them as Kubernetes objects, merged with
        # the deployment's settings (build_pod_request_obj).
        self.image_pull_secrets = image_pull_secrets
        self.node_selector = node_selector
        self.tolerations = tolerations
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
        self.cache_claim = cache_claim
        self.dataset_bytes = dataset_bytes
        self.prepared_bytes = prepared_bytes
        self.data_size = data_size
        self.checkpoint_size = checkpoint_size
        self.output_size = output_size
        self.training_bucket = training_bucket
        self.extra_env = extra_env or {}
        self.local_queue = local_queue
        self.priority_class = priority_class

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
        experiment = args.text("experiment", self.experiment)
        if experiment:
            labels["kubetrain.io/experiment"] = experiment
        trial = args.text("trial", self.trial)
        if trial is not None:
            labels["kubetrain.io/trial"] = trial
        labels.update(self.queue_labels())
        s3_secret = settings.get("s3_secret") if self.s3_secret is None else self.s3_secret
        return pod_spec.TrainingPodConfig(
            image=image,
            sync_image=sync_image,
            run_uri=run.uri,
            command=args.string_list("cmds", self.cmds),
            args=args.string_list("arguments", self.arguments),
            dataset_manifest=self.dataset_manifest or None,
            dataset_version=self.dataset_version or None,
            code_version=self.code_version or None,
            # templated: a rendered template is text ("2"); checked as TrainingPodConfig checks them
            gpus=checked_int("gpus", self.gpus, minimum=0),
            gpu_resource=self.gpu_resource or settings.get("gpu_resource"),
            cpu=self.cpu,
            memory=self.memory,
            cpu_limit=self.cpu_limit or None,
            memory_limit=self.memory_limit or None,
            s3_secret=s3_secret or None,
            service_account_name=self.service_account_name or settings.get("service_account") or None,
            image_pull_secrets=args.pull_secret_names(self.image_pull_secrets)
            or args.pull_secret_names(settings.get("image_pull_secrets")),
            node_selector=(
                args.node_selector(self.node_selector)
                if self.node_selector not in args.EMPTY
                else settings.parse_node_selector(settings.get("node_selector"))
            )
            or None,
            tolerations=args.tolerations(self.tolerations)
            if self.tolerations not in args.EMPTY
            else tuple(settings.parse_tolerations(settings.get("tolerations"))),
            namespace=self.namespace or settings.get("namespace"),
            run_as_user=self.container_user,
            sync_interval=checked_int("sync_interval", self.sync_interval, minimum=1),
            sync_quiet=self.sync_quiet,
            termination_grace_period=checked_int(
                "termination_grace_period", self.termination_grace_period, minimum=1
            ),
            cache_claim=self.cache_claim,
            dataset_bytes=dataset_bytes_of(self.dataset_bytes),
            prepared_bytes=prepared_bytes_given(self.prepared_bytes),
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
        if context is not None:
            context["ti"].xcom_push(key="run_uri", value=config.run_uri)
            context["ti"].xcom_push(key=NOTES_XCOM_KEY, value=[])
            if not self._disruptions.interruptions:
                self._push_disruptions(context)
        self.log.info(
            "Training pod: image %s, run %s, %d x %s",
            config.image,
            config.run_uri,
            config.gpus,
            config.gpu_resource,
        )
        # the arguments as given stay for the next pod of the try (their Kubernetes form adds the GPU toleration)
        given = (self.image_pull_secrets, self.node_selector, self.tolerations)
        self.image_pull_secrets = template.spec.image_pull_secrets or []
        self.node_selector = template.spec.node_selector or {}
        self.tolerations = template.spec.tolerations or []
        try:
            return super().build_pod_request_obj(context, dry_run=dry_run)
        finally:
            self.image_pull_secrets, self.node_selector, self.tolerations = given

    def queue_labels(self) -> dict[str, str]:
        """Kueue's labels for the pod: its LocalQueue and priority class, when it has a queue."""
        return args.queue_labels(self.local_queue, self.priority_class)
