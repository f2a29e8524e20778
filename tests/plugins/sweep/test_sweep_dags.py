"""The sweep DAGs' wiring and Params: round 0's variants, typed hand-offs, the plan's checks."""

from __future__ import annotations

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from airflow.sdk import DAG
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import ParamValidationError

from kubetrain import SweepSettings, common_params, sweep_pipeline
from kubetrain.sweep.space import SpaceError, tunable_schemas
from kubetrain.trainers import IMAGE_CLASSIFIER


@pytest.fixture(scope="module")
def dagbag():
    from pathlib import Path

    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(Path(__file__).resolve().parents[3] / "dags"))


def test_round_zero_has_one_training_task_per_offered_parallelism(dagbag):
    dag = dagbag.dags["sweep_image_classifier"]
    plan = dag.get_task("plan")
    variants = {p: dag.get_task(task_id) for p, task_id in plan.variant_tasks.items()}
    assert sorted(variants) == [1, 2, 4] == dag.params.get_param("parallel_trials").schema["enum"]
    for p, task in variants.items():
        assert task.max_active_tis_per_dagrun == p and task.pool == "gpu"
        assert task.upstream_task_ids >= {"round_0.suggest", "plan", "stage_dataset"}
        # each trial's pod is sized from the staged dataset, as a single run's
        assert task.partial_kwargs["dataset_bytes"].operator.task_id == "stage_dataset"
        assert task.partial_kwargs["dataset_bytes"].key == "total_bytes"
        assert task.partial_kwargs["prepared_bytes"].operator.task_id == "stage_dataset"
        assert task.partial_kwargs["prepared_bytes"].key == "prepared_bytes"
        assert task.partial_kwargs["data_size"] == "{{ params.data_size or '' }}"
    later = dag.get_task("round_1.train")
    assert later.max_active_tis_per_dagrun == 4 and later.pool == "gpu"
    assert dag.get_task("round_1.suggest").trigger_rule == "all_done"
    assert dag.get_task("leaderboard").trigger_rule == "all_done"
    assert dag.get_task("leaderboard").upstream_task_ids == {"round_3.train"}
    assert dag.get_task("promote").upstream_task_ids == {"leaderboard"}


def test_the_space_param_refuses_what_its_schema_can_see(dagbag):
    params: ParamsDict = dagbag.dags["sweep_image_classifier"].params
    for bad, words in (
        ({"momentum": [0.9]}, "momentum"),
        ({"batch_size": []}, "batch_size"),
        ({"learning_rate": {"low": 0.1}}, "learning_rate"),
        ({}, "space"),
    ):
        param = params.get_param("space")
        with pytest.raises(ParamValidationError) as raised:
            param.resolve(bad)
        assert words in str(raised.value), str(raised.value)
    for name, bad in (
        ("algorithm", "bayes"),
        ("parallel_trials", 3),
        ("early_stopping", {"rule": "bohb"}),
        ("early_stopping", {"rule": "asha", "reduction_factor": 1}),
        ("objective", {"metric": "val_accuracy", "mode": "up"}),
    ):
        with pytest.raises(ParamValidationError):
            params.get_param(name).resolve(bad)


def settings() -> SweepSettings:
    training = IMAGE_CLASSIFIER.params()
    return SweepSettings(
        tunable=tunable_schemas(training, IMAGE_CLASSIFIER.tunable), max_parallel_trials=4, rounds=3
    )


def plan_params(**overrides) -> dict:
    base = {
        "space": {"batch_size": [16, 32, 64, 128]},
        "algorithm": "grid",
        "max_trials": 8,
        "parallel_trials": 2,
        "seed": 1,
        "objective": {"metric": "val_accuracy", "mode": "max"},
        "early_stopping": {"rule": "median", "min_trials": 2, "start_step": 2},
    }
    return {**base, **overrides}


