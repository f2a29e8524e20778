"""A sweep's early-stopping settings: the plan's check of the asha and hyperband rules, and what a
trial's pod tells its checkpoint-sync sidecar (the variables trainer/sync/asha.py reads)."""

from __future__ import annotations

import re

import pytest

from kubetrain import pod_spec
from kubetrain.sweep.config import SweepSettings
from kubetrain.sweep.space import SpaceError
from kubetrain.sweep.stopping import MedianStopping, RungStopping
from kubetrain.sweep.trial import TrialPodOperator
from kubetrain_contract.early_stop import hyperband_bracket
from kubetrain_contract.pod import Env

SPACE = {"learning_rate": [0.001, 0.01, 0.1]}


def plan(early_stopping, algorithm: str = "random", **params):
    return SweepSettings(tunable=None).plan(
        {
            "space": SPACE,
            "algorithm": algorithm,
            "max_trials": 4,
            "parallel_trials": 2,
            "seed": 0,
            "objective": {"metric": "val_accuracy", "mode": "max"},
            "early_stopping": early_stopping,
            **params,
        }
    )


def test_asha_and_hyperband_get_their_defaults():
    early = plan({"rule": "asha"})["early_stopping"]
    assert {
        k: early[k] for k in ("min_resource", "reduction_factor", "grace", "max_resource", "brackets")
    } == {
        "min_resource": 1,
        "reduction_factor": 3,
        "grace": 1,
        "max_resource": None,
        "brackets": 1,
    }
    # hyperband: as many brackets as the budget allows (Optuna's floor(log_eta(max / min)) + 1), else 3
    assert plan({"rule": "hyperband", "max_resource": 27})["early_stopping"]["brackets"] == 4
    assert (
        plan({"rule": "hyperband", "max_resource": 8, "min_resource": 2})["early_stopping"]["brackets"] == 2
    )
    assert plan({"rule": "hyperband"})["early_stopping"]["brackets"] == 3
    assert plan({"rule": "hyperband", "brackets": 2})["early_stopping"]["brackets"] == 2
    # the median rule's settings are as they were
    assert plan({"rule": "median"})["early_stopping"] == {"rule": "median", "min_trials": 3, "start_step": 4}


@pytest.mark.parametrize(
    ("early", "params", "space", "budget", "brackets"),
    [
        # max_resource unset: the run's epochs, which every trial shares, bound the rungs
        ({"rule": "asha"}, {"epochs": 27}, SPACE, 27, 1),
        ({"rule": "hyperband"}, {"epochs": 27}, SPACE, 27, 4),
        # a max_resource that is set wins over the epochs
        ({"rule": "asha", "max_resource": 9}, {"epochs": 27}, SPACE, 9, 1),
        # epochs the space searches differ per trial: no shared budget
        ({"rule": "asha"}, {"epochs": 27}, {**SPACE, "epochs": [9, 27]}, None, 1),
        # epochs not above min_resource: no rung could judge a trial below them
        ({"rule": "asha", "min_resource": 3}, {"epochs": 3}, SPACE, None, 1),
        # no integer epochs Param (a container without one): unbounded, as before
        ({"rule": "asha"}, {}, SPACE, None, 1),
        ({"rule": "asha"}, {"epochs": "27"}, SPACE, None, 1),
    ],
)
def test_the_rungs_budget_defaults_to_the_runs_epochs(early, params, space, budget, brackets):
    planned = SweepSettings(tunable=None).plan(
        {
            "space": space,
            "algorithm": "random",
            "max_trials": 4,
            "parallel_trials": 2,
            "seed": 0,
            "objective": {"metric": "val_accuracy", "mode": "max"},
            "early_stopping": early,
            **params,
        }
    )["early_stopping"]
    assert (planned["max_resource"], planned["brackets"]) == (budget, brackets)


def test_tpe_with_hyperband_budgets_is_a_plan():
    pytest.importorskip("optuna")
    planned = plan({"rule": "hyperband", "max_resource": 9}, algorithm="tpe")
    assert planned["algorithm"] == "tpe" and planned["early_stopping"]["rule"] == "hyperband"


