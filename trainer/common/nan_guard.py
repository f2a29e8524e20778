"""The NaN guard: a run whose loss, all-replica gradient or weights stop being finite ends by name.

The loop looks where the host waits for the device (a log line, a checkpoint, a step hook,
SIGTERM, the end of an epoch): a non-finite loss, or a non-finite gradient without loss
scaling (or with the loss scale already below 1), stops the run with ``TrainingDiverged``
before anything after it is saved. Under mixed precision an overflowing gradient is a
normal event: the step is skipped and the loss scale lowered.
"""

from __future__ import annotations

import dataclasses
import logging

from trainer.common.config import TrainerConfig, flag_name
from trainer.common.contract import TrainingDiverged
from trainer.common.steps import Counters

log = logging.getLogger("kubetrain.trainer")

__all__ = ["check_steps", "check_weights", "learning_rate_flag"]


def learning_rate_flag(config: TrainerConfig) -> str:
    """The flag that sets this trainer's learning rate, for the advice in the message."""
    names = {f.name for f in dataclasses.fields(config)}
    return next(
        (flag_name(n) for n in ("learning_rate", "learning_rate_scale") if n in names),
        "the learning rate",
    )


def check_steps(
    counters: Counters, *, before: int, epoch: int, last_checkpoint: str, rerun: str, learning_rate_flag: str
) -> None:
    """Stop the run if the steps since ``before`` diverged; log the steps mixed precision skipped.

    Args:
        counters: what the device counted since step ``before``.
        before: the global step before these steps.
        epoch: the 0-based epoch they belong to.
        last_checkpoint: where training can go on from (``CheckpointStore.last_finite``).
        rerun: what a rerun would do (``CheckpointStore.rerun_outcome``).
        learning_rate_flag: the flag to lower.

    Raises:
        TrainingDiverged: naming the first bad step and what was not finite.
    """
    if counters.nonfinite_loss or (
        counters.nonfinite_grads and (counters.loss_scale is None or counters.loss_scale < 1.0)
    ):
        bad_step = before + max(1, counters.first_nonfinite)
        if counters.nonfinite_loss:
            what = "the loss was NaN or infinite"
        else:
            what = "the all-replica gradient was NaN or infinite" + (
                f" even with the loss scale down to {counters.loss_scale:g}" if counters.loss_scale else ""
            )
        raise TrainingDiverged(
            f"training diverged at step {bad_step} (epoch {epoch + 1}): {what} "
            f"({counters.nonfinite_loss} step(s) with a non-finite loss, {counters.nonfinite_grads} with a "
            f"non-finite gradient since step {before}); those updates were skipped and no checkpoint was "
            f"written after them. {last_checkpoint} Lower {learning_rate_flag}, clip "
            f"the gradients or check the data; {rerun}"
        )
    if counters.nonfinite_grads:
        log.info(
            "mixed precision: %d step(s) with overflowing gradients skipped; loss scale now %g",
            counters.nonfinite_grads,
            counters.loss_scale,
        )


def check_weights(broken: list[str], *, step: int, last_checkpoint: str) -> None:
    """Refuse to checkpoint weights that are no longer finite.

    Args:
        broken: paths of the variables holding NaN or infinite values (``StepRunner.variables_finite``).
        step: the global step about to be checkpointed.
        last_checkpoint: where training can go on from (``CheckpointStore.last_finite``).

    Raises:
        TrainingDiverged: naming the first few variables; nothing is written.
    """
    if not broken:
        return
    raise TrainingDiverged(
        f"training diverged by step {step}: {len(broken)} variable(s) hold NaN or infinite values "
        f"({', '.join(broken[:5])}{' ...' if len(broken) > 5 else ''}); not checkpointed. {last_checkpoint}"
    )
