"""Image classifier trainer: ``python -m trainer.image_classifier``.

Reads a directory of class folders from DATA_DIR (the extracted dataset; one top-level
folder holding the class folders is detected and entered), skips and counts files that
are not readable images, splits the rest into seeded, stratified training and validation
sets, and trains a small CNN or a MobileNetV2 (``--model mobilenet_v2``) with a cached,
prefetched tf.data pipeline. Writes the pod contract's outputs to OUTPUT_DIR, plus
confusion_matrix.json (rows: true class, columns: predicted class, on the validation set).

Transfer learning uses MobileNetV2 weights only from a local file (``--weights PATH``);
nothing is ever downloaded, and without the flag the network starts from random weights.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.common import cli
from trainer.common.config import TrainerConfig, option, parse_config, require
from trainer.common.contract import (
    DataError,
    RunInfo,
    UsageError,
    check_data_dir,
    prepare_dir,
    write_json_atomic,
    write_params,
)
from trainer.common.signals import StopRequest

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

log = logging.getLogger("kubetrain.trainer")

TRAINER = "image_classifier"
# Formats that both Pillow verifies here and tf.io.decode_image decodes in the pipeline.
DECODABLE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")
IGNORED_NAMES = ("__MACOSX",)
MOBILENET_ALPHAS = (0.35, 0.5, 0.75, 1.0, 1.3, 1.4)


@dataclass
class ClassifierConfig(TrainerConfig):
    """Flags of the image classifier."""

    batch_size: int = option(32, "global batch size, split evenly over the devices")
    learning_rate: float = option(1e-3, "Adam learning rate")
    model: str = option("cnn", "network: a small CNN or MobileNetV2", choices=("cnn", "mobilenet_v2"))
    image_size: int = option(64, "images are resized to SIZE x SIZE pixels", metavar="SIZE")
    channels: int = option(3, "colour channels the images are decoded to", choices=(1, 3))
    filters: int = option(32, "filters of the CNN's first block (doubled in each of the next two)")
    alpha: float = option(1.0, "MobileNetV2 width multiplier", choices=MOBILENET_ALPHAS)
    weights: str | None = option(
        None, "local MobileNetV2 weights file (.weights.h5 or .h5, without the top); never downloaded",
        metavar="PATH",
    )
    freeze_base: bool = option(True, "keep MobileNetV2's loaded weights frozen (only with --weights)")
    dropout: float = option(0.2, "dropout before the classification layer")
    augment: bool = option(False, "random shifts, brightness and contrast on training images")
    flip: bool = option(False, "random left-right flips on training images (not for digits or text)")
    cache: bool = option(True, "keep decoded images in memory after the first epoch")
    shuffle_buffer: int = option(10000, "shuffle buffer in images")
    verify_workers: int = option(8, "threads that check the image files before training")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.learning_rate > 0, "learning_rate", self.learning_rate, "a number > 0")
        require(isinstance(self.image_size, int) and 8 <= self.image_size <= 1024, "image_size", self.image_size,
                "an integer from 8 to 1024")
        require(isinstance(self.filters, int) and 1 <= self.filters <= 1024, "filters", self.filters,
                "an integer from 1 to 1024")
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a fraction in [0, 1)")
        require(isinstance(self.shuffle_buffer, int) and self.shuffle_buffer >= 1, "shuffle_buffer",
                self.shuffle_buffer, "an integer >= 1")
        require(isinstance(self.verify_workers, int) and 1 <= self.verify_workers <= 256, "verify_workers",
                self.verify_workers, "an integer from 1 to 256")
        if self.model == "mobilenet_v2":
            require(self.channels == 3, "channels", self.channels, "3 with --model mobilenet_v2")
            require(self.image_size >= 32, "image_size", self.image_size, ">= 32 with --model mobilenet_v2")
        if self.weights is not None:
            require(self.model == "mobilenet_v2", "weights", self.weights,
                    "unset unless --model mobilenet_v2 (the CNN has no pretrained weights)")
            require(os.path.isfile(self.weights), "weights", self.weights, "an existing local weights file")


# -- data ------------------------------------------------------------------------------


@dataclass
class ImageFolder:
    """What DATA_DIR holds: class names, usable files with labels, and skipped files."""

    root: Path
    class_names: list[str]
    files: list[tuple[str, int]]
    skipped: list[tuple[str, str]]


def _visible(entry: os.DirEntry[str] | Path) -> bool:
    return not entry.name.startswith(".") and entry.name not in IGNORED_NAMES


def find_class_root(data_dir: Path) -> Path:
    """DATA_DIR itself, or its single top-level folder when that one holds the class folders."""
    dirs = sorted(p for p in data_dir.iterdir() if _visible(p) and p.is_dir())
    if len(dirs) == 1 and any(_visible(p) and p.is_dir() for p in dirs[0].iterdir()):
        log.info("DATA_DIR holds one folder, %r: using its sub-folders as the classes", dirs[0].name)
        return dirs[0]
    return data_dir


def check_image(path: str) -> str | None:
    """None when ``path`` is an image the pipeline decodes, else why it is skipped."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            fmt = image.format
            if fmt not in DECODABLE_FORMATS:
                return f"format {fmt} is not decodable (expected one of {', '.join(DECODABLE_FORMATS)})"
            image.verify()
        # verify() checks structure only; decoding catches truncated pixel data too.
        with Image.open(path) as image:
            image.load()
    except UnidentifiedImageError:
        return "not an image"
    except (OSError, SyntaxError, ValueError) as exc:
        return f"unreadable image ({exc})"
    return None


