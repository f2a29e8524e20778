"""The built-in trainers' flags, each described once: type, default, bounds, help, form, and the rules between them.

Both sides derive from this table (docs/STYLE habit 17): the trainer's argparse parser and its
config checks (``trainer.common.config``), and the Airflow side's trigger-form Params and the
argument templates that pass each offered flag exactly once (``kubetrain.trainers``). A value
the form accepts is therefore one the trainer accepts, and the other way round
(tests/plugins/test_flag_table.py walks every bound and rule through both).

A :class:`Flag` is one command-line flag (``batch_size`` is ``--batch-size``); its
:class:`Form` says how a DAG's trigger form shows it, and whether the trainer's DAGs offer it
(``offered=False``: only a DAG that asks for it, such as the distributed one). A :class:`Rule`
relates two flags (``--image-size`` >= 32 with ``--model mobilenet_v2``): the JSON schema of one
Param cannot say it, so the DAG checks the rules before it stages the dataset
(:meth:`kubetrain.trainers.TrainerSpec.check_params`) and the trainer checks them on start.

:func:`problems` and :func:`check` check a mapping of values against a trainer's table and name
the flag as the caller shows it: ``--image-size`` on the command line, ``image_size`` in a form.

The GPU settings (``--precision``, ``--steps-per-execution``, ``--jit-compile``) default to
``auto`` (unset), which ``trainer.common.runtime`` resolves for the devices the pod got: on a GPU
what a GPU wants, on a CPU what keeps a CPU run as it always was. ``auto`` precision is
mixed_bfloat16 on GPUs of compute capability 8.0 or more, mixed_float16 (with loss scaling) on
older ones and float32 on CPUs; steps per call are 16 with a GPU and 1 on CPUs; XLA compiles on
GPUs only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DIALOGUE",
    "IMAGE_CLASSIFIER",
    "KINDS",
    "MONITORS",
    "PRECISIONS",
    "TABLES",
    "Flag",
    "Form",
    "Other",
    "Rule",
    "TrainerFlags",
    "check",
    "cli_name",
    "expected",
    "parse_text",
    "problem",
    "problems",
]

KINDS = ("int", "float", "bool", "str", "enum")
# Validation metrics a run can monitor, and whether larger is better.
MONITORS = {"val_accuracy": "max", "val_loss": "min"}
PRECISIONS = ("auto", "float32", "mixed_float16", "mixed_bfloat16")
# Distribution strategies (trainer/README.md, "Several workers").
STRATEGIES = ("auto", "mirrored", "multi_worker", "parameter_server")
# Words that stand for "unset" on the command line (``--max-steps=none``, ``--jit-compile=auto``).
UNSET_WORDS = ("", "none", "auto")


def cli_name(name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Form:
    """How a DAG's trigger form shows a flag.

    Attributes:
        title: the field's label.
        section: the form section (``Training`` or ``Model``).
        param: the Param's name, when it is not the flag's (``architecture`` for ``--model``).
        offered: whether the trainer's DAGs offer it; ``False``: only DAGs that ask for it.
    """

    title: str
    section: str = "Training"
    param: str | None = None
    offered: bool = True


@dataclass(frozen=True)
class Flag:
    """One flag of a trainer.

    Attributes:
        name: the field name (``batch_size``; on the command line ``--batch-size``).
        kind: ``int``, ``float``, ``bool``, ``str`` or ``enum``.
        default: the default value (``None``: unset; then ``nullable`` must be true).
        help: what it does, for ``--help`` and the form's description.
        minimum: the smallest allowed value (numbers).
        maximum: the largest allowed value (numbers).
        exclusive_minimum: values must be greater than this (numbers).
        exclusive_maximum: values must be less than this (numbers).
        choices: the allowed values of an ``enum``.
        nullable: whether ``None`` (unset) is allowed.
        hyper: whether it is a hyperparameter, recorded in params.json.
        form: how the trigger form shows it; ``None``: no form offers it.
        metavar: how ``--help`` shows the value.
        note: words added to the expected value in error messages.
    """

    name: str
    kind: str
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    choices: tuple[Any, ...] = ()
    nullable: bool = False
    hyper: bool = True
    form: Form | None = None
    metavar: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"flag {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "enum" and not self.choices:
            raise ValueError(f"flag {self.name!r}: an enum needs choices")
        wrong = problem(self, self.default)
        if wrong:
            raise ValueError(f"flag {self.name!r}: default {self.default!r} is not {wrong}")

    @property
    def param(self) -> str:
        """The Param's name in a DAG's form."""
        return (self.form.param if self.form else None) or self.name

    @property
    def value_type(self) -> type:
        """The Python type of a value (of the choices, for an enum)."""
        if self.kind == "enum":
            return type(self.choices[0])
        return {"int": int, "float": float, "bool": bool, "str": str}[self.kind]

    def replace(self, **changes: Any) -> Flag:
        """This flag with ``changes`` (another trainer's default, form or bounds)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Other:
    """A rule's operand that is the value of another flag (``a multiple of --num-heads``)."""

    name: str


# Rule operators: a test of (value, operand) and the words for what is expected.
_OPERATORS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "==": (lambda v, o: v == o, "{operand}"),
    "!=": (lambda v, o: v != o, "other than {operand}"),
    ">=": (lambda v, o: v >= o, ">= {operand}"),
    "<=": (lambda v, o: v <= o, "<= {operand}"),
    "unset": (lambda v, o: v is None, "unset"),
    "set": (lambda v, o: v is not None, "set"),
    "multiple_of": (lambda v, o: bool(o) and v % o == 0, "a multiple of {operand}"),
}


