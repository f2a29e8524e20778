"""The prepared copy between pods: the checkpoint-sync sidecar of the pod that made it uploads it beside the
dataset snapshot, once, manifest last; the stage-in of the next pod (``python -m trainer.sync stage-in`` as
the pod runs it) downloads it, and the trainer there decodes nothing. A damaged copy is not uploaded.

The server is moto's, as for the other stage-in tests (test_stagein.py says why).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sync_support import dataset_manifest, put_manifest, run_sync, s3_client

from kubetrain_contract.s3uri import S3Uri
from trainer.image_classifier import prepare
from trainer.image_classifier.config import ClassifierConfig
from trainer.sync.__main__ import sidecar_s3
from trainer.sync.sidecar import Sidecar, SyncConfig

SIZE = 8


@pytest.fixture(scope="module")
def s3(moto_server):
    return s3_client(moto_server)


@pytest.fixture
def s3_env(moto_server, s3, monkeypatch):
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    return moto_server.env()


class RecordingS3:
    """The sidecar's S3 access, remembering the keys it writes, in order."""

    def __init__(self, s3) -> None:
        self._s3 = s3
        self.puts: list[str] = []

    def put_bytes(self, bucket, key, data, **kwargs):
        self.puts.append(key)
        return self._s3.put_bytes(bucket, key, data, **kwargs)

    def complete_multipart_upload(self, bucket, key, *args, **kwargs):
        self.puts.append(key)
        return self._s3.complete_multipart_upload(bucket, key, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._s3, name)


@pytest.fixture
def pod1(s3, s3_env, tmp_path):
    """A dataset in S3 with its staged manifest, and the first pod's DATA_DIR with the copy its trainer made."""
    dataset = f"pets-{secrets.token_hex(3)}"
    data = tmp_path / "pod1" / "data"
    rng = np.random.default_rng(7)
    for name in ("cat", "dog"):
        (data / name).mkdir(parents=True)
        for i in range(12):
            path = data / name / f"{i}.png"
            Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(path)
            s3.put_object(Bucket="datasets", Key=f"{dataset}/{name}/{i}.png", Body=path.read_bytes())
    manifest = dataset_manifest(s3, "datasets", f"{dataset}/", dataset)
    config = ClassifierConfig(
        data_dir=str(data), checkpoint_dir=str(tmp_path), output_dir=str(tmp_path), image_size=SIZE
    )
    env = {"KUBETRAIN_DATASET_VERSION": manifest["version"]}
    copy = prepare.prepare_images(data, config, shard_bytes=5 * prepare.record_bytes(SIZE, 3), environ=env)
    assert copy.made and len(copy.manifest.shards) == 5
    return {
        "manifest_uri": put_manifest(s3, manifest),
        "prepared": S3Uri("training", f"prepared/{dataset}/{manifest['version']}/"),
        "data": data,
        "config": config,
        "env": env,
        "copy": copy,
    }


def sidecar(tmp_path: Path, pod1: dict, name: str) -> tuple[Sidecar, RecordingS3]:
    s3 = RecordingS3(sidecar_s3(4))
    config = SyncConfig(
        run=S3Uri("training", f"runs/prepared/{secrets.token_hex(4)}"),
        dirs={"checkpoints": tmp_path / name / "checkpoints"},
        settle=0,
        grace=20,
        prepared=pod1["prepared"],
        prepared_dir=pod1["data"] / ".kubetrain-prepared",
    )
    return Sidecar(s3, config), s3


def listed(s3, uri: S3Uri) -> dict[str, bytes]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=uri.key)
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    return {k[len(uri.key) :]: s3.get_object(Bucket=uri.bucket, Key=k)["Body"].read() for k in keys}


def test_the_sidecar_uploads_a_fresh_copy_once_in_its_final_pass_manifest_last(s3, pod1, tmp_path, capsys):
    copy = pod1["copy"]
    key = copy.path.name
    side, recorder = sidecar(tmp_path, pod1, "pod1")
    side.stop.set()  # SIGTERM: the final pass includes the copy
    assert side.final_pass() == 0

    in_s3 = listed(s3, pod1["prepared"])
    local = {f"{key}/{s.name}": (copy.path / s.name).read_bytes() for s in copy.manifest.shards}
    local[f"{key}/manifest.json"] = (copy.path / "manifest.json").read_bytes()
    assert in_s3 == local  # no .verified.json, nothing but the listed shards and the manifest
    prepared_puts = [k for k in recorder.puts if k.startswith(pod1["prepared"].key)]
    assert prepared_puts[-1] == f"{pod1['prepared'].key}{key}/manifest.json"
    assert len(prepared_puts) == len(local)

    # a later round of this pod, and the sidecar of a retried pod that finds the copy in S3, upload nothing
    assert side.prepared.sync() == []
    retried, recorder2 = sidecar(tmp_path, pod1, "pod1-retry")
    assert retried.prepared.sync() == []
    assert recorder2.puts == [] and len(recorder.puts) == len([*prepared_puts, "pass-1"])
    assert (
        f"prepared copy {key} is already in s3://training/{pod1['prepared'].key}" in capsys.readouterr().err
    )


