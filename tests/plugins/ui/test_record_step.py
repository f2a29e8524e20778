"""The pipeline's steps that write the Training page's data: promotion history, the run record, a failed run's record."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.operators.dedupe import RecordFailedRun, RecordTrainingOperator
from kubetrain.operators.promote import PromoteModelOperator
from kubetrain.s3_layout import S3Layout

RUN_AFTER = datetime(2026, 11, 22, 4, 0, tzinfo=UTC)
IMAGE = "registry.example/kubetrain/trainer@sha256:" + "d" * 64


class Run:
    """A finished run in S3: output files and the sidecar's final pass."""

    def __init__(
        self, client, dag_id: str, model: str, value: float, *, index: int = 0, metrics: bool = True
    ):
        self.client, self.dag_id, self.model = client, dag_id, model
        self.run_id = f"scheduled__2026-11-2{index}T04:00:00+00:00"
        self.run_after = RUN_AFTER + timedelta(days=index)
        self.location = S3Layout().run(dag_id, self.run_id)
        files = [self.upload("output", "model.keras", b"model %d" % index)]
        if metrics:
            doc = {
                "trainer": "image_classifier",
                "monitor": "val_accuracy",
                "monitor_mode": "max",
                "final": {"loss": 0.2, "val_accuracy": value},
                "best": {"val_accuracy": value, "epoch": 2},
                "epochs": 2,
                "steps": 20,
                "resumed_from_step": 10,
                "wall_time_s": 5.0,
            }
            files.append(self.upload("output", "metrics.json", json.dumps(doc).encode()))
            params = {
                "trainer": "image_classifier",
                "hyperparameters": {"epochs": 2, "learning_rate": 0.001},
                "dataset_version": "00000000000000ab",
                "image": IMAGE,
                "code_version": "deadbeef",
            }
            files.append(self.upload("output", "params.json", json.dumps(params).encode()))
        manifest = {
            "kind": "kubetrain/sync-pass",
            "format_version": 1,
            "pass": 1,
            "final": True,
            "complete": True,
            "started_at": "x",
            "finished_at": "x",
            "pod": "train-x",
            "files": files,
            "errors": [],
        }
        client.put_object(
            Bucket="training", Key=self.location.pass_key(1), Body=json.dumps(manifest).encode()
        )

    def upload(self, area, path, body):
        key = self.location.key(area, path)
        self.client.put_object(Bucket="training", Key=key, Body=body)
        return {
            "area": area,
            "path": path,
            "key": key,
            "size": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }

    def context(self, task_id: str, params: dict | None = None, **extra) -> dict:
        ti = SimpleNamespace(dag_id=self.dag_id, task_id=task_id, map_index=-1, try_number=1, **extra)
        return {
            "ti": ti,
            "run_id": self.run_id,
            "dag_run": SimpleNamespace(run_after=self.run_after),
            "params": {
                "model_name": self.model,
                "promote": "if_better",
                "dataset_uri": "s3://datasets/digits/",
                "epochs": 2,
                **(params or {}),
            },
        }


def promote(run: Run, rule: str, is_better: bool | None):
    op = PromoteModelOperator(
        task_id="promote",
        model=run.model,
        promote=rule,
        is_better=is_better,
        final_pass_timeout=0,
        keep_checkpoints=None,
    )
    return op.execute(run.context("promote"))


def test_promotions_are_kept_newest_first_with_their_rule_and_reason(client, store):
    dag, model = f"train_{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    first, second = Run(client, dag, model, 0.90, index=1), Run(client, dag, model, 0.95, index=2)
    one = promote(first, "always", None)
    two = promote(second, "if_better", True)
    assert one["reason"] == "promoted: promote=always"
    assert (
        two["reason"]
        == f"promoted: promote=if_better, val_accuracy 0.95 > 0.9 of version {one['model_version']}"
    )
    assert two["previous_version"] == one["model_version"]
    promote(second, "if_better", True)  # a retried task promotes the same version again
    history = store.promotions.newest(model)
    assert [p["version"] for p in history] == [two["model_version"], one["model_version"]]
    assert [p["rule"] for p in history] == ["if_better", "always"] and history[0]["run_id"] == second.run_id
    assert history[0]["previous"] == {"version": one["model_version"], "value": 0.9}
    assert promote(Run(client, dag, model, 0.5, index=3), "never", None)["promoted"] is False
    assert len(store.promotions.newest(model)) == 2


