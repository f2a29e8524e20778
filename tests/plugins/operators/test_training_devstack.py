"""The four operators in a row on the dev stack: a real pod with the pod-side sync tool.

stage -> train (deferred, as by default) -> report -> promote (verify, promote, prune), with a small
script as the training container. It checks the contract between the pod this side builds
and what the stage-in and checkpoint-sync containers do with it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import TaskDeferred
from airflow.sdk.execution_time.context import OutletEventAccessors

from include.devstack.stack import NAMESPACE, s3_client
from kubetrain.operators.promote import PromoteModelOperator
from kubetrain.operators.report import ReportOperator
from kubetrain.operators.stage import StageDatasetOperator
from kubetrain.operators.training import TrainingPodOperator

TRAIN_SCRIPT = r"""
import json, os, pathlib, time
data, out, ckpt = (pathlib.Path(os.environ[k]) for k in ("DATA_DIR", "OUTPUT_DIR", "CHECKPOINT_DIR"))
rows = (data / "table.csv").read_text().splitlines()
for n in (1, 2, 3):
    (ckpt / f"ckpt-{n}.index").write_bytes(b"i" * n)
    (ckpt / f"ckpt-{n}.data-00000-of-00001").write_bytes(b"d" * 10 * n)
(out / "metrics.json").write_text(json.dumps({
    "trainer": "script", "task": "classification", "monitor": "val_accuracy", "monitor_mode": "max",
    "final": {"loss": 0.4, "val_accuracy": 0.75}, "best": {"val_accuracy": 0.75, "epoch": 2},
    "epochs": 2, "steps": len(rows)}))
(out / "history.csv").write_text("epoch,step,loss,accuracy,val_loss,val_accuracy,learning_rate,wall_time_s\n"
                                 "1,1,0.9,0.5,0.8,0.6,0.001,1\n2,2,0.4,0.8,0.5,0.75,0.001,2\n")
(out / "model.keras").write_bytes(b"weights of " + os.environ["KUBETRAIN_DATASET_VERSION"].encode())
print("trained on", len(rows), "rows", flush=True)
"""


class TaskInstance:
    def __init__(self, dag_id: str, task_id: str) -> None:
        self.dag_id, self.task_id, self.try_number, self.map_index = dag_id, task_id, 1, -1
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


def test_stage_train_report_promote_on_the_dev_stack(devstack, stack_images, monkeypatch):
    env = devstack.env()
    for name in ("AIRFLOW_CONN_AWS_DEFAULT", "KUBETRAIN_REGISTRY", "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT"):
        monkeypatch.setenv(name, env[name])
    images = {image.repository: image.digest for image in stack_images.values()}
    # In-process, the kubeconfig goes by the connection: the kubernetes client read $KUBECONFIG
    # when it was imported, before this test could set it.
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {
                "conn_type": "kubernetes",
                "extra": {"kube_config_path": env["KUBECONFIG"], "namespace": NAMESPACE},
            }
        ),
    )
    for name in (
        "KUBETRAIN_TRAINING_BUCKET",
        "AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET",
        "KUBETRAIN_S3_PUBLIC_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    s3 = s3_client(env)
    dataset = f"table-{uuid.uuid4().hex[:8]}"
    model = f"script-{uuid.uuid4().hex[:6]}"
    s3.put_object(Bucket="datasets", Key=f"{dataset}/table.csv", Body=b"a,b\n1,2\n3,4\n")

    staged = StageDatasetOperator(task_id="stage", source_uri=f"s3://datasets/{dataset}/").execute(
        {"outlet_events": OutletEventAccessors()}
    )

    with DAG(f"devstack_{uuid.uuid4().hex[:8]}", schedule=None) as dag:
        train = TrainingPodOperator(
            task_id="train",
            image=f"{env['KUBETRAIN_REGISTRY']}/kubetrain/trainer:latest-cpu",
            sync_image=f"{env['KUBETRAIN_REGISTRY']}/kubetrain/sync:latest",
            cmds=["python", "-c", TRAIN_SCRIPT],
            dataset_manifest=staged["manifest_uri"],
            dataset_version=staged["version"],
            s3_secret=env["KUBETRAIN_S3_SECRET"],
            sync_interval=2,
            sync_quiet=0,
            termination_grace_period=30,  # a sidecar that ignores SIGTERM fails the test in seconds
            cpu="500m",
            memory="1Gi",
            startup_check_interval_seconds=1,
            poll_interval=1,
        )
    ti = TaskInstance(dag.dag_id, "train")
    context = {
        "ti": ti,
        "run_id": "manual__devstack",
        "dag": dag,
        "dag_run": SimpleNamespace(run_after=datetime.now(UTC)),
    }
    with pytest.raises(TaskDeferred) as deferred:
        train.execute(context)

    async def first_event():
        async for event in deferred.value.trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "success", event
    getattr(train, deferred.value.method_name)(context, event)
    run_uri = ti.xcom["run_uri"]
    # The pod ran the images pinned to their digests at submit time.
    assert train.image == f"{env['KUBETRAIN_REGISTRY']}/kubetrain/trainer@{images['kubetrain/trainer']}"
    prefix = run_uri.removeprefix("s3://training/")

    report = ReportOperator(task_id="report", run_uri=run_uri, model=model).execute(context)
    assert report["better_than_promoted"] is True and report["value"] == 0.75 and report["steps"] == 3

    result = PromoteModelOperator(
        task_id="promote",
        run_uri=run_uri,
        model=model,
        promote="if_better",
        is_better=report["better_than_promoted"],
        keep_checkpoints=1,
    ).execute(context)

    # The sidecar's final pass listed the pod's files; the Airflow side verified, promoted and pruned them.
    assert result["promoted"] is True and result["pruned"] > 0
    latest = json.loads(s3.get_object(Bucket="training", Key=f"models/{model}/latest")["Body"].read())
    model_key = f"models/{model}/{latest['version']}/model.keras"
    assert (
        s3.get_object(Bucket="training", Key=model_key)["Body"].read()
        == b"weights of " + staged["version"].encode()
    )
    left = s3.list_objects_v2(Bucket="training", Prefix=f"{prefix}/checkpoints/").get("Contents", [])
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in left) == ["ckpt-3.data-00000-of-00001", "ckpt-3.index"]
    assert s3.head_object(Bucket="training", Key=f"{prefix}/report/report.html")["ContentLength"] > 1000
    pods = train.client.list_namespaced_pod(
        NAMESPACE, label_selector=f"kubetrain.io/dag-id={dag.dag_id}"
    ).items
    assert [p.metadata.name for p in pods if not p.metadata.deletion_timestamp] == []
