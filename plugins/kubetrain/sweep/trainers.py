"""The trainers a sweep DAG tunes: their command, argument templates, training Params and monitor.

The training Params and arguments are those of the single-run DAGs (dags/train_image_classifier.py,
dags/train_dialogue_transformer.py); tests/plugins/sweep/test_sweep_dags.py checks that both
DAGs of a trainer offer the same Params with the same schemas, so a change to one that is not
made to the other fails a test. In a sweep they are the fixed values of every trial, and the
hyperparameters of the space override them trial by trial (the argument templates read
``params.<name>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from airflow.sdk import Param


@dataclass(frozen=True)
class Trainer:
    """A trainer that sweeps can tune.

    :param cmds: the base container's command.
    :param arguments: argument templates (``{{ params.x }}``), as in the single-run DAG.
    :param params: the training Params (Model and Training sections) of the single-run DAG.
    :param objective: the metric the trainer monitors, and whether larger is better.
    """

    title: str
    cmds: tuple[str, ...]
    arguments: tuple[str, ...]
    params: Callable[[], dict[str, Param]]
    objective: tuple[str, str] = ("val_accuracy", "max")

    @property
    def tunable(self) -> tuple[str, ...]:
        return tuple(self.params())


def image_classifier_params() -> dict[str, Param]:
    return {
        "architecture": Param(
            "cnn",
            type="string",
            enum=["cnn", "mobilenet_v2"],
            title="Architecture",
            description="A small CNN, or MobileNetV2 (ImageNet weights only if the image ships them).",
            section="Model",
        ),
        "epochs": Param(
            5,
            type="integer",
            minimum=1,
            maximum=1000,
            title="Epochs",
            description="Passes over the training split.",
            section="Training",
        ),
        "batch_size": Param(
            64,
            type="integer",
            minimum=1,
            maximum=4096,
            title="Batch size",
            description="Global batch size.",
            section="Training",
        ),
        "learning_rate": Param(
            0.001,
            type="number",
            exclusiveMinimum=0,
            maximum=1,
            title="Learning rate",
            description="Adam learning rate.",
            section="Training",
        ),
        "image_size": Param(
            64,
            type="integer",
            minimum=16,
            maximum=512,
            title="Image size",
            description="Images are resized to SIZE x SIZE pixels.",
            section="Model",
        ),
        "augment": Param(
            False,
            type="boolean",
            title="Augment",
            description="Random shifts, brightness and contrast.",
            section="Training",
        ),
        "validation_split": Param(
            0.2,
            type="number",
            exclusiveMinimum=0,
            exclusiveMaximum=1,
            title="Validation split",
            description="Fraction held out for validation (seeded split).",
            section="Training",
        ),
        "mixed_precision": Param(
            False,
            type="boolean",
            title="Mixed precision",
            description="float16 compute on GPUs that support it.",
            section="Training",
        ),
    }


IMAGE_CLASSIFIER = Trainer(
    title="Image classifier",
    cmds=("python", "-m", "trainer.image_classifier"),
    arguments=(
        "--model={{ params.architecture }}",
        "--epochs={{ params.epochs }}",
        "--batch-size={{ params.batch_size }}",
        "--learning-rate={{ params.learning_rate }}",
        "--image-size={{ params.image_size }}",
        "--validation-split={{ params.validation_split }}",
        "{{ '--augment' if params.augment else '--no-augment' }}",
        "{{ '--mixed-precision' if params.mixed_precision else '--no-mixed-precision' }}",
    ),
    params=image_classifier_params,
    objective=("val_accuracy", "max"),
)


def dialogue_params() -> dict[str, Param]:
    return {
        "epochs": Param(
            20,
            type="integer",
            minimum=1,
            maximum=10000,
            title="Epochs",
            description="Passes over the pairs.",
            section="Training",
        ),
        "max_steps": Param(
            0,
            type="integer",
            minimum=0,
            title="Iterations",
            description="Stop after this many steps (0: run all epochs).",
            section="Training",
        ),
        "batch_size": Param(
            64,
            type="integer",
            minimum=1,
            maximum=4096,
            title="Batch size",
            description="Global batch size.",
            section="Training",
        ),
        "sample_every_steps": Param(
            200,
            type="integer",
            minimum=1,
            title="Sample steps",
            description="Log generated replies every N steps.",
            section="Training",
        ),
        "log_every_steps": Param(
            50,
            type="integer",
            minimum=1,
            title="Display steps",
            description="Log the loss every N steps.",
            section="Training",
        ),
        "warmup_steps": Param(
            4000,
            type="integer",
            minimum=1,
            title="Warm-up steps",
            description="Linear learning-rate warm-up.",
            section="Training",
        ),
        "num_layers": Param(
            2,
            type="integer",
            minimum=1,
            maximum=24,
            title="Layers",
            description="Encoder and decoder layers.",
            section="Model",
        ),
        "num_heads": Param(
            4,
            type="integer",
            minimum=1,
            maximum=64,
            title="Heads",
            description="Attention heads; must divide the hidden size.",
            section="Model",
        ),
        "hidden_size": Param(
            128,
            type="integer",
            minimum=8,
            maximum=4096,
            title="Hidden size",
            description="Model width.",
            section="Model",
        ),
        "ff_size": Param(
            512,
            type="integer",
            minimum=8,
            maximum=16384,
            title="Feed-forward size",
            description="Feed-forward width.",
            section="Model",
        ),
        "dropout": Param(
            0.1,
            type="number",
            minimum=0,
            exclusiveMaximum=1,
            title="Dropout",
            description="Dropout rate.",
            section="Model",
        ),
        "max_length": Param(
            24,
            type="integer",
            minimum=4,
            maximum=512,
            title="Max length",
            description="Tokens kept per question and per reply.",
            section="Model",
        ),
        "vocab_size": Param(
            8000,
            type="integer",
            minimum=16,
            maximum=200000,
            title="Vocabulary",
            description="Tokenizer vocabulary size.",
            section="Model",
        ),
    }


DIALOGUE_TRANSFORMER = Trainer(
    title="Dialogue Transformer",
    cmds=("python", "-m", "trainer.dialogue"),
    arguments=(
        "--epochs={{ params.epochs }}",
        "{{ '--max-steps=%d' % params.max_steps if params.max_steps else '--epochs=%d' % params.epochs }}",
        "--batch-size={{ params.batch_size }}",
        "--sample-every-steps={{ params.sample_every_steps }}",
        "--log-every-steps={{ params.log_every_steps }}",
        "--warmup-steps={{ params.warmup_steps }}",
        "--num-layers={{ params.num_layers }}",
        "--num-heads={{ params.num_heads }}",
        "--hidden-size={{ params.hidden_size }}",
        "--ff-size={{ params.ff_size }}",
        "--dropout={{ params.dropout }}",
        "--max-input-length={{ params.max_length }}",
        "--max-output-length={{ params.max_length }}",
        "--vocab-size={{ params.vocab_size }}",
    ),
    params=dialogue_params,
    objective=("val_accuracy", "max"),
)
