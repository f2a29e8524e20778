"""The trial record: what one trial of a sweep did, at ``<sweep>/sweep/trials/<n>.json``.

The sweep's trial step writes it when the trial's pod has finished (or failed for good); the same
record, under ``trained/<dag>/trials/<fingerprint>.json``, lets a later sweep reuse a finished
trial. The suggest tasks rebuild a TPE study from the records, the checkpoint-sync sidecars of the
running trials read them for the median stopping rule, and the leaderboard and the sweep record
are built from them.
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
