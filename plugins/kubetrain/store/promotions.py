"""The promotion history of each model: ``promotions/<model>/<inverted time>~<version>.json``, newest first."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import safe_segment
from kubetrain_contract.run import PromotionEvent

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore


class PromotionRepository:
    """The models' promotion histories, in the training bucket.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.layout = store.layout

    def record(self, event: PromotionEvent) -> str:
        """Append a promotion to its model's history; return its URI."""
        from kubetrain.store.index import promotion_name

        key = self.layout.promotions_prefix(event.model) + promotion_name(event.version, datetime.now(UTC))
        return self.store.write(
            self.layout.training_bucket, key, event.to_json(indent=1) + "\n", content_type="application/json"
        )

    def newest(self, model: str, *, limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` promotions of ``model``, newest first, as stored."""
        bucket = self.layout.training_bucket
        keys = self.store.list_keys(bucket, self.layout.promotions_prefix(model), max_keys=limit)
        return [doc for doc in self.store.read_many(bucket, keys) if isinstance(doc, dict)]

    def has(self, model: str, version: str, *, newest: int = 100) -> bool:
        """Whether one of the newest ``newest`` promotions of ``model`` is of ``version``."""
        from kubetrain.store.index import SEPARATOR

        suffix = f"{SEPARATOR}{safe_segment(version)}.json"
        keys = self.store.list_keys(
            self.layout.training_bucket, self.layout.promotions_prefix(model), max_keys=newest
        )
        return any(key.endswith(suffix) for key in keys)
