"""What a trainer reports as it trains, read alike by the sidecar's stopping rule and the Airflow side.

A trainer appends one JSON object a line to ``OUTPUT_DIR/metrics.jsonl`` (or writes ``history.csv``, one
row an epoch); the checkpoint-sync sidecar reads it to stop a sweep's trial early, and the sweep's
leaderboard and the run's report read it from S3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

METRICS_JSONL = "metrics.jsonl"
HISTORY_CSV = "history.csv"
# The sidecar's record of an early stop, in the run's sync/ prefix.
EARLY_STOP_RECORD = "early-stop.json"
EARLY_STOP_KIND = "kubetrain/early-stop"


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float; None for a missing, empty, boolean, non-numeric, NaN or infinite one."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """The objects of ``metrics.jsonl``, in order; a torn last line (still being appended) is dropped.

    :raises ValueError: naming the line that is not JSON (and is not the last one).
    """
    import json

    rows = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise ValueError(f"{METRICS_JSONL} line {index + 1} is not JSON: {line[:200]!r}") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def objective_values(rows: Sequence[Mapping[str, Any]], metric: str) -> list[float]:
    """The metric of each report that has a finite value of it, in order: the usable values, for a
    trial's best and its record. A stopping rule that counts reports reads :func:`objective_reports`."""
    return [v for v in (finite_number(row.get(metric)) for row in rows) if v is not None]


def objective_reports(rows: Sequence[Mapping[str, Any]], metric: str) -> list[float | None]:
    """The metric of each report of it, in order, ``None`` where its value is not a finite number.

    A report's position (its epoch or evaluation) counts whether or not its value is usable, so
    that report ``S`` is the same report for every trial: a NaN, an infinity, a string that is
    not a number, ``null`` or an empty cell is a report without a usable value, not a missing
    report. A report of the metric is a ``metrics.jsonl`` line that has its key (whatever its
    value) or a ``history.csv`` row (every row has every column); a line without the key (a
    trainer's per-batch line of other metrics) is no report of it.
    """
    return [finite_number(row[metric]) for row in rows if metric in row]


def best_report(values: Sequence[float | None], mode: str) -> float | None:
    """The best usable value of ``values`` (the largest for ``max``, the smallest for ``min``);
    ``None`` when none is a finite number."""
    usable = [v for v in map(finite_number, values) if v is not None]
    if not usable:
        return None
    return max(usable) if mode == "max" else min(usable)
