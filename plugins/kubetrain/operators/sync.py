"""Deprecated names: ``SyncCheckpointsOperator`` is :class:`~kubetrain.operators.promote.PromoteModelOperator`.

Kept for one release so that DAGs written against it still load; they get a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any

from kubetrain.operators.promote import PromoteModelOperator
from kubetrain.run_store import SyncVerificationError

__all__ = ["SyncCheckpointsOperator", "SyncVerificationError"]


class SyncCheckpointsOperator(PromoteModelOperator):
    """Deprecated: use :class:`kubetrain.operators.promote.PromoteModelOperator` (same arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn(
            "SyncCheckpointsOperator is deprecated and will be removed in the next release: use "
            "PromoteModelOperator from kubetrain.operators.promote (same arguments)",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(**kwargs)
