"""Writing the model into OUTPUT_DIR atomically: model.keras and the SavedModel export."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from trainer.common.contract import replace_dir_atomic, temp_path_for

log = logging.getLogger("kubetrain.trainer")

SAVED_MODEL_VERSION = "1"


def save_keras_model(model: keras.Model, output_dir: Path) -> Path:
    """OUTPUT_DIR/model.keras (Keras' own format; no pickle)."""
    target = output_dir / "model.keras"
    tmp = temp_path_for(target, ".keras")  # Keras insists on the .keras suffix
    try:
        model.save(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def input_signature(model: keras.Model) -> list[Any]:
    """The model's inputs as ``tf.TensorSpec`` (a dict for dict inputs), batch dimension free."""
    import tensorflow as tf

    return [keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype, name=t.name), model.input)]


def export_saved_model(
    model: keras.Model,
    output_dir: Path,
    add_endpoints: Callable[[keras.export.ExportArchive], None] | None = None,
    io_device: str | None = None,
) -> Path:
    """OUTPUT_DIR/saved_model/1/: a SavedModel with a ``serve`` signature for TF Serving.

    TF Serving loads numbered version directories under a model base path, so the
    directory OUTPUT_DIR/saved_model is what a serving config points at. ``serve`` (also
    ``serving_default``) is the model's forward pass; ``add_endpoints`` may register
    more signatures on the same archive (the dialogue trainer's ``generate``). ``io_device``
    writes the variables through that device (``Runtime.io_device``: in parameter-server mode
    the variables live on the ps replicas, which would write them to their own disks).
    """
    target = output_dir / "saved_model"
    tmp = temp_path_for(target)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        archive = keras.export.ExportArchive()
        archive.track_and_add_endpoint("serve", model, input_signature(model))
        if add_endpoints is not None:
            add_endpoints(archive)
        options = None
        if io_device is not None:
            import tensorflow as tf

            options = tf.saved_model.SaveOptions(experimental_io_device=io_device)
        archive.write_out(str(tmp / SAVED_MODEL_VERSION), options=options, verbose=False)
        replace_dir_atomic(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target / SAVED_MODEL_VERSION
