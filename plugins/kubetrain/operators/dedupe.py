"""Train once per dataset version, parameters and image: skip a run that would repeat a finished one.

A training DAG runs on a cron schedule or when its dataset gets a new version. Either way
it must not train twice on the same data with the same parameters and the same code: the
fingerprint of (DAG, dataset version, training Params, training image digest) names a marker
object that :class:`RecordTrainingOperator` writes when a run finishes, and that
:class:`SkipIfTrainedOperator` looks for at the start of the next run. A newly published
trainer image has a new digest, so it trains again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowSkipException

from kubetrain import pod_spec
from kubetrain.hooks.registry import RegistryHook
from kubetrain.images import has_digest, pin_image
from kubetrain.operators.base import RunOperator, RunStoreOperator
from kubetrain.s3_layout import utc_stamp

if TYPE_CHECKING:
    from airflow.sdk import Context

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import RunLocation

# Params that do not change what is trained: run control, where the pod is placed, and the
# image Param itself (its resolved digest is what counts).
NOT_TRAINING_PARAMS = (
    "force",
    "experiment",
    "promote",
    "sync_interval",
    "image",
    "node_selector",
    "tolerations",
    "image_pull_secrets",
    "gpu_resource",
    "data_size",
)


def fingerprint(
    dag_id: str,
    dataset_version: str,
    params: Mapping[str, Any],
    image: str,
    exclude: Sequence[str] = NOT_TRAINING_PARAMS,
) -> str:
    """A stable hash of what a training run trains on and with.

    :param dag_id: the training DAG.
    :param dataset_version: version of the staged dataset snapshot.
    :param params: the run's Params; ``exclude`` ones are left out.
    :param image: the training image, pinned by digest (``<repository>@sha256:...``); only the
        digest counts, so the same image under another name is the same code.
    :param exclude: names of Params that do not affect the trained model.
    """
    if not dataset_version:
        raise ValueError(f"dataset version {dataset_version!r} is empty: stage the dataset first")
    if not isinstance(image, str) or not has_digest(image):
        raise ValueError(
            f"image {image!r} carries no digest: the fingerprint needs the image that runs, by digest"
        )
    payload = {
        "dag_id": dag_id,
        "dataset_version": dataset_version,
        "params": {k: v for k, v in sorted(params.items()) if k not in exclude},
        "image_digest": image.rsplit("@", 1)[1],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


class SkipIfTrainedOperator(RunStoreOperator):
    """Skip the rest of the DAG run when the same training already finished.

    Resolves the training image to its digest in the registry (the one the training task then
    runs: pass ``check.output["image"]`` on), and fingerprints (DAG, dataset version, training
    Params, image digest). The run goes on when the Param ``force`` is true, or when no marker
    exists for the fingerprint.

    Returns (XCom) ``{"fingerprint", "marker", "image", "dataset_version"}``; each key is also its
    own XCom.

    :param dataset_version: version of the staged dataset, e.g. ``stage.output["version"]``. (templated)
    :param image: the training image (default: the deployment's; see TrainingPodOperator). (templated)
    :param registry_conn_id: registry connection to resolve the image's digest with.
    :param exclude_params: Params that do not count for the fingerprint.
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: the S3 connection.
    """

    template_fields: Sequence[str] = (*RunStoreOperator.template_fields, "dataset_version", "image")
    ui_color = "#f0f0f0"

    def __init__(
        self,
        *,
        dataset_version: str,
        image: str | None = None,
        registry_conn_id: str = RegistryHook.default_conn_name,
        exclude_params: Sequence[str] = NOT_TRAINING_PARAMS,
        multiple_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(multiple_outputs=multiple_outputs, **kwargs)
        self.dataset_version = dataset_version
        self.image = image
        self.registry_conn_id = registry_conn_id
        self.exclude_params = tuple(exclude_params)

    def execute(self, context: Context) -> dict[str, str]:
        dag_id = context["ti"].dag_id
        image = pin_image(
            pod_spec.resolve_image(self.image, "trainer"), registry_conn_id=self.registry_conn_id
        )
        fp = fingerprint(dag_id, self.dataset_version, dict(context["params"]), image, self.exclude_params)
        marker = self.store.markers.uri(dag_id, fp)
        previous = self.store.markers.get(dag_id, fp)
        if previous is not None and not context["params"].get("force", False):
            reason = (
                f"already trained on dataset version {self.dataset_version} with these parameters and image "
                f"{image} in run {previous.get('run_id')} (finished {previous.get('finished_at')}); trigger "
                "with force=true to train again"
            )
            # Airflow logs only "Skipping task." for a skip, not the exception's message: say why here.
            self.log.info("Skipping: %s", reason)
            raise AirflowSkipException(reason)
        self.log.info("Fingerprint %s (image %s): not trained yet (marker %s)", fp, image, marker)
        return {"fingerprint": fp, "marker": marker, "image": image, "dataset_version": self.dataset_version}


class RecordTrainingOperator(RunOperator):
    """The pipeline's last step: the train-once marker, the run's record and (optionally) MLflow.

    Writes the marker that makes later runs with the same fingerprint skip training, then the
    run record (:mod:`kubetrain.run_record`: what ran, on which data and image, with which
    Params, its metrics, the step it resumed from, whether it was promoted and why, where its
    report is) at ``<run>/run-record.json`` and into the run index that the Training page
    lists. When an MLflow tracking URI is configured (:mod:`kubetrain.tracking`), the run is
    logged there too and a promoted model becomes the ``champion`` of its registered model.

    Returns (XCom) ``{"fingerprint", "marker", "run_record", "mlflow_run_id"}``.

    :param fingerprint: the run's fingerprint, ``check.output["fingerprint"]``. (templated)
    :param dataset_version: version of the staged dataset. (templated)
    :param image: the training image by digest, ``check.output["image"]``. (templated)
    :param promotion: what the promote task did, ``promote.output`` (recorded). (templated)
    :param report: what the report task found, ``report.output`` (report URI, the comparison). (templated)
    :param model: the model name (default: the ``model_name`` Param); without one, no run record. (templated)
    :param promote_rule: the ``promote`` Param's value (default: the Param). (templated)
    :param dataset_uri: the dataset the run trained on (default: the ``dataset_uri`` Param). (templated)
    :param dataset_manifest: the staged snapshot's manifest URI, ``stage.output["manifest_uri"]``. (templated)
    :param sweep: a sweep trial's fields for the record (``id``, ``trial``, ``stopped_early``, ...). (templated)
    :param distributed: a distributed run's fields (``backend``, ``workers``, ``ps_replicas``). (templated)
    :param disruptions: the training task's preemptions and time queued, ``train.output["disruptions"]``
        (recorded). (templated)
    :param exclude_params: Params left out of the marker, as out of the fingerprint.
    :param run_uri: the run, e.g. ``train.output["run_uri"]`` (default: this DAG run's prefix). (templated)
    :param trial: sweep trial, as given to the TrainingPodOperator. (templated)
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: the S3 connection.
    """

    template_fields: Sequence[str] = (
        *RunOperator.template_fields,
        "fingerprint",
        "dataset_version",
        "image",
        "promotion",
        "report",
        "model",
        "promote_rule",
        "dataset_uri",
        "dataset_manifest",
        "sweep",
        "distributed",
        "disruptions",
    )
    ui_color = "#f0f0f0"

    def __init__(
        self,
        *,
        fingerprint: str,
        dataset_version: str,
        image: str,
        promotion: Mapping[str, Any] | None = None,
        report: Mapping[str, Any] | None = None,
        model: str | None = None,
        promote_rule: str | None = None,
        dataset_uri: str | None = None,
        dataset_manifest: str | None = None,
        sweep: Mapping[str, Any] | None = None,
        distributed: Mapping[str, Any] | None = None,
        disruptions: Mapping[str, Any] | None = None,
        exclude_params: Sequence[str] = NOT_TRAINING_PARAMS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fingerprint = fingerprint
        self.dataset_version = dataset_version
        self.image = image
        self.promotion = promotion
        self.report = report
        self.model = model
        self.promote_rule = promote_rule
        self.dataset_uri = dataset_uri
        self.dataset_manifest = dataset_manifest
        self.sweep = sweep
        self.distributed = distributed
        self.disruptions = disruptions
        self.exclude_params = tuple(exclude_params)

    def execute(self, context: Context) -> dict[str, Any]:
        dag_id = context["ti"].dag_id
        promotion = dict(self.promotion or {})
        record = {
            "fingerprint": self.fingerprint,
            "dag_id": dag_id,
            "run_id": context["run_id"],
            "dataset_version": self.dataset_version,
            "image": self.image,
            "params": {k: v for k, v in dict(context["params"]).items() if k not in self.exclude_params},
            "model_uri": promotion.get("model_uri"),
            "model_version": promotion.get("model_version"),
            "finished_at": utc_stamp(),
        }
        marker = self.store.markers.write(dag_id, self.fingerprint, record)
        self.log.info("Recorded fingerprint %s at %s", self.fingerprint, marker)
        result: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "marker": marker,
            "run_record": None,
            "mlflow_run_id": None,
        }
        params = dict(context["params"])
        model = self.model or params.get("model_name")
        if not model:
            self.log.info("No model name (model= or the model_name Param): no run record")
            return result
        run_record = RunRecorder(self.store, self.log).build(
            context,
            run=self.run_location(context),
            model=str(model),
            trial=self.trial,
            status="success",
            dataset_uri=self.dataset_uri or params.get("dataset_uri"),
            dataset_version=self.dataset_version,
            dataset_manifest=self.dataset_manifest,
            image=self.image,
            fingerprint=self.fingerprint,
            promote_rule=self.promote_rule or params.get("promote"),
            promotion=promotion,
            report=dict(self.report or {}),
            sweep=dict(self.sweep) if self.sweep else None,
            distributed=dict(self.distributed) if self.distributed else None,
            disruptions=dict(self.disruptions) if isinstance(self.disruptions, Mapping) else None,
        )
        result["run_record"] = self.store.runs.write(run_record)
        self.log.info("Run record: %s (%s)", result["run_record"], run_record["promotion"]["reason"])
        result["mlflow_run_id"] = RunRecorder(self.store, self.log).track(run_record)
        return result


class RunRecorder:
    """Builds a run's record from what the run left in S3, and logs it to MLflow when that is configured.

    Shared by the record step (a finished run) and :class:`RecordFailedRun` (a failed one).
    """

    def __init__(self, store: RunStore, log: Any) -> None:
        self.store = store
        self.log = log

    def build(
        self, context: Context, *, run: RunLocation, model: str, trial: str | None, status: str, **fields: Any
    ) -> dict[str, Any]:
        from kubetrain.run_record import RunFacts, build_record, interrupted_pods

        metrics = self._read_json(run, "metrics.json")
        run_params = self._read_json(run, "params.json")
        resumed, source = None, None
        if not isinstance((metrics or {}).get("resumed_from_step"), int):
            resumed = self.store.passes.resumed_from_step(run)
            source = "sync-passes" if resumed is not None else None
        interrupted = interrupted_pods(fields.get("disruptions"))
        checkpoints: dict[str, tuple[int | None, bool]] = {}
        if interrupted:
            try:
                checkpoints = self.store.passes.last_checkpoints(run, interrupted)
            except ValueError as exc:  # a broken pass manifest: the steps lost stay unknown
                self.log.warning("Could not read the sync passes of the interrupted pods: %s", exc)
        ti = context["ti"]
        if trial in (None, ""):
            index = getattr(ti, "map_index", -1)
            trial = str(index) if isinstance(index, int) and index >= 0 else None
        facts = RunFacts(
            dag_id=ti.dag_id,
            run_id=context["run_id"],
            run=run,
            run_time=run_time(context),
            model=model,
            status=status,
            trial=trial,
            params=dict(context.get("params") or {}),
            metrics=metrics,
            run_params=run_params,
            resumed_from_step=resumed,
            resumed_from_source=source,
            checkpoints=checkpoints,
            **fields,
        )
        return build_record(facts).to_dict()

    def _read_json(self, run: RunLocation, name: str) -> dict[str, Any] | None:
        try:
            document = self.store.read_json(run.bucket, run.key("output", name))
        except ValueError as exc:  # a broken file is the run's problem: record it without the file
            self.log.warning("Ignoring %s: %s", name, exc)
            return None
        return document if isinstance(document, dict) else None

    def track(self, record: dict[str, Any]) -> str | None:
        """Log the run to MLflow when a tracking URI is configured; return the MLflow run id."""
        from kubetrain import tracking

        settings = tracking.configured()
        if settings is None:
            return None
        info = tracking.log_run(settings, self.store, record, log=self.log)
        record["mlflow"] = info
        self.store.runs.write(record)
        return info["run_id"]


class RecordFailedRun:
    """A task failure callback that leaves the run's record with ``status: failed`` and the error.

    The pipeline sets it on the train, report and promote tasks: when one of them fails for
    good (no retry left), the run is recorded (and tracked in MLflow) with the failing task and
    its error, what the run left in S3 (metrics, resume point) and no promotion; the train-once
    marker is not written, so the next run trains again. Failures of the callback itself are
    logged, never raised: the task's own failure is what counts.

    :param stage_task_id: the task whose XComs hold the dataset ``version`` and ``manifest_uri``.
    :param check_task_id: the task whose XComs hold the ``image`` by digest and the ``fingerprint``.
    :param train_task_id: the task whose XCom ``disruptions`` holds its preemptions and time queued.
    :param aws_conn_id: the S3 connection.
    """

    def __init__(
        self,
        *,
        stage_task_id: str = "stage_dataset",
        check_task_id: str = "check_new",
        train_task_id: str = "train",
        aws_conn_id: str | None = "aws_default",
    ) -> None:
        self.stage_task_id = stage_task_id
        self.check_task_id = check_task_id
        self.train_task_id = train_task_id
        self.aws_conn_id = aws_conn_id

    def __call__(self, context: Context) -> None:
        import logging

        log = logging.getLogger("kubetrain.record")
        try:
            self.record(context, log)
        except Exception:
            log.exception("Could not record the failed run")

    def record(self, context: Context, log: Any) -> dict[str, Any] | None:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from kubetrain.run_store import RunStore
        from kubetrain.s3_layout import S3Layout, run_from_context

        params = dict(context.get("params") or {})
        model = params.get("model_name")
        if not model:
            return None
        ti = context["ti"]

        def pulled(task_id: str, key: str) -> Any:
            try:
                return ti.xcom_pull(task_ids=task_id, key=key)
            except Exception:  # noqa: BLE001 - a missing XCom is an unknown field, not a second failure
                return None

        store = RunStore(S3Hook(aws_conn_id=self.aws_conn_id), S3Layout.from_environment())
        recorder = RunRecorder(store, log)
        error = context.get("exception")
        record = recorder.build(
            context,
            run=run_from_context(context),
            model=str(model),
            trial=None,
            status="failed",
            dataset_uri=params.get("dataset_uri"),
            dataset_version=pulled(self.stage_task_id, "version"),
            dataset_manifest=pulled(self.stage_task_id, "manifest_uri"),
            image=pulled(self.check_task_id, "image"),
            fingerprint=pulled(self.check_task_id, "fingerprint"),
            promote_rule=params.get("promote"),
            disruptions=pulled(self.train_task_id, "disruptions"),
            failure={"task": ti.task_id, "error": f"{type(error).__name__}: {error}" if error else "failed"},
        )
        uri = store.runs.write(record)
        log.info("Recorded the failed run at %s", uri)
        recorder.track(record)
        return record


def run_time(context: Context) -> datetime:
    """The DAG run's time (``run_after``, else the logical date or start): the same for every retry."""
    dag_run = context.get("dag_run")
    for name in ("run_after", "logical_date", "start_date"):
        value = getattr(dag_run, name, None)
        if isinstance(value, datetime):
            return value
    return datetime.now(UTC)
