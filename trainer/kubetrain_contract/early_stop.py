"""The early-stop record: why the checkpoint-sync sidecar stopped a sweep's trial.

The sidecar writes it to ``<run>/sync/early-stop.json`` before it writes the stop file; the sweep's
trial step reads it to tell an early stop from a failure, and the leaderboard shows it.

Also here, because both sides compute it: the Hyperband bracket of a sweep's trial
(:func:`hyperband_bracket`), which the Airflow side puts in the trial's pod and the sidecar
computes for the competitors whose records it reads; and the rung rule's ranking of a trial's
objective at a rung (:func:`rung_rank`), written once with what it does with a value that is not
a finite number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from kubetrain_contract.records import Record, spec
from kubetrain_contract.reports import finite_number


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
    best: float | None = spec(
        description="The trial's best objective value so far (null: none of its reports was a finite number)."
    )
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
    value: float | None = spec(
        None,
        description="asha, hyperband: the trial's objective at the rung (null also when it was not a finite "
        "number there: the trial is then stopped unranked).",
    )
    rank: int | None = spec(
        None,
        minimum=1,
        description="asha, hyperband: the trial's rank at the rung (1 is the best; null: its value there was "
        "not a finite number, not ranked).",
    )
    rung_trials: int | None = spec(
        None,
        minimum=1,
        description="asha, hyperband: the trials ranked at the rung, this one included when its value was "
        "ranked (null: none was).",
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
    values: list[float | None] = spec(
        description="The trial's objective at each of its reports so far, in order; null where a report's "
        "value was not a finite number (NaN, infinite, not a number): its position counts all the same."
    )
    promoted_at: int = spec(
        0,
        minimum=0,
        description="The highest rung the trial was promoted at (0: none yet); a restarted sidecar resumes there.",
    )
    published_at: str = spec(default_factory=utc_now, format="date-time")


@dataclass(frozen=True)
class RungRank:
    """How a trial's objective at a rung ranks among the other trials' values there (:func:`rung_rank`)."""

    value: float | None  # None: not a finite number, not ranked
    rank: int | None  # 1 + the ranked values strictly better; None when ``value`` is
    trials: int  # the values ranked: the others' usable ones, and this one when usable
    promoted_count: int  # how many of them go on: max(1, trials // eta); 0 when none was ranked
    cutoff: float | None  # the worst value that goes on (ties go on); None when none was ranked

    @property
    def promoted(self) -> bool:
        return self.rank is not None and self.rank <= self.promoted_count


def rung_rank(value: object, others: Sequence[object], mode: str, reduction_factor: int) -> RungRank:
    """Rank ``value``, a trial's objective at a rung, among ``others``, the values at that rung of the
    trials of its bracket that reached it; the rule of Optuna's SuccessiveHalvingPruner.

    Of ``n`` values ranked, the best ``max(1, n // eta)`` go on, ties with the cut-off included. A
    value that is not a finite number (``None``, NaN, an infinity, a string that is not a number)
    does not go on, even alone at the rung, and is not ranked: it counts in no trial's ``n``, this
    one's or a later one's. Optuna prunes a NaN at a rung before it ranks it and records no rung
    value for it; an infinity, which Optuna would rank as a number, is a diverged trial here.

    :param value: this trial's objective at the rung's report.
    :param others: the other trials' objective at the rung's report.
    :param mode: ``max`` or ``min``.
    :param reduction_factor: eta.
    """
    mine = finite_number(value)
    ranked = [v for v in map(finite_number, others) if v is not None]
    if mine is not None:
        ranked.append(mine)
    if not ranked:
        return RungRank(None, None, 0, 0, None)
    ordered = sorted(ranked, reverse=mode == "max")
    count = max(1, len(ordered) // reduction_factor)
    if mine is None:
        return RungRank(None, None, len(ordered), count, ordered[count - 1])
    better = sum(1 for v in ordered if (v > mine if mode == "max" else v < mine))
    return RungRank(mine, better + 1, len(ordered), count, ordered[count - 1])


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