@dataclass(frozen=True)
class Rule:
    """A rule between flags: ``flag op operand``, checked when ``when`` holds (always, if ``when`` is None).

    Attributes:
        flag: the flag the message names.
        op: one of ``==``, ``!=``, ``>=``, ``<=``, ``unset``, ``set``, ``multiple_of``.
        operand: a value, or :class:`Other` for another flag's value.
        when: ``(flag, op, value)``: the rule applies only when this holds.
        expected: the expected value in words, with ``{name}`` for the names of the flags as the
            caller shows them; default: the operator's words and ``with <when flag> <value>``.
    """

    flag: str
    op: str
    operand: Any = None
    when: tuple[str, str, Any] | None = None
    expected: str | None = None

    def __post_init__(self) -> None:
        for op in (self.op, self.when[1] if self.when else "=="):
            if op not in _OPERATORS:
                raise ValueError(
                    f"rule on {self.flag!r}: operator {op!r} is not one of {', '.join(_OPERATORS)}"
                )

    def names(self) -> set[str]:
        """The flags the rule reads."""
        found = {self.flag}
        if isinstance(self.operand, Other):
            found.add(self.operand.name)
        if self.when:
            found.add(self.when[0])
        return found

    def applies(self, values: Mapping[str, Any]) -> bool:
        if self.when is None:
            return True
        name, op, operand = self.when
        return _holds(op, values.get(name), operand)

    def problem(self, values: Mapping[str, Any], name: Callable[[str], str] = cli_name) -> str | None:
        """The error message if ``values`` break the rule, else None."""
        if not self.applies(values):
            return None
        value = values.get(self.flag)
        operand = values.get(self.operand.name) if isinstance(self.operand, Other) else self.operand
        if _holds(self.op, value, operand):
            return None
        shown = f"{name(self.operand.name)} {operand}" if isinstance(self.operand, Other) else operand
        if self.expected is not None:
            words = self.expected.format(**{n: name(n) for n in self.names()})
        else:
            words = _OPERATORS[self.op][1].format(operand=shown)
            if self.when:
                words += f" with {name(self.when[0])} {self.when[2]}"
        return f"{name(self.flag)} must be {words}, got {value!r}"


def _holds(op: str, value: Any, operand: Any) -> bool:
    if op not in ("unset", "set") and (value is None or operand is None):
        return True  # an unset value is another rule's concern (or allowed)
    try:
        return _OPERATORS[op][0](value, operand)
    except TypeError:
        return False


@dataclass(frozen=True)
class TrainerFlags:
    """A trainer's flags (the common ones, with the trainer's own defaults, and its own) and rules."""

    trainer: str
    flags: tuple[Flag, ...]
    rules: tuple[Rule, ...] = ()
    by_name: dict[str, Flag] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {f.name: f for f in self.flags}
        if len(by_name) != len(self.flags):
            raise ValueError(f"trainer {self.trainer!r}: a flag is listed twice")
        for rule in self.rules:
            unknown = rule.names() - set(by_name)
            if unknown:
                raise ValueError(f"trainer {self.trainer!r}: a rule names unknown flags {sorted(unknown)}")
        object.__setattr__(self, "by_name", by_name)

    def __getitem__(self, name: str) -> Flag:
        return self.by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def defaults(self) -> dict[str, Any]:
        return {f.name: f.default for f in self.flags}

    def offered(self, *extra: str) -> tuple[Flag, ...]:
        """The flags a DAG's form offers: those marked offered, and ``extra`` ones that have a form."""
        for name in extra:
            if name not in self.by_name or self.by_name[name].form is None:
                raise ValueError(f"trainer {self.trainer!r} has no flag {name!r} that a form can offer")
        return tuple(f for f in self.flags if f.form and (f.form.offered or f.name in extra))

    def by_param(self) -> dict[str, Flag]:
        """Flags by the name of their Param."""
        return {f.param: f for f in self.flags if f.form}


