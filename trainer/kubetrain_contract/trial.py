"""A sweep's records: the trial record (what one trial did, at ``<sweep>/sweep/trials/<n>.json``),
the round record (``<sweep>/sweep/rounds/<r>.json``) and the sweep record (``<sweep>/sweep/sweep.json``).

The sweep's trial step writes the trial record when the trial's pod has finished (or failed for
good); the same record, under ``trained/<dag>/trials/<fingerprint>.json``, lets a later sweep reuse a finished
trial. The suggest tasks rebuild a TPE study from the records, the checkpoint-sync sidecars of the
running trials read them for the median stopping rule, and the leaderboard and the sweep record
are built from them. The suggest task of each round writes the round record, which the leaderboard
reads to list the trials that left no record; the record task writes the sweep record last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kubetrain_contract.early_stop import EarlyStopRecord
from kubetrain_contract.records import Record, spec


@dataclass(frozen=True)
class TrialSweep:
    """The sweep a trial belongs to."""

    id: str | None = spec(None, description="The sweep's id: <dag_id>/<run_id>.")
    dag_id: str | None = spec(None, description="The sweep DAG.")
    run_id: str | None = spec(None, description="The sweep's DAG run.")
    uri: str | None = spec(None, description="The sweep's s3:// run prefix.")
    algorithm: str | None = spec(None, description="The search: grid, random or tpe.")


@dataclass(frozen=True)
class TrialObjective:
    """The metric the sweep ranks its trials by, and this trial's values of it."""

    name: str | None = spec(None, description="The metric (a metrics.jsonl key or history.csv column).")
    mode: Literal["max", "min"] | None = spec(None, description="Whether a larger or a smaller value wins.")
    value: float | None = spec(
        None, description="The trial's result: metrics.json's final value, else its best report."
    )
    values: list[float] = spec(
        default_factory=list, description="The metric at each report that had a finite value of it."
    )


@dataclass(frozen=True)
class ReusedFrom:
    """Where a trial that started no pod took its result from: a finished trial with its fingerprint."""

    run_uri: str | None = spec(None, description="The run prefix of the trial that trained.")
    sweep: str | None = spec(None, description="The id of the sweep it belonged to.")
    trial: str | None = spec(None, description="Its trial name in that sweep.")


@dataclass(frozen=True, kw_only=True)
class TrialRecord(Record):
    """Written by a sweep's trial step at <sweep>/sweep/trials/<n>.json (and, for a successful trial,
    at trained/<dag>/trials/<fingerprint>.json): the trial's point, outcome, objective and reports."""

    KIND = "kubetrain/sweep-trial"
    SCHEMA_NAME = "sweep-trial"
    TITLE = "kubetrain sweep trial record, format version 1"

    sweep: TrialSweep | None = spec(None, description="The sweep the trial belongs to.")
    trial: str = spec(description="The trial's name: its number, as the task's map index names it.")
    number: int = spec(minimum=0, description="The trial's number in the sweep, from 0.")
    round: int | None = spec(None, minimum=0, description="The round that asked for the trial.")
    params: dict[str, Any] = spec(default_factory=dict, description="The trial's point of the space.")
    fingerprint: str | None = spec(None, description="What the trial trained, as a hex digest.")
    status: Literal["success", "failed"] = spec(description="Whether the trial has a result.")
    stopped_early: bool = spec(False, description="The sidecar's stopping rule stopped the trainer.")
    early_stop: EarlyStopRecord | None = spec(
        None, description="The sidecar's decision (its early-stop.json), when it stopped the trial."
    )
    stop_requested: EarlyStopRecord | None = spec(
        None, description="A decision the trainer did not act on (it had finished first)."
    )
    early_stopping: dict[str, Any] | None = spec(None, description="The sweep's early-stopping settings.")
    error: str | None = spec(None, description="Why a failed trial failed.")
    objective: TrialObjective = spec(default_factory=TrialObjective, description="The sweep's objective.")
    final_metrics: dict[str, Any] | None = spec(None, description="metrics.json's final metrics.")
    steps: int | float | None = spec(
        None, description="Training steps (metrics.json), else the last report's."
    )
    epochs: int | float | None = spec(None, description="Epochs trained (metrics.json).")
    reports: int | None = spec(None, minimum=0, description="Reports (metrics.jsonl lines or history rows).")
    wall_time_s: float | None = spec(None, description="The trainer's wall time (metrics.json).")
    resumed_from_step: int | float | None = spec(None, description="The checkpoint step a retry resumed at.")
    exit_code: int | None = spec(None, description="The training container's exit code.")
    image: str | None = spec(None, description="The training image, pinned by digest.")
    dataset_version: str | None = spec(None, description="The staged dataset version.")
    arguments: list[str] = spec(default_factory=list, description="The training container's arguments.")
    timing: dict[str, Any] = spec(
        default_factory=dict,
        description="When the pod and each container started and finished, and the task's steps after it.",
    )
    history: list[dict[str, Any]] = spec(default_factory=list, description="The trainer's reports, in order.")
    trainer_seconds: float | None = spec(
        None,
        minimum=0,
        description="The training container's run time: its start to its finish in the pod's status, "
        "else the trainer's wall time (metrics.json).",
    )
    accelerator: Literal["gpu", "cpu"] | None = spec(
        None, description="What the trial's compute is counted in: gpu when its pod asked for GPUs, else cpu."
    )
    accelerators: float | None = spec(
        None,
        minimum=0,
        description="The GPUs the training container asked for (accelerator gpu), else its CPU request in cores.",
    )
    accelerator_hours: float | None = spec(
        None,
        minimum=0,
        description="trainer_seconds x accelerators / 3600: GPU-hours (accelerator gpu) or CPU-hours.",
    )
    run_uri: str | None = spec(None, description="The trial's s3:// run prefix.")
    report_uri: str | None = spec(None, description="The trial's report.html in S3.")
    report_url: str | None = spec(None, description="The trial's report through the API server.")
    reused_from: ReusedFrom | None = spec(None, description="The trial whose result this one reuses.")
    finished_at: str | None = spec(None, format="date-time", description="When the record was written.")

    def to_dict(self) -> dict[str, Any]:
        """The document; the early-stop decisions keep their own ``kind`` and ``format_version``."""
        doc = super().to_dict()
        for name in ("early_stop", "stop_requested"):
            nested = getattr(self, name)
            doc[name] = nested.to_dict() if nested is not None else None
        return doc

    def to_json(self, *, indent: int | None = 2) -> str:
        """The document as JSON text. NaN is kept, not refused: ``history`` and ``final_metrics``
        hold the trainer's reports as it wrote them, and a diverged loss is reported as NaN."""
        return json.dumps(self.to_dict(), indent=indent)

    @property
    def succeeded(self) -> bool:
        """The trial has a result (it finished, possibly stopped early)."""
        return self.status == "success"

    @property
    def finished(self) -> bool:
        """The trial trained to its end: a success not stopped early."""
        return self.succeeded and not self.stopped_early


