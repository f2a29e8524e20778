"""The classifier's input side: class balance from the first batch on, the folder scan's refusals and
counts, decompression bombs, and files TensorFlow drops."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline, check_image, scan_image_folder, split_files

PER_CLASS = 300


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory) -> Path:
    """Two classes of 300 tiny PNGs each; the scan lists them class by class, as any folder scan does."""
    root = tmp_path_factory.mktemp("cats_vs_dogs")
    rng = np.random.default_rng(3)
    for label, name in enumerate(("cat", "dog")):
        (root / name).mkdir()
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 128, (8, 8, 3), dtype=np.uint8) + np.uint8(127 * label)
            Image.fromarray(pixels).save(root / name / f"{i:04d}.png")
    return root


def epoch_labels(pipeline: ImagePipeline, epoch: int) -> np.ndarray:
    return np.concatenate([labels.numpy() for _, labels in pipeline.train_dataset(epoch)])


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("buffer", [0, 64], ids=["whole-split", "buffer-64"])
def test_the_first_batches_and_each_half_epoch_mix_the_classes(tmp_path, two_classes, buffer, cache):
    folder = scan_image_folder(two_classes)
    assert [label for _, label in folder.files[:PER_CLASS]] == [0] * PER_CLASS  # listed class by class
    train, val = split_files(folder.files, 0.1, seed=5)
    config = ClassifierConfig(
        data_dir=str(two_classes),
        checkpoint_dir=str(tmp_path),
        output_dir=str(tmp_path),
        image_size=8,
        batch_size=16,
        shuffle_buffer=buffer,
        cache=cache,
    )
    pipeline = ImagePipeline(train, val, config)
    first, second = epoch_labels(pipeline, 0), epoch_labels(pipeline, 1)
    assert len(first) == len(train) // 16 * 16
    # A shuffle buffer smaller than the split used to fill its first batches from the first class only.
    assert 0.3 <= np.mean(first[: 5 * 16] == 0) <= 0.7, first[: 5 * 16]
    half = len(first) // 2
    assert 0.4 <= np.mean(first[:half] == 0) <= 0.6
    assert 0.4 <= np.mean(first[half:] == 0) <= 0.6
    assert not np.array_equal(first, second)  # each epoch has its own order
    np.testing.assert_array_equal(first, epoch_labels(pipeline, 0))  # ... which is a function of the epoch


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height pixels, with one row of data: what a decompression
    bomb looks like to a reader before it decodes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
    return path


def test_a_decompression_bomb_is_skipped_and_counted(tmp_path, two_classes):
    bomb = png_header_only(tmp_path / "bomb.png", 30_000, 30_000)
    assert check_image(str(bomb)).startswith("decompression bomb: Image size (900000000 pixels) exceeds")
    data = tmp_path / "data"
    for name in ("cat", "dog"):
        (data / name).mkdir(parents=True)
        for src in sorted((two_classes / name).iterdir())[:5]:
            (data / name / src.name).write_bytes(src.read_bytes())
    (data / "dog" / "huge.png").write_bytes(bomb.read_bytes())
    folder = scan_image_folder(data)
    assert len(folder.files) == 10
    assert [(path, why.split(":")[0]) for path, why in folder.skipped] == [
        ("dog/huge.png", "decompression bomb")
    ]