def expected(flag: Flag) -> str:
    """What ``flag`` accepts, in words: ``an integer from 1 to 64``, ``one of cnn, mobilenet_v2``."""
    if flag.kind == "enum":
        words = "one of " + ", ".join(str(c) for c in flag.choices)
    elif flag.kind == "bool":
        words = "true or false"
    elif flag.kind == "str":
        words = "a string"
    else:
        words = _number_words(flag)
    if flag.note:
        words += f" ({flag.note})"
    if flag.nullable:
        words += " (or unset)"
    return words


def _number_words(flag: Flag) -> str:
    low, high = flag.minimum, flag.maximum
    low_x, high_x = flag.exclusive_minimum, flag.exclusive_maximum
    if flag.kind == "int":
        if low is not None and high is not None:
            return f"an integer from {low} to {high}"
        bounds = [f">= {low}" if low is not None else "", f"<= {high}" if high is not None else ""]
        return " ".join(["an integer", " and ".join(b for b in bounds if b)]).strip()
    lower = (low, "[") if low is not None else (low_x, "(")
    upper = (high, "]") if high is not None else (high_x, ")")
    # a share of something (a split, a dropout rate); a learning rate in (0, 1] is a number
    if lower[0] == 0 and upper[0] == 1 and (lower[1], upper[1]) != ("(", "]"):
        if lower[1] == "(" and upper[1] == ")":
            return "a fraction strictly between 0 and 1"
        return f"a fraction in {lower[1]}0, 1{upper[1]}"
    bounds = [
        f">= {low}" if low is not None else (f"> {low_x}" if low_x is not None else ""),
        f"<= {high}" if high is not None else (f"< {high_x}" if high_x is not None else ""),
    ]
    return " ".join(["a number", " and ".join(b for b in bounds if b)]).strip()


def problem(flag: Flag, value: Any) -> str | None:
    """What ``flag`` expects, if ``value`` is not one of its values; None if it is."""
    if value is None:
        return None if flag.nullable else expected(flag)
    if flag.kind == "enum":
        ok = not isinstance(value, bool) and any(value == c and type(value) is type(c) for c in flag.choices)
        # an integral float choice (alpha 1.0) accepts the integer 1, as JSON schema does
        ok = ok or (
            isinstance(value, int)
            and not isinstance(value, bool)
            and any(isinstance(c, float) and value == c for c in flag.choices)
        )
    elif flag.kind == "bool":
        ok = isinstance(value, bool)
    elif flag.kind == "str":
        ok = isinstance(value, str)
    elif flag.kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and _in_bounds(flag, value)
    else:
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and _in_bounds(flag, value)
        )
    return None if ok else expected(flag)


def _in_bounds(flag: Flag, value: float) -> bool:
    return (
        (flag.minimum is None or value >= flag.minimum)
        and (flag.maximum is None or value <= flag.maximum)
        and (flag.exclusive_minimum is None or value > flag.exclusive_minimum)
        and (flag.exclusive_maximum is None or value < flag.exclusive_maximum)
    )


def problems(
    table: TrainerFlags, values: Mapping[str, Any], *, name: Callable[[str], str] = cli_name
) -> list[str]:
    """Every error of ``values`` (by flag name; missing ones take their defaults), each naming the flag.

    Args:
        table: the trainer's flags and rules.
        values: values by flag name; names the table does not know are left alone.
        name: how to show a flag's name: ``--image-size`` (default) or a Param's name.
    """
    merged = {**table.defaults(), **{k: v for k, v in values.items() if k in table}}
    found = []
    for flag in table.flags:
        wrong = problem(flag, merged[flag.name])
        if wrong:
            found.append(f"{name(flag.name)} must be {wrong}, got {merged[flag.name]!r}")
    if found:
        return found  # the rules compare values that are each fine
    return [message for rule in table.rules if (message := rule.problem(merged, name))]


