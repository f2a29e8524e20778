"""Promoted models: ``models/<model>/<version>/`` (the run's output files) and the ``latest`` pointer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import RunLocation, check_name, s3_uri, utc_stamp
from kubetrain.store.passes import SyncPass, SyncVerificationError
from kubetrain_contract.run_layout import METRICS_JSON

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore

POINTER_KIND = "kubetrain/model-pointer"
# S3 CopyObject, which promotion uses, copies objects up to 5 GiB.
MAX_COPY_BYTES = 5 * 1024**3


class ModelRepository:
    """Promoted model versions and the ``latest`` pointer of each model, in the training bucket.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.layout = store.layout

    def promote(self, run: RunLocation, *, model: str, version: str, sync_pass: SyncPass) -> dict[str, Any]:
        """Copy the run's output files to ``models/<model>/<version>/``, then point ``latest`` at it.

        The pointer is written last, so a reader of ``latest`` never sees a half-copied version.

        :param run: the run whose output is promoted.
        :param model: the model name; ``version``: the new version's name.
        :param sync_pass: the run's verified final pass, which lists the output files.
        :return: the pointer written.
        """
        outputs = [f for f in sync_pass.files if f.get("area") == "output"]
        if not outputs:
            raise SyncVerificationError(
                f"the final sync pass of {run.uri} lists no output files: there is no model to promote"
            )
        too_big = [
            f"{f['path']} ({f.get('size')} bytes)"
            for f in outputs
            if int(f.get("size") or 0) > MAX_COPY_BYTES
        ]
        if too_big:
            raise ValueError(
                f"cannot promote {run.uri}: S3 CopyObject copies objects up to 5 GiB, and {', '.join(too_big)} "
                "is larger; split the model into smaller files"
            )
        prefix = self.layout.model_prefix(model, version)
        bucket = self.layout.training_bucket
        for entry in outputs:
            self.store.copy(run.bucket, entry["key"], bucket, prefix + entry["path"])
        pointer = {
            "kind": POINTER_KIND,
            "format_version": 1,
            "model": model,
            "version": version,
            "uri": s3_uri(bucket, prefix),
            "run_uri": run.uri,
            "sync_pass": sync_pass.number,
            "files": sorted(entry["path"] for entry in outputs),
            "promoted_at": utc_stamp(),
        }
        self.store.write_json(bucket, self.layout.model_latest_key(model), pointer)
        return pointer

    def pointer(self, model: str) -> dict[str, Any] | None:
        """The ``models/<model>/latest`` pointer, or ``None`` when nothing is promoted."""
        pointer = self.store.read_json(
            self.layout.training_bucket, self.layout.model_latest_key(check_name("model", model))
        )
        return pointer if isinstance(pointer, dict) else None

    def promoted_metrics(self, model: str) -> tuple[str | None, dict[str, Any] | None]:
        """``(version, metrics.json)`` of the promoted version of ``model``; ``(None, None)`` if none is promoted."""
        bucket = self.layout.training_bucket
        pointer_key = self.layout.model_latest_key(check_name("model", model))
        pointer = self.store.read_json(bucket, pointer_key)
        if pointer is None:
            return None, None
        version = pointer.get("version") if isinstance(pointer, dict) else None
        if not isinstance(version, str) or not version:
            raise ValueError(f"{s3_uri(bucket, pointer_key)} names no version: {str(pointer)[:200]}")
        metrics = self.store.read_json(bucket, self.layout.model_prefix(model, version) + METRICS_JSON)
        return version, metrics if isinstance(metrics, dict) else {}
