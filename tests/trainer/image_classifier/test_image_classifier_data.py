"""The classifier's input side: class balance from the first batch on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline, scan_image_folder, split_files

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
    config = ClassifierConfig(data_dir=str(two_classes), checkpoint_dir=str(tmp_path), output_dir=str(tmp_path),
                              image_size=8, batch_size=16, shuffle_buffer=buffer, cache=cache)
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