def check(table: TrainerFlags, values: Mapping[str, Any], *, name: Callable[[str], str] = cli_name) -> None:
    """Raise ``ValueError`` with the first of :func:`problems`, if any."""
    found = problems(table, values, name=name)
    if found:
        raise ValueError(found[0])


def parse_text(flag: Flag, text: str) -> Any:
    """A command-line value of ``flag`` from its text (argparse's ``type``); ``none``/``auto``/empty: unset."""
    if flag.nullable and text.strip().lower() in UNSET_WORDS:
        return None
    kind = flag.value_type
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "on", "yes", "1"):
            return True
        if lowered in ("false", "off", "no", "0"):
            return False
        raise ValueError(f"{text!r} is not true or false")
    return kind(text)


# ---------------------------------------------------------------------------------------------
# The table. Flags shared by every trainer: the contract directories and the training loop.

_LOCATION: dict[str, Any] = {
    "kind": "str",
    "default": None,
    "nullable": True,
    "hyper": False,
    "metavar": "DIR",
}

COMMON: tuple[Flag, ...] = (
    Flag("data_dir", help="dataset directory (default: $DATA_DIR)", **_LOCATION),
    Flag(
        "checkpoint_dir",
        help="checkpoints are written and resumed here (default: $CHECKPOINT_DIR)",
        **_LOCATION,
    ),
    Flag(
        "output_dir",
        help="metrics, history, params and the model go here (default: $OUTPUT_DIR)",
        **_LOCATION,
    ),
    Flag("epochs", "int", 10, "passes over the training split", minimum=1, form=Form("Epochs")),
    Flag(
        "max_steps",
        "int",
        None,
        "stop after this many optimizer steps in total, counting steps before a resume (unset: the epochs decide)",
        minimum=1,
        nullable=True,
        metavar="N",
        form=Form("Max steps", offered=False),
    ),
    Flag(
        "batch_size",
        "int",
        32,
        "global batch size, split evenly over the devices",
        minimum=1,
        form=Form("Batch size"),
    ),
    Flag(
        "validation_split",
        "float",
        0.2,
        "fraction of the data held out for validation (seeded split)",
        exclusive_minimum=0,
        exclusive_maximum=1,
        form=Form("Validation split"),
    ),
    Flag("seed", "int", 42, "seed of the split, the shuffles, augmentation and initialisation", minimum=0),
    Flag(
        "checkpoint_every_steps",
        "int",
        100,
        "write a checkpoint every N steps (0: only at epoch ends and on SIGTERM)",
        minimum=0,
        metavar="N",
        form=Form("Checkpoint every N steps", offered=False),
    ),
    Flag("keep_checkpoints", "int", 3, "how many recent checkpoints to keep", minimum=1, metavar="K"),
    Flag("log_every_steps", "int", 10, "log the training loss every N steps", minimum=1, metavar="N"),
    Flag(
        "precision",
        "enum",
        "auto",
        "compute precision: auto (mixed_bfloat16 on GPUs of compute capability 8.0 or more, mixed_float16 "
        "with dynamic loss scaling on older GPUs, float32 on CPUs), float32, mixed_float16 or mixed_bfloat16",
        choices=PRECISIONS,
        form=Form("Precision"),
    ),
    Flag(
        "virtual_cpus",
        "int",
        0,
        "split the CPU into N logical devices and mirror training over them "
        "(exercises multi-device training without GPUs; 0: off)",
        minimum=0,
        maximum=64,
        metavar="N",
    ),
    Flag(
        "steps_per_execution",
        "int",
        None,
        "training steps per call into the compiled step function; the host reads results only when it logs, "
        "checkpoints, samples or ends an epoch, so any value trains exactly as single steps, and SIGTERM waits "
        "for up to K steps (unset: 16 with a GPU, which keeps it busy with small steps; 1 on CPUs)",
        minimum=1,
        maximum=10_000,
        nullable=True,
        metavar="K",
        form=Form("Steps per execution"),
    ),
    Flag(
        "jit_compile",
        "bool",
        None,
        "compile the forward and backward pass with XLA (unset: on with a GPU, off on CPUs)",
        nullable=True,
        form=Form("XLA compilation"),
    ),
    Flag(
        "monitor",
        "enum",
        "val_accuracy",
        "validation metric that picks the best epoch and drives --patience",
        choices=tuple(MONITORS),
    ),
    Flag(
        "patience",
        "int",
        0,
        "stop after N epochs without improvement of --monitor (0: never stop early)",
        minimum=0,
        metavar="N",
    ),
    Flag(
        "restore_best",
        "bool",
        True,
        "export the weights of the best epoch by --monitor, not those of the last epoch",
    ),
    Flag(
        "deterministic",
        "bool",
        False,
        "deterministic TensorFlow ops (tf.config.experimental.enable_op_determinism): reruns repeat "
        "bit for bit, at a cost in speed on GPUs (see trainer/README.md)",
    ),
    Flag("tensorboard", "bool", True, "write TensorBoard event files to OUTPUT_DIR/tensorboard", hyper=False),
    Flag(
        "strategy",
        "enum",
        "auto",
        "distribution over devices and pods: auto (MirroredStrategy over this pod's devices, "
        "multi_worker when TF_CONFIG names several workers, parameter_server when it names parameter servers), "
        "mirrored, multi_worker or parameter_server",
        choices=STRATEGIES,
        hyper=False,
    ),
)


