"""Where a sweep keeps its records in S3, and what a trial's record says.

::

    runs/<dag_id>/<run>/trials/<n>/...            each trial's run prefix (checkpoints, output, sync, report)
    runs/<dag_id>/<run>/sweep/plan.json           the checked settings (space, algorithm, seed, objective, ...)
    runs/<dag_id>/<run>/sweep/rounds/<r>.json     the points each round asked for
    runs/<dag_id>/<run>/sweep/trials/<n>.json     one record per finished trial (kind kubetrain/sweep-trial)
    runs/<dag_id>/<run>/sweep/sweep.json          the sweep record (kind kubetrain/sweep), written last
    runs/<dag_id>/<run>/report/                   the leaderboard (report.html, report.md, plots)
    trained/<dag_id>/trials/<fingerprint>.json    a finished trial by fingerprint: a re-run reuses it

Trial records are small and listed with one request (``sweep/trials/``): the suggest tasks
rebuild a TPE study from them, the checkpoint-sync sidecars of the running trials read them
for the median stopping rule, and the leaderboard and the sweep record are built from them.

Nothing here talks to S3; :class:`~kubetrain.sweep.operators` reads and writes through the
run store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.s3_layout import RunLocation, S3Layout, s3_uri, safe_segment
from kubetrain_contract.exit_codes import EXIT_STOPPED  # noqa: F401 - the sweep operators read it here
from kubetrain_contract.reports import (  # noqa: F401 - the file names are read here by the sweep operators
    EARLY_STOP_RECORD,
    HISTORY_CSV,
    METRICS_JSONL,
    finite_number,
    objective_values,
)
from kubetrain_contract.reports import parse_jsonl as contract_parse_jsonl

TRIAL_KIND = "kubetrain/sweep-trial"
SWEEP_KIND = "kubetrain/sweep"
FORMAT_VERSION = 1
_TRIAL_RECORD = re.compile(r"/sweep/trials/(\d+)\.json$")
_ROUND_RECORD = re.compile(r"/sweep/rounds/(\d+)\.json$")


@dataclass(frozen=True)
class SweepLocation:
    """The S3 prefix of one sweep (a DAG run of a sweep DAG) and the keys below it."""

    run: RunLocation

    @classmethod
    def of(cls, layout: S3Layout, dag_id: str, run_id: str) -> SweepLocation:
        return cls(layout.run(dag_id, run_id))

    @classmethod
    def from_uri(cls, uri: str) -> SweepLocation:
        return cls(RunLocation.from_uri(uri))

    @property
    def bucket(self) -> str:
        return self.run.bucket

    @property
    def uri(self) -> str:
        return self.run.uri

    def trial_run(self, number: int | str) -> RunLocation:
        """The run prefix of trial ``number``, as TrainingPodOperator computes it for ``trial=number``."""
        return RunLocation(self.bucket, f"{self.run.prefix}/trials/{safe_segment(str(number))}")

    def key(self, name: str) -> str:
        return f"{self.run.prefix}/sweep/{name}"

    @property
    def trials_prefix(self) -> str:
        return self.key("trials/")

    @property
    def trials_uri(self) -> str:
        """What the sidecars of the trials get as ``KUBETRAIN_SWEEP_TRIALS_URI``."""
        return s3_uri(self.bucket, self.trials_prefix)

    def trial_record_key(self, number: int) -> str:
        return self.key(f"trials/{int(number)}.json")

    def round_key(self, number: int) -> str:
        return self.key(f"rounds/{int(number)}.json")

    @property
    def rounds_prefix(self) -> str:
        return self.key("rounds/")

    @property
    def plan_key(self) -> str:
        return self.key("plan.json")

    @property
    def record_key(self) -> str:
        return self.key("sweep.json")

    @staticmethod
    def trial_number(key: str) -> int | None:
        match = _TRIAL_RECORD.search(key)
        return int(match.group(1)) if match else None

    @staticmethod
    def round_number(key: str) -> int | None:
        match = _ROUND_RECORD.search(key)
        return int(match.group(1)) if match else None


def trial_marker_key(dag_id: str, fingerprint: str) -> str:
    """Key of the record of a finished trial by its fingerprint, which later sweeps reuse."""
    if not re.fullmatch(r"[0-9a-f]{8,64}", fingerprint or ""):
        raise ValueError(f"fingerprint {fingerprint!r} is not valid: expected 8-64 lower-case hex digits")
    return f"trained/{safe_segment(dag_id)}/trials/{fingerprint}.json"


# -- metrics a trial reports ---------------------------------------------------------------------


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    """OUTPUT_DIR/metrics.jsonl: one JSON object a line; a torn last line (still being written) is dropped."""
    return contract_parse_jsonl(data.decode("utf-8", errors="replace"))


def history_rows(
    *, history_csv: bytes | None = None, metrics_jsonl: bytes | None = None
) -> list[dict[str, Any]]:
    """A trial's reports in order: metrics.jsonl when the container writes one, else history.csv."""
    if metrics_jsonl is not None:
        return parse_jsonl(metrics_jsonl)
    if history_csv is not None:
        from kubetrain.report.inputs import parse_history

        return [dict(row) for row in parse_history(history_csv).rows]
    return []


def best_of(values: Sequence[float], mode: str) -> float | None:
    if not values:
        return None
    return max(values) if mode == "max" else min(values)


def objective_value(
    metrics: Mapping[str, Any] | None, values: Sequence[float], metric: str, mode: str
) -> float | None:
    """A trial's result: metrics.json's ``final`` value of the metric (the exported model), else the best report."""
    final = (metrics or {}).get("final")
    if isinstance(final, Mapping):
        value = finite_number(final.get(metric))
        if value is not None:
            return value
    return best_of(values, mode)


def ranked(records: Sequence[Mapping[str, Any]], mode: str) -> list[Mapping[str, Any]]:
    """Trial records best first by objective; trials without a value last, by trial number."""

    def key(record: Mapping[str, Any]) -> tuple:
        value = finite_number((record.get("objective") or {}).get("value"))
        number = int(record.get("number", 0))
        if value is None:
            return (1, 0.0, number)
        return (0, -value if mode == "max" else value, number)

    return sorted(records, key=key)


def summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a trial record that the sweep record keeps for every trial (no history)."""
    keep = (
        "trial",
        "number",
        "round",
        "params",
        "fingerprint",
        "status",
        "stopped_early",
        "early_stop",
        "objective",
        "steps",
        "reports",
        "wall_time_s",
        "timing",
        "run_uri",
        "report_uri",
        "report_url",
        "reused_from",
        "exit_code",
        "finished_at",
    )
    return {k: record.get(k) for k in keep}
