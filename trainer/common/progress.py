"""Training progress: the run's wall time, the time of the steps, the step and epoch log lines with
the ETA, and their TensorBoard scalars.

The host reads the device's counters only at sync points (``trainer.common.steps``); what
happened between two reads is one *segment*. The first segment holds tracing, compilation
and the first input fill, so throughput is reported for the steady state after it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from trainer.common.config import TrainerConfig
from trainer.common.steps import Counters
from trainer.common.summaries import Summaries

log = logging.getLogger("kubetrain.trainer")

__all__ = ["Progress", "Throughput", "format_eta", "next_multiple", "ratio"]


def ratio(num: float, den: float) -> float:
    """``num / den``, NaN for an empty denominator (an epoch mean over no examples)."""
    return float(num) / float(den) if den else math.nan


def next_multiple(step: int, every: int | None) -> float:
    """The next multiple of ``every`` after ``step``; infinity when ``every`` is 0 or None (never)."""
    return (step // every + 1) * every if every else math.inf


def format_eta(seconds: float) -> str:
    """``1h05m`` from an hour up, else ``4m07s``."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


@dataclass
class Throughput:
    """Wall time of the training steps, split into the first stretch (tracing, compilation,
    first input fill) and the steady state, and input wait versus compute."""

    startup_s: float | None = None
    steady_s: float = 0.0
    steady_steps: int = 0
    steady_examples: float = 0.0
    steady_input_wait_s: float = 0.0
    all_s: float = 0.0
    all_steps: int = 0
    all_examples: float = 0.0
    all_input_wait_s: float = 0.0
    input_timed: bool = True

    def add(self, seconds: float, steps: int, examples: float, input_wait_s: float) -> None:
        self.all_s += seconds
        self.all_steps += steps
        self.all_examples += examples
        self.all_input_wait_s += input_wait_s
        if self.startup_s is None:
            self.startup_s = seconds
            return
        self.steady_s += seconds
        self.steady_steps += steps
        self.steady_examples += examples
        self.steady_input_wait_s += input_wait_s

    def step_time(self) -> float:
        """Seconds per step, steady state when there is one; 0.0 before any step."""
        seconds, steps = (
            (self.steady_s, self.steady_steps) if self.steady_steps else (self.all_s, self.all_steps)
        )
        return seconds / steps if steps else 0.0

    def report(self) -> dict[str, Any]:
        # A run of one stretch has no steady state: its figures include the start-up.
        steady = self.steady_steps > 0
        seconds = self.steady_s if steady else self.all_s
        steps = self.steady_steps if steady else self.all_steps
        examples = self.steady_examples if steady else self.all_examples
        wait = self.steady_input_wait_s if steady else self.all_input_wait_s
        timed = self.input_timed
        return {
            "examples_per_s": round(examples / seconds, 2) if seconds > 0 else 0.0,
            "step_time_s": round(seconds / steps, 6) if steps else None,
            # Not measured under --deterministic: TensorFlow then refuses its timestamp op.
            "input_wait_s": round(wait, 3) if timed else None,
            "compute_s": round(max(0.0, seconds - wait), 3) if timed else None,
            "input_wait_fraction": round(wait / seconds, 4) if timed and seconds > 0 else None,
            "startup_s": round(self.startup_s, 3) if self.startup_s is not None else None,
            "timed_steps": steps,
            "steady_state": steady,
        }


