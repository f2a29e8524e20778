"""TensorBoard event files in OUTPUT_DIR/tensorboard, laid out as Keras' TensorBoard callback does.

``train/`` holds the per-log-step scalars (loss, metric, learning rate, global gradient
norm, examples/s, input wait) and the per-epoch training means; ``validation/`` holds the
per-epoch validation values, under the same names, so TensorBoard draws both on one
chart. The x axis is the global step, which continues across a resume.

The scalars are written with TensorFlow's own ``tf.summary.write`` and the metadata of
TensorBoard's scalar plugin, so the trainer image needs no ``tensorboard`` package: the
event files are read by the TensorBoard wherever it runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

SCALARS_PLUGIN = "scalars"


def scalar_metadata() -> summary_pb2.SummaryMetadata:
    """What TensorBoard's ``tf.summary.scalar`` attaches: the scalars plugin, version 0 (empty content)."""
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = SCALARS_PLUGIN
    metadata.data_class = summary_pb2.DATA_CLASS_SCALAR
    return metadata


class Summaries:
    """Writers for ``train`` and ``validation``, created on first use.

    Args:
        output_dir: OUTPUT_DIR; events go to its ``tensorboard`` folder.
        enabled: write nothing when False.
    """

    def __init__(self, output_dir: str | Path, enabled: bool = True) -> None:
        self.root = Path(output_dir) / "tensorboard"
        self.enabled = enabled
        self._writers: dict[str, Any] = {}

    def scalars(self, split: str, step: int, values: dict[str, float | None]) -> None:
        """Write finite ``values`` at ``step`` under ``split`` (``train`` or ``validation``)."""
        if not self.enabled:
            return
        writer = self._writers.get(split)
        if writer is None:
            writer = self._writers[split] = tf.summary.create_file_writer(str(self.root / split))
        metadata = scalar_metadata()
        with writer.as_default(step=step):
            for name, value in values.items():
                if value is not None and math.isfinite(value):
                    tf.summary.write(name, tf.constant(value, tf.float32), metadata=metadata)

    def flush(self) -> None:
        """Push buffered events to the files (at epoch ends, so the sidecar uploads whole epochs)."""
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
