"""A value the trigger form accepts is one the trainer accepts, and the other way round.

Every offered flag of every built-in trainer is walked just inside and just outside each of its
bounds, through each of its choices and a wrong one, and every rule between offered flags on both
sides of its line: once through the form (the Param's JSON schema, as Airflow validates it, then
the rule check the DAG makes before staging) and once through the trainer (the argument template
rendered as the training task renders it, parsed by the trainer's parser into its config).
"""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk.exceptions import ParamValidationError
from jinja2.nativetypes import NativeEnvironment

from kubetrain.trainers import TRAINERS, TrainerSpec
from kubetrain_contract.flags import Flag, Rule
from trainer.common.config import TrainerConfig, build_parser
from trainer.dialogue.train import DialogueConfig
from trainer.image_classifier.config import ClassifierConfig

DIRS = ["--data-dir=/data", "--checkpoint-dir=/checkpoints", "--output-dir=/output"]


CONFIGS: dict[str, type[TrainerConfig]] = {
    "image_classifier": ClassifierConfig,
    "dialogue": DialogueConfig,
}


def form_accepts(spec: TrainerSpec, values: dict[str, Any]) -> bool:
    """Whether the trigger form takes ``values`` (Params by name) and the DAG's rule check passes them."""
    params = spec.params()
    resolved = {}
    try:
        for name, param in params.items():
            resolved[name] = param.resolve(values[name]) if name in values else param.resolve()
    except ParamValidationError:
        return False
    try:
        spec.check_params(resolved)
    except ValueError:
        return False
    return True


def trainer_accepts(spec: TrainerSpec, values: dict[str, Any]) -> bool:
    """Whether the trainer takes the arguments the training task renders from ``values``."""
    params = {name: param.value for name, param in spec.params().items()} | values
    env = NativeEnvironment()
    arguments = [str(env.from_string(template).render(params=params)) for template in spec.arguments]
    config = CONFIGS[spec.name]
    parser = build_parser(config, prog="trainer", description="")
    parser.exit = parser.error = _refuse  # argparse ends the process on a bad value
    try:
        config(**vars(parser.parse_args([*DIRS, *arguments])))
    except (ValueError, _Refused):
        return False
    return True


class _Refused(Exception):
    pass


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise _Refused(args)


def _edge_values(flag: Flag) -> list[Any]:
    """Values just inside and just outside each bound, each choice and a wrong one, the default."""
    step = 1 if flag.kind == "int" else 1e-6
    values = [flag.default]
    for bound, inside in (
        (flag.minimum, +1),
        (flag.maximum, -1),
        (flag.exclusive_minimum, +1),
        (flag.exclusive_maximum, -1),
    ):
        if bound is not None:
            values += [bound, bound + inside * step, bound - inside * step]
    if flag.kind == "enum":
        values += [*flag.choices, "no-such-choice" if isinstance(flag.choices[0], str) else 999]
    if flag.kind == "bool":
        values += ["auto", "true", "false", "maybe"] if flag.nullable else [True, False, None]
    if flag.nullable:
        values.append(None)
    return values


def _cases() -> list[tuple[str, str, Any]]:
    return [
        (trainer, flag.param, value)
        for trainer, spec in TRAINERS.items()
        for flag in spec.flags.offered()
        for value in _edge_values(flag)
    ]


@pytest.mark.parametrize(("trainer", "param", "value"), _cases())
def test_form_and_trainer_agree_on_every_bound_and_choice(trainer, param, value):
    spec = TRAINERS[trainer]
    assert form_accepts(spec, {param: value}) == trainer_accepts(spec, {param: value}), (param, value)


def test_the_walk_meets_both_answers():
    """The edges are real edges: the form refuses some values of every bounded or enumerated flag.

    A switch takes any value (true, false, or empty for false).
    """
    for spec in TRAINERS.values():
        for flag in spec.flags.offered():
            answers = {form_accepts(spec, {flag.param: v}) for v in _edge_values(flag)}
            bounded = (
                flag.kind == "enum"
                or (flag.kind == "bool" and flag.nullable)
                or any(
                    getattr(flag, b) is not None
                    for b in ("minimum", "maximum", "exclusive_minimum", "exclusive_maximum")
                )
            )
            assert answers == ({True, False} if bounded else {True}), flag.name


def _rule_cases(spec: TrainerSpec, rule: Rule) -> list[tuple[dict[str, Any], bool]]:
    """Values of the rule's Params on both sides of its line, with the table's verdict."""
    table = spec.flags
    base: dict[str, Any] = {}
    if rule.when is not None:
        name, op, operand = rule.when
        base[table[name].param] = operand if op == "==" else None
    target = table[rule.flag]
    if rule.op == ">=":
        sides = [(rule.operand, True), (rule.operand - 1, False)]
    elif rule.op == "<=":
        sides = [(rule.operand, True), (rule.operand + 1, False)]
    elif rule.op == "multiple_of":
        other = table[rule.operand.name]
        base[other.param] = 4
        sides = [(8, True), (6, False)]
    else:
        sides = [(rule.operand, True)]
    cases = [({**base, target.param: value}, fits) for value, fits in sides]
    if rule.when is not None and rule.when[1] == "==":
        # the rule does not apply when its condition does not hold
        others = [c for c in table[rule.when[0]].choices if c != rule.when[2]]
        cases += [
            ({**base, table[rule.when[0]].param: others[0], target.param: value}, True) for value, _ in sides
        ]
    return cases


def _offered_rules() -> list[tuple[str, Rule]]:
    return [
        (trainer, rule)
        for trainer, spec in TRAINERS.items()
        for rule in spec.flags.rules
        if all(spec.flags[name].form and spec.flags[name].form.offered for name in rule.names())
    ]


@pytest.mark.parametrize(("trainer", "rule"), _offered_rules(), ids=lambda x: getattr(x, "flag", x))
def test_form_and_trainer_agree_on_each_rule_between_flags(trainer, rule):
    spec = TRAINERS[trainer]
    for values, fits in _rule_cases(spec, rule):
        assert form_accepts(spec, values) is fits, values
        assert trainer_accepts(spec, values) is fits, values


def test_the_rules_the_forms_can_break_are_walked():
    walked = {(trainer, rule.flag) for trainer, rule in _offered_rules()}
    assert {("image_classifier", "image_size"), ("dialogue", "hidden_size")} <= walked


def test_a_broken_rule_names_the_params_as_the_form_shows_them():
    spec = TRAINERS["image_classifier"]
    with pytest.raises(ValueError) as info:
        spec.check_params({"architecture": "mobilenet_v2", "image_size": 31})
    assert str(info.value) == (
        "the Params of trainer 'image_classifier' do not fit together: "
        "image_size must be >= 32 with architecture mobilenet_v2, got 31"
    )
