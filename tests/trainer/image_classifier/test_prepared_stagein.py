"""A prepared copy travels through S3: uploaded beside the dataset snapshot by one pod, downloaded by the
stage-in of the next, and reused there without decoding; incomplete or damaged copies are left out."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kubetrain_contract.s3uri import S3Uri
from trainer.image_classifier import prepare
from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.prepare import MANIFEST, decodes, prepare_images
from trainer.sync.s3 import S3
from trainer.sync.stagein import stage_prepared

SIZE = 8


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    import boto3

    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=moto_server.endpoint, region_name=moto_server.region)
    if "training" not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket="training")
    return client


@pytest.fixture
def made(tmp_path):
    data = tmp_path / "data"
    rng = np.random.default_rng(1)
    for name in ("cat", "dog"):
        (data / name).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(data / name / f"{i}.png")
    config = ClassifierConfig(
        data_dir=str(data), checkpoint_dir=str(tmp_path), output_dir=str(tmp_path), image_size=SIZE
    )
    env = {"KUBETRAIN_DATASET_VERSION": "v1"}
    copy = prepare_images(
        data, config, tmp_path / "made", shard_bytes=8 * prepare.record_bytes(SIZE, 3), environ=env
    )
    return data, config, env, copy


def upload(client, copy_path: Path, prefix: str, *, manifest: bool = True) -> None:
    for path in sorted(copy_path.glob("shard-*")):
        client.put_object(
            Bucket="training", Key=f"{prefix}{copy_path.name}/{path.name}", Body=path.read_bytes()
        )
    if manifest:  # last, as the uploader sends it
        client.put_object(
            Bucket="training",
            Key=f"{prefix}{copy_path.name}/{MANIFEST}",
            Body=(copy_path / MANIFEST).read_bytes(),
        )


def test_a_copy_uploaded_by_one_pod_is_staged_and_reused_by_the_next(s3_env, made, tmp_path):
    data, config, env, copy = made
    prefix = f"prepared/ds-{secrets.token_hex(3)}/v1/"
    upload(s3_env, copy.path, prefix)
    # An upload cut before its manifest is not a copy yet.
    s3_env.put_object(Bucket="training", Key=f"{prefix}12px-3ch-000000000000/shard-00000.bin", Body=b"x" * 10)
    dest = tmp_path / "pod2" / ".kubetrain-prepared"
    assert stage_prepared(S3(), S3Uri("training", prefix), dest, progress_interval=0) == [copy.path.name]
    assert sorted(p.name for p in dest.iterdir()) == [copy.path.name]
    before = decodes()
    again = prepare_images(data, config, dest, environ=env)
    assert decodes() == before and not again.made and again.files == copy.files


@pytest.mark.parametrize("damage", ["bytes", "name"])
def test_a_damaged_or_hostile_copy_is_left_out_and_the_stage_in_goes_on(
    s3_env, made, tmp_path, damage, capsys
):
    _, _, _, copy = made
    prefix = f"prepared/ds-{secrets.token_hex(3)}/v1/"
    upload(s3_env, copy.path, prefix, manifest=False)
    doc = json.loads((copy.path / MANIFEST).read_text())
    if damage == "bytes":
        doc["shards"][0]["sha256"] = "0" * 64
    else:
        doc["shards"][0]["name"] = "../../escape.bin"
    s3_env.put_object(
        Bucket="training", Key=f"{prefix}{copy.path.name}/{MANIFEST}", Body=json.dumps(doc).encode()
    )
    dest = tmp_path / "pod2" / ".kubetrain-prepared"
    assert stage_prepared(S3(), S3Uri("training", prefix), dest, progress_interval=0) == []
    assert not (dest / copy.path.name).exists() and not list(dest.glob(".tmp-*"))
    assert not (tmp_path / "escape.bin").exists()
    err = capsys.readouterr().err
    assert f"prepared copy {copy.path.name} under s3://training/{prefix} not staged" in err
    assert ("sha256" in err) if damage == "bytes" else ("is not shard-<number>.bin" in err)


def test_no_copy_yet_is_only_a_line_in_the_log(s3_env, tmp_path, capsys):
    assert stage_prepared(S3(), S3Uri("training", "prepared/none/v0/"), tmp_path, progress_interval=0) == []
    assert "no prepared copy under s3://training/prepared/none/v0/ yet" in capsys.readouterr().err
