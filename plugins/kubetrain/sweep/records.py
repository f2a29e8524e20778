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
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

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
from kubetrain_contract.trial import SweepCompute, SweepRecord, TrialObjective, TrialRecord, TrialSweep

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


# -- compute -------------------------------------------------------------------------------------

# The training container's name in a trial's pod (the KubernetesPodOperator's base container), under
# which the trial record's ``timing`` keeps its start and finish.
TRAINER_CONTAINER = "base"
_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")


def _stamp(value: Any) -> datetime | None:
    """An ISO 8601 time as the trial record's timing writes it, or ``None``."""
    if not isinstance(value, str) or not value:
        return None
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


def trainer_seconds(
    timing: Mapping[str, Any] | None, wall_time_s: Any = None, container: str = TRAINER_CONTAINER
) -> float | None:
    """The training container's run time: its start to its finish in ``timing`` (the pod's status),
    else the trainer's own ``wall_time_s`` (metrics.json), else ``None``.

    :param timing: a trial record's ``timing`` (``{container: {"started", "finished"}, ...}``).
    :param wall_time_s: metrics.json's ``wall_time_s``.
    :param container: the training container's name.
    """
    state = (timing or {}).get(container)
    if isinstance(state, Mapping):
        started, finished = _stamp(state.get("started")), _stamp(state.get("finished"))
        if started is not None and finished is not None and finished >= started:
            return (finished - started).total_seconds()
    wall = _number(wall_time_s)
    return float(wall) if wall is not None and wall >= 0 else None


def cpu_cores(quantity: Any) -> float | None:
    """A Kubernetes CPU quantity (``2``, ``1.5``, ``500m``) in cores, or ``None`` if it is not one."""
    if isinstance(quantity, int | float) and not isinstance(quantity, bool):
        return float(quantity) if quantity >= 0 else None
    match = _CPU.match(str(quantity).strip()) if quantity is not None else None
    if match is None:
        return None
    return float(match.group(1)) / (1000.0 if match.group(2) else 1.0)


def compute_fields(seconds: float | None, *, gpus: Any, cpu: Any) -> dict[str, Any]:
    """A trial record's compute fields: its trainer ``seconds`` and what its pod asked for.

    A trial whose pod asked for GPUs counts GPU-hours (seconds x GPUs); one that asked for none
    counts CPU-hours (seconds x its CPU request in cores).

    :param seconds: the trainer's run time (:func:`trainer_seconds`).
    :param gpus: the GPUs the training container asked for (an integer, or its text).
    :param cpu: the training container's CPU request (a Kubernetes quantity).
    """
    try:
        gpu_count = int(str(gpus).strip()) if gpus not in (None, "") else 0
    except ValueError:
        gpu_count = 0
    count: float | None  # None: a CPU request that is no quantity
    if gpu_count > 0:
        accelerator, count = "gpu", float(gpu_count)
    else:
        accelerator, count = "cpu", cpu_cores(cpu)
    hours = seconds * count / 3600.0 if seconds is not None and count is not None else None
    return {
        "trainer_seconds": seconds,
        "accelerator": accelerator,
        "accelerators": count,
        "accelerator_hours": hours,
    }


def budget_reports(
    record: TrialRecord,
    fixed_params: Mapping[str, Any] | None,
    finished_reports: int | None,
    max_resource: int | None = None,
) -> int | None:
    """The reports a trial would have made had it run to its budget: the early-stopping settings'
    ``max_resource`` (a trial's reports at full training), else its ``epochs`` (its point's, else the
    sweep's fixed Params'; kubetrain's trainers report once an epoch), else the most reports a trial
    that trained to its end made, else ``None``.

    :param record: the trial.
    :param fixed_params: the Params every trial shares (the plan's ``fixed_params``).
    :param finished_reports: the most reports of the sweep's trials that trained to their end.
    :param max_resource: the early-stopping settings' ``max_resource``, if set.
    """
    if max_resource is not None and _number(max_resource) is not None and max_resource >= 1:
        return int(max_resource)
    for source in (record.params, fixed_params or {}):
        epochs = _number(source.get("epochs"))
        if epochs is not None and epochs >= 1:
            return int(epochs)
    return finished_reports