@pytest.mark.parametrize(
    ("early", "field", "words"),
    [
        (
            {"rule": "asha", "reduction_factor": 1},
            "early_stopping.reduction_factor",
            "1 is not an integer >= 2",
        ),
        (
            {"rule": "asha", "reduction_factor": 2.5},
            "early_stopping.reduction_factor",
            "2.5 is not an integer",
        ),
        ({"rule": "hyperband", "min_resource": 0}, "early_stopping.min_resource", "0 is not an integer >= 1"),
        ({"rule": "asha", "min_resource": "3"}, "early_stopping.min_resource", "'3' is not an integer >= 1"),
        ({"rule": "asha", "grace": 0}, "early_stopping.grace", "0 is not an integer >= 1"),
        ({"rule": "asha", "max_resource": 0}, "early_stopping.max_resource", "0 is not an integer >= 1"),
        (
            {"rule": "asha", "min_resource": 4, "max_resource": 4},
            "early_stopping.max_resource",
            "4 is not above min_resource 4",
        ),
        ({"rule": "asha", "brackets": 3}, "early_stopping.brackets", "3 is not valid for asha"),
        ({"rule": "hyperband", "brackets": 0}, "early_stopping.brackets", "0 is not an integer >= 1"),
        ({"rule": "bohb"}, "early_stopping.rule", "'bohb' is not a rule: expected one of off, median, asha"),
    ],
)
def test_bad_rung_settings_are_refused_naming_the_field_and_value(early, field, words):
    with pytest.raises(SpaceError, match=words) as info:
        plan(early)
    assert info.value.field == field


def test_the_params_schema_offers_the_rules_and_their_settings():
    param = SweepSettings(tunable=None).params(space=SPACE)["early_stopping"]
    schema = param.schema
    assert schema["properties"]["rule"]["enum"] == ["off", "median", "asha", "hyperband"]
    assert schema["properties"]["reduction_factor"]["minimum"] == 2
    assert {"min_resource", "grace", "max_resource", "brackets"} <= set(schema["properties"])


def _sidecar_env(sweep, early_stopping, trial: str) -> dict[str, str]:
    settings = {**sweep.settings(), "early_stopping": early_stopping}
    op = TrialPodOperator(
        task_id="train",
        trial=trial,
        sweep=settings,
        image="registry.local/trainer@sha256:" + "a" * 64,
        hyperparameters={"learning_rate": 0.01},
        fingerprint="0123456789abcdef",
        sweep_round=0,
        dataset_version="v1",
        arguments=["--epochs=9"],
    )
    config = op.pod_config(sweep.context(map_index=int(trial)), pin=False)
    pod = pod_spec.training_pod(config)
    (sync,) = [c for c in pod.spec.init_containers if c.name == pod_spec.SYNC_CONTAINER]
    (base,) = [c for c in pod.spec.containers if c.name == "base"]
    assert Env.STOP_FILE in {e.name for e in base.env}  # the trainer looks for the stop file
    assert Env.ASHA_BRACKET not in {e.name for e in base.env}  # the rule's settings are the sidecar's
    return {e.name: e.value for e in sync.env if e.value is not None}


def test_an_asha_trials_pod_carries_what_its_sidecar_needs(sweep):
    early = plan({"rule": "asha", "min_resource": 2, "max_resource": 9})["early_stopping"]
    env = _sidecar_env(sweep, early, "5")
    assert {k: env.get(k) for k in RUNG_ENV} == {
        Env.EARLY_STOPPING: "asha",
        Env.OBJECTIVE: "val_accuracy",
        Env.OBJECTIVE_MODE: "max",
        Env.SWEEP_TRIALS_URI: sweep.location.trials_uri,
        Env.SWEEP_RUNGS_URI: f"s3://{sweep.location.bucket}/{sweep.location.key('rungs/')}",
        Env.SWEEP_TRIAL: "5",
        Env.ASHA_MIN_RESOURCE: "2",
        Env.ASHA_REDUCTION_FACTOR: "3",
        Env.ASHA_GRACE: "1",
        Env.ASHA_MAX_RESOURCE: "9",
        Env.ASHA_BRACKETS: "1",
        Env.ASHA_BRACKET: "0",
        Env.STOP_FILE: pod_spec.STOP_FILE,
    }
    assert Env.MEDIAN_MIN_TRIALS not in env


def test_a_hyperband_trials_pod_carries_its_bracket(sweep):
    early = plan({"rule": "hyperband", "max_resource": 27})["early_stopping"]
    for trial in ("0", "1", "3"):
        env = _sidecar_env(sweep, early, trial)
        assert env[Env.EARLY_STOPPING] == "hyperband" and env[Env.ASHA_BRACKETS] == "4"
        assert env[Env.ASHA_BRACKET] == str(hyperband_bracket(int(trial), 4, 3))
    assert {hyperband_bracket(n, 4, 3) for n in (0, 1, 3)} != {0}  # trials spread over the brackets


