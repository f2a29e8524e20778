"""Input pipeline: the prepared copy and the streaming pipeline against the naive one, at two dataset sizes.

Generates class folders of JPEGs (``--source-size`` px, default 256) and reads them at ``--image-size``
(default 224), as the classifier trains on them. Reported:

- preparation time (every file's header checked, decoded once, resized, written as shards) and
  the prepared copy's size;
- time to the first training batch, fresh (preparation included) and restarted (the copy reused:
  what a retry, a sweep trial or a replica pays);
- training images/s, per core, of ours (streaming the shards) without and with augmentation,
  against ``keras.utils.image_dataset_from_directory`` on the same files (no cache, no prefetch,
  as most tutorials use it), alternating timed epochs so that both see the same machine load;
- peak RSS of a fresh process that opens the copy and reads one training epoch, at ``--images``
  and at ``--large`` images: with memory bounded by the buffers, the two are close;
- how fast the two shard formats stream on one core: fixed-length raw uint8 records (ours) and
  TFRecord of ``tf.train.Example`` holding the same bytes.
With a GPU, also the training step time fed by our pipeline against the pure compute step time.

Run: trainer/.venv/bin/python bench/bench_input_pipeline.py  (or ``make bench BENCH=input_pipeline``);
writes bench/results/input_pipeline.md. A small run that only checks the script works:
``trainer/.venv/bin/python bench/bench_input_pipeline.py --quick`` (prints, writes nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer.image_classifier import prepare  # noqa: E402
from trainer.image_classifier.config import ClassifierConfig  # noqa: E402
from trainer.image_classifier.data import ImagePipeline, split_files  # noqa: E402
from trainer.image_classifier.model import build_model  # noqa: E402

CLASSES = 10
BATCH = 64
TIMED_EPOCHS = 2
RESULT = REPO / "bench" / "results" / "input_pipeline.md"
COMMAND = "trainer/.venv/bin/python bench/bench_input_pipeline.py"


def generate(root: Path, n: int, size: int, seed: int = 0) -> None:
    """``n`` JPEGs of ``size`` px in CLASSES folders: smooth colour fields, as photos compress."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(CLASSES):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
    small = max(4, size // 16)
    for i in range(n):
        coarse = rng.integers(0, 255, (small, small, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((size, size), Image.BILINEAR)
        image.save(root / f"class_{i % CLASSES}" / f"{i:06d}.jpg", quality=85)


def config_for(root: Path, image_size: int, **overrides) -> ClassifierConfig:
    return ClassifierConfig(
        data_dir=str(root),
        checkpoint_dir=str(root),
        output_dir=str(root),
        image_size=image_size,
        batch_size=BATCH,
        verify_workers=os.cpu_count() or 1,
        **overrides,
    )


def pipeline_for(copy: prepare.PreparedImages, config: ClassifierConfig) -> ImagePipeline:
    train, val = split_files(copy.files, config.validation_split, config.seed)
    return ImagePipeline(copy, train, val, config)


def drain(dataset: tf.data.Dataset) -> tuple[int, float]:
    """Iterate one epoch; return (examples, seconds)."""
    start = time.perf_counter()
    examples = 0
    for images, _ in dataset:
        examples += int(images.shape[0])
    return examples, time.perf_counter() - start


def first_batch(root: Path, location: Path, image_size: int) -> tuple[float, bool]:
    """Seconds from nothing to the first training batch, and whether the copy was made."""
    start = time.perf_counter()
    config = config_for(root, image_size)
    copy = prepare.prepare_images(root, config, location, environ={})
    next(iter(pipeline_for(copy, config).train_dataset(0)))
    return time.perf_counter() - start, copy.made


def peak_rss(root: Path, location: Path, image_size: int) -> float:
    """MiB of peak RSS of a fresh process that opens the copy and reads one training epoch."""
    out = subprocess.run(
        [sys.executable, __file__, "--child-rss", str(root), str(location), str(image_size)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def child_rss(root: Path, location: Path, image_size: int) -> None:
    config = config_for(root, image_size)
    copy = prepare.prepare_images(root, config, location, environ={})
    drain(pipeline_for(copy, config).train_dataset(0))
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"peak_mib": hwm / 1024}))


def throughput(root: Path, copy: prepare.PreparedImages, image_size: int) -> dict[str, float]:
    """Steady-state training images/s of the naive pipeline and of ours without and with augmentation."""
    plain = pipeline_for(copy, config_for(root, image_size))
    augmented = pipeline_for(copy, config_for(root, image_size, augment=True, flip=True))
    naive = tf.keras.utils.image_dataset_from_directory(
        str(root), image_size=(image_size, image_size), batch_size=BATCH, shuffle=True, seed=1, verbose=False
    )
    runs = {
        "naive": lambda epoch: naive,
        "ours": plain.train_dataset,
        "ours + augmentation": augmented.train_dataset,
    }
    for make in runs.values():
        drain(make(0))  # warm-up: tracing and the page cache are not steady state
    totals = {name: [0, 0.0] for name in runs}
    for epoch in range(1, TIMED_EPOCHS + 1):
        for name, make in runs.items():
            n, seconds = drain(make(epoch))
            totals[name][0] += n
            totals[name][1] += seconds
    return {name: n / seconds for name, (n, seconds) in totals.items()}


def formats(image_size: int, records: int) -> dict[str, float]:
    """Images/s of one core streaming fixed-length raw records and TFRecord Examples of the same pixels."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (16, image_size, image_size, 3), dtype=np.uint8)
    width = prepare.record_bytes(image_size, 3)
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    with tempfile.TemporaryDirectory(prefix="bench-formats-") as tmp:
        raw, rec = Path(tmp) / "raw.bin", Path(tmp) / "examples.tfrecord"
        with open(raw, "wb") as f, tf.io.TFRecordWriter(str(rec)) as w:
            for i in range(records):
                body = pixels[i % 16].tobytes()
                f.write(np.array([i, i % CLASSES], "<i4").tobytes() + body)
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[body])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % CLASSES])),
                }
                w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())

        def raw_parse(r: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            head = tf.io.decode_raw(tf.strings.substr(r, 0, 8), tf.int32)
            image = tf.io.decode_raw(tf.strings.substr(r, 8, width - 8), tf.uint8)
            return tf.reshape(image, [image_size, image_size, 3]), head[1]

        def example_parse(r: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            e = tf.io.parse_single_example(r, spec)
            return tf.reshape(tf.io.decode_raw(e["image"], tf.uint8), [image_size, image_size, 3]), e["label"]

        made = {
            "fixed-length raw uint8 (ours)": lambda: tf.data.FixedLengthRecordDataset(str(raw), width).map(
                raw_parse
            ),
            "TFRecord tf.train.Example": lambda: tf.data.TFRecordDataset(str(rec)).map(example_parse),
        }
        best = {name: 0.0 for name in made}
        for _ in range(3):
            for name, make in made.items():
                n, seconds = drain(make().batch(BATCH).with_options(options))
                best[name] = max(best[name], n / seconds)
    return best


def gpu_overhead(config: ClassifierConfig, pipeline: ImagePipeline, classes: int) -> str:
    """Step time fed by the pipeline vs. on one batch already on the device."""
    if not tf.config.list_physical_devices("GPU"):
        return "no GPU on this machine: the GPU step-time comparison was skipped"
    import keras

    model = build_model(config, classes)
    optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True)))
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
        )
        return loss

    x, y = (tf.identity(t) for t in next(iter(pipeline.train_dataset(0))))
    for _ in range(5):
        step(x, y).numpy()
    steps = 0
    start = time.perf_counter()
    for xb, yb in pipeline.train_dataset(1):
        step(xb, yb)
        steps += 1
    loss = step(x, y).numpy()  # wait for queued steps
    fed = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(x, y)
    loss.numpy()
    compute = (time.perf_counter() - start) / steps
    return (
        f"GPU step time fed by our pipeline {fed * 1000:.2f} ms vs pure compute on a batch already on the "
        f"device {compute * 1000:.2f} ms: input overhead {fed / compute:.2f}x "
        f"({tf.config.list_physical_devices('GPU')[0].name})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10_000, help="images of the main dataset")
    parser.add_argument(
        "--large", type=int, default=60_000, help="images of the dataset whose peak RSS is compared"
    )
    parser.add_argument("--source-size", type=int, default=256, help="side of the generated JPEGs")
    parser.add_argument("--image-size", type=int, default=224, help="side the images are read at")
    parser.add_argument(
        "--quick", action="store_true", help="200 and 600 images of 64 px read at 56: prints only"
    )
    parser.add_argument("--child-rss", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_rss:
        child_rss(Path(args.child_rss[0]), Path(args.child_rss[1]), int(args.child_rss[2]))
        return 0
    if args.quick:
        args.images, args.large, args.source_size, args.image_size = 200, 600, 64, 56
    size = args.image_size
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        root, large = Path(tmp) / "data", Path(tmp) / "large"
        generate(root, args.images, args.source_size)
        fresh, made = first_batch(root, Path(tmp) / "prepared", size)
        assert made
        restarted, made = first_batch(root, Path(tmp) / "prepared", size)
        assert not made
        copy = prepare.prepare_images(root, config_for(root, size), Path(tmp) / "prepared", environ={})
        start = time.perf_counter()
        prepare.prepare_images(root, config_for(root, size), Path(tmp) / "again", environ={})
        preparation = time.perf_counter() - start
        copy_bytes = sum(s.bytes for s in copy.manifest.shards)
        rates = throughput(root, copy, size)
        rss_small = peak_rss(root, Path(tmp) / "prepared", size)
        generate(large, args.large, args.source_size, seed=1)
        prepare.prepare_images(large, config_for(large, size), Path(tmp) / "prepared-large", environ={})
        rss_large = peak_rss(large, Path(tmp) / "prepared-large", size)
        shard_formats = formats(size, min(2_000, args.images))
        config = config_for(root, size)
        gpu = gpu_overhead(config, pipeline_for(copy, config), CLASSES)

    ratio = rates["ours"] / rates["naive"]
    lines = [
        f"Command: `{COMMAND}{' --quick' if args.quick else ''}`",
        "",
        f"Data: {args.images:,} generated JPEGs of {args.source_size} px in {CLASSES} classes, read at "
        f"{size} px; batch {BATCH}; {TIMED_EPOCHS} timed epochs each after a warm-up one, alternating.",
        f"Machine: {cores} CPU(s), {platform.machine()}, TensorFlow {tf.__version__}.",
        "",
        "| measure | value |",
        "| --- | ---: |",
        f"| preparation ({args.images:,} images: header check, one decode, resize, shards) | {preparation:.1f} s |",
        f"| prepared copy | {copy_bytes / 2**20:,.0f} MiB in {len(copy.manifest.shards)} shards |",
        f"| time to first batch, fresh (preparation included) | {fresh:.2f} s |",
        f"| time to first batch, restarted (copy reused) | {restarted:.2f} s |",
        f"| peak RSS, one epoch, {args.images:,} images | {rss_small:,.0f} MiB |",
        f"| peak RSS, one epoch, {args.large:,} images | {rss_large:,.0f} MiB |",
        "",
        "| pipeline | images/s | images/s per core |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {rate:,.0f} | {rate / cores:,.0f} |" for name, rate in rates.items()),
        "",
        f"Ratio ours / naive (image_dataset_from_directory): **{ratio:.1f}x**.",
        "",
        "| shard format, one core | images/s |",
        "| --- | ---: |",
        *(f"| {name} | {rate:,.0f} |" for name, rate in shard_formats.items()),
        "",
        gpu + ".",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
