"""Train-once markers: ``trained/<dag>/<fingerprint>.json``, written when a run with that fingerprint finishes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import s3_uri

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore


class MarkerRepository:
    """The train-once markers of the training DAGs, in the training bucket.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.layout = store.layout

    def get(self, dag_id: str, fingerprint: str) -> dict[str, Any] | None:
        """The record of a finished training with this fingerprint, or ``None``."""
        record = self.store.read_json(
            self.layout.training_bucket, self.layout.trained_marker_key(dag_id, fingerprint)
        )
        return record if isinstance(record, dict) else None

    def uri(self, dag_id: str, fingerprint: str) -> str:
        """Where the marker of ``fingerprint`` is (or would be)."""
        return s3_uri(self.layout.training_bucket, self.layout.trained_marker_key(dag_id, fingerprint))

    def write(self, dag_id: str, fingerprint: str, record: dict[str, Any]) -> str:
        """Write the train-once marker; return its URI.

        :param record: what the marker says of the run (run id, dataset version, image, Params...).
        """
        return self.store.write_json(
            self.layout.training_bucket, self.layout.trained_marker_key(dag_id, fingerprint), record
        )