def test_a_median_trials_pod_is_as_it_was(sweep):
    env = _sidecar_env(sweep, {"rule": "median", "min_trials": 2, "start_step": 3}, "0")
    assert env[Env.EARLY_STOPPING] == "median" and env[Env.MEDIAN_MIN_TRIALS] == "2"
    assert Env.SWEEP_RUNGS_URI not in env and Env.ASHA_BRACKET not in env


def test_rung_settings_in_the_pod_are_checked():
    with pytest.raises(ValueError, match="reduction_factor=1 is not valid: expected an integer >= 2"):
        RungStopping(
            rule="asha",
            objective="val_accuracy",
            mode="max",
            trials_uri="s3://training/s/sweep/trials/",
            rungs_uri="s3://training/s/sweep/rungs/",
            trial=0,
            reduction_factor=1,
        )
    with pytest.raises(ValueError, match="rungs_uri='s3://training/rungs' is not valid"):
        RungStopping(
            rule="asha",
            objective="val_accuracy",
            mode="max",
            trials_uri="s3://training/s/sweep/trials/",
            rungs_uri="s3://training/rungs",
            trial=0,
        )


MEDIAN = {"objective": "val_accuracy", "mode": "max", "trials_uri": "s3://training/s/sweep/trials/"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"objective": "val accuracy"}, "objective='val accuracy' is not a metric name"),
        ({"objective": "val_accuracy\n"}, "objective='val_accuracy\\n' is not a metric name"),
        ({"mode": "best"}, "mode='best' is not valid: expected 'max' or 'min'"),
        ({"trials_uri": "s3://training/trials"}, "trials_uri='s3://training/trials' is not valid"),
        ({"min_trials": 0}, "min_trials=0 is not valid: expected an integer >= 1"),
        ({"start_step": "two"}, "start_step='two' is not valid: expected an integer >= 1"),
    ],
)
def test_median_settings_in_the_pod_are_checked(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MedianStopping(**{**MEDIAN, **changes})


def test_median_settings_are_what_the_sidecar_reads():
    rule = MedianStopping(**MEDIAN, min_trials="2", start_step=5)
    assert rule.env() == {
        Env.EARLY_STOPPING: "median",
        Env.OBJECTIVE: "val_accuracy",
        Env.OBJECTIVE_MODE: "max",
        Env.MEDIAN_MIN_TRIALS: "2",
        Env.MEDIAN_START_STEP: "5",
        Env.SWEEP_TRIALS_URI: "s3://training/s/sweep/trials/",
    }


RUNG_ENV = (
    Env.EARLY_STOPPING,
    Env.OBJECTIVE,
    Env.OBJECTIVE_MODE,
    Env.SWEEP_TRIALS_URI,
    Env.SWEEP_RUNGS_URI,
    Env.SWEEP_TRIAL,
    Env.ASHA_MIN_RESOURCE,
    Env.ASHA_REDUCTION_FACTOR,
    Env.ASHA_GRACE,
    Env.ASHA_MAX_RESOURCE,
    Env.ASHA_BRACKETS,
    Env.ASHA_BRACKET,
    Env.STOP_FILE,
)


def test_the_decision_of_a_trial_stopped_for_a_nan_at_its_rung_reads_on_the_airflow_side():
    # issue #53 item 9: the sidecar stops a trial whose objective at a rung is not a finite number,
    # unranked; its decision has no value, rank or best, and JSON has no NaN
    import json

    import jsonschema

    from kubetrain.report.sweep import _outcome
    from kubetrain_contract.early_stop import EarlyStopRecord

    record = EarlyStopRecord(
        rule="asha",
        objective="val_accuracy",
        mode="max",
        start_step=1,
        step=2,
        best=None,
        rung=1,
        value=None,
        rank=None,
        min_resource=1,
        reduction_factor=3,
        grace=1,
    )
    doc = json.loads(record.to_json())
    jsonschema.Draft202012Validator(EarlyStopRecord.json_schema()).validate(doc)
    assert EarlyStopRecord.from_dict(doc) == record
    trial = {"status": "success", "stopped_early": True, "early_stop": doc}
    assert _outcome(trial) == "stopped early at rung 1 (report 2)"
