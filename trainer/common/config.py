"""Typed trainer configuration: dataclasses that check themselves, parsed from CLI flags.

Every field of a config dataclass is a flag (``batch_size`` -> ``--batch-size``), described once in
the flag table of the pod contract (:mod:`kubetrain_contract.flags`): its type, default, bounds,
choices, help text, whether it is a hyperparameter (recorded in params.json), and the rules between
flags. A field declared with :func:`table_field` takes all of that from the table; the parser
(:func:`build_parser`) and the checks of ``__post_init__`` (:meth:`TrainerConfig.__post_init__`)
read it from there, so the trainer accepts exactly what the DAGs' trigger forms accept. A bad value
is refused with a ``ValueError`` that names the flag, the value and what was expected, so the same
checks guard the CLI and programmatic use.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from kubetrain_contract import flags
from kubetrain_contract.flags import MONITORS, STRATEGIES, Flag, TrainerFlags
from kubetrain_contract.flags import cli_name as flag_name
from trainer.common.contract import CONTRACT_DIRS, EXIT_CODES_EPILOG

C = TypeVar("C", bound="TrainerConfig")

__all__ = [
    "MONITORS",
    "STRATEGIES",
    "TrainerConfig",
    "build_parser",
    "flag_name",
    "option",
    "parse_config",
    "require",
    "table_field",
]

# The flags every trainer shares, checked by TrainerConfig itself.
COMMON = TrainerFlags("common", flags.COMMON)


def table_field(table: TrainerFlags, name: str) -> Any:
    """A config field that is the flag ``name`` of ``table``: its default, help, choices and checks.

    Args:
        table: a trainer's flags (:data:`kubetrain_contract.flags.IMAGE_CLASSIFIER`, ...).
        name: the flag's field name.
    """
    flag = table[name]
    return field(
        default=flag.default,
        metadata={
            "flag": flag,
            "help": flag.help,
            "choices": flag.choices or None,
            "hyper": flag.hyper,
            "metavar": flag.metavar,
        },
    )


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    hyper: bool = True,
    metavar: str | None = None,
) -> Any:
    """Declare a config field that is also a CLI flag, for a trainer whose flags the table does not describe.

    The built-in trainers declare theirs with :func:`table_field`; a field declared here is parsed
    but checked only by its class's own ``__post_init__``.

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


def require(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise ``ValueError`` naming the flag, the bad value and what was expected."""
    if not ok:
        raise ValueError(f"{flag_name(name)} must be {expected}, got {value!r}")


@dataclass
class TrainerConfig:
    """Flags shared by every trainer: the contract directories, the training loop and the GPU settings.

    ``FLAGS`` is the trainer's flag table: ``__post_init__`` checks every field against it, and its
    rules, so a subclass declares its table and its fields (:func:`table_field`) and nothing else.
    """

    FLAGS: ClassVar[TrainerFlags] = COMMON

    data_dir: str | None = table_field(COMMON, "data_dir")
    checkpoint_dir: str | None = table_field(COMMON, "checkpoint_dir")
    output_dir: str | None = table_field(COMMON, "output_dir")
    epochs: int = table_field(COMMON, "epochs")
    max_steps: int | None = table_field(COMMON, "max_steps")
    batch_size: int = table_field(COMMON, "batch_size")
    validation_split: float = table_field(COMMON, "validation_split")
    seed: int = table_field(COMMON, "seed")
    checkpoint_every_steps: int = table_field(COMMON, "checkpoint_every_steps")
    keep_checkpoints: int = table_field(COMMON, "keep_checkpoints")
    log_every_steps: int = table_field(COMMON, "log_every_steps")
    precision: str = table_field(COMMON, "precision")
    virtual_cpus: int = table_field(COMMON, "virtual_cpus")
    steps_per_execution: int = table_field(COMMON, "steps_per_execution")
    jit_compile: bool | None = table_field(COMMON, "jit_compile")
    monitor: str = table_field(COMMON, "monitor")
    patience: int = table_field(COMMON, "patience")
    restore_best: bool = table_field(COMMON, "restore_best")
    deterministic: bool = table_field(COMMON, "deterministic")
    tensorboard: bool = table_field(COMMON, "tensorboard")
    strategy: str = table_field(COMMON, "strategy")

    def __post_init__(self) -> None:
        for name, env in CONTRACT_DIRS.items():
            value = getattr(self, name)
            if not value:
                raise ValueError(f"no {name.replace('_', ' ')}: pass {flag_name(name)} or set {env}")
            setattr(self, name, os.fspath(value))
        table = type(self).FLAGS
        flags.check(
            table, {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in table}
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


class _TableType:
    """argparse's ``type`` for a flag of the table: the text read as the flag's kind (``none``: unset)."""

    def __init__(self, flag: Flag) -> None:
        self.flag = flag
        # argparse names the type in its error: "invalid int value: 'x'"
        self.__name__ = flag.value_type.__name__

    def __call__(self, text: str) -> Any:
        return flags.parse_text(self.flag, text)


def _help(text: str) -> str:
    """``text`` as argparse's help: it formats help with ``%``, so a literal percent sign is doubled."""
    return text.replace("%", "%%")


def _add_table_flag(parser: argparse.ArgumentParser, flag: Flag, default: Any) -> None:
    name = flag_name(flag.name)
    help_text = _help(flag.help)
    if flag.kind == "bool" and not flag.nullable:
        parser.add_argument(
            name,
            dest=flag.name,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=help_text + f" (default: {'on' if default else 'off'})",
        )
        return
    if default is not None and "default:" not in help_text:
        help_text += f" (default: {default})"
    if flag.kind == "bool":
        # --jit-compile, --jit-compile=auto (unset) or --no-jit-compile
        parser.add_argument(
            name,
            dest=flag.name,
            nargs="?",
            const=True,
            type=_TableType(flag),
            default=default,
            metavar="true|false|auto",
            help=help_text,
        )
        parser.add_argument(
            "--no-" + name[2:], dest=flag.name, action="store_const", const=False, help=argparse.SUPPRESS
        )
        return
    parser.add_argument(
        name,
        dest=flag.name,
        type=_TableType(flag),
        default=default,
        choices=flag.choices or None,
        metavar=flag.metavar,
        help=help_text,
    )


def build_parser(
    cls: type[TrainerConfig], *, prog: str, description: str, epilog: str = ""
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of ``cls``; a table field's flag comes from the table."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=(epilog + "\n" + EXIT_CODES_EPILOG).strip() + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        flag = (cls.FLAGS.by_name.get(f.name) or meta["flag"]) if "flag" in meta else None
        if flag is not None:
            _add_table_flag(parser, flag, f.default)
            continue
        kind = _value_type(hints[f.name])
        default = f.default
        help_text = _help(meta.get("help", ""))
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
