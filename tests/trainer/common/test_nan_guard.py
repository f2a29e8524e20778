"""The NaN guard: a diverged run stops by name with where it can go on from; mixed precision's skipped
overflow steps do not stop it (plain counters, no device)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from trainer.common.config import TrainerConfig
from trainer.common.contract import TrainingDiverged
from trainer.common.nan_guard import check_steps, check_weights, learning_rate_flag
from trainer.common.steps import Counters

LAST = "The last finite checkpoint, ckpt-4 (step 4), stays in /ckpt."
RERUN = "a rerun resumes from that checkpoint and is likely to diverge again"


def counters(loss: int = 0, grads: int = 0, first: int = -1, loss_scale: float | None = None) -> Counters:
    return Counters(
        steps=8,
        nonfinite_loss=loss,
        nonfinite_grads=grads,
        first_nonfinite=first,
        input_wait_s=0.0,
        epoch_sums={},
        window={},
        loss_scale=loss_scale,
    )


def check(c: Counters) -> None:
    check_steps(c, before=8, epoch=1, last_checkpoint=LAST, rerun=RERUN, learning_rate_flag="--learning-rate")


@pytest.mark.parametrize(
    ("c", "message"),
    [
        (
            counters(loss=1, first=3),
            "training diverged at step 11 (epoch 2): the loss was NaN or infinite (1 step(s)",
        ),
        (
            counters(grads=2, first=1),
            "at step 9 (epoch 2): the all-replica gradient was NaN or infinite (0 step(s)",
        ),
        (
            counters(grads=1, first=5, loss_scale=0.5),
            "at step 13 (epoch 2): the all-replica gradient was NaN or infinite even with the loss scale down to 0.5",
        ),
    ],
    ids=["loss", "gradient", "loss-scale-exhausted"],
)
def test_a_diverged_step_stops_the_run_naming_it_and_the_last_finite_checkpoint(c, message):
    with pytest.raises(TrainingDiverged) as info:
        check(c)
    text = str(info.value)
    assert message in text
    assert (
        LAST in text
        and "Lower --learning-rate, clip the gradients or check the data" in text
        and RERUN in text
    )


def test_finite_steps_and_overflows_under_loss_scaling_go_on(caplog):
    caplog.set_level(logging.INFO)
    check(counters())
    assert caplog.text == ""
    check(counters(grads=2, first=2, loss_scale=16384.0))
    assert (
        "mixed precision: 2 step(s) with overflowing gradients skipped; loss scale now 16384" in caplog.text
    )


def test_weights_that_stopped_being_finite_are_not_checkpointed():
    check_weights([], step=8, last_checkpoint=LAST)
    broken = [f"dense/kernel_{i}" for i in range(7)]
    with pytest.raises(TrainingDiverged) as info:
        check_weights(broken, step=12, last_checkpoint=LAST)
    assert str(info.value) == (
        "training diverged by step 12: 7 variable(s) hold NaN or infinite values (dense/kernel_0, dense/kernel_1, "
        f"dense/kernel_2, dense/kernel_3, dense/kernel_4 ...); not checkpointed. {LAST}"
    )


@dataclass
class ScaledConfig(TrainerConfig):
    learning_rate_scale: float = 1.0


@dataclass
class RatedConfig(TrainerConfig):
    learning_rate: float = 0.01


def test_the_advice_names_the_trainers_learning_rate_flag(tmp_path):
    dirs = {
        "data_dir": str(tmp_path),
        "checkpoint_dir": str(tmp_path / "c"),
        "output_dir": str(tmp_path / "o"),
    }
    assert learning_rate_flag(RatedConfig(**dirs)) == "--learning-rate"
    assert learning_rate_flag(ScaledConfig(**dirs)) == "--learning-rate-scale"
    assert learning_rate_flag(TrainerConfig(**dirs)) == "the learning rate"
