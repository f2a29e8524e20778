"""The trainers' specs are the one source of their DAGs' Params, command and arguments; the DAGs render native values."""

from __future__ import annotations

from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.operators.training import TrainingPodOperator
from kubetrain.operators.training_args import string_list
from kubetrain.params import form_order, with_dialect
from kubetrain.trainers import DIALOGUE_TRANSFORMER, IMAGE_CLASSIFIER, TRAINERS, TrainerSpec

REPO = Path(__file__).resolve().parents[2]
SINGLE_RUN = {"train_image_classifier": IMAGE_CLASSIFIER, "train_dialogue_transformer": DIALOGUE_TRANSFORMER}
SWEEPS = {"sweep_image_classifier": IMAGE_CLASSIFIER, "sweep_dialogue_transformer": DIALOGUE_TRANSFORMER}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag


@pytest.mark.parametrize(("dag_id", "trainer"), [*SINGLE_RUN.items(), *SWEEPS.items()])
def test_the_dags_training_params_are_the_specs(dagbag, dag_id, trainer):
    dag = dagbag.dags[dag_id]
    expected = with_dialect(form_order(trainer.params()))  # as the trigger form orders them
    assert set(expected) <= set(dag.params)
    for name, param in expected.items():
        offered = dag.params.get_param(name)
        assert (offered.schema, offered.value) == (param.schema, param.value), name
    assert (dag.params["dataset_uri"], dag.params["model_name"]) == (trainer.dataset_uri, trainer.model)


@pytest.mark.parametrize(("dag_id", "trainer"), SINGLE_RUN.items())
def test_a_single_run_dag_runs_the_specs_command_and_arguments(dagbag, dag_id, trainer):
    dag = dagbag.dags[dag_id]
    train = dag.get_task("train")
    assert (train.cmds, train.arguments) == (list(trainer.cmds), list(trainer.arguments))
    assert dag.get_task("report").title == trainer.title


@pytest.mark.parametrize(("dag_id", "trainer"), SWEEPS.items())
def test_a_sweep_dag_runs_the_specs_command_and_arguments_per_trial(dagbag, dag_id, trainer):
    dag = dagbag.dags[dag_id]
    suggests = [task for task in dag.tasks if task.task_id.endswith(".suggest")]
    trials = [task for task in dag.tasks if ".train" in task.task_id]
    assert suggests and trials
    assert all(task.argument_templates == list(trainer.arguments) for task in suggests)
    assert all(task.partial_kwargs["cmds"] == list(trainer.cmds) for task in trials)
    assert dag.get_task("leaderboard").title == f"{trainer.title} sweep"
    assert set(dag.get_task("plan").settings.tunable) == set(trainer.tunable)


def render(dag, trainer: TrainerSpec, **params) -> list[str] | None:
    """The trainer's arguments as the DAG's training task renders them, with ``params`` over the defaults."""
    task = dag.get_task("train")
    context = {"params": {**dag.params.validate(), **params}, "dag": dag}
    return string_list("arguments", task.render_template(list(trainer.arguments), context))


def test_the_specs_arguments_render_to_the_trainers_flags(dagbag):
    classifier = dagbag.dags["train_image_classifier"]
    assert render(classifier, IMAGE_CLASSIFIER) == [
        "--epochs=10",
        "--batch-size=32",
        "--validation-split=0.2",
        "--precision=auto",
        "--steps-per-execution=none",
        "--jit-compile=auto",
        "--model=cnn",
        "--learning-rate=0.001",
        "--image-size=64",
        "--no-augment",
    ]
    assert "--augment" in render(classifier, IMAGE_CLASSIFIER, augment=True)
    assert "--jit-compile=false" in render(classifier, IMAGE_CLASSIFIER, jit_compile="false")
    dialogue = dagbag.dags["train_dialogue_transformer"]
    arguments = render(dialogue, DIALOGUE_TRANSFORMER)
    assert arguments[:3] == ["--epochs=10", "--max-steps=none", "--batch-size=64"]
    assert "--warmup-steps=none" in arguments and "--dropout=0.1" in arguments
    assert render(dialogue, DIALOGUE_TRANSFORMER, max_steps=300)[1] == "--max-steps=300"


