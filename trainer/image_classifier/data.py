"""DATA_DIR as class folders: the scan that checks every file's header, the seeded split, training's resize,
and the tf.data pipeline that streams the prepared copy (trainer.image_classifier.prepare)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.common.contract import DataError
from trainer.common.memory import tf_data_ram_budget

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf

    from trainer.image_classifier.config import ClassifierConfig
    from trainer.image_classifier.prepare import PreparedImages

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
    """None when ``path``'s header is that of an image the pipeline decodes, else why it is skipped.

    Only the header is read: the pixels are decoded once, when the prepared copy is made, and a
    file TensorFlow cannot decode is named there.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            fmt = image.format
            if fmt not in DECODABLE_FORMATS:
                return f"format {fmt} is not decodable (expected one of {', '.join(DECODABLE_FORMATS)})"
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
    """Find the class folders and check every file's header in them.

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
    if skipped:  # the whole list, with the files found unreadable when decoded, once the copy is made
        log.debug("the header check left out %d file(s)", len(skipped))
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


def resize_image(image: tf.Tensor, size: int) -> tf.Tensor:
    """Training's resize: uint8 pixels ``[h, w, c]`` (or a batch ``[n, h, w, c]``) to uint8 ``size x size``.

    The one definition used by the prepared copy, the training pipeline and the serving
    signature, so that what a model is served cannot drift from what it was trained on.
    """
    import tensorflow as tf

    resized = tf.image.resize(image, [size, size], antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(resized), 0.0, 255.0), tf.uint8)


def split_indices(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of files by their ``labels``, stratified by class: every class with two or more
    images is in both sets. Returns the (training, validation) files' indices, as int64 arrays.

    Class by class in label order, a seeded permutation of the class's files (in their listed
    order) puts the first ``round(count * fraction)`` of them (at least one, never all) in the
    validation set. Numpy throughout: a restarted pod splits 60,000 files in milliseconds.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.asarray(labels, dtype=np.int64)
    by_label = np.argsort(labels, kind="stable")  # each class's files in their listed order
    _, starts, counts = np.unique(labels[by_label], return_index=True, return_counts=True)
    train_parts, val_parts = [], []
    for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
        items = by_label[start : start + count]
        order = rng.permutation(count)
        n_val = min(count - 1, max(1, round(count * fraction))) if count > 1 else 0
        val_parts.append(items[order[:n_val]])
        train_parts.append(items[order[n_val:]])
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate([empty, *train_parts]), np.concatenate([empty, *val_parts])


def split_files(
    files: Sequence[tuple[str, int]],
    fraction: float,
    seed: int,
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """:func:`split_indices` over (path, label) pairs: the (training, validation) pairs."""
    import numpy as np

    labels = np.fromiter((label for _, label in files), dtype=np.int64, count=len(files))
    train, val = split_indices(labels, fraction, seed)
    return [files[i] for i in train.tolist()], [files[i] for i in val.tolist()]


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: fixed by (seed, epoch) so a resumed epoch repeats its order."""
    return (seed * 1_000_003 + epoch * 7_919 + 1) % (2**31 - 1)


def record_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """A seeded permutation of ``n`` training records: one epoch's order, a function of (seed, epoch)."""
    import numpy as np

    return np.random.default_rng([seed, 0x0DE2, epoch]).permutation(n)


def file_order(seed: int, epoch: int, n: int) -> list[int]:
    """A seeded permutation of ``n`` shards: one epoch's reading order."""
    import numpy as np

    return np.random.default_rng([seed, 0x5EED, epoch]).permutation(n).tolist()