def test_the_plan_sizes_the_rounds():
    assert settings().plan(plan_params())["rounds"] == [4]
    assert settings().plan(plan_params(algorithm="random", max_trials=16))["rounds"] == [16]
    tpe = settings().plan(
        plan_params(
            algorithm="tpe",
            max_trials=5,
            parallel_trials=2,
            space={"learning_rate": {"low": 1e-4, "high": 1e-1, "log": True}},
        )
    )
    assert tpe["rounds"] == [2, 2, 1]
    assert tpe["space"] == {"learning_rate": {"low": 1e-4, "high": 1e-1, "type": "float", "log": True}}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            {"algorithm": "tpe", "max_trials": 7, "space": {"learning_rate": {"low": 1e-4, "high": 1e-1}}},
            "max_trials",
        ),
        ({"parallel_trials": 3}, "parallel_trials"),
        ({"max_trials": 3}, "space"),
        ({"space": {"learning_rate": {"low": 0.5, "high": 0.1}}}, "space.learning_rate"),
        ({"objective": {"metric": "val accuracy", "mode": "max"}}, "objective.metric"),
        ({"early_stopping": {"rule": "median", "start_step": 0}}, "early_stopping.start_step"),
    ],
)
def test_the_plan_refuses_naming_the_field(overrides, field):
    with pytest.raises(SpaceError) as raised:
        settings().plan(plan_params(**overrides))
    assert raised.value.field == field


def test_any_image_trainer_gets_its_hyperparameters_as_arguments():
    """The same function builds a sweep of a third-party container (train_custom_container's trainer)."""
    from types import SimpleNamespace

    custom = SweepSettings(
        tunable=None, objective=("score", "max"), max_parallel_trials=2, rounds=2, hyperparameter_args=True
    )
    with DAG(
        "sweep_custom",
        schedule=None,
        render_template_as_native_obj=True,
        params={
            **common_params(dataset_uri="s3://datasets/x/", model="x", gpus=0),
            "args": ["train.py", "--epochs=3"],
            **custom.params(space={"lr": {"low": 0.001, "high": 0.1, "log": True}}),
        },
    ) as dag:
        tasks = sweep_pipeline(custom, cmds=["python"], arguments="{{ params.args }}", title="custom")
    assert [t.task_id for t in tasks.trials[0]] == ["round_0.train_1_at_a_time", "round_0.train_2_at_a_time"]
    # trials wait for their pods in their worker slot unless the DAG asks them to defer
    assert all(t.partial_kwargs["deferrable"] is False for r in tasks.trials for t in r)
    with DAG("sweep_custom_deferred", schedule=None, params=dag.params, render_template_as_native_obj=True):
        deferred = sweep_pipeline(custom, cmds=["python"], arguments=[], title="custom", deferrable=True)
    assert all(t.partial_kwargs["deferrable"] is True for r in deferred.trials for t in r)
    suggest = tasks.suggest[0]
    context = {"params": dag.params.validate(), "dag": dag, "ti": SimpleNamespace(dag_id="sweep_custom")}
    assert suggest.render_arguments(context, {"lr": 0.01}, 3) == ["train.py", "--epochs=3", "--lr=0.01"]


def test_trainer_arguments_read_the_trial_values():
    from types import SimpleNamespace

    sweep = settings()
    training = IMAGE_CLASSIFIER.params()
    with DAG(
        "sweep_x",
        schedule=None,
        render_template_as_native_obj=True,
        params={
            **common_params(dataset_uri="s3://datasets/x/", model="x"),
            **training,
            **sweep.params(space={"batch_size": [16]}),
        },
    ) as dag:
        tasks = sweep_pipeline(
            sweep, cmds=IMAGE_CLASSIFIER.cmds, arguments=IMAGE_CLASSIFIER.arguments, title="x"
        )
    context = {"params": dag.params.validate(), "dag": dag, "ti": SimpleNamespace(dag_id="sweep_x")}
    args = tasks.suggest[1].render_arguments(
        context, {"batch_size": 16, "learning_rate": 0.03, "augment": True}, 7
    )
    assert "--batch-size=16" in args and "--learning-rate=0.03" in args and "--augment" in args
    assert "--epochs=10" in args  # a fixed value (the flag table's default)