def sweep_compute(
    records: Sequence[TrialRecord],
    *,
    rule: str | None = None,
    fixed_params: Mapping[str, Any] | None = None,
    max_resource: int | None = None,
) -> SweepCompute:
    """The trainers' compute of a sweep (``compute_used``) and what running every trial to its budget
    would have cost (``compute_full``), in GPU-hours, or CPU-hours where no trial asked for a GPU.

    A trial that finished or failed counts its actual hours in both figures; a trial stopped early
    counts its actual hours in the first and, in the second, those hours plus its remaining reports
    (up to its budget, :func:`budget_reports`) at the rate of the sweep's trials that trained to
    their end (the median of their hours per report and accelerator): their rate spreads one
    start-up over a whole budget, as the stopped trial's full run would have. With no such trial,
    at its own hours per report, which overstates what it saved: its start-up (the trainer's
    imports, the first step's tracing: several seconds) is spread over a few reports only. A trial
    that reused an earlier result ran nothing here; one without trainer time or resources (or,
    stopped, without a budget) is counted as unknown.

    :param records: the sweep's trial records.
    :param rule: the early-stopping rule (``median``, ...; ``None`` or ``off``: no stopping).
    :param fixed_params: the Params every trial shares (the plan's ``fixed_params``).
    :param max_resource: a trial's reports at full training (the early-stopping settings'), if set.
    """
    trained = [t for t in records if t.reused_from is None]
    timed: list[tuple[TrialRecord, float]] = []
    for record in trained:
        hours = record.accelerator_hours
        if hours is None and record.accelerators is not None:  # a record written before the hours
            seconds = record.trainer_seconds or trainer_seconds(record.timing, record.wall_time_s)
            hours = seconds * record.accelerators / 3600.0 if seconds is not None else None
        if hours is not None and record.accelerator is not None:
            timed.append((record, float(hours)))
    accelerator: Literal["gpu", "cpu"] | None = (
        "gpu" if any(t.accelerator == "gpu" for t, _ in timed) else ("cpu" if timed else None)
    )
    finished_reports = max((t.reports for t in trained if t.finished and t.reports), default=None)
    rates = [
        hours / record.accelerators / record.reports
        for record, hours in timed
        if record.accelerator == accelerator
        and not record.stopped_early
        and record.succeeded
        and record.reports
        and record.accelerators
    ]
    finished_rate = statistics.median(rates) if rates else None
    used = full = 0.0
    counted = stopped = failed = 0
    for record, hours in timed:
        if record.accelerator != accelerator:  # another unit: not added to this one
            continue
        if record.stopped_early:
            reports = record.reports or (record.early_stop.step if record.early_stop else None)
            budget = budget_reports(record, fixed_params, finished_reports, max_resource)
            if not reports or budget is None:
                continue
            remaining = max(budget, reports) - reports
            if finished_rate is not None and record.accelerators:
                full += hours + remaining * finished_rate * record.accelerators
            else:
                full += hours + remaining * hours / reports
            stopped += 1
        else:
            full += hours
            failed += 0 if record.succeeded else 1
        used += hours
        counted += 1
    summary = SweepCompute(
        accelerator=accelerator,
        compute_used=used if counted else None,
        compute_full=full if counted else None,
        saved_fraction=max(0.0, min(1.0, 1.0 - used / full)) if counted and full > 0 else None,
        trials=counted,
        stopped=stopped,
        failed=failed,
        unknown=len(trained) - counted,
        reused=len(records) - len(trained),
    )
    return dataclasses.replace(summary, line=compute_line(summary, rule, stopped_total=_stopped(trained)))


def _stopped(records: Sequence[TrialRecord]) -> int:
    return sum(1 for t in records if t.stopped_early)


def _hours(value: float) -> str:
    """Hours with 2 significant digits (``3.2``, ``0.041``), never in exponent notation."""
    if value <= 0:
        return "0"
    digits = max(0, 1 - math.floor(math.log10(value)))
    return f"{value:.{digits}f}"


def compute_line(summary: SweepCompute, rule: str | None, *, stopped_total: int | None = None) -> str:
    """The compute in words, as the leaderboard shows it: ``early stopping (median) stopped 11 of 16
    trials and saved 71% of 3.2 GPU-hours``.

    :param summary: the figures (:func:`sweep_compute`).
    :param rule: the early-stopping rule (``None`` or ``off``: no stopping).
    :param stopped_total: the trials the rule stopped, counted or not (default: the counted ones).
    """
    unit = "GPU-hours" if summary.accelerator == "gpu" else "CPU-hours"
    total = summary.trials + summary.unknown
    stopped = summary.stopped if stopped_total is None else stopped_total
    if summary.compute_full is None:
        line = f"compute unknown: no trial of {total} has its trainer time and resources"
    elif rule in (None, "", "off"):
        line = (
            f"no early stopping: {summary.trials} trial(s) used {_hours(summary.compute_used or 0.0)} {unit}"
        )
    else:
        saved = round(100 * (summary.saved_fraction or 0.0))
        line = (
            f"early stopping ({rule}) stopped {stopped} of {total} trials and saved {saved}% of "
            f"{_hours(summary.compute_full)} {unit} (used {_hours(summary.compute_used or 0.0)})"
        )
    notes = []
    if summary.compute_full is not None and summary.unknown:
        notes.append(f"{summary.unknown} trial(s) without trainer time, resources or budget not counted")
    if summary.failed:
        notes.append(f"{summary.failed} failed trial(s) counted as they ran")
    if summary.reused:
        notes.append(f"{summary.reused} reused trial(s) ran nothing here")
    return line + (f"; {'; '.join(notes)}" if notes else "")


def runs_compute(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The sweep's compute as its trials' run records carry it (their ``sweep.compute``; the
    Training page's sweep view shows it), or ``None`` where no record has it (written before).

    :param runs: the run records of one sweep's trials.
    """
    for run in runs:
        compute = (run.get("sweep") or {}).get("compute")
        if isinstance(compute, Mapping) and compute.get("line"):
            return dict(compute)
    return None


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
        "trainer_seconds",
        "accelerator",
        "accelerators",
        "accelerator_hours",
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
