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
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowSkipException

from kubetrain import pod_spec
from kubetrain.hooks.registry import RegistryHook
from kubetrain.images import has_digest, pin_image
from kubetrain.operators.base import RunStoreOperator
from kubetrain.s3_layout import utc_stamp

if TYPE_CHECKING:
    from airflow.sdk import Context

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
        raise ValueError(f"image {image!r} carries no digest: the fingerprint needs the image that runs, by digest")
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
        image = pin_image(pod_spec.resolve_image(self.image, "trainer"), registry_conn_id=self.registry_conn_id)
        fp = fingerprint(dag_id, self.dataset_version, dict(context["params"]), image, self.exclude_params)
        marker = self.store.marker_uri(dag_id, fp)
        previous = self.store.trained_marker(dag_id, fp)
        if previous is not None and not context["params"].get("force", False):
            raise AirflowSkipException(
                f"already trained on dataset version {self.dataset_version} with these parameters and image "
                f"{image} in run {previous.get('run_id')} (finished {previous.get('finished_at')}); trigger "
                "with force=true to train again"
            )
        self.log.info("Fingerprint %s (image %s): not trained yet (marker %s)", fp, image, marker)
        return {"fingerprint": fp, "marker": marker, "image": image, "dataset_version": self.dataset_version}


class RecordTrainingOperator(RunStoreOperator):
    """Write the marker that makes later runs with the same fingerprint skip training.

    :param fingerprint: the run's fingerprint, ``check.output["fingerprint"]``. (templated)
    :param dataset_version: version of the staged dataset. (templated)
    :param image: the training image by digest, ``check.output["image"]``. (templated)
    :param promotion: what the promote task did, ``promote.output`` (recorded). (templated)
    :param exclude_params: Params left out of the record, as out of the fingerprint.
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: the S3 connection.
    """

    template_fields: Sequence[str] = (
        *RunStoreOperator.template_fields,
        "fingerprint",
        "dataset_version",
        "image",
        "promotion",
    )
    ui_color = "#f0f0f0"

    def __init__(
        self,
        *,
        fingerprint: str,
        dataset_version: str,
        image: str,
        promotion: Mapping[str, Any] | None = None,
        exclude_params: Sequence[str] = NOT_TRAINING_PARAMS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fingerprint = fingerprint
        self.dataset_version = dataset_version
        self.image = image
        self.promotion = promotion
        self.exclude_params = tuple(exclude_params)

    def execute(self, context: Context) -> dict[str, str]:
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
        marker = self.store.record_trained(dag_id, self.fingerprint, record)
        self.log.info("Recorded fingerprint %s at %s", self.fingerprint, marker)
        return {"fingerprint": self.fingerprint, "marker": marker}