def _trainer(
    trainer: str, own: Iterable[Flag], rules: Iterable[Rule] = (), **defaults: dict[str, Any]
) -> TrainerFlags:
    """The common flags (with ``defaults``: changes per flag) followed by the trainer's ``own``."""
    common = tuple(f.replace(**defaults[f.name]) if f.name in defaults else f for f in COMMON)
    return TrainerFlags(trainer, (*common, *own), tuple(rules))


MOBILENET_ALPHAS = (0.35, 0.5, 0.75, 1.0, 1.3, 1.4)

IMAGE_CLASSIFIER = _trainer(
    "image_classifier",
    (
        Flag(
            "model",
            "enum",
            "cnn",
            "network: a small CNN or MobileNetV2 (ImageNet weights only with --weights)",
            choices=("cnn", "mobilenet_v2"),
            form=Form("Architecture", "Model", param="architecture"),
        ),
        Flag(
            "learning_rate",
            "float",
            1e-3,
            "Adam learning rate",
            exclusive_minimum=0,
            maximum=1,
            form=Form("Learning rate"),
        ),
        Flag(
            "image_size",
            "int",
            64,
            "images are resized to SIZE x SIZE pixels (>= 32 for mobilenet_v2)",
            minimum=8,
            maximum=1024,
            metavar="SIZE",
            form=Form("Image size", "Model"),
        ),
        Flag("channels", "enum", 3, "colour channels the images are decoded to", choices=(1, 3)),
        Flag(
            "filters",
            "int",
            32,
            "filters of the CNN's first block (doubled in each of the next two)",
            minimum=1,
            maximum=1024,
        ),
        Flag("alpha", "enum", 1.0, "MobileNetV2 width multiplier", choices=MOBILENET_ALPHAS),
        Flag(
            "weights",
            "str",
            None,
            "local MobileNetV2 weights file (.weights.h5 or .h5, without the top); never downloaded",
            nullable=True,
            metavar="PATH",
        ),
        Flag("freeze_base", "bool", True, "keep MobileNetV2's loaded weights frozen (only with --weights)"),
        Flag(
            "dropout",
            "float",
            0.2,
            "dropout before the classification layer",
            minimum=0,
            exclusive_maximum=1,
        ),
        Flag(
            "augment",
            "bool",
            False,
            "random shifts, brightness and contrast on training images",
            form=Form("Augment"),
        ),
        Flag("flip", "bool", False, "random left-right flips on training images (not for digits or text)"),
        Flag(
            "shuffle_buffer",
            "int",
            0,
            "0: each epoch reads the whole training split in a new seeded order, record by record where it lies "
            "in the prepared copy, with no shuffle buffer; N: read the shards in a new seeded order and shuffle "
            "through a seeded buffer of N images instead (for storage where random reads are slow)",
            minimum=0,
            metavar="N",
            note="0: a permutation of the whole split, no buffer",
        ),
        Flag(
            "verify_workers",
            "int",
            8,
            "threads that check and decode the images when the prepared copy is made",
            minimum=1,
            maximum=256,
        ),
        Flag(
            "prepared_dir",
            "str",
            None,
            "where prepared copies of DATA_DIR live, one folder per preprocessing (default: "
            "KUBETRAIN_PREPARED_DIR, else DATA_DIR/.kubetrain-prepared)",
            nullable=True,
            hyper=False,
            metavar="DIR",
        ),
    ),
    (
        Rule("channels", "==", 3, when=("model", "==", "mobilenet_v2")),
        Rule("image_size", ">=", 32, when=("model", "==", "mobilenet_v2")),
        Rule(
            "weights",
            "unset",
            when=("model", "!=", "mobilenet_v2"),
            expected="unset unless {model} mobilenet_v2 (the CNN has no pretrained weights)",
        ),
    ),
)

