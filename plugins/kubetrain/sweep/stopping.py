"""The early-stopping rules of a sweep's trial, as its pod carries them: the checkpoint-sync sidecar
reads the variables of :meth:`MedianStopping.env` or :meth:`RungStopping.env` and writes the stop file
(trainer/sync/README.md, "Median stopping"; trainer/sync/asha.py for asha and hyperband).

A trial's :class:`~kubetrain.pod_spec.TrainingPodConfig` holds one as ``early_stopping``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubetrain.pod_sizing import checked_int
from kubetrain_contract.pod import Env

_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _check_objective(objective: object, mode: object) -> None:
    if not isinstance(objective, str) or not _METRIC_NAME.fullmatch(objective):
        raise ValueError(f"objective={objective!r} is not a metric name: expected e.g. 'val_accuracy'")
    if mode not in ("max", "min"):
        raise ValueError(f"mode={mode!r} is not valid: expected 'max' or 'min'")


def _check_prefix(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.startswith("s3://") or not value.endswith("/"):
        raise ValueError(f"{name}={value!r} is not valid: expected an s3:// prefix ending in '/'")


@dataclass(frozen=True)
class MedianStopping:
    """Median early stopping of one trial of a sweep, done by its checkpoint-sync sidecar.

    :param objective: the metric the trainer reports per epoch (a history.csv column, or a key of
        OUTPUT_DIR/metrics.jsonl), e.g. ``val_accuracy``.
    :param mode: ``max`` or ``min``: whether larger is better.
    :param trials_uri: ``s3://`` prefix of the sweep's finished trial records.
    :param min_trials: finished trials needed before any trial is stopped.
    :param start_step: reports a trial makes before it may be stopped.
    """

    objective: str
    mode: str
    trials_uri: str
    min_trials: int = 3
    start_step: int = 4

    def __post_init__(self) -> None:
        _check_objective(self.objective, self.mode)
        _check_prefix("trials_uri", self.trials_uri)
        object.__setattr__(self, "min_trials", checked_int("min_trials", self.min_trials, minimum=1))
        object.__setattr__(self, "start_step", checked_int("start_step", self.start_step, minimum=1))

    def env(self) -> dict[str, str]:
        """The checkpoint-sync sidecar's variables for the rule."""
        return {
            Env.EARLY_STOPPING: "median",
            Env.OBJECTIVE: self.objective,
            Env.OBJECTIVE_MODE: self.mode,
            Env.MEDIAN_MIN_TRIALS: str(self.min_trials),
            Env.MEDIAN_START_STEP: str(self.start_step),
            Env.SWEEP_TRIALS_URI: self.trials_uri,
        }


@dataclass(frozen=True)
class RungStopping:
    """asha or hyperband early stopping of one trial of a sweep, done by its checkpoint-sync sidecar
    (trainer/sync/asha.py).

    :param rule: ``asha`` or ``hyperband``.
    :param objective: the metric the trainer reports per epoch or step.
    :param mode: ``max`` or ``min``: whether larger is better.
    :param trials_uri: ``s3://`` prefix of the sweep's trial records.
    :param rungs_uri: ``s3://`` prefix where the trials' sidecars publish their rung reports.
    :param trial: the trial's number in the sweep.
    :param min_resource: reports at the first rung.
    :param reduction_factor: eta: the top ``1/eta`` of a rung go on.
    :param grace: reports a trial makes before it may be stopped.
    :param max_resource: a trial's reports at full training (no rung at or above it), or ``None``.
    :param brackets: the sweep's Hyperband brackets (1 for asha).
    :param bracket: the trial's bracket (from its number: ``hyperband_bracket``).
    """

    rule: str
    objective: str
    mode: str
    trials_uri: str
    rungs_uri: str
    trial: int
    min_resource: int = 1
    reduction_factor: int = 3
    grace: int = 1
    max_resource: int | None = None
    brackets: int = 1
    bracket: int = 0

    def __post_init__(self) -> None:
        if self.rule not in ("asha", "hyperband"):
            raise ValueError(f"rule={self.rule!r} is not valid: expected 'asha' or 'hyperband'")
        _check_objective(self.objective, self.mode)
        _check_prefix("trials_uri", self.trials_uri)
        _check_prefix("rungs_uri", self.rungs_uri)
        object.__setattr__(self, "trial", checked_int("trial", self.trial, minimum=0))
        object.__setattr__(self, "min_resource", checked_int("min_resource", self.min_resource, minimum=1))
        object.__setattr__(
            self, "reduction_factor", checked_int("reduction_factor", self.reduction_factor, minimum=2)
        )
        object.__setattr__(self, "grace", checked_int("grace", self.grace, minimum=1))
        if self.max_resource is not None:
            object.__setattr__(
                self, "max_resource", checked_int("max_resource", self.max_resource, minimum=1)
            )
        object.__setattr__(self, "brackets", checked_int("brackets", self.brackets, minimum=1))
        object.__setattr__(self, "bracket", checked_int("bracket", self.bracket, minimum=0))
        if self.bracket >= self.brackets:
            raise ValueError(
                f"bracket={self.bracket!r} is not valid: expected 0 to {self.brackets - 1} ({self.brackets} brackets)"
            )

    def env(self) -> dict[str, str]:
        """The checkpoint-sync sidecar's variables for the rule."""
        return {
            Env.EARLY_STOPPING: self.rule,
            Env.OBJECTIVE: self.objective,
            Env.OBJECTIVE_MODE: self.mode,
            Env.SWEEP_TRIALS_URI: self.trials_uri,
            Env.SWEEP_RUNGS_URI: self.rungs_uri,
            Env.SWEEP_TRIAL: str(self.trial),
            Env.ASHA_MIN_RESOURCE: str(self.min_resource),
            Env.ASHA_REDUCTION_FACTOR: str(self.reduction_factor),
            Env.ASHA_GRACE: str(self.grace),
            **({Env.ASHA_MAX_RESOURCE: str(self.max_resource)} if self.max_resource is not None else {}),
            Env.ASHA_BRACKETS: str(self.brackets),
            Env.ASHA_BRACKET: str(self.bracket),
        }


# What a trial's pod may carry as its ``early_stopping``.
EarlyStopping = MedianStopping | RungStopping
