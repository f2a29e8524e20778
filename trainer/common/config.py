"""Typed trainer configuration: dataclasses that check themselves, parsed from CLI flags.

Every field of a config dataclass is a flag (``batch_size`` -> ``--batch-size``); its
``metadata`` carries the help text, the allowed choices and whether it is a
hyperparameter (recorded in params.json) or a location (the contract directories).
``__post_init__`` refuses a bad value with a ``ValueError`` that names the flag, the
value and what was expected, so the same checks guard the CLI and programmatic use.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trainer.common.contract import CONTRACT_DIRS, EXIT_CODES_EPILOG

C = TypeVar("C", bound="TrainerConfig")

# Validation metrics a run can monitor, and whether larger is better.
MONITORS = {"val_accuracy": "max", "val_loss": "min"}
# Distribution strategies (trainer/README.md, "Several workers").
STRATEGIES = ("auto", "mirrored", "multi_worker", "parameter_server")


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    hyper: bool = True,
    metavar: str | None = None,
) -> Any:
    """Declare a config field that is also a CLI flag.

    Args:
        default: the default value.
        help: the flag's help text.
        choices: the allowed values, if the flag is an enumeration.
        hyper: whether the value is a hyperparameter recorded in params.json.
        metavar: how --help shows the value.
    """
    return field(
        default=default, metadata={"help": help, "choices": choices, "hyper": hyper, "metavar": metavar}
    )


def flag_name(name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def require(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise ``ValueError`` naming the flag, the bad value and what was expected."""
    if not ok:
        raise ValueError(f"{flag_name(name)} must be {expected}, got {value!r}")


