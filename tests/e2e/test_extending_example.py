"""The DAG of docs/extending.md runs as the guide says, on the dev stack, so the guide cannot rot.

The guide's image is built from its Dockerfile (docs/examples/keras_model/Dockerfile: the Keras
script in /app on TensorFlow's image, which the dev stack's registry mirror serves) with buildah
and pushed to the dev stack's registry, as the guide's two commands do. A few images in class
folders are uploaded to the example's dataset prefix, and `airflow dags test` runs
example_keras_model from dags/: stage, check, train (the script, unmodified, in the training pod
from that image), report, promote, record.
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


def publish_example_image(registry: str, mirror: str) -> str:
    """The guide's image, built from its Dockerfile and pushed to the dev stack's registry."""
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import BuildRequest, PushTarget

    builder = BuildahBuilder(
        REPO / ".tools" / "buildah",
        storage_driver="auto",
        mirror=mirror,
        mirror_insecure=True,
        log=lambda line: None,
    )
    target = PushTarget(registry, "examples/keras-model", insecure=True)
    request = BuildRequest(
        context=EXAMPLE, repository="examples/keras-model", tags=("1",), dockerfile="Dockerfile"
    )
    local = builder.build(request, target, local_tag="keras-model")
    builder.push(local, target, "1")
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
        [
            str(TRAINER_PYTHON),
            "-m",
            "include.sample_data.digits",
            "--out",
            str(archive),
            "--size",
            "16",
            "--per-class",
            "16",
            "--seed",
            "7",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    s3.upload_file(str(archive), "datasets", "keras-digits/digits.zip")
    image = publish_example_image(env["KUBETRAIN_REGISTRY"], env["KUBETRAIN_REGISTRY_MIRROR"])

    run = airflow.dags_test(
        DAG_ID, {"image": image, "epochs": 2, "force": True}, KUBETRAIN_RETRY_DELAY_SECONDS="1"
    )
    assert run.returncode == 0 and run.state() == "success", run.output[-4000:]
    assert run.task_states() == dict.fromkeys(
        ["stage_dataset", "check_new", "train", "report", "promote", "record"], "success"
    )

    # The unmodified script trained in the pod (Keras' own progress lines in the task log) ...
    assert "[base] Epoch 2/2" in run.output and "[base] trained 2 epochs: val_accuracy" in run.output
    # ... on the image the run names by digest ...
    assert run.xcom("check_new")["image"].startswith(
        f"{env['KUBETRAIN_REGISTRY']}/examples/keras-model@sha256:"
    )
    # ... and the platform did the rest: report, promotion, the train-once record.
    report = run.xcom("report")
    assert (report["trainer"], report["monitor"], report["epochs"]) == ("keras_model", "val_accuracy", 2)
    promoted = run.xcom("promote")
    assert promoted["promoted"] is True, promoted
    latest = json.loads(s3.get_object(Bucket="training", Key=f"models/{MODEL}/latest")["Body"].read())
    model = s3.head_object(Bucket="training", Key=f"models/{MODEL}/{latest['version']}/model.keras")
    assert model["ContentLength"] > 1000
    assert run.xcom("record")["marker"].startswith("s3://training/")
