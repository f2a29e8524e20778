"""Stage a dataset: pin what is in S3 now as an immutable snapshot manifest."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from kubetrain.manifest import (
    build_manifest,
    check_manifest,
    dataset_name_from_uri,
    dumps,
    list_source_objects,
)
from kubetrain.s3_layout import S3Layout, check_name, parse_s3_uri

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context


def dataset_asset(source_uri: str) -> Asset:
    """The Asset that stands for a dataset source; DAGs scheduled on new versions use the same.

    Its name is the S3 URI; its URI uses the ``x-s3`` scheme so that declaring it in a DAG
    file does not load the amazon provider's S3 URI handling (and boto3) at parse time.
    """
    bucket, key = parse_s3_uri(source_uri)
    return Asset(name=source_uri, uri=f"x-s3://{bucket}/{key}", group="dataset")


class StageDatasetOperator(BaseOperator):
    """Resolve a dataset URI to a snapshot manifest at ``s3://<training>/manifests/<dataset>/<version>.json``.

    The source is an S3 prefix (``s3://datasets/digits/``) or a single object, typically an
    archive (``s3://datasets/digits.zip``). The version is derived from the objects' keys,
    sizes and ETags, so staging an unchanged dataset writes nothing: the manifest key is checked
    first. The task emits an event for the dataset's Asset whose extra carries the version and
    the manifest URI.

    Returns (XCom) ``{"dataset", "version", "manifest_uri", "objects", "total_bytes", "new"}``.

    :param source_uri: the dataset's S3 URI. (templated)
    :param dataset: dataset name (default: derived from the URI). (templated)
    :param skip_if_unchanged: skip the task (no Asset event, so nothing downstream is
        triggered) when this version is already staged; for DAGs that watch for new data.
    :param training_bucket: bucket for manifests (default: the deployment's training bucket). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = ("source_uri", "dataset", "training_bucket")
    ui_color = "#e8f4fa"

    def __init__(
        self,
        *,
        source_uri: str,
        dataset: str | None = None,
        skip_if_unchanged: bool = False,
        training_bucket: str | None = None,
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        # A literal URI names its Asset at parse time; a templated one needs explicit outlets.
        if "outlets" not in kwargs and "{{" not in source_uri:
            kwargs["outlets"] = [dataset_asset(source_uri)]
        super().__init__(**kwargs)
        self.source_uri = source_uri
        self.dataset = dataset
        self.skip_if_unchanged = skip_if_unchanged
        self.training_bucket = training_bucket
        self.aws_conn_id = aws_conn_id

    @cached_property
    def hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def execute(self, context: Context) -> dict[str, Any]:
        client = self.hook.get_conn()
        dataset = (
            check_name("dataset", self.dataset) if self.dataset else dataset_name_from_uri(self.source_uri)
        )
        layout = S3Layout.from_environment(training_bucket=self.training_bucket)

        source, objects = list_source_objects(client, self.source_uri)
        manifest = build_manifest(dataset, source, objects)
        version = manifest["version"]
        key = layout.manifest_key(dataset, version)
        manifest_uri = layout.manifest_uri(dataset, version)

        existing = self._read_existing(client, layout.training_bucket, key)
        if existing is None:
            client.put_object(
                Bucket=layout.training_bucket, Key=key, Body=dumps(manifest), ContentType="application/json"
            )
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

        result = {
            "dataset": dataset,
            "version": version,
            "manifest_uri": manifest_uri,
            "objects": len(objects),
            "total_bytes": manifest["total_bytes"],
            "new": existing is None,
        }
        self._emit_asset_event(context, source, result)
        return result

    def _read_existing(self, client: Any, bucket: str, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        # The key is derived from the content, so an existing object is the same snapshot;
        # it is still read back to refuse a foreign or corrupt file under our name.
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        try:
            return check_manifest(json.loads(body))
        except ValueError as exc:
            raise ValueError(
                f"s3://{bucket}/{key} exists but is not a valid dataset manifest: {exc}"
            ) from exc

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
