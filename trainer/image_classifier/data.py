"""DATA_DIR as class folders: the scan that checks every file, the seeded split, and the tf.data pipeline."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.common.contract import DataError

if TYPE_CHECKING:
    import tensorflow as tf

    from trainer.image_classifier.config import ClassifierConfig

log = logging.getLogger("kubetrain.trainer")

# Formats that both Pillow verifies here and tf.io.decode_image decodes in the pipeline.
DECODABLE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")
IGNORED_NAMES = ("__MACOSX",)


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
    except Image.DecompressionBombError as exc:
        # Pillow refuses to decode images above twice Image.MAX_IMAGE_PIXELS: one such file
        # (or a crafted header) would otherwise take the memory of the whole pod.
        return f"decompression bomb: {exc}"
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
            candidates.extend(
                (os.path.join(dirpath, name), class_dir.name)
                for name in sorted(filenames)
                if not name.startswith(".")
            )
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
        log.warning(
            "skipped %d file(s) that are not readable images: %s%s",
            len(skipped),
            shown,
            " ..." if len(skipped) > 10 else "",
        )
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


def split_files(
    files: Sequence[tuple[str, int]],
    fraction: float,
    seed: int,
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


def file_order(seed: int, epoch: int | None, n: int) -> list[int]:
    """A seeded permutation of ``n`` files: the cache's order (``epoch`` None) or one epoch's."""
    import numpy as np

    key = [seed, 0x5EED] if epoch is None else [seed, 0x5EED, epoch]
    return np.random.default_rng(key).permutation(n).tolist()


class ImagePipeline:
    """tf.data input: parallel decode, in-memory cache, seeded per-epoch shuffle, prefetch.

    The scan lists files class by class. Shuffling that list only through a buffer smaller
    than the split fills the first batches of every epoch from the first classes, so the
    files are put in a seeded random order before anything is decoded or cached. With the
    cache, each epoch then shuffles the cached images with a buffer of the whole split by
    default (an exact shuffle, cheap because the buffer refers to the cached tensors);
    without it, each epoch reads the files in its own seeded order.

    Args:
        train: training (path, label) pairs.
        val: validation (path, label) pairs.
        config: image size, channels, batch size, augmentation, cache and shuffle flags.
    """

    def __init__(
        self, train: Sequence[tuple[str, int]], val: Sequence[tuple[str, int]], config: ClassifierConfig
    ) -> None:
        import tensorflow as tf

        self.tf = tf
        self.config = config
        self.size = config.image_size
        self.train_count = len(train)
        self.val_count = len(val)
        self.train_items = [train[i] for i in file_order(config.seed, None, len(train))]
        self.train_base = self._decoded(self.train_items)
        self.val_items = list(val)
        self.val_base = self._decoded(self.val_items)

    def shuffle_buffer(self) -> int:
        """Images in the per-epoch shuffle buffer of the cached split."""
        n = max(1, self.train_count)
        return n if self.config.shuffle_buffer == 0 else min(self.config.shuffle_buffer, n)

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

    def dropped_files(self) -> list[str]:
        """Files of either split that TensorFlow could not decode, although the scan read them.

        ``ignore_errors`` drops such files from the pipeline without a count. Counting the
        elements of each split finds out how many: from memory when the cache is complete
        (the usual case at the end of training), else by decoding once more. Only when the
        counts fall short is every file decoded one by one to name the culprits.
        """
        tf = self.tf

        def count(ds: tf.data.Dataset) -> int:
            return int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))

        missing = (self.train_count - count(self.train_base)) + (self.val_count - count(self.val_base))
        if missing <= 0:
            return []
        bad = []
        for path, _ in [*self.train_items, *self.val_items]:
            try:
                tf.io.decode_image(
                    tf.io.read_file(path), channels=self.config.channels, expand_animations=False
                )
            except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, tf.errors.UnimplementedError):
                bad.append(path)
        return bad

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
        if self.config.cache:
            ds = self.train_base.shuffle(self.shuffle_buffer(), seed=seed, reshuffle_each_iteration=False)
        else:
            ds = self._decoded(
                [self.train_items[i] for i in file_order(self.config.seed, epoch, self.train_count)]
            )
        if self.config.augment:
            # Numbering the elements before skipping keeps each image's augmentation seed
            # tied to its position in the epoch, so a resumed epoch augments identically.
            base = tf.constant(seed, tf.int64)
            ds = ds.enumerate().skip(skip_batches * batch)
            ds = ds.map(
                lambda i, xy: (self._augment(xy[0], tf.stack([base, i])), xy[1]),
                num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True,
            )
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
