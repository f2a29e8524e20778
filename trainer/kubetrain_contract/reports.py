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
    """The metric of each report that has a finite value of it, in order."""
    return [v for v in (finite_number(row.get(metric)) for row in rows) if v is not None]
