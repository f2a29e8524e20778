"""The best epoch by ``--monitor``: which one it is, its weights kept aside, and the export.

``CHECKPOINT_DIR/best/ckpt-<step>`` holds the model weights of the best epoch so far (with
``--restore-best``, the default); at the end of the run they are loaded back so that the
exported model is the best epoch's, not the last one's. The record of the best epoch
(epoch, step, value, its history row) travels in the trainer state of each checkpoint.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from kubetrain_contract.kit import check_monitor_mode
from trainer.common.checkpoints import CHECKPOINT_NAME

log = logging.getLogger("kubetrain.trainer")

BEST_DIR = "best"

__all__ = ["BEST_DIR", "BestEpoch"]


class BestEpoch:
    """Tracks the best epoch by the monitored metric and keeps its weights.

    Args:
        model: the model whose weights are kept and restored.
        monitor: the history column that decides (``val_accuracy``, ``val_loss``).
        mode: ``max`` or ``min``: which way is better.
        restore_best: whether the best weights are kept and exported (``--restore-best``).
        write_dir: where this process writes checkpoints (CHECKPOINT_DIR on the chief).
        checkpoint_dir: CHECKPOINT_DIR, where an earlier process of the run left its best weights.
        io: checkpoint options (the I/O device in parameter-server mode).
    """

    def __init__(
        self,
        *,
        model: keras.Model,
        monitor: str,
        mode: str,
        restore_best: bool,
        write_dir: Path,
        checkpoint_dir: Path,
        io: tf.train.CheckpointOptions | None = None,
    ) -> None:
        self.monitor = monitor
        self.mode = check_monitor_mode(mode)
        self.restore_best = restore_best
        self.write_dir = write_dir
        self.checkpoint_dir = checkpoint_dir
        self.io = io
        self.best: dict[str, Any] | None = None  # epoch, step, value, monitor, row
        self._checkpoint = tf.train.Checkpoint(model=model)
        # Two: the best recorded in the newest training checkpoint survives a newer best
        # written just before a crash.
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, str(write_dir / BEST_DIR), max_to_keep=2, checkpoint_name=CHECKPOINT_NAME
        )

    def improved(self, value: float | None) -> bool:
        """Whether ``value`` beats the best so far (a NaN or a missing value never does)."""
        if value is None or not math.isfinite(value):
            return False
        if self.best is None or self.best.get("value") is None:
            return True
        return value > self.best["value"] if self.mode == "max" else value < self.best["value"]

    def is_best(self, step: int) -> bool:
        """Whether the epoch closed at ``step`` is the best so far."""
        return self.best is not None and self.best["step"] == step

    def offer(self, row: dict[str, Any]) -> bool:
        """Record a closed epoch's history row if it is the best so far; True when it is."""
        if not self.improved(row.get(self.monitor)):
            return False
        self.best = {
            "epoch": row["epoch"],
            "step": row["step"],
            "value": row[self.monitor],
            "monitor": self.monitor,
            "row": dict(row),
        }
        if self.restore_best:
            self._save_weights(row["step"])
        return True

    def _save_weights(self, step: int) -> None:
        # Closing the epoch of a restored SIGTERM checkpoint again must not rewrite a file the
        # sidecar may already have uploaded: the same step's weights are the same.
        if self._existing(step) is not None:
            return
        self._manager.save(checkpoint_number=step, options=self.io)

    def _existing(self, step: int) -> Path | None:
        """The best weights of ``step``, written by this process or by an earlier one of the run."""
        name = f"{CHECKPOINT_NAME}-{step}"
        return next(
            (
                d / BEST_DIR / name
                for d in (self.write_dir, self.checkpoint_dir)
                if (d / BEST_DIR / f"{name}.index").exists()
            ),
            None,
        )

    def restore_weights(self, history: list[dict[str, Any]]) -> bool:
        """Load the best epoch's weights into the model; False (the last weights kept) when unavailable.

        Args:
            history: the run's rows; when the last one is the best, the model holds its weights already.
        """
        if self.best is None or not self.restore_best:
            return False
        if history and history[-1].get("step") == self.best["step"]:
            return True
        path = (
            self._existing(self.best["step"])
            or self.write_dir / BEST_DIR / f"{CHECKPOINT_NAME}-{self.best['step']}"
        )
        try:
            self._checkpoint.restore(str(path), options=self.io).assert_existing_objects_matched()
        except (tf.errors.NotFoundError, tf.errors.DataLossError, AssertionError, ValueError) as exc:
            log.warning(
                "the best epoch's weights (%s) cannot be read (%s): exporting the last epoch's weights",
                path,
                str(exc).splitlines()[0][:200],
            )
            return False
        log.info(
            "restored the weights of epoch %d (step %d, %s %.4f), the best by %s",
            self.best["epoch"],
            self.best["step"],
            self.monitor,
            self.best["value"],
            self.monitor,
        )
        return True

    def exported_row(self, restored: bool, history: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The history row whose weights the model holds: the best epoch's when restored, else the last."""
        if restored and self.best is not None:
            return self.best["row"]
        return history[-1] if history else None
