"""Run records as the record step writes them (their documents), for the Training page's tests."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

from kubetrain.run_record import RunFacts, build_record
from kubetrain.s3_layout import S3Layout

T0 = datetime(2026, 3, 2, 8, 0, tzinfo=UTC)
IMAGE = "registry.example/kubetrain/trainer@sha256:" + "c" * 64


def history_csv(losses: list[float], accuracies: list[float]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        ["epoch", "step", "loss", "accuracy", "val_loss", "val_accuracy", "learning_rate", "wall_time_s"]
    )
    for epoch, (loss, acc) in enumerate(zip(losses, accuracies, strict=True), start=1):
        writer.writerow([epoch, epoch * 10, loss, acc, loss * 1.1, acc * 0.95, 0.001, epoch * 2.5])
    return out.getvalue().encode()


def make_record(
    *,
    dag_id: str = "train_image_classifier",
    run_id: str,
    model: str = "digits",
    when: datetime = T0,
    value: float | None = 0.9,
    status: str = "success",
    version: str = "0123456789abcdef",
    trial: str | None = None,
    promoted: bool = False,
    model_version: str | None = None,
    hyper: dict | None = None,
    monitor: str = "val_accuracy",
    mode: str = "max",
    sweep: dict | None = None,
) -> dict:
    layout = S3Layout()
    metrics = {
        "trainer": "image_classifier",
        "monitor": monitor,
        "monitor_mode": mode,
        "final": {"loss": 0.3, "accuracy": 0.91, "val_loss": 0.35, monitor: value},
        "best": {monitor: value, "epoch": 3},
        "epochs": 3,
        "steps": 30,
        "resumed_from_step": 0,
        "wall_time_s": 12.5,
        "examples_per_s": 800.0,
    }
    promotion = {
        "promoted": promoted,
        "model_version": model_version,
        "model_uri": f"s3://training/models/{model}/{model_version}/",
    }
    facts = RunFacts(
        dag_id=dag_id,
        run_id=run_id,
        run=layout.run(dag_id, run_id, trial),
        run_time=when,
        model=model,
        status=status,
        trial=trial,
        params={"epochs": 3, "batch_size": 64, "promote": "if_better"},
        metrics=metrics if status == "success" else None,
        run_params={
            "trainer": "image_classifier",
            "hyperparameters": hyper or {"epochs": 3, "batch_size": 64, "learning_rate": 0.001},
            "code_version": "abc123",
        },
        dataset_uri="s3://datasets/digits/",
        dataset_version=version,
        image=IMAGE,
        promote_rule="if_better",
        promotion=promotion if status == "success" else None,
        report={"report_uri": f"s3://training/runs/{dag_id}/x/report/report.html"}
        if status == "success"
        else None,
        failure={"task": "train", "error": "PodFailed: OOMKilled"} if status == "failed" else None,
        sweep=sweep,
    )
    return build_record(facts).to_dict()