class RecordReader:
    """Reads the prepared copy's records by number, each straight into its place in a batch.

    One ``os.preadv`` per record puts its 8-byte header and its pixels into the batch's arrays:
    the only copy of the pixels on the way to the training step is the kernel's, out of the page
    cache. A tf.data pipeline that streams the shards as strings and unpacks them copies each
    image three to five times; on the reference machine it read 3,650 images per CPU-second at
    224 px, where gathering the same records from their files in numpy read 42,000 to 64,000.
    Each record's header is checked against the record asked for, and a short read (a truncated
    shard) is an error, never zeros.
    """

    def __init__(self, prepared: PreparedImages) -> None:
        import numpy as np

        self.width = prepared.record_bytes
        manifest = prepared.manifest
        self.shape = (manifest.image_size, manifest.image_size, manifest.channels)
        self.starts = np.concatenate([[0], np.cumsum([s.records for s in manifest.shards])]).astype(np.int64)
        self.paths = prepared.shard_paths()
        self._fds: list[int] | None = None

    def _open(self) -> list[int]:
        if self._fds is None:
            fds = [os.open(path, os.O_RDONLY) for path in self.paths]
            self._fds = fds
            import weakref

            # Closed when the reader goes; at exit the process's end closes them, after the reads stop.
            weakref.finalize(self, _close_all, fds).atexit = False
            _READS.watch()
        return self._fds

    def read(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (uint8 images ``[n, size, size, channels]``, int32 labels) of ``records``, in their order."""
        with _READS:
            return self._read(records)

    def _read(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import numpy as np

        fds = self._open()
        records = np.asarray(records, dtype=np.int64)
        images = np.empty((len(records), *self.shape), dtype=np.uint8)
        heads = np.empty((len(records), 2), dtype="<i4")
        shards = np.searchsorted(self.starts, records, side="right") - 1
        offsets = (records - self.starts[shards]) * self.width
        for k, (shard, offset) in enumerate(zip(shards.tolist(), offsets.tolist(), strict=True)):
            head, pixels = memoryview(heads[k]).cast("B"), memoryview(images[k]).cast("B")
            got = 0
            while got < self.width:  # a read may return less than asked: read the rest
                rest = [head[got:], pixels] if got < len(head) else [pixels[got - len(head) :]]
                more = os.preadv(fds[shard], rest, offset + got)
                if not more:
                    raise DataError(
                        f"{self.paths[shard]}: record {records[k]} ends after {got} of {self.width} bytes "
                        "(a truncated shard); remove the prepared copy to have it made again"
                    )
                got += more
        if not np.array_equal(heads[:, 0], records):
            wrong = int(np.flatnonzero(heads[:, 0] != records)[0])
            raise DataError(
                f"the prepared copy's record {records[wrong]} holds record {heads[wrong, 0]}: "
                "the copy is damaged; remove it to have it made again"
            )
        return images, heads[:, 1].astype(np.int32)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class _ReadsInFlight:
    """The reads tf.data's threads run in Python, stopped before the interpreter's teardown.

    tf.data calls :meth:`RecordReader.read` from its own threads (``tf.numpy_function``), ahead of
    the batches asked for. A thread that needs the GIL once the interpreter has begun its teardown
    never gets it, and an iterator still alive then waits for that call for ever in its destructor:
    a process that read one batch and returned from ``main`` hung at exit in 4 of 8 runs. So at exit
    (an ``atexit`` hook, while threads can still run Python) new reads fail at once and the hook
    waits until none is in flight and none has started for a moment: by then the pipelines' buffers
    are full and nothing calls into Python again. The trainer ends with ``os._exit`` after the exit
    hooks (trainer.common.cli.exit_process), so it never reaches the teardown; this guards the
    benches, the tests and any other program that streams a prepared copy.
    """

    QUIET_S = 0.05
    MOST_S = 10.0

    def __init__(self) -> None:
        import threading

        self._cond = threading.Condition()
        self._running = 0
        self._last = 0.0
        self._closing = False
        self._watched = False

    def watch(self) -> None:
        with self._cond:
            if not self._watched:
                import atexit

                atexit.register(self.stop)
                self._watched = True

    def __enter__(self) -> None:
        import time

        with self._cond:
            if self._closing:
                raise DataError("the process is exiting: the prepared copy is no longer read")
            self._running += 1
            self._last = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def stop(self) -> None:
        import time

        deadline = time.monotonic() + self.MOST_S
        with self._cond:
            self._closing = True
            while time.monotonic() < deadline:
                quiet_since = time.monotonic() - self._last
                if self._running == 0 and quiet_since >= self.QUIET_S:
                    return
                self._cond.wait(timeout=max(self.QUIET_S - quiet_since, 0.01))


_READS = _ReadsInFlight()


class ImagePipeline:
    """tf.data input over the prepared copy: memory bounded by the batches in flight, not the dataset.

    By default each epoch trains on the whole training split in a seeded permutation
    (:func:`record_order`), read record by record where it lies in the copy
    (:class:`RecordReader`): no shuffle buffer to fill or hold. With ``--shuffle-buffer N`` (for
    storage where random reads are slow) each epoch instead reads the shards in a seeded order
    (:func:`file_order`), a few at a time, interleaved record by record, keeps the training
    split's records, and shuffles them through a seeded buffer of N images. The prepared copy
    wrote the images in a seeded random order, so every shard mixes the classes. Either way the
    order is a function of (seed, epoch) alone: a resumed
    epoch skips the batches already trained on and sees exactly the rest. Validation reads its
    records in the copy's order.

    Args:
        prepared: the verified prepared copy.
        train: training (path, label) pairs from ``prepared.files``, or their indices there.
        val: validation (path, label) pairs from ``prepared.files``, or their indices there.
        config: image size, channels, batch size, augmentation and shuffle flags.
    """

    # Shards read at once: more mix the records better, each costs a read buffer.
    CYCLE = 4
    READ_BUFFER = 256 * 1024

    def __init__(
        self,
        prepared: PreparedImages,
        train: Sequence[tuple[str, int]] | np.ndarray,
        val: Sequence[tuple[str, int]] | np.ndarray,
        config: ClassifierConfig,
    ) -> None:
        import numpy as np
        import tensorflow as tf

        if (prepared.manifest.image_size, prepared.manifest.channels) != (config.image_size, config.channels):
            raise ValueError(
                f"the prepared copy holds {prepared.manifest.image_size} px, {prepared.manifest.channels} "
                f"channel(s); --image-size {config.image_size} --channels {config.channels} needs its own"
            )
        self.tf = tf
        self.config = config
        self.prepared = prepared
        self.size = config.image_size
        n = prepared.manifest.records
        self.train_mask = np.zeros(n, dtype=bool)
        self.val_mask = np.zeros(n, dtype=bool)
        for mask, items in ((self.train_mask, train), (self.val_mask, val)):
            if isinstance(items, np.ndarray):  # indices into prepared.files (split_indices)
                records = prepared.file_records[items]
            else:
                records = prepared.records_of(path for path, _ in items)
            mask[records[records >= 0]] = True
        # Files TensorFlow could not decode are in the split but have no record.
        self.train_count = int(self.train_mask.sum())
        self.val_count = int(self.val_mask.sum())
        self.train_records = np.flatnonzero(self.train_mask)
        self.val_records = np.flatnonzero(self.val_mask)
        self.reader = RecordReader(prepared)

    def shuffle_buffer(self) -> int:
        """Images in the shuffle buffer of --shuffle-buffer N, at most the training split; 0: the default,
        a permutation of the whole split read by record and no buffer."""
        return min(self.config.shuffle_buffer, max(1, self.train_count))

    def _records(self, shards: Sequence[str], mask: np.ndarray, cycle: int) -> tf.data.Dataset:
        """The records of ``shards`` whose record number ``mask`` keeps, as whole record strings: the
        pixels are copied out once, a batch at a time (:meth:`_parse`). Filtering, shuffling and skipping
        whole records moves no pixels; unpacking each chunk of records and unbatching the images (the way
        before) copied every image four more times: 2,100 to 2,450 images per CPU-second at 224 px on the
        reference machine, against 3,650 this way (and 16,500 for :class:`RecordReader`)."""
        tf = self.tf
        width = self.prepared.record_bytes
        keep = tf.constant(mask)
        paths = tf.data.Dataset.from_tensor_slices(tf.constant(list(shards), dtype=tf.string))
        cycle = max(1, min(cycle, len(shards)))
        parallel = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True} if cycle > 1 else {}
        ds = paths.interleave(
            lambda p: tf.data.FixedLengthRecordDataset(p, width, buffer_size=self.READ_BUFFER),
            cycle_length=cycle,
            block_length=1,
            **parallel,
        )

        def wanted(record: Any) -> Any:  # the record number: the header's first 4 bytes
            head = tf.io.decode_raw(tf.strings.substr(record, 0, 4), tf.int32, little_endian=True)
            return tf.gather(keep, head[0])

        return ds.filter(wanted)

    def _parse(self, records: Any) -> tuple[Any, Any]:
        """A batch of record strings as (uint8 images ``[b, size, size, channels]``, int32 labels)."""
        tf = self.tf
        width = self.prepared.record_bytes
        head = tf.io.decode_raw(tf.strings.substr(records, 0, 8), tf.int32, little_endian=True)
        raw = tf.io.decode_raw(records, tf.uint8, fixed_length=width)
        return tf.reshape(raw[:, 8:], [-1, self.size, self.size, self.config.channels]), head[:, 1]

    def augmentation_params(self, count: Any, seed: tf.Tensor) -> tf.Tensor:
        """What the augmentation does to each of ``count`` images, drawn at once from ``seed``: float32
        ``[count, 5]``, one row per image (:func:`model_pixels` applies it, :meth:`augmentation_draws` reads
        it): the window's row and column offsets in the image reflect-padded by ``size // 8`` (whole numbers
        uniform in 0 ... 2 * pad), 1.0 where the image is flipped left to right (never without --flip), the
        brightness delta (uniform within +-10% of 255) and the contrast factor (uniform in [0.8, 1.2])."""
        tf = self.tf
        pad = max(1, self.size // 8)
        draw = tf.random.stateless_uniform([count, 5], seed)
        offsets = tf.minimum(tf.floor(draw[:, :2] * (2 * pad + 1)), float(2 * pad))
        flip = tf.cast(draw[:, 2] < 0.5, tf.float32) if self.config.flip else tf.zeros([count])
        delta = (draw[:, 3] * 2.0 - 1.0) * (0.1 * 255.0)
        factor = 0.8 + 0.4 * draw[:, 4]
        return tf.concat([offsets, flip[:, None], delta[:, None], factor[:, None]], axis=1)

    def augmentation_draws(self, count: Any, seed: tf.Tensor) -> tuple[Any, Any, Any, Any]:
        """:meth:`augmentation_params` as (offsets int32 ``[count, 2]``, flip bool, delta, factor)."""
        tf = self.tf
        params = self.augmentation_params(count, seed)
        return tf.cast(params[:, :2], tf.int32), params[:, 2] > 0.5, params[:, 3], params[:, 4]

    def augment(self, images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        """The trainer's augmentation of one uint8 batch with the draws of ``seed``, as float32 pixels."""
        return model_pixels(images, self.augmentation_params(self.tf.shape(images)[0], seed))

    def train_dataset(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        """Training batches of ``epoch`` without the first ``skip_batches`` (already trained on)."""
        tf = self.tf
        batch = self.config.batch_size
        seed = epoch_seed(self.config.seed, epoch)
        if self.config.shuffle_buffer:
            shards = self.prepared.shard_paths()
            order = [shards[i] for i in file_order(self.config.seed, epoch, len(shards))]
            ds = self._records(order, self.train_mask, self.CYCLE)
            ds = ds.shuffle(self.shuffle_buffer(), seed=seed, reshuffle_each_iteration=False)
            # Skipped before batching: the batches already trained on are read but never assembled.
            ds = ds.skip(skip_batches * batch).batch(batch, drop_remainder=True)
            ds = ds.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            ds = ds.enumerate(start=skip_batches).map(lambda i, xy: (i, *xy))
        else:
            # Batch i is records order[i * batch : (i + 1) * batch]: a resumed epoch starts at its batch.
            order = self.train_records[record_order(self.config.seed, epoch, self.train_count)]
            ds = self._read_batches(order, batch, skip_batches, self.train_count // batch)
        if self.config.augment:
            # Only the draws are made here; the training step applies them (model_pixels). Each batch's
            # seed is (epoch seed, batch number in the epoch): a resumed epoch numbers its batches from
            # skip_batches and draws for them what the unbroken one did.
            base = tf.constant(seed, tf.int64)
            return self._bounded(
                ds.map(
                    lambda i, x, y: (x, y, self.augmentation_params(tf.shape(y)[0], tf.stack([base, i])))
                ).prefetch(tf.data.AUTOTUNE)
            )
        return self._bounded(ds.map(lambda i, x, y: (x, y)).prefetch(tf.data.AUTOTUNE))

    def val_dataset(self) -> tf.data.Dataset:
        """Validation batches, in a fixed order: the validation split's records in the copy's order."""
        batch = self.config.batch_size
        ds = self._read_batches(self.val_records, batch, 0, -(-self.val_count // batch))
        return self._bounded(ds.map(lambda i, x, y: (x, y)).prefetch(self.tf.data.AUTOTUNE))

    def _read_batches(self, order: np.ndarray, batch: int, first: int, end: int) -> tf.data.Dataset:
        """(batch number, images, labels) of batches ``first`` ... ``end - 1`` of ``order``'s records,
        several read at once (:class:`RecordReader`; the reads release the GIL)."""
        tf = self.tf
        reader, shape = self.reader, self.reader.shape

        def read(i: Any) -> tuple[Any, Any]:
            return reader.read(order[int(i) * batch : (int(i) + 1) * batch])

        def load(i: Any) -> tuple[Any, Any, Any]:
            images, labels = tf.numpy_function(read, [i], [tf.uint8, tf.int32], stateful=False)
            images.set_shape([None, *shape])
            labels.set_shape([None])
            return i, images, labels

        ds = tf.data.Dataset.range(first, max(first, end))
        return ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _bounded(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        """``ds`` with tf.data's buffers within a share of the container's memory limit, where it has one
        (tf.data would otherwise budget half of the node's memory: trainer.common.memory)."""
        budget = tf_data_ram_budget()
        if budget is None:
            return ds
        options = self.tf.data.Options()
        options.autotune.ram_budget = budget
        return ds.with_options(options)


def model_pixels(images: tf.Tensor, augmentation: tf.Tensor | None = None) -> tf.Tensor:
    """The float32 pixels the network takes, from a uint8 batch ``[b, size, size, channels]`` of the
    pipeline and, with --augment, the batch's draws (:meth:`ImagePipeline.augmentation_params`).

    The training step calls this, on the device that runs it: the pipeline hands over uint8 pixels (a
    quarter of float32's bytes to copy to a GPU) and five numbers an image, so the CPU cores feeding a
    GPU do no pixel arithmetic. Per image: a random horizontal flip, a random ``size``-px window of the
    image reflect-padded by ``size // 8`` on each side, a brightness delta and a contrast factor (about
    each channel's mean, as ``tf.image.adjust_contrast``), clipped to [0, 255]. The padding is never
    built: the window's reflected row and column indices pick the pixels of the uint8 batch. The result is
    a function of the pixels and the draws alone, whatever the replica the image lands on.
    """
    import tensorflow as tf

    if augmentation is None:
        return tf.cast(images, tf.float32)
    size = images.shape[1]
    pad = max(1, size // 8)
    offsets = tf.cast(augmentation[:, :2], tf.int32)
    flip = augmentation[:, 2] > 0.5
    # Index k of the padded image reads pixel reflect(k - pad) of the image (np.pad mode="reflect").
    taken = tf.abs(offsets[:, :, None] + tf.range(size, dtype=tf.int32)[None, None, :] - pad)
    taken = (size - 1) - tf.abs((size - 1) - taken)
    rows, cols = taken[:, 0], taken[:, 1]
    # The flip comes before the padding: the window then reads the mirrored columns.
    cols = tf.where(flip[:, None], (size - 1) - cols, cols)
    x = tf.gather(images, rows, axis=1, batch_dims=1)
    x = tf.cast(tf.gather(x, cols, axis=2, batch_dims=1), tf.float32)
    # Brightness then contrast, (x + delta - mean(x + delta)) * factor + mean(x + delta), folded into
    # one multiply-add: x * factor + (mean(x) * (1 - factor) + delta).
    delta = tf.reshape(augmentation[:, 3], [-1, 1, 1, 1])
    factor = tf.reshape(augmentation[:, 4], [-1, 1, 1, 1])
    shift = tf.reduce_mean(x, axis=[1, 2], keepdims=True) * (1.0 - factor) + delta
    return tf.clip_by_value(x * factor + shift, 0.0, 255.0)