def test_the_record_step_writes_the_run_record(client, store):
    dag, model = f"train_{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    run = Run(client, dag, model, 0.91)
    report = {
        "report_uri": f"{run.location.uri}/report/report.html",
        "report_url": "/kubetrain/reports/x",
        "monitor": "val_accuracy",
        "monitor_mode": "max",
        "value": 0.91,
        "better_than_promoted": False,
        "promoted_metric": 0.93,
        "promoted_version": "20261101T040000Z-0a1b2c3d",
    }
    op = RecordTrainingOperator(
        task_id="record",
        fingerprint="abcdef0123456789",
        dataset_version="00000000000000ab",
        image=IMAGE,
        promotion={"promoted": False, "model_uri": None, "model_version": None},
        report=report,
        dataset_manifest="s3://training/manifests/digits/00000000000000ab.json",
    )
    result = op.execute(run.context("record"))
    assert result["run_record"] == f"{run.location.uri}/run-record.json" and result["mlflow_run_id"] is None
    record = store.runs.get(run.location)
    assert (
        record["status"] == "success"
        and record["model"] == model
        and record["run_time"] == "2026-11-22T04:00:00Z"
    )
    assert record["dataset"] == {
        "uri": "s3://datasets/digits/",
        "version": "00000000000000ab",
        "manifest_uri": "s3://training/manifests/digits/00000000000000ab.json",
    }
    assert record["image"]["digest"] == "sha256:" + "d" * 64 and record["code_version"] == "deadbeef"
    assert (
        record["hyperparameters"] == {"epochs": 2, "learning_rate": 0.001} and record["params"]["epochs"] == 2
    )
    assert (record["epochs"], record["steps"], record["resumed_from_step"]) == (2, 20, 10)
    assert record["promotion"]["reason"] == (
        "not promoted: promote=if_better, lost to version 20261101T040000Z-0a1b2c3d (val_accuracy 0.93; this run 0.91)"
    )
    assert record["report_uri"] == report["report_uri"] and record["fingerprint"] == "abcdef0123456789"
    listed = client.list_objects_v2(Bucket="training", Prefix=f"index/{model}/")["Contents"]
    assert len(listed) == 1 and listed[0]["Key"].endswith("~00000000000000ab~success.json")


def test_a_failed_run_is_recorded_by_the_failure_callback(client, store):
    dag, model = f"train_{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    run = Run(client, dag, model, 0.0, metrics=False)
    pulled = {
        ("stage_dataset", "version"): "00000000000000cd",
        ("check_new", "image"): IMAGE,
        ("check_new", "fingerprint"): "0123456789abcdef",
    }
    context = run.context("train", xcom_pull=lambda task_ids, key: pulled.get((task_ids, key)))
    context["exception"] = RuntimeError("pod train-x failed: OOMKilled")
    record = RecordFailedRun().record(context, SimpleNamespace(info=print, warning=print))
    assert record["status"] == "failed" and record["failure"] == {
        "task": "train",
        "error": "RuntimeError: pod train-x failed: OOMKilled",
    }
    assert record["dataset"]["version"] == "00000000000000cd" and record["metrics"]["value"] is None
    assert record["promotion"] == {
        "rule": "if_better",
        "promoted": False,
        "version": None,
        "model_uri": None,
        "reason": "not promoted: the run failed in train",
        "compared_with": None,
    }
    assert record["resumed_from_step"] == 0 and record["resumed_from_source"] == "sync-passes"
    assert store.runs.get(run.location) == record
    assert not client.list_objects_v2(Bucket="training", Prefix=f"trained/{dag}/").get(
        "KeyCount"
    )  # no train-once marker


def test_the_failure_callback_never_raises(client):
    broken = {
        "ti": SimpleNamespace(dag_id="d", task_id="train", map_index=-1),
        "params": {"model_name": "Not A Name"},
        "run_id": "r",
    }
    RecordFailedRun()(broken)  # logged, not raised: the task's own failure is what counts


@pytest.mark.parametrize("model", [None, ""])
def test_no_model_no_record(client, model):
    run = Run(client, f"train_{uuid.uuid4().hex[:6]}", "x", 0.5)
    op = RecordTrainingOperator(
        task_id="record", fingerprint="abcdef0123456789", dataset_version="00000000000000ab", image=IMAGE
    )
    context = run.context("record")
    context["params"]["model_name"] = model
    assert op.execute(context)["run_record"] is None
