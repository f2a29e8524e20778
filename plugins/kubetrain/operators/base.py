"""Base classes of the operators that read and write kubetrain's objects in S3."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from kubetrain.doc_md import class_doc_md
from kubetrain.run_store import RunStore
from kubetrain.s3_layout import RunLocation, S3Layout, run_from_context

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context


class RunStoreOperator(BaseOperator):
    """An operator whose S3 reads and writes go through a :class:`~kubetrain.run_store.RunStore`.

    :param training_bucket: training bucket (default: the deployment's setting). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = ("training_bucket",)

    def __init__(
        self, *, training_bucket: str | None = None, aws_conn_id: str | None = "aws_default", **kwargs: Any
    ) -> None:
        kwargs.setdefault("doc_md", class_doc_md(type(self)))  # the task's documentation in the UI
        super().__init__(**kwargs)
        self.training_bucket = training_bucket
        self.aws_conn_id = aws_conn_id

    @cached_property
    def hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    @cached_property
    def store(self) -> RunStore:
        """The store, with the layout of this deployment (and this task's training bucket)."""
        return RunStore(self.hook, S3Layout.from_environment(training_bucket=self.training_bucket))


class RunOperator(RunStoreOperator):
    """An operator that works on one training run's prefix.

    :param run_uri: the run, e.g. ``train.output["run_uri"]`` (default: this DAG run's prefix,
        as TrainingPodOperator computes it). (templated)
    :param trial: sweep trial, as given to the TrainingPodOperator; mapped tasks default to
        their map index. (templated)
    :param training_bucket: training bucket (default: the deployment's setting). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = (*RunStoreOperator.template_fields, "run_uri", "trial")

    def __init__(self, *, run_uri: str | None = None, trial: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_uri = run_uri
        self.trial = trial

    def run_location(self, context: Context) -> RunLocation:
        """The run this task works on."""
        return run_from_context(
            context, run_uri=self.run_uri, trial=self.trial, training_bucket=self.training_bucket
        )