def test_a_copy_whose_shard_does_not_match_its_manifest_is_not_uploaded(s3, pod1, tmp_path, capsys):
    copy = pod1["copy"]
    key = copy.path.name
    shard = copy.path / copy.manifest.shards[2].name
    damaged = bytearray(shard.read_bytes())
    damaged[-1] ^= 0xFF
    shard.write_bytes(bytes(damaged))

    side, recorder = sidecar(tmp_path, pod1, "pod1")
    assert side.prepared.sync() == []
    in_s3 = listed(s3, pod1["prepared"])
    # the shards before the damaged one may be there; neither the damaged one nor the manifest is
    assert f"{key}/{shard.name}" not in in_s3 and f"{key}/manifest.json" not in in_s3
    err = capsys.readouterr().err
    assert f"prepared copy {key} not uploaded: {shard.name}: sha256" in err and "the manifest says" in err
    # the same damaged copy is not read again at every round
    puts = list(recorder.puts)
    assert side.prepared.sync() == [] and "not uploaded" not in capsys.readouterr().err
    assert recorder.puts == puts

    # the trainer refuses the copy and makes it again: that one goes up, manifest last
    remade = prepare.prepare_images(
        pod1["data"], pod1["config"], shard_bytes=5 * prepare.record_bytes(SIZE, 3), environ=pod1["env"]
    )
    assert remade.made
    assert side.prepared.sync() == [key]
    assert recorder.puts[-1] == f"{pod1['prepared'].key}{key}/manifest.json"
    assert listed(s3, pod1["prepared"])[f"{key}/{shard.name}"] == (remade.path / shard.name).read_bytes()


def test_the_next_pods_stage_in_downloads_the_copy_and_its_trainer_decodes_nothing(
    s3, s3_env, pod1, tmp_path
):
    # the sidecar's thread beside its passes uploads the copy while the trainer runs
    side, _ = sidecar(tmp_path, pod1, "pod1")
    thread = threading.Thread(target=side.upload_prepared, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while pod1["copy"].path.name not in side.prepared.done and time.monotonic() < deadline:
        time.sleep(0.05)
    side.stop.set()
    thread.join(10)
    assert not thread.is_alive() and side.prepared.done == {pod1["copy"].path.name}

    data2 = tmp_path / "pod2" / "data"
    done = run_sync(
        [
            "stage-in",
            "--manifest",
            pod1["manifest_uri"],
            "--data-dir",
            str(data2),
            "--checkpoint-dir",
            str(tmp_path / "pod2" / "checkpoints"),
            "--progress-interval",
            "0",
        ],
        {**s3_env, "KUBETRAIN_PREPARED_URI": str(pod1["prepared"])},
    )
    assert done.returncode == 0, done.stderr
    staged = data2 / ".kubetrain-prepared" / pod1["copy"].path.name
    assert json.loads((staged / "manifest.json").read_text()) == json.loads(
        (pod1["copy"].path / "manifest.json").read_text()
    )

    before = prepare.decodes()
    config = ClassifierConfig(
        data_dir=str(data2), checkpoint_dir=str(tmp_path), output_dir=str(tmp_path), image_size=SIZE
    )
    again = prepare.prepare_images(data2, config, environ=pod1["env"])
    assert prepare.decodes() == before
    assert not again.made and again.path == staged
    assert [Path(p).relative_to(data2) for p, _ in again.files] == [
        Path(p).relative_to(pod1["data"]) for p, _ in pod1["copy"].files
    ]


def test_a_prepared_uri_that_is_not_an_s3_uri_is_refused_naming_the_variable(s3_env, tmp_path):
    done = run_sync(
        [
            "stage-in",
            "--manifest",
            "s3://training/manifests/x/0123456789abcdef.json",
            "--data-dir",
            str(tmp_path),
        ],
        {**s3_env, "KUBETRAIN_PREPARED_URI": "https://training/prepared/x/"},
    )
    assert done.returncode == 1
    assert "KUBETRAIN_PREPARED_URI" in done.stderr
