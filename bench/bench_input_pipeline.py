"""Input pipeline: the prepared copy and the streaming pipeline against the naive one, at two dataset sizes.

Generates class folders of JPEGs (``--source-size`` px, default 256) at two sizes (``--images``, default
10,000, and ``--large``, default 60,000) and reads them at ``--image-size`` (default 224), as the classifier
trains on them, with the staged dataset version a training pod has. Reported:

- preparation and the first batch of a fresh pod (every file's header checked, decoded once, resized,
  written as shards), and the prepared copy's size, at both sizes;
- time to the first training batch of a restarted pod (a new process over the existing copy: what a
  retry or a preempted run's next pod pays), and the peak RSS of that process over one whole training
  epoch, at both sizes, alternating, median and range of ``--repeats`` rounds: with memory and start-up
  bounded by the buffers, the two sizes give about the same figures;
- training images/s per core of ours (reading the prepared records) without and with the trainer's augmentation
  (the pipeline draws it, the training step applies it on its device; also with the step's pixel
  arithmetic done on the CPU, as a pod without a GPU does), against
  ``keras.utils.image_dataset_from_directory`` on the same files (no cache, no prefetch, as most
  tutorials use it), in paired rounds (ours, then the peer's), with the median ratio and its range;
- a ``--trials``-trial sweep's decode CPU against one preparation: the first trial makes the copy, every
  later one finds it (as the stage-in places it on a new pod) and only checks its checksums;
- how fast the two shard formats stream on one core: fixed-length raw uint8 records (ours) and
  TFRecord of ``tf.train.Example`` holding the same bytes;
- the load average along the run: a busy machine's figures are reported, no target is called met.
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from kubetrain_contract.pod import Env  # noqa: E402
from trainer.image_classifier import prepare  # noqa: E402
from trainer.image_classifier.config import ClassifierConfig  # noqa: E402
from trainer.image_classifier.data import ImagePipeline, model_pixels, split_indices  # noqa: E402
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
    """The pipeline as the trainer builds it: the split made over the copy's label column."""
    train, val = split_indices(copy.labels, config.validation_split, config.seed)
    return ImagePipeline(copy, train, val, config)


def drain(dataset: Iterable[Any]) -> tuple[int, float]:
    """Iterate one epoch of batches (tuples whose first item is the images, or the images); return
    (examples, seconds)."""
    start = time.perf_counter()
    examples = 0
    for batch in dataset:
        examples += int((batch[0] if isinstance(batch, tuple) else batch).shape[0])
    return examples, time.perf_counter() - start


def pod_environ(version: str) -> dict[str, str]:
    """What a training pod's environment tells the trainer: the staged dataset version names the data."""
    return {Env.DATASET_VERSION: version}


def restarted_pod(root: Path, location: Path, image_size: int, version: str) -> dict[str, float]:
    """A fresh process over an existing copy, as a restarted pod's trainer: seconds from opening the copy
    to the first training batch, and the peak RSS (MiB) after reading one whole training epoch."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(root), str(location), str(image_size), version],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(root: Path, location: Path, image_size: int, version: str) -> None:
    start = time.perf_counter()
    config = config_for(root, image_size)
    copy = prepare.prepare_images(root, config, location, environ=pod_environ(version))
    batches = iter(pipeline_for(copy, config).train_dataset(0))
    next(batches)
    first = time.perf_counter() - start
    for _ in batches:
        pass
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"first_batch_s": first, "peak_mib": hwm / 1024, "made": copy.made}))


def sweep_decode_cpu(root: Path, image_size: int, version: str, trials: int, tmp: Path) -> dict[str, float]:
    """CPU seconds of the prepare step of each trial of a sweep on one dataset version: the first trial
    makes the copy, every later one is a new pod whose stage-in placed the copy's bytes (hard links
    here) without the stamp of a process that hashed them, so it checks every shard's sha256."""
    config = config_for(root, image_size)
    environ = pod_environ(version)
    decodes = prepare.decodes()
    start = time.process_time()
    first = prepare.prepare_images(root, config, tmp / "trial-00", environ=environ)
    made = time.process_time() - start
    assert first.made
    checks = []
    for t in range(1, trials):
        location = tmp / f"trial-{t:02d}"
        shutil.copytree(tmp / "trial-00", location, copy_function=os.link)
        (location / first.path.name / prepare.VERIFIED_STAMP).unlink()
        start = time.process_time()
        copy = prepare.prepare_images(root, config, location, environ=environ)
        checks.append(time.process_time() - start)
        assert not copy.made
        shutil.rmtree(location)
    return {"made_cpu_s": made, "check_cpu_s": sum(checks), "decodes": prepare.decodes() - decodes}


