"""One trial: its record (typed, one assembly), the pod's state from the provider's callback, and the
records the trial step writes to S3 (the test server)."""

from __future__ import annotations

import inspect
import json
from datetime import UTC, datetime

import jsonschema
import pytest
from kubernetes.client import models as k8s

from kubetrain.sweep.records import (
    EARLY_STOP_RECORD,
    assemble_trial,
    summary,
    trial_marker_key,
    trial_outcome,
)
from kubetrain.sweep.trial import TrialPodCallbacks, TrialPodOperator, pod_state
from kubetrain_contract import EarlyStopRecord, RecordError
from kubetrain_contract.trial import TrialRecord

FINGERPRINT = "0123456789abcdef"
DECISION = EarlyStopRecord(
    rule="median",
    objective="val_accuracy",
    mode="max",
    start_step=2,
    min_trials=1,
    step=3,
    best=0.4,
    median=0.6,
    finished_trials=2,
    decided_at="2026-11-22T04:20:00.000000Z",
)

# A success record as the sweep wrote it before the record was typed: every later reader takes it.
OLD_SUCCESS = {
    "kind": "kubetrain/sweep-trial",
    "format_version": 1,
    "sweep": {
        "id": "s/r",
        "dag_id": "s",
        "run_id": "r",
        "uri": "s3://training/runs/s/r",
        "algorithm": "grid",
    },
    "trial": "1",
    "number": 1,
    "round": 0,
    "params": {"learning_rate": 0.01},
    "fingerprint": FINGERPRINT,
    "status": "success",
    "stopped_early": True,
    "early_stop": DECISION.to_dict(),
    "stop_requested": None,
    "early_stopping": {"rule": "median", "min_trials": 1, "start_step": 2},
    "objective": {"name": "val_accuracy", "mode": "max", "value": 0.4, "values": [0.2, 0.3, 0.4]},
    "final_metrics": None,
    "steps": 30,
    "epochs": None,
    "reports": 3,
    "wall_time_s": 12.5,
    "resumed_from_step": None,
    "exit_code": 79,
    "image": "registry.local/trainer@sha256:" + "a" * 64,
    "dataset_version": "v1",
    "arguments": ["--epochs=3"],
    "timing": {"task_started": "2026-11-22T04:00:00Z", "try_number": 1, "base": {"exit_code": 79}},
    "history": [{"step": 1, "val_accuracy": 0.2}, {"step": 2, "val_accuracy": 0.3}],
    "run_uri": "s3://training/runs/s/r/trials/1",
    "report_uri": None,
    "report_url": None,
    "reused_from": None,
    "finished_at": "2026-11-22T04:21:00Z",
}
# A failed record as the sweep wrote it: fewer fields.
OLD_FAILED = {
    "kind": "kubetrain/sweep-trial",
    "format_version": 1,
    "sweep": OLD_SUCCESS["sweep"],
    "trial": "2",
    "number": 2,
    "round": 0,
    "params": {"learning_rate": 0.1},
    "fingerprint": FINGERPRINT,
    "status": "failed",
    "stopped_early": False,
    "error": "the trainer exited with 65 (bad data); a retry would end the same",
    "objective": {"name": "val_accuracy", "mode": "max", "value": None, "values": []},
    "exit_code": 65,
    "timing": {"pod_created": None},
    "run_uri": "s3://training/runs/s/r/trials/2",
    "finished_at": "2026-11-22T04:22:00Z",
}


def test_the_records_the_sweep_wrote_before_read_and_a_success_writes_back_the_same_document():
    record = TrialRecord.from_dict(OLD_SUCCESS)
    assert record.early_stop == DECISION and record.objective.values == [0.2, 0.3, 0.4]
    new = {"error": None, "trainer_seconds": None, "accelerator": None, "accelerators": None}
    # every field is written, null where unset (the compute fields came later)
    assert record.to_dict() == OLD_SUCCESS | new | {"accelerator_hours": None}
    failed = TrialRecord.from_dict(OLD_FAILED)
    assert not failed.succeeded and failed.exit_code == 65 and failed.history == []
    assert {k: v for k, v in failed.to_dict().items() if k in OLD_FAILED} == OLD_FAILED


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"kind": "kubetrain/run"}, "unknown kind"),
        ({"status": "done"}, "'status'"),
        ({"number": "1"}, "'number'"),
        ({"objective": {"value": "high"}}, "'objective.value'"),
        ({"early_stop": {"rule": "median"}}, "'early_stop' is"),
    ],
)
def test_a_document_that_is_no_trial_record_is_refused_naming_the_field(change, named):
    with pytest.raises(RecordError, match=named):
        TrialRecord.from_dict(OLD_SUCCESS | change, where="trials/1.json")


