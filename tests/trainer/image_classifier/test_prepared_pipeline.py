"""The pipeline over a prepared copy: exact resume, bounded buffers and no cache, balanced first batches,
a fixed validation split, and a second training run that decodes nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.image_classifier import prepare
from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline, model_pixels, split_files
from trainer.image_classifier.prepare import decodes, prepare_images

PER_CLASS = 150
SIZE = 8
SHARD_BYTES = 20 * prepare.record_bytes(SIZE, 3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Two classes of small PNGs; the scan lists them class by class."""
    root = tmp_path_factory.mktemp("pipeline") / "data"
    rng = np.random.default_rng(3)
    for label, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 128, (12, 12, 3), dtype=np.uint8) + np.uint8(127 * label)
            Image.fromarray(pixels).save(root / name / f"{i:04d}.png")
    return root


def config_for(data: Path, **overrides) -> ClassifierConfig:
    values = {"image_size": SIZE, "batch_size": 16, "verify_workers": 2}
    values.update(overrides)
    return ClassifierConfig(data_dir=str(data), checkpoint_dir=str(data), output_dir=str(data), **values)


@pytest.fixture(scope="module")
def copy(folder, tmp_path_factory):
    location = tmp_path_factory.mktemp("prepared")
    return prepare_images(folder, config_for(folder), location, shard_bytes=SHARD_BYTES, environ={})


def pipeline_for(copy, folder, **overrides) -> ImagePipeline:
    config = config_for(folder, **overrides)
    train, val = split_files(copy.files, config.validation_split, config.seed)
    return ImagePipeline(copy, train, val, config)


def batches(dataset) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (pixels, labels) the training step sees: with --augment, the batch's draws applied."""
    return [(model_pixels(x, *draws).numpy(), y.numpy()) for x, y, *draws in dataset]


@pytest.mark.parametrize("shuffle_buffer", [0, 32], ids=["permutation", "buffer"])
@pytest.mark.parametrize("augment", [False, True], ids=["plain", "augmented"])
def test_a_resumed_epoch_yields_the_batches_of_an_uninterrupted_one(copy, folder, augment, shuffle_buffer):
    pipeline = pipeline_for(copy, folder, augment=augment, flip=augment, shuffle_buffer=shuffle_buffer)
    whole = batches(pipeline.train_dataset(2))
    assert len(whole) == pipeline.train_count // 16 > 10
    resumed = batches(
        pipeline_for(
            copy, folder, augment=augment, flip=augment, shuffle_buffer=shuffle_buffer
        ).train_dataset(2, 7)
    )
    assert len(resumed) == len(whole) - 7
    for (x, y), (rx, ry) in zip(whole[7:], resumed, strict=True):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    other_epoch = batches(pipeline.train_dataset(3))
    assert not np.array_equal(
        np.concatenate([y for _, y in whole]), np.concatenate([y for _, y in other_epoch])
    )