def throughput(root: Path, copy: prepare.PreparedImages, image_size: int, repeats: int) -> list[dict]:
    """Training images/s of ours (without, then with augmentation) and of the naive pipeline, in paired
    rounds (ours, then the peer's, on the same machine load), after one warm-up epoch each."""
    plain = pipeline_for(copy, config_for(root, image_size))
    augmented = pipeline_for(copy, config_for(root, image_size, augment=True, flip=True))
    naive = tf.keras.utils.image_dataset_from_directory(
        str(root), image_size=(image_size, image_size), batch_size=BATCH, shuffle=True, seed=1, verbose=False
    )
    apply = tf.function(model_pixels)

    def applied_on_cpu(epoch: int) -> Iterator[tf.Tensor]:
        # What a pod without a GPU pays: the step applies the draws on the CPU, here outside any step.
        return (apply(x, draws) for x, _, draws in augmented.train_dataset(epoch))

    runs = {
        "ours": plain.train_dataset,
        "naive": lambda epoch: naive,
        "ours + augmentation": augmented.train_dataset,
        "ours + augmentation applied on the CPU": applied_on_cpu,
    }
    for make in runs.values():
        drain(make(0))  # warm-up: tracing and the page cache are not steady state
    rounds = []
    for epoch in range(1, repeats + 1):
        row = {}
        for name, make in runs.items():
            n, seconds = drain(make(epoch))
            row[name] = n / seconds
        rounds.append(row)
    return rounds


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


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """The median and, over several rounds, the range: ``median (min-max)``."""
    median = fmt.format(statistics.median(values))
    return median if len(values) == 1 else f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10_000, help="images of the main dataset")
    parser.add_argument(
        "--large", type=int, default=60_000, help="images of the dataset whose start-up and RSS are compared"
    )
    parser.add_argument("--source-size", type=int, default=256, help="side of the generated JPEGs")
    parser.add_argument("--image-size", type=int, default=224, help="side the images are read at")
    parser.add_argument("--repeats", type=int, default=3, help="paired rounds (ours, then the peer's)")
    parser.add_argument(
        "--trials", type=int, default=16, help="trials of the sweep whose decode CPU is counted"
    )
    parser.add_argument(
        "--quick", action="store_true", help="200 and 600 images of 64 px read at 56: prints only"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), int(args.child[2]), args.child[3])
        return 0
    if args.quick:
        args.images, args.large, args.source_size, args.image_size, args.trials = 200, 600, 64, 56, 3
    size = args.image_size
    cores = os.cpu_count() or 1
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        root, large = Path(tmp) / "data", Path(tmp) / "large"
        generate(root, args.images, args.source_size)
        generate(large, args.large, args.source_size, seed=1)
        sizes = {
            args.images: (root, Path(tmp) / "prepared"),
            args.large: (large, Path(tmp) / "prepared-large"),
        }
        fresh = {}
        for n, (data, location) in sizes.items():
            start = time.perf_counter()
            copy = prepare.prepare_images(
                data, config_for(data, size), location, environ=pod_environ(f"v{n}")
            )
            next(iter(pipeline_for(copy, config_for(data, size)).train_dataset(0)))
            fresh[n] = (time.perf_counter() - start, copy)
            assert copy.made
        loads.append(os.getloadavg())
        # restarted pods, alternating the two sizes round by round
        restarted: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
        for _ in range(args.repeats):
            for n, (data, location) in sizes.items():
                restarted[n].append(restarted_pod(data, location, size, f"v{n}"))
                assert not restarted[n][-1]["made"]
        loads.append(os.getloadavg())
        copy = fresh[args.images][1]
        preparation_cpu = time.process_time()
        prepare.prepare_images(
            root, config_for(root, size), Path(tmp) / "again", environ=pod_environ("again")
        )
        preparation_cpu = time.process_time() - preparation_cpu
        shutil.rmtree(Path(tmp) / "again")
        sweep = sweep_decode_cpu(root, size, f"v{args.images}-sweep", args.trials, Path(tmp) / "sweep")
        loads.append(os.getloadavg())
        rounds = throughput(root, copy, size, args.repeats)
        loads.append(os.getloadavg())
        shard_formats = formats(size, min(2_000, args.images))
        config = config_for(root, size)
        gpu = gpu_overhead(config, pipeline_for(copy, config), CLASSES)
        copy_bytes = {n: sum(s.bytes for s in c.manifest.shards) for n, (_, c) in fresh.items()}

    small, big = args.images, args.large
    first = {n: [r["first_batch_s"] for r in restarted[n]] for n in sizes}
    rss = {n: [r["peak_mib"] for r in restarted[n]] for n in sizes}
    first_ratio = statistics.median(first[big]) / statistics.median(first[small])
    rss_ratio = statistics.median(rss[big]) / statistics.median(rss[small])
    ratios = [r["ours"] / r["naive"] for r in rounds]
    augmented = [r["ours + augmentation"] / cores for r in rounds]
    on_cpu = [r["ours + augmentation applied on the CPU"] / cores for r in rounds]
    sweep_ratio = (sweep["made_cpu_s"] + sweep["check_cpu_s"]) / preparation_cpu
    decode_ratio = sweep["made_cpu_s"] / preparation_cpu
    busiest = max(load[0] for load in loads)
    quiet = busiest <= 1.25 * cores + 1  # the bench itself keeps the cores busy
    lines = [
        f"Command: `{COMMAND}{' --quick' if args.quick else ''}`",
        "",
        f"Data: generated JPEGs of {args.source_size} px in {CLASSES} classes ({small:,} and {big:,} images), "
        f"read at {size} px; batch {BATCH}; {args.repeats} rounds, each size or pipeline in turn.",
        f"Machine: {cores} CPU(s), {platform.machine()}, TensorFlow {tf.__version__}. Load averages (1 min) "
        f"along the run: {', '.join(f'{load[0]:.1f}' for load in loads)}: "
        + (
            "quiet."
            if quiet
            else f"busy (above {1.25 * cores + 1:g}): measured under load, no target called met."
        ),
        "",
        f"| measure | {small:,} images | {big:,} images | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| preparation and first batch, fresh pod | {fresh[small][0]:.1f} s | {fresh[big][0]:.1f} s | "
        f"{fresh[big][0] / fresh[small][0]:.2f} |",
        f"| prepared copy | {copy_bytes[small] / 2**20:,.0f} MiB | {copy_bytes[big] / 2**20:,.0f} MiB | |",
        f"| time to first batch, restarted pod (copy reused), median (range) | {spread(first[small], '{:.2f}')} s "
        f"| {spread(first[big], '{:.2f}')} s | **{first_ratio:.2f}** (target within 10%) |",
        f"| peak RSS of the trainer process over one epoch, median (range) | {spread(rss[small])} MiB | "
        f"{spread(rss[big])} MiB | **{rss_ratio:.2f}** (target within 10%) |",
        "",
        f"Training images/s per core ({small:,} images; {cores} cores), median (range) over the rounds:",
        "",
        "| pipeline | images/s per core |",
        "| --- | ---: |",
        *(f"| {name} | {spread([r[name] / cores for r in rounds])} |" for name in rounds[0]),
        "",
        f"Ours / image_dataset_from_directory, both without augmentation, paired by round: **{spread(ratios, '{:.1f}')}x** "
        "(target at least 5x). With the trainer's augmentation (flip, crop, brightness and contrast, drawn "
        "by the pipeline, applied by the training step on its device): "
        f"**{spread(augmented)}** images/s per core (target at least 650 at 224 px); its pixel arithmetic "
        f"done on the CPU as well, as on a pod without a GPU: {spread(on_cpu)} images/s per core.",
        "",
        f"A {args.trials}-trial sweep on one dataset version ({small:,} images): the first trial prepares "
        f"({sweep['made_cpu_s']:.1f} CPU s), the other {args.trials - 1} check the copy's checksums "
        f"({sweep['check_cpu_s']:.1f} CPU s in all) and decode nothing; images decoded in all: "
        f"{sweep['decodes']:,} ({small:,} files). Against one preparation ({preparation_cpu:.1f} CPU s): decode CPU "
        f"**{decode_ratio:.2f}x** (target at most 1.2x); with the checks, {sweep_ratio:.2f}x.",
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
