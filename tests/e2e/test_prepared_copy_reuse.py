"""The prepared image copy on the dev stack: made once per dataset version and reused by every later pod (a
replacement pod of the same try, the next run on the same data), and read in bounded memory.

Real parts throughout (the stack's S3, its Kubernetes API and kubelet, the trainer and sync images from the
checkout). What a pod decoded is counted by the trainer itself (``images decoded by this run: N`` in its log,
``prepared: {made, decoded}`` in metrics.json), never timed.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
from kubernetes import client, config

from include.devstack.kubeapi.cluster import memory_cgroup_usable
from include.devstack.stack import NAMESPACE, s3_client

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
FAST = {"KUBETRAIN_RETRY_DELAY_SECONDS": "1"}
DIGITS = 1797  # the generator's images (scikit-learn's digits)
PREPARED_URI = "KUBETRAIN_PREPARED_URI"


@pytest.fixture(scope="module")
def s3(devstack):
    return s3_client(devstack.env())


@pytest.fixture(scope="module")
def core(devstack) -> client.CoreV1Api:
    return client.CoreV1Api(
        config.new_client_from_config(config_file=devstack.env()["KUBETRAIN_ADMIN_KUBECONFIG"])
    )


def upload_digits(s3, tmp: Path, prefix: str, size: int, shifts: int = 1) -> str:
    """The digits as PNGs of ``size`` px (each at ``shifts`` positions), zipped by the project's generator,
    uploaded under ``prefix``."""
    path = tmp / "digits.zip"
    subprocess.run(
        [
            *(str(TRAINER_PYTHON), "-m", "include.sample_data.digits", "--out", str(path)),
            *("--size", str(size), "--shifts", str(shifts)),
        ],
        cwd=REPO,
        check=True,
    )
    s3.upload_file(str(path), "datasets", f"{prefix}/digits.zip")
    return f"s3://datasets/{prefix}/"


def read_json(s3, key: str, bucket: str = "training"):
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def pods_of(core, dag_id: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(NAMESPACE, label_selector=f"kubetrain.io/dag-id={dag_id}").items


def env_of(pod: client.V1Pod, container: str, name: str) -> str | None:
    for c in [*(pod.spec.init_containers or []), *pod.spec.containers]:
        if c.name == container:
            return next((e.value for e in c.env or [] if e.name == name), None)
    return None


def prepared_manifests(s3, uri: str) -> list[str]:
    """Keys of the prepared copies' manifests under ``uri`` (``s3://training/prepared/<dataset>/<version>/``)."""
    prefix = uri.removeprefix("s3://training/")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="training", Prefix=prefix)
    return [o["Key"] for p in pages for o in p.get("Contents", []) if o["Key"].endswith("/manifest.json")]


class KillOnceUploaded(threading.Thread):
    """Deletes the running training pod (a preemption or a drain) once its prepared copy is complete in S3.

    The pod's own log is kept as it was when it was deleted.
    """

    def __init__(self, core, s3, dag_id: str) -> None:
        super().__init__(daemon=True)
        self.core, self.s3, self.dag_id = core, s3, dag_id
        self.stop = threading.Event()
        self.killed: str | None = None
        self.log = ""
        self.uri: str | None = None

    def run(self) -> None:
        while not self.stop.is_set() and self.killed is None:
            for pod in pods_of(self.core, self.dag_id):
                if pod.metadata.deletion_timestamp or pod.status.phase != "Running":
                    continue
                self.uri = env_of(pod, "checkpoint-sync", PREPARED_URI)
                if not self.uri or not prepared_manifests(self.s3, self.uri):
                    continue
                try:
                    log = self.core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, container="base")
                except client.ApiException:
                    continue
                self.core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)
                self.killed, self.log = pod.metadata.name, log
                return
            self.stop.wait(0.5)