def scan_image_folder(data_dir: Path, workers: int = 8) -> ImageFolder:
    """Find the class folders and check every file in them.

    Raises:
        DataError: when fewer than two classes hold readable images.
    """
    root = find_class_root(data_dir)
    class_dirs = sorted((p for p in root.iterdir() if _visible(p) and p.is_dir()), key=lambda p: p.name)
    loose = [p.name for p in root.iterdir() if _visible(p) and p.is_file()]
    if loose:
        log.info("ignoring %d file(s) beside the class folders: %s", len(loose), ", ".join(sorted(loose)[:5]))
    if not class_dirs:
        raise DataError(
            f"no class folders in DATA_DIR {str(data_dir)!r}: expected one sub-folder per class holding its images"
        )
    candidates: list[tuple[str, str]] = []
    for class_dir in class_dirs:
        for dirpath, dirnames, filenames in os.walk(class_dir):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in IGNORED_NAMES)
            candidates.extend((os.path.join(dirpath, name), class_dir.name)
                              for name in sorted(filenames) if not name.startswith("."))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        problems = list(pool.map(check_image, (path for path, _ in candidates)))
    per_class: dict[str, list[str]] = {d.name: [] for d in class_dirs}
    skipped = []
    for (path, name), problem in zip(candidates, problems, strict=True):
        if problem is None:
            per_class[name].append(path)
        else:
            skipped.append((os.path.relpath(path, root), problem))
    empty = [name for name, paths in per_class.items() if not paths]
    if empty:
        log.warning("class folder(s) without a readable image left out: %s", ", ".join(empty))
    class_names = [name for name, paths in per_class.items() if paths]
    if skipped:
        shown = "; ".join(f"{path}: {why}" for path, why in skipped[:10])
        log.warning("skipped %d file(s) that are not readable images: %s%s", len(skipped), shown,
                    " ..." if len(skipped) > 10 else "")
    if not class_names:
        raise DataError(f"no readable images in DATA_DIR {str(data_dir)!r} ({len(skipped)} file(s) skipped)")
    if len(class_names) < 2:
        raise DataError(
            f"only one class ({class_names[0]!r}) has readable images in DATA_DIR {str(data_dir)!r}; a classifier "
            "needs at least two class folders"
        )
    files = [(path, label) for label, name in enumerate(class_names) for path in per_class[name]]
    log.info("found %d images in %d classes under %s", len(files), len(class_names), root)
    return ImageFolder(root=root, class_names=class_names, files=files, skipped=skipped)


