"""Run records seeded into the test S3 server, as the record step writes them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from training_records import T0, history_csv, make_record

from kubetrain.s3_layout import S3Layout


@pytest.fixture
def seeded(store, client):
    """Eight runs of two models and two DAGs (one failed), with a history.csv each and one promoted version."""
    import uuid

    tag = uuid.uuid4().hex[:6]
    runs = []
    specs = [
        # (dag, model, minutes after T0, value, status, dataset version)
        ("train_image_classifier", f"digits-{tag}", 0, 0.80, "success", "0000000000000001"),
        ("train_image_classifier", f"digits-{tag}", 10, 0.95, "success", "0000000000000001"),
        ("train_image_classifier", f"digits-{tag}", 20, 0.90, "success", "0000000000000002"),
        ("train_image_classifier", f"digits-{tag}", 30, None, "failed", "0000000000000002"),
        ("train_custom_container", f"digits-{tag}", 40, 0.85, "success", "0000000000000002"),
        ("train_dialogue_transformer", f"chat-{tag}", 5, 0.40, "success", "00000000000000aa"),
        ("train_dialogue_transformer", f"chat-{tag}", 15, 0.55, "success", "00000000000000aa"),
        ("secret_dag", f"digits-{tag}", 50, 0.99, "success", "0000000000000001"),
    ]
    for index, (dag, model, minutes, value, status, version) in enumerate(specs):
        run_id = f"manual__{tag}-{index}"
        promoted = index == 1
        record = make_record(
            dag_id=dag,
            run_id=run_id,
            model=model,
            when=T0 + timedelta(minutes=minutes),
            value=value,
            status=status,
            version=version,
            promoted=promoted,
            model_version="v1" if promoted else None,
            hyper={"epochs": 3, "batch_size": 32 * (1 + index % 2), "learning_rate": 0.001},
        )
        store.runs.write(record)
        run = S3Layout().run(dag, run_id)
        client.put_object(
            Bucket="training",
            Key=run.key("output", "history.csv"),
            Body=history_csv([1.0, 0.6, 0.4 + index / 100], [0.5, 0.7, 0.8 + index / 100]),
        )
        runs.append(record)
    model = f"digits-{tag}"
    pointer = {
        "kind": "kubetrain/model-pointer",
        "format_version": 1,
        "model": model,
        "version": "v1",
        "uri": f"s3://training/models/{model}/v1/",
        "run_uri": runs[1]["run_uri"],
        "promoted_at": "2026-03-02T08:12:00Z",
    }
    client.put_object(Bucket="training", Key=f"models/{model}/latest", Body=json.dumps(pointer).encode())
    return {"tag": tag, "digits": model, "chat": f"chat-{tag}", "runs": runs}
