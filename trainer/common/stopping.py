"""When a run is over: ``--epochs``, ``--max-steps``, ``--patience``, or the sweep's stop file.

An early stop (``--patience`` without improvement of ``--monitor``, or ``KUBETRAIN_STOP_FILE``
written by a sweep's sidecar) is recorded once, in the trainer state of each later
checkpoint, so that a retried run sees it and does not train again.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.common.config import TrainerConfig
from trainer.common.signals import StopRequest

log = logging.getLogger("kubetrain.trainer")

__all__ = ["Stopping"]


class Stopping:
    """Decides whether the run is over and keeps the record of an early stop.

    Args:
        config: ``--epochs``, ``--max-steps``, ``--patience`` and ``--monitor``.
        stop: the stop request, which also looks for the stop file.
    """

    def __init__(self, config: TrainerConfig, stop: StopRequest) -> None:
        self.config = config
        self.stop = stop
        self.stopped_early: dict[str, Any] | None = None

    def max_reached(self, step: int) -> bool:
        """Whether ``--max-steps`` is reached at ``step``."""
        return self.config.max_steps is not None and step >= self.config.max_steps

    def finished(self, *, step: int, epoch: int, batch_in_epoch: int) -> bool:
        """Whether the run is over with ``epoch`` epochs completed at ``step``."""
        return (
            epoch >= self.config.epochs
            or self.max_reached(step)
            or self.stopped_early is not None
            or self.stop_file_seen(step=step, epoch=epoch, batch_in_epoch=batch_in_epoch)
        )

    def stop_file_seen(self, *, step: int, epoch: int, batch_in_epoch: int) -> bool:
        """Whether the sweep's sidecar asked this run to stop (``KUBETRAIN_STOP_FILE``): early stopping."""
        request = self.stop.stop_file_request()
        if request is not None and self.stopped_early is None:
            self.stopped_early = {
                "epoch": epoch + (1 if batch_in_epoch else 0),
                "step": step,
                "by": "stop file",
                "monitor": self.config.monitor,
                "request": request,
            }
            log.info("early stopping requested through the stop file at step %d", step)
        return request is not None

    def after_epoch(self, row: dict[str, Any], best: dict[str, Any] | None) -> None:
        """After a completed epoch's ``row``: stop early when ``--monitor`` has not improved on the ``best``
        epoch for ``--patience`` epochs (0: never)."""
        patience = self.config.patience
        if not patience or best is None:
            return
        waited = row["epoch"] - best["epoch"]
        if waited < patience:
            return
        self.stopped_early = {
            "epoch": row["epoch"],
            "step": row["step"],
            "best_epoch": best["epoch"],
            "patience": patience,
            "monitor": self.config.monitor,
        }
        log.info(
            "early stopping: %s has not improved for %d epoch(s) since epoch %d (--patience %d)",
            self.config.monitor,
            waited,
            best["epoch"],
            patience,
        )
