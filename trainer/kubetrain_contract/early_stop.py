"""The early-stop record: why the checkpoint-sync sidecar stopped a sweep's trial.

The sidecar writes it to ``<run>/sync/early-stop.json`` before it writes the stop file; the sweep's
trial step reads it to tell an early stop from a failure, and the leaderboard shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from kubetrain_contract.records import Record, spec


def utc_now() -> str:
    """The time now as the records write it: ``2026-01-02T03:04:05.123456Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class EarlyStopRecord(Record):
    """Written by the checkpoint-sync sidecar at <run>/sync/early-stop.json when its stopping rule
    stops a sweep's trial, before it writes the stop file the trainer obeys."""

    KIND = "kubetrain/early-stop"
    SCHEMA_NAME = "early-stop"
    TITLE = "kubetrain early-stop record, format version 1"

    rule: str = spec(description="The stopping rule that decided, as median.")
    objective: str = spec(
        description="The metric the rule compared (a metrics.jsonl key or history.csv column)."
    )
    mode: Literal["max", "min"] = spec(description="Whether a larger or a smaller objective is better.")
    start_step: int = spec(minimum=1, description="The first report at which the rule may stop a trial.")
    min_trials: int = spec(minimum=1, description="Finished trials the rule needs before it stops any.")
    step: int = spec(minimum=1, description="The number of reports the trial had made when it was stopped.")
    best: float = spec(description="The trial's best objective value so far.")
    median: float = spec(description="The value the trial's best was compared with.")
    finished_trials: int = spec(minimum=0, description="How many finished trials the comparison used.")
    decided_at: str = spec(default_factory=utc_now, format="date-time")