def test_a_replaced_pod_and_the_next_run_reuse_the_prepared_copy(airflow, core, s3, tmp_path):
    dag_id = "train_image_classifier"
    dataset = upload_digits(s3, tmp_path, "e2e-prepared-reuse", 16)
    conf = {
        "dataset_uri": dataset,
        "model_name": "e2e-prepared-reuse",
        "epochs": 4,
        "image_size": 32,
        "batch_size": 64,
        "sync_interval": 1,
        "promote": "never",
    }
    killer = KillOnceUploaded(core, s3, dag_id)
    killer.start()
    try:
        run = airflow.dags_test(dag_id, conf, **FAST)
    finally:
        killer.stop.set()
        killer.join(10)
    assert run.returncode == 0 and run.state() == "success", run.output[-4000:]
    assert killer.killed, (
        "no pod was deleted after its prepared copy was uploaded: the test exercised nothing"
    )
    # the first pod made the copy (the sidecar uploaded it beside the snapshot) ...
    assert f"prepared {DIGITS} images (32 px, 3 channel(s))" in killer.log, killer.log[-3000:]
    assert f"images decoded by this run: {DIGITS}" in killer.log
    (manifest_key,) = prepared_manifests(s3, killer.uri)
    manifest = read_json(s3, manifest_key)
    assert sum(s["records"] for s in manifest["shards"]) == DIGITS
    uploaded = s3.head_object(Bucket="training", Key=manifest_key)["ETag"]
    # ... and the pod that replaced it (same try: a deletion from outside costs no retry) decoded nothing
    assert run.try_numbers("train") == 1
    prefix = run.xcom("train", key="run_uri").removeprefix("s3://training/")
    metrics = read_json(s3, f"{prefix}/output/metrics.json")
    assert metrics["prepared"] == {"made": False, "decoded": 0}, metrics.get("prepared")
    assert "using the prepared copy" in run.output and "images decoded by this run: 0" in run.output
    assert metrics["epochs"] == 4 and metrics["train_examples"] + metrics["val_examples"] == DIGITS

    # the next run on the same dataset version (other Params, so it trains) finds the copy in S3
    again = airflow.dags_test(dag_id, {**conf, "epochs": 1}, **FAST)
    assert again.returncode == 0 and again.state() == "success", again.output[-4000:]
    assert again.xcom("stage_dataset")["version"] == run.xcom("stage_dataset")["version"]
    prefix = again.xcom("train", key="run_uri").removeprefix("s3://training/")
    metrics = read_json(s3, f"{prefix}/output/metrics.json")
    assert metrics["prepared"] == {"made": False, "decoded": 0}, metrics.get("prepared")
    assert metrics["train_examples"] + metrics["val_examples"] == DIGITS
    # the copy in S3 is the first pod's: found, not uploaded again
    assert prepared_manifests(s3, killer.uri) == [manifest_key]
    assert s3.head_object(Bucket="training", Key=manifest_key)["ETag"] == uploaded


@pytest.mark.skipif(
    not memory_cgroup_usable(), reason="no memory cgroup here: the kubelet cannot enforce a limit"
)
def test_the_trainer_streams_a_dataset_larger_than_its_memory_limit(
    airflow, core, s3, stack_images, tmp_path
):
    """The classifier trains an epoch of a dataset whose decoded images (16,173 at 224 px: 2.3 GiB) outgrow its
    container's memory limit (1.75 GiB, enforced by the kubelet's cgroup: a pipeline that held the decoded
    split, in a cache or a whole-split shuffle buffer, would be OOM-killed). The trainer image runs as a
    custom container (the trainer's own DAG offers no Param for a CNN as small as this test needs); the
    container prints the limit its cgroup holds, then execs the trainer."""
    limit, size, images = 7 << 28, 224, DIGITS * 9
    dataset = upload_digits(s3, tmp_path, "e2e-memory-limit", 32, shifts=9)
    script = (
        "for f in /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes; do "
        '[ -r "$f" ] && echo "memory limit seen by the container: $(cat "$f")"; done; '
        f"exec python -m trainer.image_classifier --image-size {size} --filters 2 --batch-size 64 --epochs 1"
    )
    conf = {
        "dataset_uri": dataset,
        "model_name": "e2e-memory-limit",
        "image": stack_images["trainer"].reference,
        "command": ["sh", "-c"],
        "args": [script],
        "cpu": "2",
        "memory": "1792Mi",
        "data_size": "4Gi",
        "promote": "never",
        "metrics_required": True,
    }
    run = airflow.dags_test("train_custom_container", conf, **FAST)
    assert run.returncode == 0 and run.state() == "success", run.output[-4000:]
    assert f"memory limit seen by the container: {limit}" in run.output, run.output[-4000:]
    prefix = run.xcom("train", key="run_uri").removeprefix("s3://training/")
    metrics = read_json(s3, f"{prefix}/output/metrics.json")
    assert metrics["prepared"] == {"made": True, "decoded": images}, metrics.get("prepared")
    assert metrics["epochs"] == 1 and metrics["train_examples"] + metrics["val_examples"] == images
    decoded = images * size * size * 3
    assert decoded > limit * 1.25, decoded  # the dataset, decoded, is well over the limit ...
    assert 0 < metrics["peak_rss_bytes"] < limit, metrics["peak_rss_bytes"]  # ... the trainer stayed under it
