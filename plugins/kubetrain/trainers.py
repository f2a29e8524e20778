"""The trainers kubetrain ships, each described once: its image, command, argument templates and Params.

A :class:`TrainerSpec` is the single source of a trainer's run-time choices. The single-run DAGs
(dags/train_image_classifier.py, dags/train_dialogue_transformer.py) offer its Params and run its
command with its arguments; the sweep DAGs (dags/sweep_*.py) offer the same Params as the fixed
values of every trial, and the hyperparameters of the space override them trial by trial (the
argument templates read ``params.<name>``).

The argument templates are rendered with the DAG's Params (``render_template_as_native_obj``:
``{{ params.epochs }}`` is the integer 5); each one renders text, so the list is the container's
arguments as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from airflow.sdk import Param

from kubetrain.params import SWITCH

__all__ = ["DIALOGUE_TRANSFORMER", "IMAGE_CLASSIFIER", "TRAINERS", "TrainerSpec"]


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer of the training image: what runs it and the Params that drive it.

    :param name: the trainer's name, as ``metrics.json`` reports it.
    :param title: the report's title.
    :param product: the kubetrain image that holds the trainer, an image kind of
        :mod:`kubetrain.imagebuild.products` (``trainer``: the deployment's training image, which a
        run uses unless its ``image`` Param names another).
    :param cmds: the base container's command.
    :param arguments: the command's argument templates (``{{ params.x }}``).
    :param params: the training Params (Model and Training sections), built anew at each call so
        that no two DAGs share a Param object.
    :param dataset_uri: the dataset the DAGs train on by default.
    :param model: the model name the DAGs promote as by default.
    :param objective: the metric the trainer monitors, and whether larger is better.
    """

    name: str
    title: str
    cmds: tuple[str, ...]
    arguments: tuple[str, ...]
    params: Callable[[], dict[str, Param]]
    dataset_uri: str
    model: str
    product: str = "trainer"
    objective: tuple[str, str] = ("val_accuracy", "max")

    def __post_init__(self) -> None:
        if not self.cmds or not all(isinstance(c, str) and c for c in self.cmds):
            raise ValueError(
                f"cmds {self.cmds!r} of trainer {self.name!r} is not a command: expected strings"
            )
        if not all(isinstance(a, str) for a in self.arguments):
            raise ValueError(f"arguments {self.arguments!r} of trainer {self.name!r} are not all strings")
        if self.objective[1] not in ("max", "min"):
            raise ValueError(
                f"objective {self.objective!r} of trainer {self.name!r}: expected mode 'max' or 'min'"
            )

    @property
    def tunable(self) -> tuple[str, ...]:
        """The hyperparameters a sweep may search: every training Param."""
        return tuple(self.params())


def image_classifier_params() -> dict[str, Param]:
    """The image classifier's training Params."""
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
            type=SWITCH,
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
            type=SWITCH,
            title="Mixed precision",
            description="float16 compute on GPUs that support it.",
            section="Training",
        ),
    }


IMAGE_CLASSIFIER = TrainerSpec(
    name="image_classifier",
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
    dataset_uri="s3://datasets/digits/",
    model="image-classifier",
    objective=("val_accuracy", "max"),
)


def dialogue_params() -> dict[str, Param]:
    """The dialogue Transformer's training Params."""
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


DIALOGUE_TRANSFORMER = TrainerSpec(
    name="dialogue",
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
    dataset_uri="s3://datasets/dialogue/",
    model="dialogue-transformer",
    objective=("val_accuracy", "max"),
)


# By name: the trainers of the shipped DAGs.
TRAINERS: dict[str, TrainerSpec] = {t.name: t for t in (IMAGE_CLASSIFIER, DIALOGUE_TRANSFORMER)}
