"""The trainers kubetrain ships, each described once: its image, command, argument templates and Params.

A :class:`TrainerSpec` is the single source of a trainer's run-time choices. The single-run DAGs
(dags/train_image_classifier.py, dags/train_dialogue_transformer.py) offer its Params and run its
command with its arguments; the sweep DAGs (dags/sweep_*.py) offer the same Params as the fixed
values of every trial, and the hyperparameters of the space override them trial by trial (the
argument templates read ``params.<name>``).

The Params and the argument templates are derived from the trainer's flag table
(:mod:`kubetrain_contract.flags`), which the trainer's own parser and checks read too: each
offered flag is one Param (type, bounds, choices, title, description, default) and one argument,
so the form accepts what the trainer accepts and passes each flag once. The rules between flags
(``image_size`` >= 32 with ``architecture`` mobilenet_v2), which one Param's JSON schema cannot
say, are checked by :meth:`TrainerSpec.check_params` before the dataset is staged.

The argument templates are rendered with the DAG's Params (``render_template_as_native_obj``:
``{{ params.epochs }}`` is the integer 5); each one renders text, so the list is the container's
arguments as they are. An unset value (an empty Max steps) renders as ``--max-steps=none``, which
the trainer reads as unset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow.sdk import Param

from kubetrain.params import SWITCH
from kubetrain_contract import flags
from kubetrain_contract.flags import Flag, TrainerFlags

__all__ = [
    "DIALOGUE_TRANSFORMER",
    "IMAGE_CLASSIFIER",
    "TRAINERS",
    "TrainerSpec",
    "flag_argument",
    "flag_param",
    "flag_schema",
]

# JSON schema types of the table's kinds (an enum's follows its choices).
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
# A nullable switch (``--jit-compile``: on, off or unset) is a choice of words in the form: a switch
# always submits true or false. The trainer reads the same words (kubetrain_contract.flags.parse_text).
TRI_STATE = ("auto", "true", "false")
_BOUNDS = {
    "minimum": "minimum",
    "maximum": "maximum",
    "exclusive_minimum": "exclusiveMinimum",
    "exclusive_maximum": "exclusiveMaximum",
}


def _description(flag: Flag) -> str:
    text = flag.help[:1].upper() + flag.help[1:]
    return text if text.endswith(".") else text + "."


def flag_schema(flag: Flag) -> dict[str, Any]:
    """The JSON schema of ``flag``'s Param (without its default): type, bounds, choices, title, section.

    A boolean is a switch (:data:`kubetrain.params.SWITCH`; an unset switch passes ``--no-x``); a
    boolean that may be unset is a choice of :data:`TRI_STATE` (``auto`` or empty: unset).

    :param flag: a flag of the table that has a form.
    """
    if flag.form is None:
        raise ValueError(f"flag {flag.name!r} has no form: no Param offers it")
    kind = flag.value_type
    schema: dict[str, Any] = {}
    if kind is bool and flag.nullable:
        schema.update(type=["string", "null"], enum=[*TRI_STATE, None])
    elif kind is bool:
        schema["type"] = list(SWITCH)
    else:
        json_type = _JSON_TYPES[kind]
        schema["type"] = [json_type, "null"] if flag.nullable else json_type
    if flag.kind == "enum":
        schema["enum"] = [*flag.choices, *([None] if flag.nullable else [])]
    for attribute, keyword in _BOUNDS.items():
        value = getattr(flag, attribute)
        if value is not None:
            schema[keyword] = value
    schema["title"] = flag.form.title
    schema["description"] = _description(flag)
    schema["section"] = flag.form.section
    return schema


def flag_param(flag: Flag) -> Param:
    """A new Param for ``flag``: its schema (:func:`flag_schema`) and the table's default."""
    return Param(_form_value(flag, flag.default), **flag_schema(flag))


def _form_value(flag: Flag, value: Any) -> Any:
    """A flag's value as its Param holds it (``auto`` for an unset switch of :data:`TRI_STATE`)."""
    if flag.kind == "bool" and flag.nullable and not isinstance(value, str):
        return TRI_STATE[0] if value is None else TRI_STATE[1 if value else 2]
    return value


def _flag_value(flag: Flag, value: Any) -> Any:
    """A Param's value as the trainer reads it from the argument: an unset switch is off."""
    if flag.kind == "bool" and flag.nullable and isinstance(value, str):
        return flags.parse_text(flag, value)
    if flag.kind == "bool" and value is None:
        return False
    return value