@dataclass(frozen=True)
class PlannedTrial:
    """A point a round asked for."""

    number: int = spec(minimum=0, description="The trial's number in the sweep.")
    params: dict[str, Any] = spec(default_factory=dict, description="The point of the space.")
    fingerprint: str | None = spec(None, description="What the trial trains, as a hex digest.")
    reused_from: ReusedFrom | None = spec(None, description="The finished trial it reuses: no pod.")


@dataclass(frozen=True, kw_only=True)
class SweepRoundRecord(Record):
    """Written by a sweep's suggest task at <sweep>/sweep/rounds/<round>.json: the points the round
    asked for, with the finished trials they reuse."""

    KIND = "kubetrain/sweep-round"
    SCHEMA_NAME = "sweep-round"
    TITLE = "kubetrain sweep round record, format version 1"

    round: int = spec(minimum=0, description="The round, from 0.")
    algorithm: str | None = spec(None, description="The search: grid, random or tpe.")
    trials: list[PlannedTrial] = spec(default_factory=list, description="The points, by trial number.")
    asked_at: str | None = spec(None, format="date-time", description="When the round asked for them.")


@dataclass(frozen=True)
class SweepObjective:
    """The metric a sweep ranks its trials by."""

    metric: str | None = spec(None, description="A metrics.jsonl key or history.csv column.")
    mode: Literal["max", "min"] | None = spec(None, description="Whether a larger or a smaller value wins.")


@dataclass(frozen=True)
class SweepDataset:
    """The dataset every trial trained on."""

    uri: str | None = spec(None, description="The dataset's source URI.")
    version: str | None = spec(None, description="The staged version.")
    manifest: str | None = spec(None, description="The staged manifest's s3:// URI.")


@dataclass(frozen=True)
class SweepBest:
    """The leaderboard's best trial."""

    best_trial: str | None = spec(None, description="Its trial name.")
    best_run_uri: str | None = spec(None, description="Its run prefix.")
    best_value: float | None = spec(None, description="Its objective value.")


@dataclass(frozen=True)
class SweepCounts:
    """How the trials ended."""

    trials: int | None = spec(None, minimum=0, description="Trials planned.")
    succeeded: int | None = spec(None, minimum=0, description="Trials that trained to their end.")
    stopped_early: int | None = spec(None, minimum=0, description="Trials stopped by the stopping rule.")
    failed: int | None = spec(None, minimum=0, description="Trials without a result.")