@pytest.mark.parametrize(
    ("exit_code", "metrics", "stopped", "requested"),
    [
        (79, None, True, False),  # the sidecar stopped the trainer
        (0, {"stopped_early": {"by": "stop file"}}, True, False),  # the trainer saw the stop file
        (0, {"final": {"val_accuracy": 0.9}}, False, True),  # it finished before it saw it
    ],
)
def test_an_early_stop_decision_marks_the_trial_only_when_the_trainer_obeyed_it(
    exit_code, metrics, stopped, requested
):
    rows = [{"step": 1, "val_accuracy": 0.2}, {"step": 2, "val_accuracy": 0.5}, {"step": 3}]
    outcome = trial_outcome(metrics, rows, DECISION, exit_code, "val_accuracy", "max")
    assert outcome["stopped_early"] is stopped
    assert (outcome["early_stop"] is DECISION) is stopped
    assert (outcome["stop_requested"] is DECISION) is requested
    assert outcome["values"] == [0.2, 0.5] and outcome["reports"] == 3 and outcome["steps"] == 3


def test_the_outcome_takes_metrics_json_first_and_refuses_what_is_no_number():
    metrics = {"final": {"val_loss": 0.3}, "steps": 40, "epochs": "three", "wall_time_s": True}
    rows = [{"val_loss": 0.5}, {"val_loss": 0.4}]
    outcome = trial_outcome(metrics, rows, None, 0, "val_loss", "min")
    assert outcome["value"] == 0.3 and outcome["steps"] == 40
    assert outcome["epochs"] is None and outcome["wall_time_s"] is None
    assert trial_outcome(None, rows, None, 0, "val_loss", "min")["value"] == 0.4


def test_one_assembly_for_a_failed_a_reused_and_a_stand_in_trial():
    settings = {"id": "s/r2", "dag_id": "s", "run_id": "r2", "uri": "s3://training/runs/s/r2"}
    settings |= {"algorithm": "tpe", "objective": {"metric": "val_accuracy", "mode": "max"}}
    failed = assemble_trial(
        settings, 4, round=1, params={"lr": 1}, fingerprint=None, run_uri="u", finished_at="t", error="boom"
    )
    assert (failed.status, failed.error, failed.trial, failed.sweep.algorithm) == (
        "failed",
        "boom",
        "4",
        "tpe",
    )
    assert failed.objective.name == "val_accuracy" and failed.objective.value is None
    marker = TrialRecord.from_dict(OLD_SUCCESS)
    reused = assemble_trial(
        settings,
        7,
        round=2,
        params={"learning_rate": 0.01},
        fingerprint=marker.fingerprint,
        run_uri=marker.run_uri,
        finished_at="t",
        value=0.4,
        values=[0.4],
        outcome=marker,
    )
    # this sweep's trial, the other one's outcome
    assert (reused.number, reused.round, reused.sweep.id) == (7, 2, "s/r2")
    assert (
        reused.history == marker.history and reused.early_stop == marker.early_stop and reused.exit_code == 79
    )
    stand_in = assemble_trial(
        None, 3, round=0, params={}, fingerprint=None, run_uri="u", finished_at=None, error="no record"
    )
    assert stand_in.sweep is None and stand_in.objective.name is None and not stand_in.succeeded
    assert summary(reused)["early_stop"] == DECISION.to_dict() and "history" not in summary(reused)


def running_pod(exit_code: int | None) -> k8s.V1Pod:
    started = datetime(2026, 11, 22, 4, 1, tzinfo=UTC)
    finished = datetime(2026, 11, 22, 4, 9, tzinfo=UTC)
    base = (
        k8s.V1ContainerState(
            terminated=k8s.V1ContainerStateTerminated(
                exit_code=exit_code, started_at=started, finished_at=finished
            )
        )
        if exit_code is not None
        else k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at=started))
    )
    sidecar = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at=started))
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="trial-0", creation_timestamp=datetime(2026, 11, 22, 4, 0, tzinfo=UTC)
        ),
        status=k8s.V1PodStatus(
            container_statuses=[
                k8s.V1ContainerStatus(
                    name="base", state=base, image="i", image_id="", ready=False, restart_count=0
                ),
                k8s.V1ContainerStatus(
                    name="checkpoint-sync", state=sidecar, image="i", image_id="", ready=True, restart_count=0
                ),
            ]
        ),
    )


def test_pod_state_says_when_each_container_ran_and_how_it_ended():
    state = pod_state(running_pod(79))
    assert state["pod_created"] == "2026-11-22T04:00:00Z"
    assert state["base"] == {
        "started": "2026-11-22T04:01:00Z",
        "finished": "2026-11-22T04:09:00Z",
        "exit_code": 79,
    }
    assert state["checkpoint-sync"]["finished"] is None and state["checkpoint-sync"]["exit_code"] is None
    assert pod_state(None) == {"pod_created": None}