def test_the_batch_augmentation_takes_windows_of_the_reflect_padded_images(copy, folder):
    import tensorflow as tf

    pipeline = pipeline_for(copy, folder, augment=True, flip=True)
    images = np.random.default_rng(5).integers(0, 256, (64, SIZE, SIZE, 3), dtype=np.uint8)
    seed = tf.constant([11, 3], tf.int64)
    out = pipeline.augment(tf.constant(images), seed).numpy()
    offsets, flip, delta, factor = (t.numpy() for t in pipeline.augmentation_draws(64, seed))
    pad = max(1, SIZE // 8)
    for b in range(len(images)):
        image = images[b, :, ::-1] if flip[b] else images[b]
        padded = np.pad(image.astype(np.float64), [(pad, pad), (pad, pad), (0, 0)], mode="reflect")
        window = padded[offsets[b, 0] : offsets[b, 0] + SIZE, offsets[b, 1] : offsets[b, 1] + SIZE]
        brighter = window + delta[b]
        mean = brighter.mean(axis=(0, 1))  # per channel, as tf.image.adjust_contrast
        expected = np.clip((brighter - mean) * factor[b] + mean, 0.0, 255.0)
        np.testing.assert_allclose(out[b], expected, atol=1e-3, err_msg=f"image {b}")
    # Each image draws its own window, flip, brightness and contrast, within the ranges.
    assert set(offsets.ravel().tolist()) == set(range(2 * pad + 1))
    assert 10 < flip.sum() < 54
    assert np.all(np.abs(delta) <= 0.1 * 255) and np.ptp(delta) > 25
    assert np.all((factor >= 0.8) & (factor <= 1.2)) and np.ptp(factor) > 0.2
    np.testing.assert_array_equal(pipeline.augment(tf.constant(images), seed).numpy(), out)
    assert not np.array_equal(pipeline.augment(tf.constant(images), tf.constant([11, 4], tf.int64)), out)
    unflipped = pipeline_for(copy, folder, augment=True, flip=False)
    assert not unflipped.augmentation_draws(64, seed)[1].numpy().any()


@pytest.mark.parametrize("shuffle_buffer", [0, 32], ids=["permutation", "buffer"])
def test_a_resumed_augmented_epoch_augments_each_batch_as_the_unbroken_one(copy, folder, shuffle_buffer):
    # Batch k of an epoch is augmented with seed (epoch seed, k) whether the epoch started at 0 or resumed.
    pipeline = pipeline_for(copy, folder, augment=True, flip=True, shuffle_buffer=shuffle_buffer)
    plain = pipeline_for(copy, folder, augment=False, shuffle_buffer=shuffle_buffer)
    whole = batches(pipeline.train_dataset(4))
    for skip in (1, len(whole) - 1):
        resumed = batches(pipeline.train_dataset(4, skip))
        assert len(resumed) == len(whole) - skip
        for (x, y), (rx, ry) in zip(whole[skip:], resumed, strict=True):
            np.testing.assert_array_equal(x, rx)
            np.testing.assert_array_equal(y, ry)
    # The same images as without augmentation, changed: not the identity, nor one draw for the batch.
    raw = batches(plain.train_dataset(4))
    assert [y.tolist() for _, y in raw] == [y.tolist() for _, y in whole]
    assert not np.allclose(raw[0][0], whole[0][0])


def graph_nodes(dataset) -> list:
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    return list(graph.node)


def test_training_holds_no_cache_and_no_shuffle_buffer_unless_one_is_asked_for(copy, folder):
    import tensorflow as tf

    pipeline = pipeline_for(copy, folder)
    for dataset in (pipeline.train_dataset(0), pipeline.train_dataset(1, 3), pipeline.val_dataset()):
        ops = [n.op for n in graph_nodes(dataset)]
        assert not [op for op in ops if "Cache" in op or "Shuffle" in op], ops
    buffered = pipeline_for(copy, folder, shuffle_buffer=40)
    assert buffered.shuffle_buffer() == 40 < buffered.train_count
    nodes = graph_nodes(buffered.train_dataset(0))
    consts = {n.name: n for n in nodes if n.op == "Const"}
    buffers = [
        int(tf.make_ndarray(consts[n.input[1].split(":")[0]].attr["value"].tensor))
        for n in nodes
        if n.op.startswith("ShuffleDataset")
    ]
    assert buffers == [40]
    assert not [n.op for n in nodes if "Cache" in n.op]
    assert pipeline_for(copy, folder, shuffle_buffer=10_000).shuffle_buffer() == buffered.train_count


def test_an_epoch_is_a_seeded_permutation_of_the_whole_training_split(copy, folder):
    pipeline = pipeline_for(copy, folder)
    record_of = copy.record_of()
    train, _ = split_files(copy.files, 0.2, pipeline.config.seed)
    by_record = {record_of[p]: label for p, label in train}
    epochs = []
    for epoch in (0, 1):
        seen = [b for b in batches(pipeline.train_dataset(epoch))]
        labels = np.concatenate([y for _, y in seen])
        assert len(labels) == pipeline.train_count // 16 * 16
        epochs.append(np.concatenate([x.reshape(len(x), -1) for x, _ in seen]))
    # Every batch holds training images with their labels; an epoch repeats none of them.
    for pixels in epochs:
        assert len({row.tobytes() for row in pixels}) == len(pixels)
    assert not np.array_equal(epochs[0], epochs[1])
    first = pipeline.reader.read(pipeline.train_records[:5])
    assert [by_record[r] for r in pipeline.train_records[:5].tolist()] == first[1].tolist()


def test_a_truncated_or_shuffled_shard_is_an_error_not_zeros(copy, folder, tmp_path):
    from trainer.common.contract import DataError

    damaged = prepare_images(folder, config_for(folder), tmp_path, shard_bytes=SHARD_BYTES, environ={})
    pipeline = pipeline_for(damaged, folder)
    last = Path(damaged.shard_paths()[-1])
    records = damaged.manifest.records
    # Damaged after the copy was checked, as a disk or another process could: the reader still notices.
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size - 10)
    with pytest.raises(DataError, match=f"record {records - 1} ends after .* bytes .*truncated shard"):
        pipeline.reader.read(np.array([0, records - 1]))
    first = Path(damaged.shard_paths()[0])
    data = bytearray(first.read_bytes())
    width = damaged.record_bytes
    data[:width], data[width : 2 * width] = data[width : 2 * width], data[:width]
    first.write_bytes(bytes(data))
    with pytest.raises(DataError, match="record 0 holds record 1: the copy is damaged"):
        pipeline.reader.read(np.array([0]))


