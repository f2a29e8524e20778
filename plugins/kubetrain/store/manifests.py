"""Staged dataset manifests: ``manifests/<dataset>/<version>.json`` in the training bucket."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import s3_uri

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore


class ManifestRepository:
    """The staged snapshots of the datasets; :mod:`kubetrain.manifest` builds and checks them.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.layout = store.layout

    def staged(self, dataset: str, version: str) -> dict[str, Any] | None:
        """The staged manifest of a dataset version, checked, or ``None`` when it is not staged."""
        from kubetrain.manifest import check_manifest

        bucket, key = self.layout.training_bucket, self.layout.manifest_key(dataset, version)
        document = self.store.read_json(bucket, key)
        if document is None:
            return None
        # The key is derived from the content, so an existing object is the same snapshot; it
        # is still checked to refuse a foreign or corrupt file under our name.
        try:
            return check_manifest(document)
        except ValueError as exc:
            raise ValueError(
                f"{s3_uri(bucket, key)} exists but is not a valid dataset manifest: {exc}"
            ) from exc

    def stage(self, manifest: dict[str, Any]) -> str:
        """Write a dataset manifest under its dataset and version; return its URI."""
        from kubetrain.manifest import dumps

        key = self.layout.manifest_key(manifest["dataset"], manifest["version"])
        return self.store.write(self.layout.training_bucket, key, dumps(manifest))
