"""The prepared copy of an image folder: made once and reused without decoding, refused and made again when
damaged or foreign, streamed with bounded buffers, and resumed batch for batch."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.image_classifier import prepare
from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline
from trainer.image_classifier.prepare import MANIFEST, PreparedManifest, decodes, prepare_images

PER_CLASS = 60
SIZE = 8
# A few records per shard, so the pipeline reads many shards as it would a large dataset.
SHARD_BYTES = 16 * prepare.record_bytes(SIZE, 3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Two classes of small JPEGs, a file that is no image and a truncated JPEG."""
    root = tmp_path_factory.mktemp("images") / "data"
    rng = np.random.default_rng(7)
    for label, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 100, (20, 24, 3), dtype=np.uint8) + np.uint8(150 * label)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.jpg", quality=90)
    (root / "cat" / "notes.jpg").write_text("not an image")
    whole = (root / "dog" / "000.jpg").read_bytes()
    (root / "dog" / "truncated.jpg").write_bytes(whole[:-40])  # the header is whole, the pixels are not
    return root


def config_for(data: Path, tmp_path: Path, **overrides) -> ClassifierConfig:
    values = {"image_size": SIZE, "batch_size": 8, "verify_workers": 2}
    values.update(overrides)
    return ClassifierConfig(
        data_dir=str(data), checkpoint_dir=str(tmp_path / "c"), output_dir=str(tmp_path / "o"), **values
    )


def prepared(data: Path, tmp_path: Path, location: Path, **overrides):
    return prepare_images(
        data, config_for(data, tmp_path, **overrides), location, shard_bytes=SHARD_BYTES, environ={}
    )