class Progress:
    """Times the segments between sync points and writes the step log line every ``log_every_steps``.

    Args:
        config: ``--epochs`` and ``--max-steps`` (for the ETA), ``--log-every-steps``.
        steps_per_epoch: batches per epoch.
        metric: the metric's name in the log line and the scalars.
        summaries: where the step scalars go (TensorBoard).
        input_timed: whether the device measures its input wait (not under ``--deterministic``).
    """

    def __init__(
        self,
        config: TrainerConfig,
        steps_per_epoch: int,
        *,
        metric: str,
        summaries: Summaries,
        input_timed: bool,
    ) -> None:
        self.config = config
        self.steps_per_epoch = steps_per_epoch
        # The steps of the whole run, for the ETA.
        self.total_steps = config.epochs * steps_per_epoch
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.metric = metric
        self.summaries = summaries
        self.input_timed = input_timed
        self.throughput = Throughput(input_timed=input_timed)
        self.wall_before = 0.0  # training wall time spent by earlier processes of this run
        self._started = time.monotonic()
        self.next_log: float = 0
        self._first_log = True
        self._segment_started: float | None = None
        self._window_s = 0.0
        self._window_wait_s = 0.0
        self._window_examples_seen = 0.0

    def wall_time(self) -> float:
        """Training wall time of the whole run, earlier processes included."""
        return self.wall_before + (time.monotonic() - self._started)

    def resumed(self, wall_before: float) -> None:
        """A checkpoint was restored: the run's earlier processes trained for ``wall_before`` seconds."""
        self.wall_before = wall_before
        self._started = time.monotonic()

    def start_segment(self) -> None:
        """Steps are being queued: the segment's clock runs from the first of them."""
        if self._segment_started is None:
            self._segment_started = time.perf_counter()

    def account(self, counters: Counters) -> None:
        """The device was read: its steps since the last read end the segment."""
        now = time.perf_counter()
        seconds = now - self._segment_started if self._segment_started is not None else 0.0
        self._segment_started = None
        examples = counters.window["examples"] - self._window_examples_seen
        self.throughput.add(seconds, counters.steps, examples, counters.input_wait_s)
        self._window_examples_seen = counters.window["examples"]
        self._window_s += seconds
        self._window_wait_s += counters.input_wait_s

    def due(self, step: int) -> bool:
        """Whether the log line is due at ``step`` (the first read always logs)."""
        return self._first_log or step >= self.next_log

    def eta(self, step: int) -> str:
        """Training time left at the step time so far (evaluation and checkpoints not counted)."""
        return format_eta(max(0, self.total_steps - step) * self.throughput.step_time())

    def log_step(
        self,
        *,
        step: int,
        epoch: int,
        batch_in_epoch: int,
        counters: Counters,
        epoch_sums: dict[str, float],
        learning_rate: float,
    ) -> None:
        """The step line and scalars over the window since the previous line; the caller then resets
        the device's window (``StepRunner.reset_window``)."""
        w = counters.window
        rate = w["examples"] / self._window_s if self._window_s > 0 else 0.0
        wait = self._window_wait_s / self._window_s if self._window_s > 0 and self.input_timed else math.nan
        log.info(
            "step %d epoch %d/%d batch %d/%d loss %.4f %s %.4f (epoch mean loss %.4f) lr %.3g examples/s %.1f "
            "input wait %s eta %s",
            step,
            epoch + 1,
            self.config.epochs,
            batch_in_epoch,
            self.steps_per_epoch,
            ratio(w["loss_sum"], w["examples"]),
            self.metric,
            ratio(w["correct"], w["count"]),
            ratio(epoch_sums["loss_sum"], epoch_sums["examples"]),
            learning_rate,
            rate,
            f"{wait:.0%}" if math.isfinite(wait) else "not measured",
            self.eta(step),
        )
        self.summaries.scalars(
            "train",
            step,
            {
                "loss": ratio(w["loss_sum"], w["examples"]),
                self.metric: ratio(w["correct"], w["count"]),
                "learning_rate": learning_rate,
                "gradient_global_norm": ratio(w["grad_norm_sum"], w["applied_steps"]),
                "examples_per_s": rate,
                "input_wait_fraction": wait,
                **({"loss_scale": counters.loss_scale} if counters.loss_scale is not None else {}),
            },
        )
        self._window_examples_seen = 0.0
        self._window_s = self._window_wait_s = 0.0
        self._first_log = False
        self.next_log = next_multiple(step, self.config.log_every_steps)

    def log_epoch(self, row: dict[str, Any], best: str | None = None) -> None:
        """The line and scalars of a closed epoch's history row; ``best`` names the monitor it is the best by."""
        metric = self.metric
        log.info(
            "epoch %d%s: loss %.4f %s %.4f val_loss %.4f val_%s %.4f%s",
            row["epoch"],
            " (partial, --max-steps reached)" if row.get("partial") else "",
            row["loss"],
            metric,
            row[metric],
            row["val_loss"],
            metric,
            row[f"val_{metric}"],
            f" (best {best} so far)" if best else "",
        )
        self.summaries.scalars("train", row["step"], {f"epoch_{k}": row[k] for k in ("loss", metric)})
        self.summaries.scalars(
            "validation",
            row["step"],
            {"epoch_loss": row["val_loss"], f"epoch_{metric}": row[f"val_{metric}"]},
        )
        self.summaries.flush()