def test_a_trial_on_gpus_counts_gpu_hours_and_one_without_timing_the_trainers_wall_time(sweep):
    op = trial_operator(sweep, gpus="2", cpu="4")
    assert op._compute(pod_state(running_pod(0))) == {
        "trainer_seconds": 480.0,
        "accelerator": "gpu",
        "accelerators": 2.0,
        "accelerator_hours": pytest.approx(2 * 480 / 3600),
    }
    fields = trial_operator(sweep, cpu="500m")._compute({"pod_created": None}, 90)
    assert fields == {
        "trainer_seconds": 90.0,
        "accelerator": "cpu",
        "accelerators": 0.5,
        "accelerator_hours": pytest.approx(0.5 * 90 / 3600),
    }
    assert trial_operator(sweep)._compute({"pod_created": None})["accelerator_hours"] is None


def trial_operator(sweep, **kwargs) -> TrialPodOperator:
    kwargs.setdefault("sweep", sweep.settings())
    return TrialPodOperator(
        task_id="train",
        trial="0",
        image="registry.local/trainer@sha256:" + "a" * 64,
        hyperparameters={"learning_rate": 0.01},
        fingerprint=FINGERPRINT,
        sweep_round=0,
        dataset_version="v1",
        arguments=["--epochs=3"],
        **kwargs,
    )


def test_the_provider_hands_the_finished_pod_to_the_trial_through_its_callbacks(sweep):
    class Own(TrialPodCallbacks.__mro__[1]):  # a DAG's own callbacks are kept
        pass

    op = trial_operator(sweep, callbacks=Own)
    assert op.callbacks == [Own, TrialPodCallbacks]
    TrialPodCallbacks.on_pod_completion(
        pod=running_pod(65), client=None, mode="sync", operator=op, context={}
    )
    assert op.pod_state["base"]["exit_code"] == 65


def test_the_callback_the_trial_relies_on_is_the_providers_with_the_pod_and_the_operator():
    from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback

    assert TrialPodCallbacks.__mro__[1] is KubernetesPodOperatorCallback
    parameters = inspect.signature(KubernetesPodOperatorCallback.on_pod_completion).parameters
    assert {"pod", "operator", "context"} <= set(parameters)


def test_a_trial_that_ends_on_a_final_exit_code_records_why_and_fails(sweep):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    op = trial_operator(sweep)
    op.pod_state = pod_state(running_pod(65))
    with pytest.raises(AirflowFailException, match="exited with 65"):
        op._after_failure(sweep.context(map_index=0), AirflowException("Pod trial-0 returned a failure"))
    record = TrialRecord.from_json(sweep.get(sweep.location.trial_record_key(0)))
    assert (record.status, record.exit_code, record.number, record.fingerprint) == (
        "failed",
        65,
        0,
        FINGERPRINT,
    )
    assert "exited with 65" in record.error and record.timing["base"]["exit_code"] == 65
    assert (record.trainer_seconds, record.accelerator) == (480.0, "cpu")  # a failed trial's compute counts
    assert record.sweep.id == sweep.settings()["id"] and record.objective.name == "val_accuracy"


def test_a_stopped_trial_is_recorded_in_the_sweep_and_by_its_fingerprint(sweep):
    op = trial_operator(sweep)
    context = sweep.context(map_index=0)
    run = op.trial_run(context)
    rows = [{"step": s, "val_accuracy": v} for s, v in ((1, 0.2), (2, 0.3), (3, float("nan")))]
    sweep.put(run.key("output", "metrics.jsonl"), "\n".join(json.dumps(r) for r in rows).encode())
    sweep.put(f"{run.prefix}/sync/{EARLY_STOP_RECORD}", DECISION.to_json().encode())
    state = pod_state(running_pod(79))
    result = op.record(context, state)
    assert result == {
        "trial": "0",
        "status": "success",
        "stopped_early": True,
        "objective": 0.3,
        "run_uri": run.uri,
        "report_url": None,
    }
    body = sweep.get(sweep.location.trial_record_key(0))
    record = TrialRecord.from_json(body)
    jsonschema.validate(json.loads(body), TrialRecord.json_schema())
    assert record.early_stop == DECISION and record.stop_requested is None and record.reports == 3
    assert record.history[2]["val_accuracy"] != record.history[2]["val_accuracy"]  # NaN, as reported
    assert record.timing["base"]["exit_code"] == 79 and record.timing["try_number"] == 1
    assert record.timing["final_pass"] <= record.timing["recorded"]
    # the training container ran 04:01 to 04:09 with no GPU asked for: CPU-hours of its 1-core request
    assert (record.trainer_seconds, record.accelerator, record.accelerators) == (480.0, "cpu", 1.0)
    assert record.accelerator_hours == pytest.approx(480 / 3600)
    assert summary(record)["accelerator_hours"] == record.accelerator_hours
    assert json.loads(body)["early_stop"]["kind"] == "kubetrain/early-stop"
    marker = sweep.get(trial_marker_key(sweep.dag_id, FINGERPRINT))
    assert TrialRecord.from_json(marker) == record
    # a retry of the task finds the record: no pod
    again = trial_operator(sweep).execute(sweep.context(map_index=0))
    assert again == result