def test_a_copy_is_made_once_and_reused_without_decoding(tmp_path, folder):
    location = tmp_path / "prepared"
    before = decodes()
    first = prepared(folder, tmp_path, location)
    assert first.made and decodes() - before == 2 * PER_CLASS + 1  # the truncated JPEG too, once
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert manifest["format_version"] == prepare.FORMAT_VERSION
    assert manifest["key"] == prepare.preprocessing_key(SIZE, 3) == first.path.name
    assert manifest["dataset"].startswith("listing:")
    assert manifest["class_names"] == ["cat", "dog"]
    assert [why.split(" (")[0] for _, why in manifest["skipped"]] == ["not an image", "unreadable image"]
    assert sorted(path for path, _ in manifest["skipped"]) == ["cat/notes.jpg", "dog/truncated.jpg"]
    assert sum(s["records"] for s in manifest["shards"]) == 2 * PER_CLASS
    assert len(manifest["shards"]) == -(-2 * PER_CLASS // 16)
    for shard in manifest["shards"]:
        assert (first.path / shard["name"]).stat().st_size == shard["bytes"]
    assert not [p.name for p in location.iterdir() if p.name != first.path.name], "temporary files left"

    before = decodes()
    second = prepared(folder, tmp_path, location)
    assert decodes() == before and not second.made
    assert second.files == first.files and second.class_names == ["cat", "dog"]

    # Another preprocessing is another copy beside the first.
    other = prepared(folder, tmp_path, location, image_size=12)
    assert other.made and other.path != first.path and first.path.exists()


def test_the_records_hold_training_resize_of_each_file(tmp_path, folder):
    import tensorflow as tf

    from trainer.image_classifier.data import resize_image

    copy = prepared(folder, tmp_path, tmp_path / "prepared")
    pipeline = ImagePipeline(copy, copy.files, [], config_for(folder, tmp_path))
    records = copy.record_of()
    width = copy.record_bytes
    raw = b"".join(Path(p).read_bytes() for p in copy.shard_paths())
    for path, label in copy.files[:: 2 * PER_CLASS // 5]:
        record = raw[records[path] * width : (records[path] + 1) * width]
        index, stored_label = np.frombuffer(record[:8], "<i4")
        expected = resize_image(tf.io.decode_image(tf.io.read_file(path), channels=3), SIZE).numpy()
        assert (index, stored_label) == (records[path], label)
        np.testing.assert_array_equal(np.frombuffer(record[8:], np.uint8).reshape(SIZE, SIZE, 3), expected)
    assert pipeline.train_count == 2 * PER_CLASS


def flip_a_byte(path: Path) -> None:
    shard = sorted(path.glob("shard-*"))[1]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(data)


def truncate_a_shard(path: Path) -> None:
    shard = sorted(path.glob("shard-*"))[-1]
    shard.write_bytes(shard.read_bytes()[:-5])


def manifest_of_another_preprocessing(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    doc["key"] = prepare.preprocessing_key(16, 3)
    (path / MANIFEST).write_text(json.dumps(doc))


def manifest_of_another_dataset(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    doc["dataset"] = "version:0123456789abcdef"
    (path / MANIFEST).write_text(json.dumps(doc))


def manifest_of_another_format(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    doc["format_version"] = prepare.FORMAT_VERSION + 1
    (path / MANIFEST).write_text(json.dumps(doc))


def a_label_column_of_another_length(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    doc["labels"] = prepare.encode_column(prepare.decode_column(doc["labels"])[:-1])
    (path / MANIFEST).write_text(json.dumps(doc))


def a_label_column_that_is_not_base64(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    doc["labels"] = prepare.decode_column(doc["labels"]).tolist()  # the list form of format 2
    (path / MANIFEST).write_text(json.dumps(doc))


def a_record_column_that_names_a_record_twice(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    records = prepare.decode_column(doc["file_records"])
    records[np.flatnonzero(records == 1)[0]] = 0
    doc["file_records"] = prepare.encode_column(records)
    (path / MANIFEST).write_text(json.dumps(doc))


def a_record_count_that_lies(path: Path) -> None:
    doc = json.loads((path / MANIFEST).read_text())
    doc["shards"][0]["records"] += 1
    (path / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (flip_a_byte, "sha256"),
        (truncate_a_shard, "bytes, the manifest says"),
        (manifest_of_another_preprocessing, "made for preprocessing '16px-3ch-"),
        (manifest_of_another_dataset, "made from dataset 'version:0123456789abcdef'"),
        (
            manifest_of_another_format,
            f"format_version {prepare.FORMAT_VERSION + 1}, expected {prepare.FORMAT_VERSION}",
        ),
        (a_label_column_of_another_length, "labels: expected 120 whole numbers, one per file, found 119"),
        (a_label_column_that_is_not_base64, "labels: expected base64 of little-endian int32, found list"),
        (
            a_record_column_that_names_a_record_twice,
            "file_records: expected the record numbers 0 ... 119, each once",
        ),
        (a_record_count_that_lies, "bytes listed for 17 records"),
    ],
)
def test_a_damaged_or_foreign_copy_is_refused_and_made_again(tmp_path, folder, caplog, damage, reason):
    made = prepared(folder, tmp_path, tmp_path / "made")
    # Copied as a stage-in would download it: new files, which this process has not hashed yet.
    location = tmp_path / "downloaded"
    shutil.copytree(made.path, location / made.path.name)
    damage(location / made.path.name)
    caplog.set_level(logging.INFO)
    before = decodes()
    again = prepared(folder, tmp_path, location)
    assert "refusing the prepared copy" in caplog.text and reason in caplog.text, caplog.text
    assert again.made and decodes() - before == 2 * PER_CLASS + 1
    assert again.path == location / made.path.name
    for name in ("shard-00001.bin", MANIFEST):
        assert (again.path / name).read_bytes() == (made.path / name).read_bytes()


def test_an_undamaged_download_is_hashed_once_and_trusted(tmp_path, folder, monkeypatch):
    made = prepared(folder, tmp_path, tmp_path / "made")
    location = tmp_path / "downloaded"
    shutil.copytree(made.path, location / made.path.name)
    hashed = []
    real = prepare._file_sha256
    monkeypatch.setattr(prepare, "_file_sha256", lambda p: hashed.append(p.name) or real(p))
    before = decodes()
    first = prepared(folder, tmp_path, location)
    assert not first.made and decodes() == before and len(hashed) == len(made.manifest.shards)
    hashed.clear()
    prepared(folder, tmp_path, location)
    assert hashed == []  # this process's stamp vouches for the files it hashed


def test_a_staged_dataset_version_names_the_copy(tmp_path, folder):
    config = config_for(folder, tmp_path)
    location = tmp_path / "prepared"
    env = {"KUBETRAIN_DATASET_VERSION": "v1"}
    first = prepare_images(folder, config, location, shard_bytes=SHARD_BYTES, environ=env)
    assert first.manifest.dataset == "version:v1"
    assert not prepare_images(folder, config, location, shard_bytes=SHARD_BYTES, environ=env).made
    again = prepare_images(
        folder, config, location, shard_bytes=SHARD_BYTES, environ={"KUBETRAIN_DATASET_VERSION": "v2"}
    )
    assert again.made and again.manifest.dataset == "version:v2"


def test_the_location_comes_from_the_environment(tmp_path, folder):
    assert prepare.prepared_dir(folder, {}) == folder / ".kubetrain-prepared"
    assert prepare.prepared_dir(folder, {"KUBETRAIN_PREPARED_DIR": str(tmp_path)}) == tmp_path
    copy = prepare_images(
        folder,
        config_for(folder, tmp_path),
        shard_bytes=SHARD_BYTES,
        environ={"KUBETRAIN_PREPARED_DIR": str(tmp_path / "env")},
    )
    assert copy.path.parent == tmp_path / "env"


def test_the_manifest_round_trips(tmp_path, folder):
    copy = prepared(folder, tmp_path, tmp_path / "prepared")
    assert PreparedManifest.from_json(copy.manifest.to_json()) == copy.manifest
    with pytest.raises(ValueError, match=f"format_version None, expected {prepare.FORMAT_VERSION}"):
        PreparedManifest.from_json("{}")


def test_a_copy_another_process_published_first_is_used(tmp_path, folder, caplog):
    location = tmp_path / "prepared"
    config = config_for(folder, tmp_path)
    fingerprint = prepare.dataset_fingerprint(folder, {})
    first = prepare.make_prepared(folder, config, location, fingerprint, shard_bytes=SHARD_BYTES)
    caplog.set_level(logging.INFO)
    second = prepare.make_prepared(folder, config, location, fingerprint, shard_bytes=SHARD_BYTES)
    assert "published the prepared copy" in caplog.text and "first; using it" in caplog.text
    assert second.path == first.path and second.manifest == first.manifest
    assert [p.name for p in location.iterdir()] == [first.path.name]


def test_a_copy_that_cannot_fit_in_data_is_refused_before_anything_is_decoded(tmp_path, folder):
    from kubetrain_contract.pod import Env
    from trainer.common.contract import DataError

    data = tmp_path / "data"
    shutil.copytree(folder, data)
    location = data / ".kubetrain-prepared"
    config = config_for(data, tmp_path, image_size=224)
    images = 2 * PER_CLASS + 1  # the truncated JPEG's header is whole: it is counted until decoded
    needed = images * prepare.record_bytes(224, 3)
    used = prepare._allocated_bytes(data)

    before = decodes()
    with pytest.raises(DataError) as refused:
        prepare_images(data, config, location, environ={Env.DATA_SIZE_BYTES: str(used + needed - 4096)})
    assert decodes() == before
    assert f"the prepared copy of {images} images at 224 px needs" in str(refused.value)
    assert f"set the DAG's data_size to at least {-(-(used + needed) // (1 << 30)) + 1}Gi" in str(
        refused.value
    )
    assert not location.exists() or not any(location.iterdir())

    made = prepare_images(
        data, config, location, environ={Env.DATA_SIZE_BYTES: str(used + needed + (1 << 20))}
    )
    assert made.made and prepare._allocated_bytes(data) <= used + needed + (1 << 20)

    # a copy kept outside DATA_DIR is not /data's concern
    elsewhere = prepare_images(
        data, config_for(data, tmp_path), tmp_path / "elsewhere", environ={Env.DATA_SIZE_BYTES: "1"}
    )
    assert elsewhere.made
