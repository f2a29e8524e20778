"""The classifier's SavedModel serves files as training saw them: same pixels, same prediction."""

from __future__ import annotations

import io
import json
import logging
import zipfile
from pathlib import Path

import numpy as np
import pytest

from include.sample_data import digits as digits_data
from trainer.common.export import latest_saved_model, next_version, saved_model_versions
from trainer.image_classifier import data as image_data
from trainer.image_classifier import train as image_classifier
from trainer.image_classifier.prepare import prepare_images

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def test_each_export_gets_a_higher_version(tmp_path):
    base = tmp_path / "saved_model"
    assert saved_model_versions(base) == [] and next_version(base, now=1_700_000_000) == 1_700_000_000
    (base / "1").mkdir(parents=True)
    (base / "1800000000").mkdir()
    (base / ".1900000000.tmp").mkdir()  # a half-written export is no version
    assert saved_model_versions(base) == [1, 1_800_000_000]
    assert next_version(base, now=1_700_000_000) == 1_800_000_001  # never below an existing one
    assert next_version(base, now=1_900_000_000) == 1_900_000_000
    assert latest_saved_model(base) == base / "1800000000"
    with pytest.raises(FileNotFoundError, match="no SavedModel version directory"):
        latest_saved_model(tmp_path / "empty")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, image_classifier.ClassifierConfig]:
    root = tmp_path_factory.mktemp("serving")
    archive = root / "digits.zip"
    digits_data.main(["--out", str(archive), "--per-class", "12"])
    data = root / "data"
    with zipfile.ZipFile(archive) as z:
        z.extractall(data)
    out = root / "out"
    args = ["--data-dir", str(data), "--checkpoint-dir", str(root / "ckpt"), "--output-dir", str(out)]
    flags = ["--image-size", "24", "--batch-size", "16", "--epochs", "3", "--no-augment", "--no-tensorboard"]
    assert image_classifier.main([*args, *flags]) == 0
    config = image_classifier.ClassifierConfig(
        data_dir=str(data),
        checkpoint_dir=str(root / "c"),
        output_dir=str(root / "o"),
        image_size=24,
        batch_size=16,
    )
    return data, out, config


def test_serving_a_training_file_gives_the_training_pipelines_prediction(trained, caplog):
    import keras
    import tensorflow as tf

    caplog.set_level(logging.INFO)
    data, out, config = trained
    prepared = prepare_images(data, config)  # the copy the run prepared: its pixels are training's
    record_of = prepared.record_of()
    files = sorted((p for p, _ in prepared.files if record_of[p] >= 0), key=record_of.__getitem__)
    # Every file on the validation side: the pipeline yields them in record order.
    pipeline = image_data.ImagePipeline(prepared, [], [(p, 0) for p in files], config)
    model = keras.saving.load_model(out / "model.keras")
    expected = np.concatenate([np.asarray(model(x, training=False)) for x, _ in pipeline.val_dataset()])
    assert expected.shape == (len(files), 10)

    loaded = tf.saved_model.load(str(latest_saved_model(out / "saved_model")))
    assert set(loaded.signatures) >= {"serving_default", "serve", "serve_pixels"}
    encoded = tf.constant([Path(p).read_bytes() for p in files])
    served = loaded.signatures["serving_default"](images=encoded)
    assert set(served) == {"class_name", "probability", "probabilities", "class_names"}
    probabilities = served["probabilities"].numpy()
    assert np.abs(probabilities - expected).max() < 1e-4
    classes = json.loads((out / "params.json").read_text())["classes"]
    names = [c.decode() for c in served["class_name"].numpy()]
    assert names == [classes[i] for i in expected.argmax(axis=1)]
    assert np.allclose(served["probability"].numpy(), expected.max(axis=1), atol=1e-4)
    assert [[c.decode() for c in row] for row in served["class_names"].numpy()[:2]] == [classes, classes]

    # uint8 pixels of any size go through the same resize: the original files' pixels, and a JPEG.
    from PIL import Image

    with Image.open(files[0]) as image:
        original = np.asarray(image.convert("RGB"))
    pixels = loaded.signatures["serve_pixels"](pixels=tf.constant(original[None]))
    assert np.abs(pixels["probabilities"].numpy()[0] - expected[0]).max() < 1e-4
    big = np.asarray(Image.fromarray(original).resize((original.shape[1] * 3, original.shape[0] * 2)))
    jpeg = io.BytesIO()
    Image.fromarray(big).save(jpeg, format="JPEG", quality=95)
    both = loaded.signatures["serve"](images=tf.constant([jpeg.getvalue()]))
    scaled = loaded.signatures["serve_pixels"](pixels=tf.constant(big[None]))
    assert both["probabilities"].shape == scaled["probabilities"].shape == (1, 10)
    assert np.allclose(both["probabilities"].numpy().sum(), 1.0, atol=1e-4)