def flag_argument(flag: Flag) -> str:
    """The argument template that passes ``flag`` from its Param, once.

    :param flag: a flag of the table that has a form.
    """
    option, value = flags.cli_name(flag.name), f"params.{flag.param}"
    if flag.kind == "bool" and not flag.nullable:
        return f"{{{{ '{option}' if {value} else '--no-{option[2:]}' }}}}"
    if flag.nullable:
        return f"{option}={{{{ 'none' if {value} is none else {value} }}}}"
    return f"{option}={{{{ {value} }}}}"


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
    :param flags: the trainer's flag table, when its Params and arguments come from it
        (:meth:`from_flags`); its rules are then checked by :meth:`check_params`.
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
    flags: TrainerFlags | None = None

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

    @classmethod
    def from_flags(cls, table: TrainerFlags, *extra: str, **fields: Any) -> TrainerSpec:
        """A spec whose Params and arguments are the flags ``table`` offers, and the ``extra`` ones named.

        The objective is the default ``--monitor`` and its direction.

        :param table: the trainer's flags (:data:`kubetrain_contract.flags.TABLES`).
        :param extra: flags with a form that the trainer's own DAGs do not offer (``max_steps``).
        :param fields: the other fields of the spec.
        """
        offered = table.offered(*extra)
        monitor = table["monitor"].default

        def params() -> dict[str, Param]:
            return {flag.param: flag_param(flag) for flag in offered}

        return cls(
            arguments=tuple(flag_argument(flag) for flag in offered),
            params=params,
            objective=(monitor, flags.MONITORS[monitor]),
            flags=table,
            **fields,
        )

    def extended(self, *names: str) -> TrainerSpec:
        """This trainer with the flags ``names`` offered too, each as a Param and passed once.

        :param names: flags of the table that have a form (the distributed DAG's ``max_steps``,
            ``checkpoint_every_steps``).
        """
        if self.flags is None:
            raise ValueError(f"trainer {self.name!r} has no flag table: its Params cannot be extended")
        already = {f.name for f in self.flags.offered()}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("arguments", "params", "objective", "flags"):
            fields.pop(name)
        return TrainerSpec.from_flags(self.flags, *(n for n in names if n not in already), **fields)

    @property
    def tunable(self) -> tuple[str, ...]:
        """The hyperparameters a sweep may search: every training Param."""
        return tuple(self.params())

    def param_name(self, flag: str) -> str:
        """How the form names ``flag``: its Param's name, else its command-line name."""
        known = self.flags.by_name.get(flag) if self.flags is not None else None
        return known.param if known is not None and known.form else flags.cli_name(flag)

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Refuse Params that break one of the trainer's rules, naming the Params (``ValueError``).

        The values reach the trainer as its arguments do: an unset switch as false; flags the
        form does not offer keep the trainer's defaults. Each Param's own bounds are its schema's.

        :param params: a run's Params by name (others than the training ones are left alone).
        """
        if self.flags is None:
            return
        values: dict[str, Any] = {}
        for param, flag in self.flags.by_param().items():
            if param not in params:
                continue
            try:
                values[flag.name] = _flag_value(flag, params[param])
            except ValueError:
                values[flag.name] = params[param]  # the flag's own check names it
        found = flags.problems(self.flags, values, name=self.param_name)
        if found:
            raise ValueError(f"the Params of trainer {self.name!r} do not fit together: " + "; ".join(found))

    def check_run(self, context: Mapping[str, Any]) -> None:
        """A task's ``pre_execute`` hook: fail the run, without retries, when its Params break a rule.

        :param context: the task's context; its ``params`` are checked (:meth:`check_params`).
        """
        from airflow.sdk.exceptions import AirflowFailException

        try:
            self.check_params(context["params"])
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None


IMAGE_CLASSIFIER = TrainerSpec.from_flags(
    flags.IMAGE_CLASSIFIER,
    name="image_classifier",
    title="Image classifier",
    cmds=("python", "-m", "trainer.image_classifier"),
    dataset_uri="s3://datasets/digits/",
    model="image-classifier",
)

DIALOGUE_TRANSFORMER = TrainerSpec.from_flags(
    flags.DIALOGUE,
    name="dialogue",
    title="Dialogue Transformer",
    cmds=("python", "-m", "trainer.dialogue"),
    dataset_uri="s3://datasets/dialogue/",
    model="dialogue-transformer",
)


# By name: the trainers of the shipped DAGs.
TRAINERS: dict[str, TrainerSpec] = {t.name: t for t in (IMAGE_CLASSIFIER, DIALOGUE_TRANSFORMER)}
