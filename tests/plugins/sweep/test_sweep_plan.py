"""A sweep's rounds against the test S3 server: the points asked for, the trials reused by fingerprint."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowFailException

from kubetrain.operators.dedupe import fingerprint
from kubetrain.sweep.plan import TRIAL_EXCLUDE, SuggestTrialsOperator
from kubetrain.sweep.records import assemble_trial, trial_marker_key
from kubetrain.sweep.store import load_trial_records, write_trial
from kubetrain_contract.trial import TrialRecord

SPACE = {"learning_rate": [0.1, 0.01, 0.001]}
IMAGE = "registry.local/trainer@sha256:" + "a" * 64


def suggest(sweep, **kwargs) -> SuggestTrialsOperator:
    op = SuggestTrialsOperator(
        task_id="round_0.suggest",
        round=0,
        argument_templates=["--lr={{ params.learning_rate }}", "--trial={{ trial.number }}"],
        dataset_version="v1",
        image=IMAGE,
        **kwargs,
    )
    op.store = sweep.store
    return op


def trained_before(sweep, learning_rate: float, *, stopped_early: bool = False) -> TrialRecord:
    """The fingerprint record of a trial of an earlier run of the same sweep DAG with this point."""
    fp = fingerprint(sweep.dag_id, "v1", {"learning_rate": learning_rate}, IMAGE, TRIAL_EXCLUDE)
    earlier = {"id": f"{sweep.dag_id}/earlier", "objective": {"metric": "val_accuracy", "mode": "max"}}
    record = assemble_trial(
        earlier,
        5,
        round=0,
        params={"learning_rate": learning_rate},
        fingerprint=fp,
        run_uri=f"s3://training/runs/{sweep.dag_id}/earlier/trials/5",
        finished_at="2026-11-21T04:00:00Z",
        value=0.8,
        values=[0.5, 0.8],
        history=[{"val_accuracy": 0.5}, {"val_accuracy": 0.8}],
        final_metrics={"val_accuracy": 0.85},
        stopped_early=stopped_early,
        early_stopping={"rule": "median", "min_trials": 1, "start_step": 1},
    )
    write_trial(sweep.store, "training", trial_marker_key(sweep.dag_id, fp), record)
    return record


def test_a_grid_round_asks_for_every_point_and_renders_each_trials_arguments(sweep):
    sweep.plan(SPACE)
    entries = suggest(sweep).execute(sweep.context())
    assert [e["hyperparameters"] for e in entries] == [{"learning_rate": v} for v in SPACE["learning_rate"]]
    assert entries[1]["arguments"] == ["--lr=0.01", "--trial=1"] and entries[1]["trial"] == "1"
    round_doc = json.loads(sweep.get(sweep.location.round_key(0)))
    assert round_doc["kind"] == "kubetrain/sweep-round" and [t["number"] for t in round_doc["trials"]] == [
        0,
        1,
        2,
    ]
    assert {t["fingerprint"] for t in round_doc["trials"]} == {e["fingerprint"] for e in entries}


def test_a_point_trained_before_is_reused_as_this_sweeps_trial_without_a_pod(sweep):
    plan = sweep.plan(SPACE)
    earlier = trained_before(sweep, 0.01)
    entries = suggest(sweep).execute(sweep.context())
    assert [e["trial"] for e in entries] == ["0", "2"]
    record = load_trial_records(sweep.store, sweep.location)[1]
    assert (record.number, record.round, record.params) == (1, 0, {"learning_rate": 0.01})
    assert record.sweep.id == plan["id"] and record.run_uri == earlier.run_uri
    # the objective under this sweep's objective: metrics.json's final value first
    assert record.objective.value == 0.85 and record.objective.values == [0.5, 0.8]
    assert record.reused_from.run_uri == earlier.run_uri and record.reused_from.sweep == earlier.sweep.id
    assert record.history == earlier.history
    round_doc = json.loads(sweep.get(sweep.location.round_key(0)))
    assert (
        round_doc["kind"] == "kubetrain/sweep-round" and round_doc["trials"][1]["reused_from"]["trial"] == "5"
    )
    # a point finished earlier in this run is never trained again, even with force
    assert [e["trial"] for e in suggest(sweep).execute(sweep.context(force=True))] == ["0", "2"]


def test_a_trial_stopped_under_other_early_stopping_settings_or_unreadable_trains_again(sweep):
    sweep.plan(SPACE, early_stopping={"rule": "median", "min_trials": 3, "start_step": 4})
    trained_before(sweep, 0.1, stopped_early=True)
    fp = fingerprint(sweep.dag_id, "v1", {"learning_rate": 0.001}, IMAGE, TRIAL_EXCLUDE)
    sweep.put(trial_marker_key(sweep.dag_id, fp), {"kind": "kubetrain/run", "format_version": 1})
    entries = suggest(sweep).execute(sweep.context())
    assert [e["trial"] for e in entries] == ["0", "1", "2"]
    assert load_trial_records(sweep.store, sweep.location) == {}


def test_a_round_beyond_the_plan_asks_for_nothing_and_no_plan_fails_naming_the_key(sweep):
    with pytest.raises(AirflowFailException, match="plan.json"):
        suggest(sweep).execute(sweep.context())
    sweep.plan(SPACE)
    op = suggest(sweep)
    op.round = 1
    assert op.execute(sweep.context()) == []
