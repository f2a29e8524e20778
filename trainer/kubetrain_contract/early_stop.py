"""The early-stop record: why the checkpoint-sync sidecar stopped a sweep's trial.

The sidecar writes it to ``<run>/sync/early-stop.json`` before it writes the stop file; the sweep's
trial step reads it to tell an early stop from a failure, and the leaderboard shows it.

Also here, because both sides compute it: the Hyperband bracket of a sweep's trial
(:func:`hyperband_bracket`), which the Airflow side puts in the trial's pod and the sidecar
computes for the competitors whose records it reads.
"""

from __future__ import annotations

import math
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

    rule: str = spec(description="The stopping rule that decided: median, asha or hyperband.")
    objective: str = spec(
        description="The metric the rule compared (a metrics.jsonl key or history.csv column)."
    )
    mode: Literal["max", "min"] = spec(description="Whether a larger or a smaller objective is better.")
    start_step: int = spec(minimum=1, description="The first report at which the rule may stop a trial.")
    step: int = spec(minimum=1, description="The number of reports the trial had made when it was stopped.")
    best: float = spec(description="The trial's best objective value so far.")
    min_trials: int | None = spec(
        None, minimum=1, description="median: finished trials the rule needs before it stops any."
    )
    median: float | None = spec(None, description="median: the value the trial's best was compared with.")
    finished_trials: int | None = spec(
        None, minimum=0, description="median: how many finished trials the comparison used."
    )
    rung: int | None = spec(
        None,
        minimum=1,
        description="asha, hyperband: the rung (a number of reports) the trial was judged at.",
    )
    value: float | None = spec(None, description="asha, hyperband: the trial's objective at the rung.")
    rank: int | None = spec(
        None, minimum=1, description="asha, hyperband: the trial's rank at the rung (1 is the best)."
    )
    rung_trials: int | None = spec(
        None, minimum=1, description="asha, hyperband: the trials ranked at the rung, this one included."
    )
    promoted: int | None = spec(
        None, minimum=1, description="asha, hyperband: how many of them go on: max(1, rung_trials // eta)."
    )
    cutoff: float | None = spec(
        None, description="asha, hyperband: the value a trial needed at the rung to go on (ties go on)."
    )
    min_resource: int | None = spec(
        None, minimum=1, description="asha, hyperband: reports at the first rung."
    )
    reduction_factor: int | None = spec(
        None, minimum=2, description="asha, hyperband: eta; rungs are min_resource * eta**k reports."
    )
    grace: int | None = spec(
        None, minimum=1, description="asha, hyperband: reports a trial makes before it may be stopped."
    )
    bracket: int | None = spec(
        None,
        minimum=0,
        description="hyperband: the trial's bracket (its first rung: min_resource * eta**bracket).",
    )
    decided_at: str = spec(default_factory=utc_now, format="date-time")


@dataclass(frozen=True)
class RungReportRecord(Record):
    """Published by the checkpoint-sync sidecar of a sweep's trial under the asha or hyperband rule at
    <sweep>/sweep/rungs/<trial>.json each time the trial reaches a rung, before it is ranked there: the
    other running trials' sidecars rank their own trials against it."""

    KIND = "kubetrain/rung-report"
    SCHEMA_NAME = "rung-report"
    TITLE = "kubetrain rung report, format version 1"

    trial: int = spec(minimum=0, description="The trial's number in the sweep.")
    bracket: int = spec(minimum=0, description="The trial's Hyperband bracket (0 under asha).")
    objective: str = spec(description="The metric of the values (a metrics.jsonl key or history.csv column).")
    values: list[float] = spec(description="The trial's objective at each of its reports so far, in order.")
    promoted_at: int = spec(
        0,
        minimum=0,
        description="The highest rung the trial was promoted at (0: none yet); a restarted sidecar resumes there.",
    )
    published_at: str = spec(default_factory=utc_now, format="date-time")


def hyperband_allocation(brackets: int, reduction_factor: int) -> list[int]:
    """The share of the trials each Hyperband bracket gets, as Optuna's HyperbandPruner weighs them.

    Bracket ``b`` (its first rung at ``min_resource * eta**b``) gets ``ceil(B * eta**s / (s + 1))`` with
    ``s = B - 1 - b``: the most aggressive bracket gets the most trials.

    :param brackets: the number of brackets, ``B`` (at least 1).
    :param reduction_factor: eta (at least 2).
    """
    if brackets < 1 or reduction_factor < 2:
        raise ValueError(
            f"brackets={brackets!r}, reduction_factor={reduction_factor!r}: expected >= 1 and >= 2"
        )
    return [
        math.ceil(brackets * reduction_factor ** (brackets - 1 - b) / (brackets - b)) for b in range(brackets)
    ]


def hyperband_bracket(number: int, brackets: int, reduction_factor: int) -> int:
    """The Hyperband bracket of trial ``number``: a smooth weighted round robin over the trial numbers.

    Optuna's HyperbandPruner draws a bracket from a hash of the study name and trial number, in
    proportion to :func:`hyperband_allocation`; here the trial number's place in a cycle of
    ``sum(allocation)`` trials picks it, the brackets interleaved in the cycle (nginx's smooth
    weighted round robin), so that the first trials already spread over the brackets, every cycle
    fills them in exactly those proportions, and both sides compute the same bracket from the number.

    :param number: the trial's number in the sweep (from 0).
    :param brackets: the number of brackets.
    :param reduction_factor: eta.
    """
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise ValueError(f"trial number {number!r} is not an integer >= 0")
    allocation = hyperband_allocation(brackets, reduction_factor)
    total = sum(allocation)
    current = [0] * brackets
    bracket = 0
    for _ in range(number % total + 1):
        current = [c + w for c, w in zip(current, allocation, strict=True)]
        bracket = max(range(brackets), key=lambda b: (current[b], -b))
        current[bracket] -= total
    return bracket


def hyperband_brackets(min_resource: int, max_resource: int | None, reduction_factor: int) -> int:
    """How many Hyperband brackets a budget allows: ``floor(log_eta(max_resource / min_resource)) + 1``
    (Optuna's count), at least 1; 3 when the budget (``max_resource`` reports) is not known.

    :param min_resource: reports at the first rung of the most aggressive bracket.
    :param max_resource: a trial's reports at full training, or ``None``.
    :param reduction_factor: eta.
    """
    if max_resource is None:
        return 3
    count, resource = 0, min_resource
    while resource < max_resource:
        count += 1
        resource *= reduction_factor
    return max(1, count if resource > max_resource else count + 1)