def split_files(files: Sequence[tuple[str, int]], fraction: float, seed: int,
                ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Seeded split, stratified by class: every class with two or more images is in both sets."""
    import numpy as np

    rng = np.random.default_rng(seed)
    by_label: dict[int, list[tuple[str, int]]] = {}
    for item in files:
        by_label.setdefault(item[1], []).append(item)
    train, val = [], []
    for label in sorted(by_label):
        items = by_label[label]
        order = rng.permutation(len(items))
        n_val = min(len(items) - 1, max(1, round(len(items) * fraction))) if len(items) > 1 else 0
        val.extend(items[i] for i in order[:n_val])
        train.extend(items[i] for i in order[n_val:])
    return train, val


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: fixed by (seed, epoch) so a resumed epoch repeats its order."""
    return (seed * 1_000_003 + epoch * 7_919 + 1) % (2**31 - 1)


class ImagePipeline:
    """tf.data input: parallel decode, in-memory cache, seeded per-epoch shuffle, prefetch.

    Args:
        train: training (path, label) pairs.
        val: validation (path, label) pairs.
        config: image size, channels, batch size, augmentation and cache flags.
    """

    def __init__(self, train: Sequence[tuple[str, int]], val: Sequence[tuple[str, int]],
                 config: ClassifierConfig) -> None:
        import tensorflow as tf

        self.tf = tf
        self.config = config
        self.size = config.image_size
        self.train_count = len(train)
        self.val_count = len(val)
        self.train_base = self._decoded(train)
        self.val_base = self._decoded(val)

    def _decoded(self, items: Sequence[tuple[str, int]]) -> tf.data.Dataset:
        tf = self.tf
        size, channels = self.size, self.config.channels
        paths = tf.constant([p for p, _ in items], dtype=tf.string)
        labels = tf.constant([label for _, label in items], dtype=tf.int32)

        def load(path: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
            image = tf.image.resize(image, [size, size], antialias=True)
            # uint8 keeps the in-memory cache at a quarter of the float32 size.
            image = tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)
            image.set_shape([size, size, channels])
            return image, label

        ds = tf.data.Dataset.from_tensor_slices((paths, labels))
        ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        # The files were checked before training; this only guards against a file that
        # changed since or that Pillow reads and TensorFlow does not.
        ds = ds.ignore_errors(log_warning=True)
        return ds.cache() if self.config.cache else ds

    def _augment(self, image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        tf = self.tf
        size, channels = self.size, self.config.channels
        seeds = tf.random.experimental.stateless_split(seed, 4)
        x = tf.cast(image, tf.float32)
        if self.config.flip:
            x = tf.image.stateless_random_flip_left_right(x, seeds[0])
        pad = max(1, size // 8)
        x = tf.pad(x, [[pad, pad], [pad, pad], [0, 0]], mode="REFLECT")
        x = tf.image.stateless_random_crop(x, [size, size, channels], seeds[1])
        x = tf.image.stateless_random_brightness(x, 0.1 * 255.0, seeds[2])
        x = tf.image.stateless_random_contrast(x, 0.8, 1.2, seeds[3])
        return tf.clip_by_value(x, 0.0, 255.0)

    def train_dataset(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        """Training batches of ``epoch`` without the first ``skip_batches`` (already trained on)."""
        tf = self.tf
        batch = self.config.batch_size
        seed = epoch_seed(self.config.seed, epoch)
        ds = self.train_base.shuffle(min(self.config.shuffle_buffer, max(1, self.train_count)), seed=seed,
                                     reshuffle_each_iteration=False)
        if self.config.augment:
            # Numbering the elements before skipping keeps each image's augmentation seed
            # tied to its position in the epoch, so a resumed epoch augments identically.
            base = tf.constant(seed, tf.int64)
            ds = ds.enumerate().skip(skip_batches * batch)
            ds = ds.map(lambda i, xy: (self._augment(xy[0], tf.stack([base, i])), xy[1]),
                        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            ds = ds.batch(batch, drop_remainder=True)
        else:
            ds = ds.skip(skip_batches * batch).batch(batch, drop_remainder=True)
            # One cast per batch instead of one per image.
            ds = ds.map(lambda x, y: (tf.cast(x, tf.float32), y), num_parallel_calls=tf.data.AUTOTUNE)
        return ds.prefetch(tf.data.AUTOTUNE)

    def val_dataset(self) -> tf.data.Dataset:
        """Validation batches, in a fixed order."""
        tf = self.tf
        ds = self.val_base.batch(self.config.batch_size)
        return ds.map(lambda x, y: (tf.cast(x, tf.float32), y), num_parallel_calls=tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE
        )


# -- model -----------------------------------------------------------------------------


def build_model(config: ClassifierConfig, num_classes: int) -> keras.Model:
    """The classifier: pixel values 0-255 in, class probabilities out."""
    import keras

    size, channels = config.image_size, config.channels
    inputs = keras.Input((size, size, channels), name="image")
    if config.model == "cnn":
        x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
        for block in range(3):
            x = keras.layers.Conv2D(config.filters * 2**block, 3, padding="same", use_bias=False)(x)
            # Momentum 0.9 rather than 0.99: short runs must still end with usable
            # moving statistics for inference.
            x = keras.layers.BatchNormalization(momentum=0.9)(x)
            x = keras.layers.ReLU()(x)
            x = keras.layers.MaxPooling2D()(x) if block < 2 else keras.layers.GlobalAveragePooling2D()(x)
    else:
        x = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0)(inputs)  # MobileNetV2 expects [-1, 1]
        if config.weights:
            log.info("MobileNetV2 starts from the local weights file %s", config.weights)
        else:
            log.info("no --weights given: MobileNetV2 starts from random weights (weights are never downloaded)")
        try:
            base = keras.applications.MobileNetV2(input_shape=(size, size, 3), include_top=False,
                                                  weights=config.weights, alpha=config.alpha, pooling="avg")
        except (ValueError, OSError) as exc:
            raise UsageError(f"--weights {config.weights!r} cannot be loaded into MobileNetV2 "
                             f"(alpha {config.alpha}, include_top=False): {exc}") from exc
        frozen = bool(config.weights) and config.freeze_base
        base.trainable = not frozen
        # A frozen base runs its batch-norm layers in inference mode, keeping the loaded statistics.
        x = base(x, training=False) if frozen else base(x)
    x = keras.layers.Dropout(config.dropout, seed=config.seed)(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="probabilities")(x)
    return keras.Model(inputs, outputs, name=f"{config.model}_classifier")


def classification_sums(model: keras.Model, batch: Any, training: bool) -> dict[str, tf.Tensor]:
    """Per-replica loss and accuracy sums for a batch of (images, labels)."""
    import keras
    import tensorflow as tf

    images, labels = batch
    probs = model(images, training=training)
    losses = keras.losses.sparse_categorical_crossentropy(labels, probs)
    predicted = tf.argmax(probs, axis=-1, output_type=labels.dtype)
    n = tf.cast(tf.shape(labels)[0], tf.float32)
    return {
        "loss_sum": tf.reduce_sum(tf.cast(losses, tf.float32)),
        "examples": n,
        "correct": tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.float32)),
        "count": n,
    }


def confusion_matrix(model: keras.Model, dataset: tf.data.Dataset, num_classes: int) -> list[list[int]]:
    """Counts of (true class, predicted class) over ``dataset``."""
    import numpy as np
    import tensorflow as tf

    predict = tf.function(lambda x: tf.argmax(model(x, training=False), axis=-1, output_type=tf.int32))
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    for images, labels in dataset:
        np.add.at(matrix, (labels.numpy(), predict(images).numpy()), 1)
    return matrix.tolist()


# -- main ------------------------------------------------------------------------------


def train(config: ClassifierConfig, stop: StopRequest) -> None:
    """Run the whole training job described by ``config``."""
    data_dir = check_data_dir(config.data_dir)
    prepare_dir(config.checkpoint_dir, "CHECKPOINT_DIR")
    output_dir = prepare_dir(config.output_dir, "OUTPUT_DIR")
    folder = scan_image_folder(data_dir, config.verify_workers)
    train_files, val_files = split_files(folder.files, config.validation_split, config.seed)
    if not val_files:
        raise DataError("the validation split is empty: every class has a single image")
    if len(train_files) < config.batch_size:
        raise DataError(f"{len(train_files)} training images are fewer than --batch-size {config.batch_size}; "
                        "lower --batch-size or add images")
    log.info("split: %d training and %d validation images (seed %d)", len(train_files), len(val_files), config.seed)
    run = RunInfo.from_env()
    write_params(output_dir, TRAINER, config.hyperparameters(), run, classes=folder.class_names)

    import keras  # noqa: F401  (imported here: TensorFlow loads only once the flags and data are fine)

    from trainer.common.export import export_saved_model, save_keras_model
    from trainer.common.loop import TrainingLoop, metrics_document
    from trainer.common.runtime import configure

    runtime = configure(config)
    pipeline = ImagePipeline(train_files, val_files, config)
    with runtime.strategy.scope():
        model = build_model(config, len(folder.class_names))
        optimizer = runtime.wrap_optimizer(keras.optimizers.Adam(config.learning_rate))

    def check_resume(extra: dict[str, Any]) -> None:
        saved = extra.get("classes")
        if saved is not None and saved != folder.class_names:
            raise DataError(f"the checkpoint in CHECKPOINT_DIR was trained on classes {saved} but DATA_DIR now "
                            f"holds {folder.class_names}; use an empty --checkpoint-dir for a new run")

    loop = TrainingLoop(
        trainer=TRAINER, config=config, runtime=runtime, model=model, optimizer=optimizer,
        compute_fn=classification_sums, train_dataset_fn=pipeline.train_dataset,
        val_dataset=pipeline.val_dataset(), steps_per_epoch=len(train_files) // config.batch_size,
        global_batch_size=config.batch_size, stop=stop, extra_state={"classes": folder.class_names},
        check_resume=check_resume,
    )
    result = loop.run(history_path=output_dir / "history.csv")

    write_json_atomic(output_dir / "confusion_matrix.json", {
        "classes": folder.class_names,
        "matrix": confusion_matrix(model, pipeline.val_dataset(), len(folder.class_names)),
        "split": "validation",
        "rows": "true class",
        "columns": "predicted class",
    })
    save_keras_model(model, output_dir)
    export_saved_model(model, output_dir)
    # metrics.json comes last: its presence tells readers the run's outputs are complete.
    write_json_atomic(output_dir / "metrics.json", metrics_document(
        trainer=TRAINER, task="classification", metric="accuracy", result=result, runtime=runtime,
        skipped_files=len(folder.skipped), classes=folder.class_names,
        train_examples=len(train_files), val_examples=len(val_files),
    ))
    log.info("done: %d steps, val_accuracy %.4f; outputs in %s", result.steps,
             result.history[-1]["val_accuracy"] if result.history else float("nan"), output_dir)


DESCRIPTION = __doc__.split("\n\n", 1)[1] if __doc__ else ""
EPILOG = """\
data layout:
  DATA_DIR/<class>/<image>   or   DATA_DIR/<one folder>/<class>/<image>
  PNG, JPEG, GIF, BMP and WEBP files are used; anything else is skipped and counted.

outputs (OUTPUT_DIR):
  metrics.json history.csv params.json model.keras saved_model/1/ confusion_matrix.json
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, and return the exit code."""
    cli.setup_logging()
    config = parse_config(ClassifierConfig, argv, prog="python -m trainer.image_classifier",
                          description=DESCRIPTION, epilog=EPILOG)
    return cli.run(lambda stop: train(config, stop))


if __name__ == "__main__":
    sys.exit(main())