@dataclass(frozen=True)
class SweepCompute:
    """The trainers' compute of a sweep, and an estimate of what running every trial to its budget
    would have cost (a stopped trial's own seconds per report times its budget of reports)."""

    accelerator: Literal["gpu", "cpu"] | None = spec(
        None, description="The unit: GPU-hours (gpu) or CPU-hours where no trial asked for a GPU (cpu)."
    )
    compute_used: float | None = spec(
        None, minimum=0, description="Accelerator-hours the counted trials' trainers ran."
    )
    compute_full: float | None = spec(
        None,
        minimum=0,
        description="Accelerator-hours had every counted trial run to its budget: a stopped trial's "
        "hours per report times its budget of reports, the other trials' actual hours.",
    )
    saved_fraction: float | None = spec(
        None, minimum=0, maximum=1, description="1 - compute_used / compute_full."
    )
    trials: int = spec(0, minimum=0, description="Trials counted (trained in this sweep, with timing).")
    stopped: int = spec(0, minimum=0, description="Counted trials the stopping rule stopped.")
    failed: int = spec(0, minimum=0, description="Counted trials that failed: their actual hours in both.")
    unknown: int = spec(
        0,
        minimum=0,
        description="Trials not counted: no trainer time or resources, or a stopped trial with no "
        "known budget (their hours are in neither figure).",
    )
    reused: int = spec(0, minimum=0, description="Trials that reused an earlier result: no compute here.")
    line: str | None = spec(None, description="The figures in words, as the leaderboard shows them.")


@dataclass(frozen=True)
class SweepComparison:
    """The best trial against the promoted model."""

    better_than_promoted: bool | None = spec(None, description="Whether it beat the promoted model.")
    reason: str | None = spec(None, description="The comparison, in words.")


@dataclass(frozen=True, kw_only=True)
class SweepRecord(Record):
    """Written last by a sweep's record task at <sweep>/sweep/sweep.json: the plan, every trial's
    point and result (without its reports), the best trial, the leaderboard and the promotion."""

    KIND = "kubetrain/sweep"
    SCHEMA_NAME = "sweep"
    TITLE = "kubetrain sweep record, format version 1"

    id: str | None = spec(None, description="The sweep's id: <dag_id>/<run_id>.")
    dag_id: str | None = spec(None, description="The sweep DAG.")
    run_id: str | None = spec(None, description="The sweep's DAG run.")
    uri: str | None = spec(None, description="The sweep's s3:// run prefix.")
    title: str | None = spec(None, description="The sweep's title.")
    space: dict[str, Any] = spec(default_factory=dict, description="The search space, as checked.")
    algorithm: str | None = spec(None, description="The search: grid, random or tpe.")
    seed: int | None = spec(None, minimum=0, description="The seed of random and tpe.")
    max_trials: int | None = spec(None, minimum=1, description="The most trials the sweep may run.")
    parallel_trials: int | None = spec(None, minimum=1, description="Trials run at once.")
    objective: SweepObjective = spec(default_factory=SweepObjective, description="The objective.")
    early_stopping: dict[str, Any] | None = spec(None, description="The early-stopping settings.")
    rounds: list[int] = spec(default_factory=list, description="Trials per round.")
    image: str | None = spec(None, description="The training image, pinned by digest.")
    code_version: str | None = spec(None, description="The image's code version.")
    dataset: SweepDataset = spec(default_factory=SweepDataset, description="The dataset.")
    model: str | None = spec(None, description="The model the sweep trains.")
    fixed_params: dict[str, Any] = spec(default_factory=dict, description="The Params every trial shares.")
    trials: list[dict[str, Any]] = spec(
        default_factory=list, description="Every trial's record without its reports, by trial number."
    )
    best: SweepBest = spec(default_factory=SweepBest, description="The best trial.")
    counts: SweepCounts = spec(default_factory=SweepCounts, description="How the trials ended.")
    comparison: SweepComparison = spec(default_factory=SweepComparison, description="Against the promoted.")
    promotion: dict[str, Any] = spec(default_factory=dict, description="What the promote task did.")
    compute: SweepCompute = spec(
        default_factory=SweepCompute, description="The trainers' compute, and what it would have been."
    )
    report_uri: str | None = spec(None, description="The leaderboard's report.html in S3.")
    report_url: str | None = spec(None, description="The leaderboard through the API server.")
    created_at: str | None = spec(None, format="date-time", description="When the plan was written.")
    finished_at: str | None = spec(None, format="date-time", description="When this record was written.")
