"""Training progress: throughput split into start-up and steady state, the ETA, and the step and epoch
log lines with their scalars (plain values, no device)."""

from __future__ import annotations

import logging
import math

import pytest

from trainer.common.config import TrainerConfig
from trainer.common.progress import Progress, Throughput, format_eta, next_multiple, ratio
from trainer.common.steps import Counters


class Scalars:
    """Collects what would go to TensorBoard."""

    def __init__(self) -> None:
        self.written: list[tuple[str, int, dict]] = []
        self.flushed = 0

    def scalars(self, split: str, step: int, values: dict) -> None:
        self.written.append((split, step, values))

    def flush(self) -> None:
        self.flushed += 1


def config(tmp_path, **settings) -> TrainerConfig:
    dirs = {
        "data_dir": str(tmp_path),
        "checkpoint_dir": str(tmp_path / "c"),
        "output_dir": str(tmp_path / "o"),
    }
    return TrainerConfig(**dirs, **settings)


def counters(steps: int, examples: float, wait: float = 0.0, loss_scale: float | None = None) -> Counters:
    window = {
        "loss_sum": 0.5 * examples,
        "examples": examples,
        "correct": 0.25 * examples,
        "count": examples,
        "grad_norm_sum": 2.0 * steps,
        "applied_steps": float(steps),
    }
    return Counters(
        steps=steps,
        nonfinite_loss=0,
        nonfinite_grads=0,
        first_nonfinite=-1,
        input_wait_s=wait,
        epoch_sums={"loss_sum": 4.0, "examples": 8.0, "correct": 2.0, "count": 8.0},
        window=window,
        loss_scale=loss_scale,
    )


def test_the_first_stretch_is_start_up_and_the_rest_the_steady_state():
    t = Throughput()
    t.add(5.0, 1, 8, 0.5)  # tracing and compilation
    t.add(1.0, 10, 80, 0.25)
    t.add(1.0, 10, 80, 0.25)
    assert t.report() == {
        "examples_per_s": 80.0,
        "step_time_s": 0.1,
        "input_wait_s": 0.5,
        "compute_s": 1.5,
        "input_wait_fraction": 0.25,
        "startup_s": 5.0,
        "timed_steps": 20,
        "steady_state": True,
    }
    assert t.step_time() == pytest.approx(0.1)


def test_a_single_stretch_reports_its_own_figures_and_an_untimed_input_none():
    t = Throughput(input_timed=False)
    t.add(2.0, 4, 32, 0.0)
    report = t.report()
    assert (report["examples_per_s"], report["step_time_s"], report["steady_state"]) == (16.0, 0.5, False)
    assert report["input_wait_s"] is report["compute_s"] is report["input_wait_fraction"] is None
    assert Throughput().report()["step_time_s"] is None and Throughput().step_time() == 0.0


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0m00s"), (247.9, "4m07s"), (3599, "59m59s"), (3900, "1h05m"), (90000, "25h00m")],
)
def test_eta_format(seconds, text):
    assert format_eta(seconds) == text


@pytest.mark.parametrize(
    ("step", "every", "expected"), [(0, 4, 4), (3, 4, 4), (4, 4, 8), (5, 0, math.inf), (5, None, math.inf)]
)
def test_next_multiple(step, every, expected):
    assert next_multiple(step, every) == expected


def test_ratio_of_nothing_is_nan():
    assert ratio(3, 4) == 0.75 and math.isnan(ratio(1, 0))


def test_eta_counts_the_steps_left_up_to_max_steps(tmp_path):
    progress = Progress(
        config(tmp_path, epochs=10, max_steps=100),
        50,
        metric="accuracy",
        summaries=Scalars(),
        input_timed=True,
    )
    assert progress.total_steps == 100
    progress.throughput.add(9.0, 1, 8, 0.0)  # start-up: not the step time
    progress.throughput.add(2.0, 10, 80, 0.0)
    assert progress.eta(40) == "0m12s"  # 60 steps of 0.2 s
    assert progress.eta(120) == "0m00s"


def test_the_step_line_covers_the_window_since_the_last_one(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    scalars = Scalars()
    progress = Progress(
        config(tmp_path, epochs=2, log_every_steps=4),
        8,
        metric="accuracy",
        summaries=scalars,
        input_timed=True,
    )
    assert progress.due(1)  # the first read always logs
    progress.start_segment()
    progress.account(counters(3, 24, wait=0.0, loss_scale=1024.0))
    progress.log_step(
        step=3,
        epoch=0,
        batch_in_epoch=3,
        counters=counters(3, 24, loss_scale=1024.0),
        epoch_sums=counters(3, 24).epoch_sums,
        learning_rate=0.01,
    )
    assert (
        "step 3 epoch 1/2 batch 3/8 loss 0.5000 accuracy 0.2500 (epoch mean loss 0.5000) lr 0.01"
        in caplog.text
    )
    assert "input wait 0% eta" in caplog.text
    split, step, values = scalars.written[-1]
    assert (split, step) == ("train", 3)
    assert (
        values["gradient_global_norm"] == 2.0
        and values["loss_scale"] == 1024.0
        and values["examples_per_s"] > 0
    )
    assert progress.next_log == 4 and not progress.due(3) and progress.due(4)


def test_without_input_timing_the_wait_is_not_measured(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    progress = Progress(config(tmp_path), 8, metric="accuracy", summaries=Scalars(), input_timed=False)
    progress.start_segment()
    progress.account(counters(1, 8))
    progress.log_step(
        step=1,
        epoch=0,
        batch_in_epoch=1,
        counters=counters(1, 8),
        epoch_sums=counters(1, 8).epoch_sums,
        learning_rate=0.1,
    )
    assert "input wait not measured" in caplog.text


def test_the_epoch_line_marks_a_partial_epoch_and_the_best_so_far(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    scalars = Scalars()
    progress = Progress(config(tmp_path), 8, metric="accuracy", summaries=scalars, input_timed=True)
    row = {
        "epoch": 2,
        "step": 12,
        "loss": 0.5,
        "accuracy": 0.75,
        "val_loss": 0.25,
        "val_accuracy": 0.875,
        "partial": True,
    }
    progress.log_epoch(row, best="val_accuracy")
    assert (
        "epoch 2 (partial, --max-steps reached): loss 0.5000 accuracy 0.7500 val_loss 0.2500 val_accuracy 0.8750 "
        "(best val_accuracy so far)" in caplog.text
    )
    assert scalars.written == [
        ("train", 12, {"epoch_loss": 0.5, "epoch_accuracy": 0.75}),
        ("validation", 12, {"epoch_loss": 0.25, "epoch_accuracy": 0.875}),
    ]
    assert scalars.flushed == 1


def test_wall_time_counts_earlier_processes(tmp_path):
    progress = Progress(config(tmp_path), 8, metric="accuracy", summaries=Scalars(), input_timed=True)
    progress.resumed(100.0)
    assert 100.0 <= progress.wall_time() < 101.0
