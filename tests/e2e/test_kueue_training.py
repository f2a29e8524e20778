"""A training run on a shared cluster, end to end through `airflow dags test`: Kueue (the dev stack's
stand-in, one GPU of quota in LocalQueue 'training') preempts the low-priority run for a high-priority
workload; the run checkpoints on SIGTERM, waits re-queued, resumes at its checkpointed step once it is
admitted again, and ends in success with one preemption and no retry used. Real TensorFlow on the
digits data."""

from __future__ import annotations

import pytest
from kueue_preemption import preempting

# the module's fixtures: S3, the admin's CoreV1Api, the digits dataset in S3
from test_training_dags import FAST, assert_no_pods_left, core, digits, read_json, s3  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def checkpointed_an_epoch(log: str) -> bool:
    """The trainer has ended an epoch and written its checkpoint: preempt it now."""
    return "checkpoint ckpt-" in log and "end of epoch" in log


def test_a_preempted_low_priority_run_resumes_at_its_checkpoint_without_a_retry(airflow, core, s3, digits):  # noqa: F811
    dag_id = "train_image_classifier"
    conf = {
        "dataset_uri": digits,
        "model_name": "e2e-kueue",
        "epochs": 5,
        "image_size": 32,
        "batch_size": 64,
        "sync_interval": 2,
        "gpus": 1,
        "queue": "training",
        "priority": "low",
    }
    with preempting(core, dag_id, ready=checkpointed_an_epoch) as seen:
        run = airflow.dags_test(dag_id, conf, **FAST)
    assert "preempted" in seen, "the run was never preempted: the test did not exercise Kueue"
    assert run.returncode == 0 and run.state() == "success", run.output[-4000:]
    assert run.task_states()["train"] == "success" and run.task_states()["record"] == "success"
    assert run.try_numbers("train") == 1, "the preemption cost a retry"
    # the replacement waited in the queue behind the high-priority workload before it was admitted
    assert seen.get("requeued"), seen
    notes = run.xcom("train", key="notes")
    assert any(f"pod {seen['preempted']} was ended from outside" in n for n in notes), notes

    prefix = run.xcom("train", key="run_uri").removeprefix("s3://training/")
    metrics = read_json(s3, f"{prefix}/output/metrics.json")
    record = read_json(s3, f"{prefix}/run-record.json")
    disruptions = record["disruptions"]
    assert disruptions["preemptions"] == 1, disruptions
    assert disruptions["queued_s"] > 0, disruptions
    (interrupted,) = disruptions["interruptions"]
    assert interrupted["pod"] == seen["preempted"]
    # the new pod resumed exactly where the preempted one's last sync pass left it
    assert interrupted["resume_step"] == metrics["resumed_from_step"] > 0, (interrupted, metrics)
    # the trainer checkpointed on SIGTERM (exit 75) whenever the task saw its exit code
    assert interrupted["exit_code"] in (75, None), interrupted
    if interrupted["exit_code"] == 75:
        assert interrupted["steps_lost"] == 0 and disruptions["steps_lost"] == 0, disruptions
    assert metrics["epochs"] == 5
    md = s3.get_object(Bucket="training", Key=f"{prefix}/report/report.md")["Body"].read().decode()
    assert "| Preemptions | 1 (no retry used; resumed at step " in md, md[:3000]
    assert_no_pods_left(core, dag_id)
