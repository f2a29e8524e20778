"""Writing the model into OUTPUT_DIR atomically: model.keras and the SavedModel export.

TF Serving watches a model's base path and serves the highest numbered version directory
under it, so every export adds a new, higher version (:func:`next_version`) instead of
rewriting one: a retried run's export, or a promoted model copied beside an earlier one,
becomes the served version rather than being mixed with or hidden by an older one.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from trainer.common.contract import temp_path_for

log = logging.getLogger("kubetrain.trainer")

SAVED_MODEL_DIR = "saved_model"


def saved_model_versions(model_dir: Path) -> list[int]:
    """The version directories (numbers, as TF Serving reads them) under ``model_dir``, ascending."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def latest_saved_model(model_dir: Path) -> Path:
    """The version directory that TF Serving would serve: the highest number under ``model_dir``.

    Raises:
        FileNotFoundError: ``model_dir`` holds no version directory.
    """
    versions = saved_model_versions(model_dir)
    if not versions:
        raise FileNotFoundError(f"no SavedModel version directory (a number) under {str(model_dir)!r}")
    return model_dir / str(versions[-1])


def next_version(model_dir: Path, now: float | None = None) -> int:
    """A version above every existing one: the Unix time in seconds, or the highest version + 1.

    A time-based number also orders exports of different runs copied under one base path.
    """
    import time

    stamp = int(time.time() if now is None else now)
    return max([stamp, *(v + 1 for v in saved_model_versions(model_dir))])


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
    *,
    serve_model: bool = True,
) -> Path:
    """OUTPUT_DIR/saved_model/<version>/: a SavedModel for TF Serving, in a new version directory.

    TF Serving loads numbered version directories under a model base path, so the
    directory OUTPUT_DIR/saved_model is what a serving config points at; the version is
    :func:`next_version`'s, and the directory appears whole (written aside, then renamed).
    With ``serve_model`` the model's forward pass is the ``serve`` signature (also
    ``serving_default``); ``add_endpoints`` may register more signatures on the same archive
    (the dialogue trainer's ``generate``; the classifier's image signatures, which then take
    ``serve``'s place). ``io_device`` writes the variables through that device
    (``Runtime.io_device``: in parameter-server mode the variables live on the ps replicas,
    which would write them to their own disks).

    Returns:
        The version directory written.
    """
    base = output_dir / SAVED_MODEL_DIR
    base.mkdir(parents=True, exist_ok=True)
    target = base / str(next_version(base))
    tmp = temp_path_for(target)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        archive = keras.export.ExportArchive()
        if serve_model:
            archive.track_and_add_endpoint("serve", model, input_signature(model))
        else:
            archive.track(model)
        if add_endpoints is not None:
            add_endpoints(archive)
        options = None
        if io_device is not None:
            import tensorflow as tf

            options = tf.saved_model.SaveOptions(experimental_io_device=io_device)
        archive.write_out(str(tmp), options=options, verbose=False)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("SavedModel version %s written to %s", target.name, target)
    return target