@pytest.mark.parametrize("dag_id", [*SINGLE_RUN, *SWEEPS, "train_image_classifier_distributed"])
def test_each_flag_is_passed_once(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    if "train" in dag.task_dict:
        templates = dag.get_task("train").arguments
    else:
        templates = next(t.argument_templates for t in dag.tasks if t.task_id.endswith(".suggest"))
    context = {"params": dag.params.validate(), "dag": dag}
    rendered = string_list("arguments", dag.tasks[0].render_template(list(templates), context))
    names = [argument.split("=")[0].replace("--no-", "--") for argument in rendered]
    assert len(names) == len(set(names)), rendered


def test_the_distributed_dag_offers_the_table_s_max_steps_and_checkpoint_interval(dagbag):
    dag = dagbag.dags["train_image_classifier_distributed"]
    spec = IMAGE_CLASSIFIER.extended("max_steps", "checkpoint_every_steps")
    for name in ("max_steps", "checkpoint_every_steps"):
        assert name in spec.tunable and name not in IMAGE_CLASSIFIER.tunable
        assert dag.params.get_param(name).schema == with_dialect(spec.params())[name].schema
    assert dag.get_task("train").arguments == ["--strategy=auto", *spec.arguments]
    arguments = render(dag, spec, max_steps=40)
    assert "--max-steps=40" in arguments and "--checkpoint-every-steps=100" in arguments
    assert "--epochs=10" in arguments and "--max-steps=none" in render(dag, spec)


def test_a_rule_between_params_is_refused_before_staging_naming_the_params():
    from airflow.sdk.exceptions import AirflowFailException

    IMAGE_CLASSIFIER.check_params({"architecture": "mobilenet_v2", "image_size": 32})
    IMAGE_CLASSIFIER.check_params({"architecture": "cnn", "image_size": 16})
    with pytest.raises(ValueError, match="image_size must be >= 32 with architecture mobilenet_v2, got 16"):
        IMAGE_CLASSIFIER.check_params({"architecture": "mobilenet_v2", "image_size": 16})
    with pytest.raises(AirflowFailException, match="hidden_size must be a multiple of num_heads 4, got 30"):
        DIALOGUE_TRANSFORMER.check_run({"params": {"hidden_size": 30, "num_heads": 4}})


def test_the_dialogue_monitors_val_loss_and_warms_up_a_fraction_of_its_steps_by_default():
    assert DIALOGUE_TRANSFORMER.objective == ("val_loss", "min")
    warmup = DIALOGUE_TRANSFORMER.params()["warmup_steps"]
    assert warmup.value is None and warmup.schema["minimum"] == 1


def test_every_dag_that_trains_renders_native_objects(dagbag):
    """Params reach the training pods as values: a mapping, a list, an integer, never text parsed back."""
    training = []
    for dag in dagbag.dags.values():
        classes = [getattr(task, "operator_class", type(task)) for task in dag.tasks]
        if any(isinstance(c, type) and issubclass(c, TrainingPodOperator) for c in classes):
            training.append(dag.dag_id)
            assert dag.render_template_as_native_obj is True, dag.dag_id
    assert {*SINGLE_RUN, *SWEEPS, "train_custom_container"} <= set(training)


def test_the_specs_are_complete_and_check_themselves():
    from kubetrain.imagebuild.products import DEFAULT_PRODUCTS

    for name, trainer in TRAINERS.items():
        assert trainer.name == name and trainer.product in DEFAULT_PRODUCTS
        assert trainer.tunable == tuple(trainer.params())
        assert trainer.params() is not trainer.params()  # no two DAGs share a Param object
    with pytest.raises(ValueError, match=r"cmds \(\) of trainer 'x' is not a command"):
        TrainerSpec(
            name="x", title="x", cmds=(), arguments=(), params=dict, dataset_uri="s3://d/x/", model="x"
        )
    with pytest.raises(ValueError, match=r"objective \('loss', 'down'\) of trainer 'x'"):
        TrainerSpec(
            name="x",
            title="x",
            cmds=("python",),
            arguments=(),
            params=dict,
            dataset_uri="s3://d/x/",
            model="x",
            objective=("loss", "down"),
        )