DIALOGUE_FORMATS = ("auto", "tsv", "jsonl", "cornell")

DIALOGUE = _trainer(
    "dialogue",
    (
        Flag(
            "data_format",
            "enum",
            "auto",
            "input format; auto detects it from the files in DATA_DIR",
            choices=DIALOGUE_FORMATS,
        ),
        Flag(
            "data_file",
            "str",
            None,
            "read only this file (or Cornell folder), relative to DATA_DIR",
            nullable=True,
            hyper=False,
            metavar="PATH",
        ),
        Flag(
            "max_pairs",
            "int",
            None,
            "use at most this many pairs (the first ones read)",
            minimum=2,
            nullable=True,
            metavar="N",
        ),
        Flag(
            "vocab_size",
            "int",
            8000,
            "tokenizer vocabulary size, four special tokens included",
            minimum=8,
            maximum=1_000_000,
            form=Form("Vocabulary", "Model"),
        ),
        Flag("min_count", "int", 1, "leave out words seen fewer times than this", minimum=1),
        Flag("lowercase", "bool", True, "lower-case text before tokenizing"),
        Flag(
            "max_input_length",
            "int",
            24,
            "question tokens kept (longer questions are cut)",
            minimum=2,
            maximum=1024,
            form=Form("Question length", "Model"),
        ),
        Flag(
            "max_output_length",
            "int",
            24,
            "reply tokens, </s> included (longer replies are cut)",
            minimum=2,
            maximum=1024,
            form=Form("Reply length", "Model"),
        ),
        Flag(
            "num_layers",
            "int",
            2,
            "encoder and decoder layers (each)",
            minimum=1,
            maximum=64,
            form=Form("Layers", "Model"),
        ),
        Flag(
            "num_heads",
            "int",
            4,
            "attention heads; must divide --hidden-size",
            minimum=1,
            form=Form("Heads", "Model"),
        ),
        Flag("hidden_size", "int", 128, "model width", minimum=2, form=Form("Hidden size", "Model")),
        Flag(
            "ff_size",
            "int",
            512,
            "feed-forward layer width",
            minimum=1,
            form=Form("Feed-forward size", "Model"),
        ),
        Flag(
            "dropout",
            "float",
            0.1,
            "dropout rate",
            minimum=0,
            exclusive_maximum=1,
            form=Form("Dropout", "Model"),
        ),
        Flag(
            "warmup_steps",
            "int",
            None,
            "steps of linear learning-rate warm-up (unset: 5% of the planned optimizer steps, --epochs x steps "
            "per epoch or --max-steps, at least 1)",
            minimum=1,
            nullable=True,
            metavar="N",
            form=Form("Warm-up steps"),
        ),
        # The schedule peaks at scale / sqrt(hidden_size * warmup_steps): the paper's 1.0 with its 4,000 warm-up
        # steps and width 512 peaks at 7e-4, but a short warm-up at 1.0 peaks over 1e-2, where the demo's model
        # learnt three times slower (val_loss 1.86 against 0.56 after 228 steps at 0.3).
        Flag(
            "learning_rate_scale",
            "float",
            0.3,
            "multiplier of the warm-up schedule's learning rate (1.0: Attention Is All You Need's)",
            exclusive_minimum=0,
        ),
        Flag("clip_norm", "float", 1.0, "clip gradients to this global norm", exclusive_minimum=0),
        Flag(
            "sample_every_steps",
            "int",
            200,
            "log greedy replies to validation questions every N steps",
            minimum=1,
            metavar="N",
            form=Form("Sample every N steps"),
        ),
        Flag("num_samples", "int", 3, "validation questions answered at each sample", minimum=1, maximum=100),
    ),
    (Rule("hidden_size", "multiple_of", Other("num_heads")),),
    batch_size={"default": 64},
    validation_split={"default": 0.1, "help": "fraction of the pairs held out for validation (seeded split)"},
    monitor={"default": "val_loss"},
    max_steps={"form": Form("Max steps")},
    log_every_steps={"form": Form("Log every N steps")},
)

# By trainer name, as metrics.json and kubetrain.trainers name them.
TABLES: dict[str, TrainerFlags] = {t.trainer: t for t in (IMAGE_CLASSIFIER, DIALOGUE)}
