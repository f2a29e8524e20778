"""The task chain every training DAG shares, and the Params that drive it.

    stage_dataset -> check_new -> train -> report -> promote -> record

Each task hands its results to the next as typed XComs (``task.output[...]``): the staged
version and manifest, the training image pinned by digest and the fingerprint, the run URI,
whether the run beats the promoted model, what was promoted.

Training DAG files take their Params and trainer arguments from a trainer's spec
(:mod:`kubetrain.trainers`) and call :func:`training_pipeline` inside their ``with DAG(...)``
block; this module holds the wiring so that the DAG files stay thin.

**Native values.** The DAG renders its templates as native objects
(``render_template_as_native_obj=True``): ``{{ params.gpus }}`` reaches the training task as
an integer, ``{{ params.node_selector }}`` as the Param's mapping, ``{{ params.args }}`` as its
list; nothing is written to text and parsed back. The free names (model name, experiment) reach
their tasks as the Params themselves (``dag.param("model_name")``, resolved when the task runs):
native rendering would read a rendered ``1.10`` as the number 1.1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import Param, XComArg

from kubetrain.defaults import DEFAULT_ARGS
from kubetrain.operators.dedupe import RecordFailedRun, RecordTrainingOperator, SkipIfTrainedOperator
from kubetrain.operators.promote import PromoteModelOperator
from kubetrain.operators.report import ReportOperator
from kubetrain.operators.stage import StageDatasetOperator, dataset_asset
from kubetrain.operators.training import TrainingPodOperator
from kubetrain.params import S3_URI, SWITCH, form_order, native_dag, with_dialect
from kubetrain.settings import DNS_SUBDOMAIN, LABEL_VALUE_PATTERN, QUALIFIED_NAME_PATTERN, environ

if TYPE_CHECKING:
    from airflow.sdk import Asset, AssetOrTimeSchedule, BaseOperator

__all__ = ["DEFAULT_ARGS", "TrainingTasks", "common_params", "form_order", "schedule", "training_pipeline"]

# The trigger form's quantities, each small enough that Kubernetes can count it as an int64 (bytes, or
# millicores for CPU: kubetrain.pod_sizing.quantity holds the exact rule). A pattern cannot compare
# numbers, so each suffix gets as many digits as surely fit: up to 18 digits of bytes (10**18 < 2**63),
# 15 of k/Ki, 12 of M/Mi, 9 of G/Gi, 6 of T/Ti, 3 of P/Pi; CPU up to 15 digits of cores or 18 of
# millicores, with at most nano precision (9 decimals of a core).
CPU_PATTERN = r"^([0-9]{1,15}(\.[0-9]{1,9})?|[0-9]{1,18}(\.[0-9]{1,6})?m)$"
MEMORY_PATTERN = r"^([0-9]{1,18}|[0-9]{1,15}(Ki|k)|[0-9]{1,12}(Mi|M)|[0-9]{1,9}(Gi|G)|[0-9]{1,6}(Ti|T))$"
SIZE_PATTERN = (
    r"^([0-9]{1,15}(\.[0-9]{1,9})?(Ki|k)|[0-9]{1,12}(\.[0-9]{1,9})?(Mi|M)|[0-9]{1,9}(\.[0-9]{1,9})?(Gi|G)"
    r"|[0-9]{1,6}(\.[0-9]{1,9})?(Ti|T)|[0-9]{1,3}(\.[0-9]{1,9})?(Pi|P))$"
)
# A node label or toleration as the API server takes it (kubetrain.settings: qualified names, label values).
LABEL_KEY_SCHEMA = {"type": "string", "maxLength": 317, "pattern": QUALIFIED_NAME_PATTERN}
LABEL_VALUE_SCHEMA = {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE_PATTERN}
TOLERATION_SCHEMA = {
    "type": "object",
    "properties": {
        # empty only with operator Exists (the Python check says so in words)
        "key": {
            "type": ["null", "string"],
            "maxLength": 317,
            "pattern": rf"^$(?!\n)|{QUALIFIED_NAME_PATTERN}",
        },
        "operator": {"enum": [None, "", "Equal", "Exists"]},
        "value": {**LABEL_VALUE_SCHEMA, "type": ["null", "string"]},
        "effect": {"enum": [None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "toleration_seconds": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    },
    "additionalProperties": False,
}


def schedule(dataset_uri: str, cron_env: str, default_cron: str | None) -> list[Asset] | AssetOrTimeSchedule:
    """Run on a cron schedule OR when the dataset's Asset gets a new version.

    The cron expression comes from the environment variable ``cron_env`` (empty: no cron,
    only new data triggers the DAG). New versions are announced by the watch_datasets DAG.

    :param dataset_uri: the default dataset, whose Asset triggers a run.
    :param cron_env: name of the environment variable that holds the cron expression.
    :param default_cron: the cron expression when the variable is unset.
    """
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    asset = dataset_asset(dataset_uri)
    cron = environ(cron_env, default_cron or "") or ""
    if not cron:
        return [asset]
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(cron, timezone="UTC"), assets=[asset])


def form_dataset_prefixes(narrowed: Sequence[str] = ()) -> tuple[str, ...]:
    """The dataset prefixes the trigger form can know at parse time: the DAG's own, else the environment's.

    The deployment's setting is the Variable ``kubetrain_dataset_prefixes``, else the environment
    variable ``KUBETRAIN_DATASET_PREFIXES``, else the whole datasets bucket; a DAG file reads no Variable
    when it is parsed (STYLE.md rule 4), so the form takes the environment's value, and the stage task
    (:meth:`StageDatasetOperator.check_source`), which reads the Variable too, stays the authority.

    :param narrowed: the DAG's own prefixes (the stage task's ``allowed_prefixes``), each within the
        deployment's.
    """
    from kubetrain.settings import get_from_environment, parse_list

    if narrowed:
        return tuple(narrowed)
    allowed = parse_list("dataset_prefixes", get_from_environment("dataset_prefixes"))
    return allowed or (f"s3://{get_from_environment('datasets_bucket')}/",)


def dataset_uri_pattern(prefixes: Sequence[str]) -> str:
    """A JSON-schema pattern that accepts the dataset URIs under ``prefixes`` as the stage task's check does.

    The check of ``'.'`` and ``'..'`` segments and of the training bucket's own areas stays the stage
    task's. ``s3://b/p/`` takes ``s3://b/p``, ``s3://b/p/...``; ``s3://b/`` takes the whole bucket. Only the
    characters that are special in both Python's and JavaScript's regular expressions are escaped, so
    the trigger form's checker and the API server's read the pattern alike.
    """

    def escaped(text: str) -> str:
        return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in text)

    alternatives = []
    for prefix in prefixes:
        bucket, _, key = prefix.strip().removeprefix("s3://").partition("/")
        path = f"{bucket}/{key.strip('/')}" if key.strip("/") else bucket
        alternatives.append(escaped(f"s3://{path}"))
    # A value that is no s3:// URI at all passes here: the format refuses it, in words.
    return f"^(?!s3://)|^({'|'.join(alternatives)})(/|$)"


def common_params(
    *,
    dataset_uri: str,
    model: str,
    gpus: int = 1,
    cpu: str = "2",
    memory: str = "4Gi",
    dataset_prefixes: Sequence[str] = (),
    **params: Param,
) -> dict[str, Param]:
    """Params that every training DAG has (dataset, model name, resources, cluster, promotion), and the DAG's own.

    The result is in the trigger form's order (:func:`kubetrain.params.form_order`): the DAG's
    Training and Model Params first and open, then Data, Resources, Cluster and Promotion,
    folded. A Param of the DAG's own replaces a common one of the same name. Every Param declares
    the draft-07 JSON Schema dialect (:func:`kubetrain.params.with_dialect`); a DAG that adds Params
    beside these passes the whole dict through ``with_dialect`` too.

    :param dataset_uri: the default dataset, ``s3://<bucket>/<prefix>/`` or ``s3://<bucket>/<file>``.
    :param model: the default model name (the name it is promoted as).
    :param gpus: default GPUs per training pod.
    :param cpu: default CPU request and limit.
    :param memory: default memory request and limit.
    :param dataset_prefixes: the DAG's own dataset prefixes, as given to its stage task's ``allowed_prefixes``
        (default: the deployment's, from the environment: :func:`form_dataset_prefixes`); the form refuses
        a dataset outside them.
    :param params: the DAG's own Params, e.g. ``epochs=Param(5, type="integer", section="Training")``.
    """
    prefixes = form_dataset_prefixes(dataset_prefixes)
    common = {
        "dataset_uri": Param(
            dataset_uri,
            type="string",
            format=S3_URI,
            pattern=dataset_uri_pattern(prefixes),
            title="Dataset",
            description="S3 prefix (s3://bucket/prefix/) or single archive (s3://bucket/data.zip) to train on, "
            f"under {' or '.join(prefixes)}. The form knows the deployment's prefixes from the environment "
            "(KUBETRAIN_DATASET_PREFIXES, else the datasets bucket); the stage task checks the dataset again "
            "against the kubetrain_dataset_prefixes Variable where one is set.",
            section="Data",
        ),
        "model_name": Param(
            model,
            type="string",
            pattern=r"^[a-z0-9]([a-z0-9._-]{0,98}[a-z0-9])?$",
            title="Model name",
            description="Name under which the model is promoted: s3://<training bucket>/models/<name>/.",
            section="Model",
        ),
        "gpus": Param(
            gpus,
            type="integer",
            minimum=0,
            maximum=8,
            title="GPUs",
            description="GPUs per pod, requested as the GPU resource.",
            section="Resources",
        ),
        "gpu_resource": Param(
            None,
            type=["null", "string"],
            pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
            title="GPU resource",
            description="Extended resource GPUs are requested as, e.g. nvidia.com/mig-1g.10gb; empty: the deployment's "
            "(KUBETRAIN_GPU_RESOURCE, default nvidia.com/gpu).",
            section="Cluster",
        ),
        "node_selector": Param(
            None,
            type=["null", "object"],
            propertyNames=LABEL_KEY_SCHEMA,
            additionalProperties=LABEL_VALUE_SCHEMA,
            title="Node selector",
            description='Node labels the pod must match, e.g. {"gpu-type": "a100"}; empty: the deployment\'s '
            "(KUBETRAIN_NODE_SELECTOR).",
            section="Cluster",
        ),
        "tolerations": Param(
            None,
            type=["null", "array"],
            items=TOLERATION_SCHEMA,
            title="Tolerations",
            description='Extra tolerations, e.g. [{"key": "spot", "operator": "Exists"}]; GPU pods always tolerate their '
            "GPU taint. Empty: the deployment's (KUBETRAIN_TOLERATIONS).",
            section="Cluster",
        ),
        "queue": Param(
            None,
            type=["null", "string"],
            pattern=DNS_SUBDOMAIN,
            title="Queue",
            description="Kueue LocalQueue the run's pods wait in for quota; empty: the deployment's (KUBETRAIN_QUEUE), "
            "none when that is empty too.",
            section="Cluster",
        ),
        "priority": Param(
            None,
            type=["null", "string"],
            pattern=DNS_SUBDOMAIN,
            title="Priority",
            description="Kueue WorkloadPriorityClass of the run's pods (a higher one may preempt lower ones, which "
            "resume from their checkpoints); empty: the queue's default.",
            section="Cluster",
        ),
        "image_pull_secrets": Param(
            None,
            type=["null", "array"],
            items={"type": "string"},
            title="Image pull secrets",
            description="docker-registry Secrets for a private registry; empty: the deployment's "
            "(KUBETRAIN_IMAGE_PULL_SECRETS).",
            section="Cluster",
        ),
        "cpu": Param(
            cpu,
            type="string",
            pattern=CPU_PATTERN,
            title="CPU",
            description="CPU request and limit, e.g. 2 or 500m.",
            section="Resources",
        ),
        "memory": Param(
            memory,
            type="string",
            pattern=MEMORY_PATTERN,
            title="Memory",
            description="Memory request and limit, e.g. 4Gi.",
            section="Resources",
        ),
        "sync_interval": Param(
            30,
            type="integer",
            minimum=1,
            maximum=3600,
            title="Checkpoint sync interval",
            description="Seconds between uploads of new checkpoints to S3 while the pod trains.",
            section="Resources",
        ),
        "data_size": Param(
            None,
            type=["null", "string"],
            pattern=SIZE_PATTERN,
            title="Data volume size",
            description="Size of the pod's /data volume, e.g. 200Gi; empty: twice the dataset plus 1Gi, enough for the "
            "dataset and its archives extracted beside them. Set it for archives that expand to more than their own "
            "size (text, CSV), as the extracted members and the archives share the volume.",
            section="Resources",
        ),
        "image": Param(
            None,
            type=["null", "string"],
            title="Training image",
            description="Image reference; empty: the image the build_trainer_image DAG published last. Runs pin it to "
            "its digest.",
            section="Resources",
        ),
        "promote": Param(
            "if_better",
            type="string",
            enum=["if_better", "always", "never"],
            title="Promote",
            description="Promote the trained model: only if it beats the promoted one, always, or never.",
            section="Promotion",
        ),
        "experiment": Param(
            None,
            type=["null", "string"],
            maxLength=63,
            title="Experiment",
            description="Free label for the pods and the report.",
            section="Promotion",
        ),
        "force": Param(
            False,
            type=SWITCH,
            title="Force",
            description="Train even when this dataset version was already trained with these Params.",
            section="Promotion",
        ),
    }
    return with_dialect(form_order({**common, **params}))


@dataclass
class TrainingTasks:
    stage: StageDatasetOperator
    check: SkipIfTrainedOperator
    train: TrainingPodOperator
    report: ReportOperator
    promote: PromoteModelOperator
    record: RecordTrainingOperator


def pushed(task: BaseOperator, key: str = "return_value") -> Any:
    """What ``task`` pushes to XCom under ``key`` (``task.output[key]``): a reference the task it is given to
    resolves when it runs, typed ``Any`` because an argument of any type may take one."""
    return XComArg(task, key=key)


def training_pipeline(
    *,
    cmds: Sequence[str] | str,
    arguments: Sequence[str] | str,
    title: str,
    keep_checkpoints: int = 3,
    require_metrics: bool | str = True,
    execution_timeout: timedelta = timedelta(hours=24),
    train_operator: type[TrainingPodOperator] = TrainingPodOperator,
    check_params: Callable[[Any], None] | None = None,
    **train_kwargs: Any,
) -> TrainingTasks:
    """Create the shared task chain in the current DAG context.

    :param cmds: the base container's command, or a template that renders a list (``{{ params.command }}``).
    :param arguments: its arguments (templated; Params via ``{{ params.x }}``, numbers become text), or a
        template that renders a list (``{{ params.args }}``).
    :param title: report title.
    :param keep_checkpoints: checkpoint sets kept in S3 after the run.
    :param require_metrics: whether a run without OUTPUT_DIR/metrics.json fails the report (templated).
    :param execution_timeout: limit of the training task.
    :param train_operator: the training task's class: :class:`TrainingPodOperator`, or a subclass such as
        :class:`~kubetrain.operators.distributed.DistributedTrainingOperator` (several workers).
    :param check_params: a ``pre_execute`` hook of the staging task that fails the run, before anything is
        staged or scheduled, when its Params break a rule across flags that the form's schema cannot state
        (:meth:`kubetrain.trainers.TrainerSpec.check_run`: ``mobilenet_v2`` needs ``image_size >= 32``).
    :param train_kwargs: more arguments of ``train_operator``.
    """
    # A run that fails at any step is recorded too (status failed, the failed task, its error): by a
    # failure callback, which has the task's exception in its context, rather than by a record task that
    # runs when upstream failed (it could not read the error and, the only leaf, would turn the failed DAG
    # run green by succeeding). The record task stays all_success, so a failed step leaves the run failed.
    record_failure = RecordFailedRun(stage_task_id="stage_dataset", check_task_id="check_new")
    own_callbacks = train_kwargs.pop("on_failure_callback", None) or []
    own_callbacks = list(own_callbacks) if isinstance(own_callbacks, list | tuple) else [own_callbacks]
    stage = StageDatasetOperator(
        task_id="stage_dataset",
        source_uri="{{ params.dataset_uri }}",
        outlets=[],
        on_failure_callback=[record_failure],
        pre_execute=check_params,
    )
    dag = native_dag(stage, "training_pipeline")
    check = SkipIfTrainedOperator(
        task_id="check_new",
        dataset_version=pushed(stage, "version"),
        image="{{ params.image or '' }}",
        on_failure_callback=[record_failure],
    )
    train = train_operator(
        task_id="train",
        pool="gpu",
        image=pushed(check, "image"),
        cmds=cmds if isinstance(cmds, str) else list(cmds),
        arguments=arguments if isinstance(arguments, str) else list(arguments),
        dataset_manifest=pushed(stage, "manifest_uri"),
        dataset_version=pushed(stage, "version"),
        dataset_bytes=pushed(stage, "total_bytes"),
        prepared_bytes=pushed(stage, "prepared_bytes"),
        data_size="{{ params.data_size or '' }}",
        experiment=dag.param("experiment"),
        gpus="{{ params.gpus }}",
        gpu_resource="{{ params.gpu_resource or '' }}",
        node_selector="{{ params.node_selector }}",
        tolerations="{{ params.tolerations }}",
        image_pull_secrets="{{ params.image_pull_secrets }}",
        local_queue="{{ params.queue or '' }}",
        priority_class="{{ params.priority or '' }}",
        cpu="{{ params.cpu }}",
        memory="{{ params.memory }}",
        sync_interval="{{ params.sync_interval }}",
        execution_timeout=execution_timeout,
        on_failure_callback=[record_failure, *own_callbacks],
        **train_kwargs,
    )
    report = ReportOperator(
        task_id="report",
        run_uri=pushed(train, "run_uri"),
        model=dag.param("model_name"),
        title=title,
        require_metrics=require_metrics,
        notes=pushed(train, "notes"),
        disruptions=pushed(train, "disruptions"),
        image=pushed(check, "image"),
        dataset_version=pushed(stage, "version"),
        command=cmds if isinstance(cmds, str) else list(cmds),
        dataset_uri="{{ params.dataset_uri }}",
        dataset_bytes=pushed(stage, "total_bytes"),
        dataset_objects=pushed(stage, "objects"),
        promote="{{ params.promote }}",
        on_failure_callback=[record_failure],
    )
    promote = PromoteModelOperator(
        task_id="promote",
        run_uri=pushed(train, "run_uri"),
        model=dag.param("model_name"),
        promote="{{ params.promote }}",
        is_better=pushed(report, "better_than_promoted"),
        keep_checkpoints=keep_checkpoints,
        on_failure_callback=[record_failure],
    )
    record = RecordTrainingOperator(
        task_id="record",
        fingerprint=pushed(check, "fingerprint"),
        dataset_version=pushed(stage, "version"),
        image=pushed(check, "image"),
        promotion=pushed(promote),
        report=pushed(report),
        run_uri=pushed(train, "run_uri"),
        dataset_manifest=pushed(stage, "manifest_uri"),
        disruptions=pushed(train, "disruptions"),
    )
    stage >> check >> train >> report >> promote >> record
    return TrainingTasks(stage, check, train, report, promote, record)
