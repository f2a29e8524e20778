"""Stage a dataset: pin what is in S3 now as an immutable snapshot manifest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset, ExceptionRetryPolicy, RetryAction, RetryRule
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from kubetrain.manifest import (
    DatasetNotFoundError,
    build_manifest,
    dataset_name_from_uri,
    list_source_objects,
)
from kubetrain.operators.base import RunStoreOperator
from kubetrain.s3_layout import check_dataset_source, check_name
from kubetrain_contract.s3uri import parse_s3_uri

if TYPE_CHECKING:
    from airflow.sdk import Context


class StageFailed(SystemExit):
    """The stage task's end on a bad dataset: one line in the task log, no traceback.

    Airflow 3.3's task runner logs every exception a task raises with its traceback (``Task failed with
    exception``), AirflowFailException included, and ``raise ... from None`` only drops the chained cause;
    a ``SystemExit`` it logs as one line, ``Task exited``. So the operator logs the sentence itself and
    ends with this exception, which carries the sentence to the failure callbacks (the run record's
    reason). Whether it is retried is the task's ``retry_policy``: a :class:`DatasetRefused` never is.
    tests/e2e/test_training_dags.py fails when the runner starts logging a traceback for it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


class DatasetRefused(StageFailed):
    """A dataset outside the allowed prefixes: it will not change on a retry."""


def dataset_asset(source_uri: str) -> Asset:
    """The Asset that stands for a dataset source; DAGs scheduled on new versions use the same.

    Its name is the S3 URI; its URI uses the ``x-s3`` scheme so that declaring it in a DAG
    file does not load the amazon provider's S3 URI handling (and boto3) at parse time.
    """
    bucket, key = parse_s3_uri(source_uri)
    return Asset(name=source_uri, uri=f"x-s3://{bucket}/{key}", group="dataset")


class StageDatasetOperator(RunStoreOperator):
    """Resolve a dataset URI to a snapshot manifest at ``s3://<training>/manifests/<dataset>/<version>.json``.

    The source is an S3 prefix (``s3://datasets/digits/``) or a single object, typically an
    archive (``s3://datasets/digits.zip``). The version is derived from the objects' keys,
    sizes and ETags, so staging an unchanged dataset writes nothing: the manifest key is checked
    first. The task emits an event for the dataset's Asset whose extra carries the version and
    the manifest URI.

    Returns (XCom) ``{"dataset", "version", "manifest_uri", "objects", "total_bytes", "new"}``;
    each key is also its own XCom, for typed hand-offs such as ``stage.output["version"]``.

    :param source_uri: the dataset's S3 URI. (templated)
    :param dataset: dataset name (default: derived from the URI). (templated)
    :param skip_if_unchanged: skip the task (no Asset event, so nothing downstream is
        triggered) when this version is already staged; for DAGs that watch for new data.
    :param allowed_prefixes: ``s3://`` prefixes this DAG's datasets must be under, within the deployment's
        (the ``dataset_prefixes`` setting, default the datasets bucket); the URI, a Param that whoever may
        trigger the DAG sets, is refused outside them, and never reaches the training bucket's runs or models.
    :param training_bucket: bucket for manifests (default: the deployment's training bucket). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = (*RunStoreOperator.template_fields, "source_uri", "dataset")
    ui_color = "#e8f4fa"

    def __init__(
        self,
        *,
        source_uri: str,
        dataset: str | None = None,
        skip_if_unchanged: bool = False,
        allowed_prefixes: Sequence[str] = (),
        multiple_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        # A literal URI names its Asset at parse time; a templated one needs explicit outlets.
        if "outlets" not in kwargs and "{{" not in source_uri:
            kwargs["outlets"] = [dataset_asset(source_uri)]
        # A refused dataset fails at once; any other failure keeps the task's retries.
        kwargs.setdefault(
            "retry_policy",
            ExceptionRetryPolicy(rules=[RetryRule(exception=DatasetRefused, action=RetryAction.FAIL)]),
        )
        super().__init__(multiple_outputs=multiple_outputs, **kwargs)
        self.source_uri = source_uri
        self.dataset = dataset
        self.skip_if_unchanged = skip_if_unchanged
        self.allowed_prefixes = tuple(allowed_prefixes)

    def check_source(self) -> None:
        """Refuse a source outside the deployment's and this DAG's dataset prefixes (no retry: it will not change)."""
        from kubetrain import settings

        layout = self.store.layout
        allowed = settings.parse_list("dataset_prefixes", settings.get("dataset_prefixes")) or (
            f"s3://{layout.datasets_bucket}/",
        )
        try:
            check_dataset_source(
                self.source_uri,
                allowed=allowed,
                training_bucket=layout.training_bucket,
                narrowed=self.allowed_prefixes,
            )
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            self.check_source()
        except AirflowFailException as exc:
            self.log.error("%s", exc)
            raise DatasetRefused(str(exc)) from None
        dataset = (
            check_name("dataset", self.dataset) if self.dataset else dataset_name_from_uri(self.source_uri)
        )
        try:
            source, objects = list_source_objects(self.store, self.source_uri)
        except DatasetNotFoundError as exc:  # a bad value too: one line (retried: the data may yet land)
            self.log.error("%s", exc)
            raise StageFailed(str(exc)) from None
        manifest = build_manifest(dataset, source, objects)
        version = manifest["version"]
        manifest_uri = self.store.layout.manifest_uri(dataset, version)

        existing = self.store.manifests.staged(dataset, version)
        if existing is None:
            self.store.manifests.stage(manifest)
            self.log.info(
                "Staged %s (%d objects, %d bytes) as %s",
                source,
                len(objects),
                manifest["total_bytes"],
                manifest_uri,
            )
        else:
            self.log.info(
                "Dataset %s is unchanged: version %s is already staged at %s", source, version, manifest_uri
            )
            if self.skip_if_unchanged:
                raise AirflowSkipException(f"{source} is unchanged since version {version} was staged")

        # The prepared copies an earlier pod made of this version (the image classifier's decoded records):
        # the stage-in downloads them into /data beside the dataset, so the pod's /data is sized for them.
        # A version's first run has none yet; its trainer makes the copy within the derived size's margin.
        layout = self.store.layout
        prepared = sum(
            int(item["Size"])
            for item in self.store.list(layout.training_bucket, layout.prepared_prefix(dataset, version))
        )
        if prepared:
            self.log.info("Prepared copies of version %s: %d bytes, sized into /data", version, prepared)
        result = {
            "dataset": dataset,
            "version": version,
            "manifest_uri": manifest_uri,
            "objects": len(objects),
            "total_bytes": manifest["total_bytes"],
            "prepared_bytes": prepared,
            "new": existing is None,
        }
        self._emit_asset_event(context, source, result)
        return result

    def _emit_asset_event(self, context: Context, source: str, result: dict[str, Any]) -> None:
        outlets = [o for o in (self.outlets or []) if isinstance(o, Asset)]
        if not outlets:
            return
        matching = [a for a in outlets if a.uri.rstrip("/") == source.rstrip("/")] or outlets
        extra = {
            "dataset": result["dataset"],
            "version": result["version"],
            "manifest": result["manifest_uri"],
        }
        for asset in matching:
            context["outlet_events"][asset].extra = extra