@dataclass
class TrainerConfig:
    """Flags shared by every trainer: the contract directories and the training loop."""

    data_dir: str | None = option(None, "dataset directory (default: $DATA_DIR)", hyper=False, metavar="DIR")
    checkpoint_dir: str | None = option(
        None,
        "checkpoints are written and resumed here (default: $CHECKPOINT_DIR)",
        hyper=False,
        metavar="DIR",
    )
    output_dir: str | None = option(
        None,
        "metrics, history, params and the model go here (default: $OUTPUT_DIR)",
        hyper=False,
        metavar="DIR",
    )
    epochs: int = option(10, "passes over the training split")
    max_steps: int | None = option(
        None, "stop after this many optimizer steps in total, counting steps before a resume", metavar="N"
    )
    batch_size: int = option(32, "global batch size, split evenly over the devices")
    validation_split: float = option(0.2, "fraction of the data held out for validation (seeded split)")
    seed: int = option(42, "seed of the split, the shuffles, augmentation and initialisation")
    checkpoint_every_steps: int = option(
        100, "write a checkpoint every N steps (0: only at epoch ends and on SIGTERM)", metavar="N"
    )
    keep_checkpoints: int = option(3, "how many recent checkpoints to keep", metavar="K")
    log_every_steps: int = option(10, "log the training loss every N steps", metavar="N")
    mixed_precision: bool = option(False, "mixed_float16 compute with dynamic loss scaling")
    virtual_cpus: int = option(
        0,
        "split the CPU into N logical devices and mirror training over them "
        "(exercises multi-device training without GPUs; 0: off)",
        metavar="N",
    )
    steps_per_execution: int = option(
        1,
        "training steps per call into the compiled step function; the host reads results only when it logs, "
        "checkpoints, samples or ends an epoch (8-32 keeps a GPU busy with small steps)",
        metavar="K",
    )
    jit_compile: bool = option(False, "compile the forward and backward pass with XLA")
    monitor: str = option(
        "val_accuracy", "validation metric that picks the best epoch and drives --patience", choices=MONITORS
    )
    patience: int = option(
        0, "stop after N epochs without improvement of --monitor (0: never stop early)", metavar="N"
    )
    restore_best: bool = option(
        True, "export the weights of the best epoch by --monitor, not those of the last epoch"
    )
    deterministic: bool = option(
        False,
        "deterministic TensorFlow ops (tf.config.experimental.enable_op_determinism): reruns repeat "
        "bit for bit, at a cost in speed on GPUs (see trainer/README.md)",
    )
    tensorboard: bool = option(True, "write TensorBoard event files to OUTPUT_DIR/tensorboard", hyper=False)
    strategy: str = option(
        "auto",
        "distribution over devices and pods: auto (MirroredStrategy over this pod's devices, "
        "multi_worker when TF_CONFIG names several workers, parameter_server when it names parameter servers), "
        "mirrored, multi_worker or parameter_server",
        choices=STRATEGIES,
        hyper=False,
    )

    def __post_init__(self) -> None:
        for name, env in CONTRACT_DIRS.items():
            value = getattr(self, name)
            if not value:
                raise ValueError(f"no {name.replace('_', ' ')}: pass {flag_name(name)} or set {env}")
            setattr(self, name, os.fspath(value))
        require(isinstance(self.epochs, int) and self.epochs >= 1, "epochs", self.epochs, "an integer >= 1")
        require(
            self.max_steps is None or (isinstance(self.max_steps, int) and self.max_steps >= 1),
            "max_steps",
            self.max_steps,
            "an integer >= 1 (or unset)",
        )
        require(
            isinstance(self.batch_size, int) and self.batch_size >= 1,
            "batch_size",
            self.batch_size,
            "an integer >= 1",
        )
        require(
            0.0 < self.validation_split < 1.0,
            "validation_split",
            self.validation_split,
            "a fraction strictly between 0 and 1",
        )
        require(isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "an integer >= 0")
        require(
            isinstance(self.checkpoint_every_steps, int) and self.checkpoint_every_steps >= 0,
            "checkpoint_every_steps",
            self.checkpoint_every_steps,
            "an integer >= 0",
        )
        require(
            isinstance(self.keep_checkpoints, int) and self.keep_checkpoints >= 1,
            "keep_checkpoints",
            self.keep_checkpoints,
            "an integer >= 1",
        )
        require(
            isinstance(self.log_every_steps, int) and self.log_every_steps >= 1,
            "log_every_steps",
            self.log_every_steps,
            "an integer >= 1",
        )
        require(
            isinstance(self.virtual_cpus, int) and 0 <= self.virtual_cpus <= 64,
            "virtual_cpus",
            self.virtual_cpus,
            "an integer from 0 to 64",
        )
        require(
            isinstance(self.steps_per_execution, int) and 1 <= self.steps_per_execution <= 10_000,
            "steps_per_execution",
            self.steps_per_execution,
            "an integer from 1 to 10000",
        )
        require(self.monitor in MONITORS, "monitor", self.monitor, f"one of {', '.join(MONITORS)}")
        require(self.strategy in STRATEGIES, "strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        require(
            isinstance(self.patience, int) and self.patience >= 0,
            "patience",
            self.patience,
            "an integer >= 0",
        )

    @property
    def monitor_mode(self) -> str:
        """``max`` for accuracy, ``min`` for loss."""
        return MONITORS[self.monitor]

    def hyperparameters(self) -> dict[str, Any]:
        """Every hyperparameter by field name, as recorded in params.json."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("hyper", True)
        }


def _value_type(annotation: Any) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def build_parser(
    cls: type[TrainerConfig], *, prog: str, description: str, epilog: str = ""
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of ``cls``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=(epilog + "\n" + EXIT_CODES_EPILOG).strip() + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _value_type(hints[f.name])
        meta = f.metadata
        default = f.default
        help_text = meta.get("help", "")
        if default is not None and kind is not bool and "default:" not in help_text:
            help_text += f" (default: {default})"
        if kind is bool:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text + f" (default: {'on' if default else 'off'})",
            )
        else:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                type=kind,
                default=default,
                choices=meta.get("choices"),
                metavar=meta.get("metavar"),
                help=help_text,
            )
    return parser


def parse_config(
    cls: type[C],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    epilog: str = "",
    environ: Mapping[str, str] | None = None,
) -> C:
    """Parse flags into ``cls``; the contract directories fall back to the environment.

    A bad value ends the process through ``parser.error``: exit code 2 and a message that
    names the flag.
    """
    env = os.environ if environ is None else environ
    parser = build_parser(cls, prog=prog, description=description, epilog=epilog)
    values = vars(parser.parse_args(argv))
    for name, var in CONTRACT_DIRS.items():
        if not values.get(name):
            values[name] = env.get(var) or None
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