def test_the_first_batches_and_each_half_epoch_mix_the_classes(copy, folder):
    # The scan lists the files class by class; the prepared copy stores them in a seeded random order.
    assert [label for _, label in copy.files[:PER_CLASS]] == [0] * PER_CLASS
    pipeline = pipeline_for(copy, folder, shuffle_buffer=16)
    labels = np.concatenate([y for _, y in batches(pipeline.train_dataset(0))])
    assert 0.3 <= np.mean(labels[: 5 * 16] == 0) <= 0.7, labels[: 5 * 16]
    half = len(labels) // 2
    assert 0.35 <= np.mean(labels[:half] == 0) <= 0.65
    assert 0.35 <= np.mean(labels[half:] == 0) <= 0.65


def test_validation_is_the_same_split_in_the_same_order_on_every_run(copy, folder, tmp_path):
    config = config_for(folder)
    train, val = split_files(copy.files, config.validation_split, config.seed)
    assert not {p for p, _ in train} & {p for p, _ in val} and len(train) + len(val) == 2 * PER_CLASS
    first = batches(pipeline_for(copy, folder).val_dataset())
    # Another process, another prepared copy of the same files: the same examples, labels and order.
    again = prepare_images(folder, config, tmp_path, shard_bytes=SHARD_BYTES * 3, environ={})
    second = batches(pipeline_for(again, folder).val_dataset())
    assert sum(len(y) for _, y in first) == len(val)
    for (x, y), (x2, y2) in zip(first, second, strict=True):
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x, x2)
    by_path = dict(copy.files)
    assert sorted(np.concatenate([y for _, y in first]).tolist()) == sorted(by_path[p] for p, _ in val)


def test_a_pipeline_for_another_preprocessing_is_refused(copy, folder):
    with pytest.raises(ValueError, match="holds 8 px, 3 channel"):
        pipeline_for(copy, folder, image_size=16)


def test_a_second_training_run_reuses_the_copy_and_decodes_nothing(tmp_path, folder, caplog, monkeypatch):
    from trainer.image_classifier import train as image_classifier

    monkeypatch.setenv("KUBETRAIN_PREPARED_DIR", str(tmp_path / "prepared"))
    monkeypatch.delenv("KUBETRAIN_DATASET_VERSION", raising=False)
    caplog.set_level(logging.INFO)

    def run(name: str) -> dict:
        args = ["--data-dir", str(folder), "--checkpoint-dir", str(tmp_path / name / "c")]
        args += ["--output-dir", str(tmp_path / name / "o"), "--image-size", str(SIZE), "--batch-size", "16"]
        assert image_classifier.main([*args, "--max-steps", "2", "--log-every-steps", "100"]) == 0, (
            caplog.text
        )
        return json.loads((tmp_path / name / "o" / "metrics.json").read_text())

    before = decodes()
    first = run("first")
    assert decodes() - before == 2 * PER_CLASS
    before = decodes()
    second = run("second")
    assert decodes() == before, "the second run decoded images"
    assert "using the prepared copy" in caplog.text
    # metrics.json counts what each run's preparation decoded, as the pod's own record of it
    assert first["prepared"] == {"made": True, "decoded": 2 * PER_CLASS}
    assert second["prepared"] == {"made": False, "decoded": 0}
    assert "images decoded by this run: 0" in caplog.text
    assert (first["train_examples"], first["val_examples"]) == (
        second["train_examples"],
        second["val_examples"],
    )
    assert first["train_examples"] + first["val_examples"] == 2 * PER_CLASS


EXIT_MID_EPOCH = """
import sys
from pathlib import Path

from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline, split_indices
from trainer.image_classifier.prepare import prepare_images

data, location = Path(sys.argv[1]), Path(sys.argv[2])
config = ClassifierConfig(
    data_dir=str(data), checkpoint_dir=str(data), output_dir=str(data), image_size=96, batch_size=8
)
copy = prepare_images(data, config, location, environ={})
train, val = split_indices(copy.labels, config.validation_split, config.seed)
batches = iter(ImagePipeline(copy, train, val, config).train_dataset(0))
next(batches)
print("read one batch", flush=True)
# main returns with the iterator alive and tf.data's threads reading ahead
"""


def test_a_program_that_stops_mid_epoch_exits(folder, tmp_path):
    """The interpreter's teardown with reads in flight: without the exit hook that stops them
    (data._ReadsInFlight) this hung in about half of the runs, for ever."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    location = tmp_path / "prepared"
    for run in range(6):
        done = subprocess.run(
            [sys.executable, "-c", EXIT_MID_EPOCH, str(folder), str(location)],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=300,  # a hang is for ever; a loaded machine takes seconds
        )
        assert done.returncode == 0 and "read one batch" in done.stdout, (run, done.stderr[-2000:])
