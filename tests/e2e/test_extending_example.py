"""The DAG of docs/extending.md runs as the guide says, on the dev stack, so the guide cannot rot.

The guide's image (docs/examples/keras_model/Dockerfile: the Keras script in /app on TensorFlow's
image) is published to the dev stack's registry as one layer holding the script, the way a
build would leave it there; the dev stack runs it in the trainer environment, from the script's
folder (include/devstack/images.json). A few images in class folders are uploaded to the
example's dataset prefix, and `airflow dags test` runs example_keras_model from dags/: stage,
check, train (the script, unmodified, in the training pod), report, promote, record.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import boto3
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
EXAMPLE = REPO / "docs" / "examples" / "keras_model"
DAG_ID = "example_keras_model"
MODEL = "keras-digits"


def publish_example_image(registry: str, work: Path) -> str:
    """The guide's image in the dev stack's registry: /app/train.py, WORKDIR /app, user 10001."""
    from kubetrain.imagebuild.layer import write_layer
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, RegistryClient, push_image

    layer = write_layer(EXAMPLE, work / "keras-model.tar.gz", dest="/app", excludes=("Dockerfile", "__pycache__"))
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"User": "10001", "WorkingDir": "/app", "Cmd": ["python", "train.py"]},
    }
    with RegistryClient(registry, insecure=True, timeout=30) as client:
        push_image(client, "examples/keras-model", "1", [layer.blob(OCI_LAYER_GZIP)], config)
    return f"{registry}/examples/keras-model:1"


def test_the_guides_dag_trains_reports_and_promotes_its_keras_script(airflow, devstack, tmp_path):
    env = devstack.env()
    s3 = boto3.client(
        "s3",
        endpoint_url=env["KUBETRAIN_S3_ENDPOINT"],
        aws_access_key_id=env["KUBETRAIN_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["KUBETRAIN_S3_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    archive = tmp_path / "digits.zip"
    subprocess.run(
        [str(TRAINER_PYTHON), "-m", "include.sample_data.digits", "--out", str(archive), "--size", "16",
         "--per-class", "16", "--seed", "7"],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    s3.upload_file(str(archive), "datasets", "keras-digits/digits.zip")
    image = publish_example_image(env["KUBETRAIN_REGISTRY"], tmp_path)

    run = airflow.dags_test(DAG_ID, {"image": image, "epochs": 2, "force": True}, KUBETRAIN_RETRY_DELAY_SECONDS="1")
    assert run.returncode == 0 and run.state() == "success", run.output[-4000:]
    assert run.task_states() == dict.fromkeys(["stage_dataset", "check_new", "train", "report", "promote", "record"], "success")

    # The unmodified script trained in the pod (Keras' own progress lines in the task log) ...
    assert "[base] Epoch 2/2" in run.output and "[base] trained 2 epochs: val_accuracy" in run.output
    # ... on the image the run names by digest ...
    assert run.xcom("check_new")["image"].startswith(f"{env['KUBETRAIN_REGISTRY']}/examples/keras-model@sha256:")
    # ... and the platform did the rest: report, promotion, the train-once record.
    report = run.xcom("report")
    assert (report["trainer"], report["monitor"], report["epochs"]) == ("keras_model", "val_accuracy", 2)
    promoted = run.xcom("promote")
    assert promoted["promoted"] is True, promoted
    latest = json.loads(s3.get_object(Bucket="training", Key=f"models/{MODEL}/latest")["Body"].read())
    model = s3.head_object(Bucket="training", Key=f"models/{MODEL}/{latest['version']}/model.keras")
    assert model["ContentLength"] > 1000
    assert run.xcom("record")["marker"].startswith("s3://training/")
