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

A trial record is a :class:`~kubetrain_contract.trial.TrialRecord`; :func:`assemble_trial` is the
one place one is put together (a trained trial, a failed one, one reused by fingerprint, and the
stand-in of a trial that left none). Nothing here talks to S3; :mod:`kubetrain.sweep.store` reads
and the sweep's operators write through the run store.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.s3_layout import RunLocation, S3Layout, s3_uri, safe_segment
from kubetrain_contract.early_stop import EarlyStopRecord
from kubetrain_contract.exit_codes import EXIT_STOPPED
from kubetrain_contract.reports import (  # noqa: F401 - the file names are read here by the sweep operators
    EARLY_STOP_RECORD,
    HISTORY_CSV,
    METRICS_JSONL,
    finite_number,
    objective_values,
)
from kubetrain_contract.reports import parse_jsonl as contract_parse_jsonl
from kubetrain_contract.trial import SweepRecord, TrialObjective, TrialRecord, TrialSweep

TRIAL_KIND = TrialRecord.KIND
SWEEP_KIND = SweepRecord.KIND
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


def sweep_ref(settings: Mapping[str, Any]) -> TrialSweep:
    """The sweep fields of a trial record, from the plan or the trials' settings."""
    return TrialSweep(
        id=settings.get("id"),
        dag_id=settings.get("dag_id"),
        run_id=settings.get("run_id"),
        uri=settings.get("uri"),
        algorithm=settings.get("algorithm"),
    )


def assemble_trial(
    settings: Mapping[str, Any] | None,
    number: int,
    *,
    round: int | None,
    params: Mapping[str, Any] | None,
    fingerprint: str | None,
    run_uri: str | None,
    finished_at: str | None,
    value: float | None = None,
    values: Sequence[float] = (),
    error: str | None = None,
    outcome: TrialRecord | None = None,
    **fields: Any,
) -> TrialRecord:
    """A trial record: trial ``number`` of the sweep ``settings`` describe, at its point ``params``.

    :param settings: the plan or the trials' settings (``id``, ``dag_id``, ``run_id``, ``uri``,
        ``algorithm``, ``objective``), or ``None`` where the record names no sweep.
    :param number: the trial's number.
    :param round: the round that asked for it.
    :param params: the trial's point of the space.
    :param fingerprint: what it trained, as a hex digest.
    :param run_uri: the run prefix of the trial that trained (another sweep's for a reused one).
    :param finished_at: when the record is written (``None``: not written by the trial's task).
    :param value: the trial's objective value.
    :param values: the objective at each report.
    :param error: why the trial failed; a record with an error has status ``failed``.
    :param outcome: a finished trial whose outcome this one reuses (its reports, metrics, timing).
    :param fields: further :class:`TrialRecord` fields (the outcome of a trained trial).
    """
    objective = (settings or {}).get("objective") or {}
    head: dict[str, Any] = {
        "sweep": sweep_ref(settings) if settings is not None else None,
        "trial": str(number),
        "number": int(number),
        "round": round,
        "params": dict(params or {}),
        "fingerprint": fingerprint,
        "status": "failed" if error is not None else "success",
        "error": error,
        "objective": TrialObjective(
            name=objective.get("metric"), mode=objective.get("mode"), value=value, values=list(values)
        ),
        "run_uri": run_uri,
        "finished_at": finished_at,
        **fields,
    }
    if outcome is not None:
        return dataclasses.replace(outcome, **head)
    return TrialRecord(**head)


def _number(value: Any) -> int | float | None:
    """A number metrics.json reports, or ``None`` for anything else (the record's fields are numbers)."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def trial_outcome(
    metrics: Mapping[str, Any] | None,
    rows: Sequence[Mapping[str, Any]],
    early_stop: EarlyStopRecord | None,
    exit_code: int | None,
    metric: str,
    mode: str,
) -> dict[str, Any]:
    """The outcome fields of a trained trial's record, from what it wrote.

    :param metrics: its metrics.json (``None``: it wrote none).
    :param rows: its reports (:func:`history_rows`).
    :param early_stop: the sidecar's early-stop decision, if it made one.
    :param exit_code: the training container's exit code.
    :param metric: the objective.
    :param mode: ``max`` or ``min``.
    """
    metrics = metrics or {}
    values = objective_values(rows, metric)
    by = metrics.get("stopped_early")
    by = by.get("by") if isinstance(by, Mapping) else None
    # the decision alone is not enough: the trainer may have finished before it saw the stop file
    stopped = early_stop is not None and (exit_code == EXIT_STOPPED or by == "stop file")
    final = metrics.get("final")
    return {
        "value": objective_value(metrics, values, metric, mode),
        "values": values,
        "stopped_early": stopped,
        "early_stop": early_stop if stopped else None,
        "stop_requested": early_stop if not stopped else None,
        "final_metrics": dict(final) if isinstance(final, Mapping) else None,
        "steps": _number(metrics.get("steps")) or (_number(rows[-1].get("step")) if rows else None),
        "epochs": _number(metrics.get("epochs")),
        "reports": len(rows),
        "wall_time_s": _number(metrics.get("wall_time_s")),
        "resumed_from_step": _number(metrics.get("resumed_from_step")),
        "exit_code": exit_code,
        "history": [dict(row) for row in rows],
    }


def ranked(records: Sequence[TrialRecord], mode: str) -> list[TrialRecord]:
    """Trial records best first by objective; trials without a value last, by trial number."""

    def key(record: TrialRecord) -> tuple:
        value = finite_number(record.objective.value)
        if value is None:
            return (1, 0.0, record.number)
        return (0, -value if mode == "max" else value, record.number)

    return sorted(records, key=key)


def counts(records: Sequence[TrialRecord]) -> dict[str, int]:
    """How many trials finished, were stopped early, and failed."""
    return {
        "succeeded": sum(1 for t in records if t.finished),
        "stopped_early": sum(1 for t in records if t.stopped_early),
        "failed": sum(1 for t in records if not t.succeeded),
    }


def summary(record: TrialRecord) -> dict[str, Any]:
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
    doc = record.to_dict()
    return {k: doc.get(k) for k in keep}
