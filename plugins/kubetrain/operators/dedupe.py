"""Train once per dataset version and parameters: skip a run that would repeat a finished one.

A training DAG runs on a cron schedule or when its dataset gets a new version. Either way
it must not train twice on the same dataset version with the same parameters: the
fingerprint of (DAG, dataset version, training parameters, image) names a marker object
that :class:`RecordTrainingOperator` writes when a run finishes, and that
:class:`SkipIfTrainedOperator` looks for at the start of the next run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.common.compat.sdk import AirflowSkipException, BaseOperator

from kubetrain.s3_layout import S3Layout, utc_stamp

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context

# Params that do not change what is trained.
NOT_TRAINING_PARAMS = ("force", "experiment", "promote", "sync_interval")


def fingerprint(dag_id: str, dataset_version: str, params: dict[str, Any], exclude: Sequence[str] = NOT_TRAINING_PARAMS) -> str:
    """A stable hash of what a training run trains on and with.

    :param dag_id: the training DAG.
    :param dataset_version: version of the staged dataset snapshot.
    :param params: the run's Params; ``exclude`` ones are left out.
    :param exclude: names of Params that do not affect the trained model.
    """
    if not dataset_version:
        raise ValueError(f"dataset version {dataset_version!r} is empty: stage the dataset first")
    payload = {
        "dag_id": dag_id,
        "dataset_version": dataset_version,
        "params": {k: v for k, v in sorted(params.items()) if k not in exclude},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


class _MarkerOperator(BaseOperator):
    template_fields: Sequence[str] = ("dataset_version", "training_bucket")

    def __init__(
        self,
        *,
        dataset_version: str,
        exclude_params: Sequence[str] = NOT_TRAINING_PARAMS,
        training_bucket: str | None = None,
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.dataset_version = dataset_version
        self.exclude_params = tuple(exclude_params)
        self.training_bucket = training_bucket
        self.aws_conn_id = aws_conn_id

    @cached_property
    def hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def marker(self, context: Context) -> tuple[str, str, str]:
        """(bucket, key, fingerprint) of this run's marker."""
        layout = S3Layout.from_environment(training_bucket=self.training_bucket)
        dag_id = context["ti"].dag_id
        fp = fingerprint(dag_id, self.dataset_version, dict(context["params"]), self.exclude_params)
        return layout.training_bucket, layout.trained_marker_key(dag_id, fp), fp


class SkipIfTrainedOperator(_MarkerOperator):
    """Skip the rest of the DAG run when the same training already finished.

    The run goes on when the Param ``force`` is true, or when no marker exists for its
    fingerprint (DAG, dataset version, training Params).

    :param dataset_version: version of the staged dataset, e.g. from StageDatasetOperator's XCom. (templated)
    :param exclude_params: Params that do not count for the fingerprint.
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: the S3 connection.
    """

    ui_color = "#f0f0f0"

    def execute(self, context: Context) -> dict[str, str]:
        bucket, key, fp = self.marker(context)
        body = self.hook.read_key(key, bucket) if self.hook.check_for_key(key, bucket) else None
        if body is not None and not context["params"].get("force", False):
            previous = json.loads(body)
            raise AirflowSkipException(
                f"already trained on dataset version {self.dataset_version} with these parameters "
                f"in run {previous.get('run_id')} (finished {previous.get('finished_at')}); trigger with force=true to train again"
            )
        self.log.info("fingerprint %s: not trained yet (marker s3://%s/%s)", fp, bucket, key)
        return {"fingerprint": fp, "marker": f"s3://{bucket}/{key}"}


class RecordTrainingOperator(_MarkerOperator):
    """Write the marker that makes later runs with the same fingerprint skip training.

    :param dataset_version: version of the staged dataset. (templated)
    :param exclude_params: Params that do not count for the fingerprint.
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: the S3 connection.
    """

    ui_color = "#f0f0f0"

    def execute(self, context: Context) -> dict[str, str]:
        bucket, key, fp = self.marker(context)
        record = {
            "fingerprint": fp,
            "dag_id": context["ti"].dag_id,
            "run_id": context["run_id"],
            "dataset_version": self.dataset_version,
            "params": {k: v for k, v in dict(context["params"]).items() if k not in self.exclude_params},
            "finished_at": utc_stamp(),
        }
        self.hook.load_string(json.dumps(record, indent=2, default=str), key, bucket, replace=True)
        self.log.info("recorded fingerprint %s at s3://%s/%s", fp, bucket, key)
        return {"fingerprint": fp, "marker": f"s3://{bucket}/{key}"}
