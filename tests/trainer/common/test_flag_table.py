"""The trainer reads its flags from the contract's table: fields, parser, checks, and the GPU settings resolved per device."""

from __future__ import annotations

import dataclasses

import pytest

from kubetrain_contract import flags
from kubetrain_contract.flags import Flag, Form, Other, Rule, TrainerFlags
from trainer.common.config import TrainerConfig, build_parser, parse_config
from trainer.image_classifier.config import ClassifierConfig

DIRS = {"data_dir": "/data", "checkpoint_dir": "/checkpoints", "output_dir": "/output"}


@pytest.mark.parametrize(
    ("cls", "table"), [(TrainerConfig, flags.COMMON), (ClassifierConfig, flags.IMAGE_CLASSIFIER.flags)]
)
def test_a_config_has_one_field_per_flag_with_the_table_s_default(cls, table):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert list(fields) == [flag.name for flag in table]
    for flag in table:
        assert fields[flag.name].default == flag.default, flag.name
        assert fields[flag.name].metadata["hyper"] is flag.hyper, flag.name
    defaults = vars(build_parser(cls, prog="t", description="").parse_args([]))
    assert defaults == {flag.name: flag.default for flag in table}


def test_the_parser_reads_unset_and_three_state_values():
    parser = build_parser(ClassifierConfig, prog="t", description="")

    def parsed(*argv: str) -> dict:
        return vars(parser.parse_args(list(argv)))

    assert parsed("--max-steps=none")["max_steps"] is None and parsed("--max-steps=7")["max_steps"] == 7
    assert parsed("--steps-per-execution=auto")["steps_per_execution"] is None
    assert [
        parsed(a)["jit_compile"] for a in ("--jit-compile", "--no-jit-compile", "--jit-compile=auto")
    ] == [
        True,
        False,
        None,
    ]
    assert parsed("--jit-compile=false")["jit_compile"] is False and parsed()["jit_compile"] is None
    assert parsed("--precision=mixed_bfloat16", "--alpha=0.5", "--channels=1")["alpha"] == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision=float16"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"precision": "float16"},
            "--precision must be one of auto, float32, mixed_float16, mixed_bfloat16, got",
        ),
        (
            {"steps_per_execution": 0},
            "--steps-per-execution must be an integer from 1 to 10000 (or unset), got 0",
        ),
        ({"jit_compile": "yes"}, "--jit-compile must be true or false (or unset), got 'yes'"),
        ({"image_size": 2000}, "--image-size must be an integer from 8 to 1024, got 2000"),
        (
            {"model": "mobilenet_v2", "image_size": 31},
            "--image-size must be >= 32 with --model mobilenet_v2, got 31",
        ),
        ({"epochs": True}, "--epochs must be an integer >= 1, got True"),
    ],
)
def test_the_config_checks_through_the_table_naming_the_flag(values, message):
    with pytest.raises(ValueError) as info:
        ClassifierConfig(**DIRS, **values)
    assert message in str(info.value)


def test_a_bad_value_on_the_command_line_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(
            ClassifierConfig,
            [
                "--model=mobilenet_v2",
                "--image-size=16",
                *(f"--{k.replace('_', '-')}={v}" for k, v in DIRS.items()),
            ],
            prog="t",
            description="",
        )
    assert info.value.code == 2
    assert "--image-size must be >= 32 with --model mobilenet_v2, got 16" in capsys.readouterr().err


def test_the_dialogue_table_has_the_new_defaults():
    table = flags.DIALOGUE
    assert table["warmup_steps"].default is None and table["warmup_steps"].minimum == 1
    assert table["monitor"].default == "val_loss" and table["batch_size"].default == 64
    assert flags.problems(table, {"warmup_steps": 0}) == [
        "--warmup-steps must be an integer >= 1 (or unset), got 0"
    ]
    assert flags.problems(table, {"hidden_size": 30, "num_heads": 4}) == [
        "--hidden-size must be a multiple of --num-heads 4, got 30"
    ]
    assert flags.problems(table, {"hidden_size": 32, "num_heads": 4, "warmup_steps": None}) == []


def test_the_table_refuses_a_flag_or_rule_that_does_not_hold_together():
    with pytest.raises(ValueError, match=r"flag 'n': default 0 is not an integer >= 1"):
        Flag("n", "int", 0, "n", minimum=1)
    with pytest.raises(ValueError, match="an enum needs choices"):
        Flag("e", "enum", "a", "e")
    with pytest.raises(ValueError, match=r"a rule names unknown flags \['m'\]"):
        TrainerFlags("t", (Flag("n", "int", 1, "n"),), (Rule("n", "multiple_of", Other("m")),))
    with pytest.raises(ValueError, match="has no flag 'seed' that a form can offer"):
        flags.IMAGE_CLASSIFIER.offered("seed")
    assert Flag("x", "int", 1, "x", form=Form("X", param="y")).param == "y"


def test_gpu_settings_default_to_what_a_gpu_wants_and_resolve_per_device():
    from trainer.common.runtime import resolve_gpu_settings

    config = ClassifierConfig(**DIRS)
    assert (config.precision, config.steps_per_execution, config.jit_compile) == ("auto", None, None)
    cpu = resolve_gpu_settings(config, [])
    assert cpu == {"precision": "float32", "steps_per_execution": 1, "jit_compile": False}
    assert resolve_gpu_settings(config, [(8, 0), (9, 0)])["precision"] == "mixed_bfloat16"
    assert resolve_gpu_settings(config, [(7, 5)]) == {
        "precision": "mixed_float16",
        "steps_per_execution": 16,
        "jit_compile": True,
    }
    # one older (or unknown) GPU among newer ones: float16 works on all of them
    assert resolve_gpu_settings(config, [(8, 6), (7, 0)])["precision"] == "mixed_float16"
    assert resolve_gpu_settings(config, [None])["precision"] == "mixed_float16"
    chosen = ClassifierConfig(**DIRS, precision="mixed_bfloat16", jit_compile=False, steps_per_execution=4)
    assert resolve_gpu_settings(chosen, [(7, 5)]) == {
        "precision": "mixed_bfloat16",
        "steps_per_execution": 4,
        "jit_compile": False,
    }


def test_auto_precision_on_this_cpu_is_float32_and_recorded():
    import keras
    import tensorflow as tf

    from trainer.common.runtime import configure

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    config = ClassifierConfig(**DIRS)
    runtime = configure(config)
    assert keras.mixed_precision.dtype_policy().name == "float32"
    resolved = {"precision": "float32", "steps_per_execution": 1, "jit_compile": False}
    assert runtime.facts() == resolved and runtime.mixed_precision is False
    # from start-up on, the config says what runs (the loop and metrics.json read it)
    assert {name: getattr(config, name) for name in resolved} == resolved
