"""Train-once fingerprints: a finished training is not repeated for the same data, Params and image."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowSkipException
from structlog.testing import capture_logs

from kubetrain.operators.dedupe import RecordTrainingOperator, SkipIfTrainedOperator, fingerprint
from tests.plugins.imagebuild.support import push_busybox_base, start_registry

IMAGE = "registry.example/kubetrain/trainer@sha256:" + "a" * 64


def test_fingerprint_ignores_non_training_params_only():
    base = {
        "epochs": 3,
        "batch_size": 64,
        "force": False,
        "experiment": "a",
        "promote": "always",
        "image": None,
    }
    same = {
        **base,
        "force": True,
        "experiment": "b",
        "promote": "never",
        "image": "trainer:latest",
        "node_selector": {"a": "b"},
    }
    version = "0123456789abcdef"
    assert fingerprint("d", version, base, IMAGE) == fingerprint("d", version, same, IMAGE)
    assert fingerprint("d", version, base, IMAGE) != fingerprint("d", version, {**base, "epochs": 4}, IMAGE)
    assert fingerprint("d", version, base, IMAGE) != fingerprint("d", "fedcba9876543210", base, IMAGE)
    assert fingerprint("d", version, base, IMAGE) != fingerprint("e", version, base, IMAGE)
    # Only the digest counts: the same image under another name is the same code; another digest is not.
    renamed = "mirror.example/ml/trainer@sha256:" + "a" * 64
    assert fingerprint("d", version, base, IMAGE) == fingerprint("d", version, base, renamed)
    assert fingerprint("d", version, base, IMAGE) != fingerprint(
        "d", version, base, IMAGE.replace("a" * 64, "b" * 64)
    )


def test_fingerprint_needs_a_version_and_a_digest():
    with pytest.raises(ValueError, match="dataset version '' is empty"):
        fingerprint("d", "", {}, IMAGE)
    with pytest.raises(
        ValueError, match="image 'registry.example/kubetrain/trainer:latest' carries no digest"
    ):
        fingerprint("d", "0123456789abcdef", {}, "registry.example/kubetrain/trainer:latest")


def _context(params: dict, run_id: str = "manual__1"):
    return {"ti": SimpleNamespace(dag_id="train_x", map_index=-1), "params": params, "run_id": run_id}


@pytest.fixture
def registry(tmp_path, client, monkeypatch):
    """A registry that the deployment's settings and registry connection point at."""
    reg = start_registry(tmp_path / "registry")
    for name, value in reg.conn_env("kubetrain_registry_default").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KUBETRAIN_REGISTRY", reg.host)
    for name in ("KUBETRAIN_TRAINER_IMAGE", "AIRFLOW_VAR_KUBETRAIN_TRAINER_IMAGE"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield reg
    finally:
        reg.stop()


def test_same_data_params_and_image_is_skipped_and_a_new_image_trains_again(registry, client, tmp_path):
    first = push_busybox_base(registry.client(), "kubetrain/trainer", "latest", tmp_path / "v1")
    version = os.urandom(8).hex()
    params = {"epochs": 3, "force": False, "image": None}
    check = SkipIfTrainedOperator(task_id="check_new", dataset_version=version)
    found = check.execute(_context(params))
    assert found["image"] == f"{registry.host}/kubetrain/trainer@{first}"
    assert found["marker"].startswith("s3://training/trained/train_x/")

    promotion = {"model_uri": "s3://training/models/m/v1/", "model_version": "v1", "promoted": True}
    RecordTrainingOperator(
        task_id="record",
        fingerprint=found["fingerprint"],
        dataset_version=version,
        image=found["image"],
        promotion=promotion,
    ).execute(_context(params))
    bucket, _, key = found["marker"][len("s3://") :].partition("/")
    record = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert record["run_id"] == "manual__1" and record["dataset_version"] == version
    assert record["image"] == found["image"] and record["model_version"] == "v1"

    with (
        capture_logs() as logged,
        pytest.raises(AirflowSkipException, match=f"already trained on dataset version {version}.*manual__1"),
    ):
        check.execute(_context(params, run_id="scheduled__2"))
    # the task log says why (Airflow logs the skip, not its message)
    assert [
        e["event"] for e in logged if e["log_level"] == "info" and e["event"].startswith("Skipping: ")
    ] == [
        f"Skipping: already trained on dataset version {version} with these parameters and image "
        f"{found['image']} in run manual__1 (finished {record['finished_at']}); trigger with force=true "
        "to train again"
    ], logged
    # other Params, or force, train again
    assert (
        check.execute(_context({**params, "epochs": 4}, run_id="scheduled__3"))["fingerprint"]
        != found["fingerprint"]
    )
    assert (
        check.execute(_context({**params, "force": True}, run_id="manual__4"))["fingerprint"]
        == found["fingerprint"]
    )

    # A newly published trainer image (the build DAG moved `latest`) is new code: it trains again.
    second = push_busybox_base(
        registry.client(), "kubetrain/trainer", "latest", tmp_path / "v2", extra_layers=[_layer(tmp_path)]
    )
    assert second != first
    again = check.execute(_context(params, run_id="scheduled__5"))
    assert again["image"] == f"{registry.host}/kubetrain/trainer@{second}"
    assert again["fingerprint"] != found["fingerprint"]


def _layer(tmp_path):
    from kubetrain.imagebuild.layer import write_layer
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP

    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('v2')\n")
    return write_layer(code, tmp_path / "code.tar.gz").blob(OCI_LAYER_GZIP)
