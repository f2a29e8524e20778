"""Median early stopping of a sweep's trial, decided by its checkpoint-sync sidecar.

The rule is Katib's ``medianstop`` (the median stopping rule of Google Vizier): a running
trial that has made at least ``start_step`` reports is stopped at report ``S`` when its best
objective value so far is strictly worse than the median, over the sweep's finished trials,
of each one's running average of the objective over its first ``S`` reports; the rule
applies once at least ``min_trials`` trials have finished. A finished trial is one whose
record says it succeeded without being stopped; one with fewer than ``S`` reports
contributes the average of all of its reports.

A report whose objective is not a finite number (NaN, an infinity, a value that is not a
number, ``null``, an empty cell) still counts as a report: report ``S`` is the ``S``-th line
that has the objective whatever its value. A trial's best is its best usable value; a trial
none of whose reports is usable is stopped once the rule applies to it (``S >= start_step``, the
finished trials to compare with), as Optuna's MedianPruner prunes a trial whose intermediate
values are all NaN. A finished trial's running average is
over its usable values among its first ``S`` reports; one that has none there does not count at
``S``, neither in the median nor towards ``min_trials``.

Reports come from the trial's own OUTPUT_DIR, read locally: ``metrics.jsonl`` (one JSON
object a line, appended per epoch or step; any container can write it) when it exists, else
``history.csv`` (kubetrain's trainers write one row per epoch). A container that writes
neither is never stopped. The finished trials' reports come from their records in S3
(``KUBETRAIN_SWEEP_TRIALS_URI``), each read once.

A stop writes the decision to ``<run>/sync/early-stop.json`` first, then the stop file
(``KUBETRAIN_STOP_FILE``); the trainer, which looks for the file between steps, writes its
checkpoint and outputs and exits with 79.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain_contract.early_stop import EarlyStopRecord
from kubetrain_contract.reports import (
    EARLY_STOP_KIND,
    EARLY_STOP_RECORD,
    HISTORY_CSV,
    METRICS_JSONL,
    best_report,
    finite_number,
    objective_reports,
    parse_jsonl,
)
from kubetrain_contract.s3uri import S3Uri
from trainer.sync.progress import log
from trainer.sync.s3 import S3

__all__ = [
    "EARLY_STOP_KIND",
    "EARLY_STOP_RECORD",
    "HISTORY_CSV",
    "METRICS_JSONL",
    "MODES",
    "check_objective",
    "Decision",
    "MedianRule",
    "MedianStopper",
    "ReportStopper",
    "parse_reports",
    "record_values",
    "report_values",
]

MODES = ("max", "min")


def check_objective(objective: str, mode: str) -> None:
    """Refuse an empty objective metric or a mode other than ``max`` and ``min`` (every stopping rule's)."""
    if not objective:
        raise ValueError("the objective metric is empty: expected a history.csv column or metrics.jsonl key")
    if mode not in MODES:
        raise ValueError(f"objective mode {mode!r} is not valid: expected 'max' or 'min'")


@dataclass(frozen=True)
class Decision:
    """Why a trial is stopped at report ``step``."""

    step: int
    best: float | None  # None: none of the trial's reports was a finite number
    median: float
    finished_trials: int

    def record(self, rule: MedianRule) -> EarlyStopRecord:
        """The early-stop record of this decision under ``rule``."""
        return EarlyStopRecord(rule="median", **dataclasses.asdict(rule), **dataclasses.asdict(self))


@dataclass(frozen=True)
class MedianRule:
    """The median stopping rule with its settings (see the module docstring)."""

    objective: str
    mode: str = "max"
    min_trials: int = 3
    start_step: int = 4

    def __post_init__(self) -> None:
        check_objective(self.objective, self.mode)
        if self.min_trials < 1 or self.start_step < 1:
            raise ValueError(
                f"min_trials {self.min_trials} and start_step {self.start_step} must be at least 1"
            )

    def decide(self, values: list[float | None], finished: list[list[float | None]]) -> Decision | None:
        """A stop decision for a trial that reported ``values`` so far (``None`` where a report was not
        a finite number), or ``None`` to let it run."""
        step = len(values)
        if step < self.start_step:
            return None
        averages = []
        for curve in finished:
            usable = [v for v in map(finite_number, curve[:step]) if v is not None]
            if usable:
                averages.append(sum(usable) / len(usable))
        if len(averages) < self.min_trials:
            return None
        median = statistics.median(averages)
        best = best_report(values, self.mode)
        if best is None:
            return Decision(step, None, median, len(averages))
        worse = best < median if self.mode == "max" else best > median
        return Decision(step, best, median, len(averages)) if worse else None


def report_values(rows: list[dict[str, Any]], objective: str) -> list[float | None]:
    """The objective of each report of it, in order, ``None`` where it is not a finite number: a
    report's position counts whether or not its value is usable
    (:func:`kubetrain_contract.reports.objective_reports`)."""
    return objective_reports(rows, objective)


def parse_reports(jsonl: str | None, history: str | None) -> list[dict[str, Any]]:
    """Report rows from metrics.jsonl (preferred) or history.csv; a torn last line is ignored."""
    if jsonl is not None:
        return parse_jsonl(jsonl)
    if history is not None:
        return [dict(row) for row in csv.DictReader(io.StringIO(history))]
    return []


def record_values(record: Mapping[str, Any], objective: str) -> list[float | None]:
    """The objective per report of a trial record (``None`` where not a finite number): its history,
    else its objective's values (the usable ones only, as the Airflow side records them)."""
    history, objective_record = record.get("history"), record.get("objective")
    rows = history if isinstance(history, list) else []
    values = report_values([r for r in rows if isinstance(r, dict)], objective)
    recorded = objective_record if isinstance(objective_record, dict) else {}
    if not values and recorded.get("name") == objective and isinstance(recorded.get("values"), list):
        values = [finite_number(v) for v in recorded["values"]]
    return values


class ReportStopper:
    """What the sidecar's stopping rules share: this trial's reports, read locally when they change,
    and the stop (the decision in S3, then the stop file).

    Args:
        s3: the sidecar's S3 access.
        run: this trial's run prefix (``KUBETRAIN_RUN_URI``).
        output_dir: the trial's OUTPUT_DIR.
        stop_file: where to tell the trainer to stop (``KUBETRAIN_STOP_FILE``).
    """

    def __init__(self, s3: S3, *, run: S3Uri, output_dir: Path, stop_file: Path) -> None:
        self.s3 = s3
        self.run = run
        self.output_dir = output_dir
        self.stop_file = stop_file
        self._seen: tuple | None = None
        self.decision: Any = None  # the stop decision, once taken

    def check(self) -> Any:
        """Look at this trial's reports; stop it when the rule says so. The decision, once taken."""
        raise NotImplementedError

    def _local_reports(self) -> tuple[tuple, list[dict[str, Any]] | None]:
        """(what the report files look like, their rows); no rows when nothing changed since the last look."""
        names = (METRICS_JSONL, HISTORY_CSV)
        state: list[tuple[int, int] | None] = []
        for name in names:
            try:
                st = os.stat(self.output_dir / name)
                state.append((st.st_size, st.st_mtime_ns))
            except OSError:
                state.append(None)
        key = tuple(state)
        if key == self._seen:
            return key, None
        texts: dict[str, str | None] = {}
        for name in names:
            try:
                texts[name] = (self.output_dir / name).read_text(encoding="utf-8-sig", errors="replace")
            except OSError:
                texts[name] = None
        return key, parse_reports(texts[METRICS_JSONL], texts[HISTORY_CSV])

    def write_stop(self, record: EarlyStopRecord) -> None:
        """Record the decision in S3, then write the stop file (atomically) for the trainer."""
        body = (record.to_json(indent=1) + "\n").encode()
        key = f"{self.run.key.rstrip('/')}/sync/{EARLY_STOP_RECORD}"
        self.s3.put_bytes(self.run.bucket, key, body, content_type="application/json")
        tmp = self.stop_file.with_name(self.stop_file.name + ".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, self.stop_file)


class MedianStopper(ReportStopper):
    """Applies :class:`MedianRule` to this trial whenever its reports grow.

    Args:
        s3: the sidecar's S3 access.
        rule: the rule and its settings.
        run: this trial's run prefix (``KUBETRAIN_RUN_URI``).
        trials: prefix of the sweep's finished trial records (``KUBETRAIN_SWEEP_TRIALS_URI``).
        output_dir: the trial's OUTPUT_DIR.
        stop_file: where to tell the trainer to stop (``KUBETRAIN_STOP_FILE``).
    """

    def __init__(
        self, s3: S3, rule: MedianRule, *, run: S3Uri, trials: S3Uri, output_dir: Path, stop_file: Path
    ) -> None:
        super().__init__(s3, run=run, output_dir=output_dir, stop_file=stop_file)
        self.rule = rule
        self.trials = trials
        self.decision: Decision | None = None
        self._finished: dict[str, list[float | None]] = {}  # record key -> objective per report
        self._not_finished: set[tuple[str, str]] = (
            set()
        )  # (key, etag) of records of trials that did not succeed

    def finished_values(self) -> list[list[float | None]]:
        """The objective per report of every finished trial of the sweep (records read once)."""
        for item in self.s3.list_objects(self.trials.bucket, self.trials.key):
            key, etag = item["Key"], item["ETag"]
            if not key.endswith(".json") or key in self._finished or (key, etag) in self._not_finished:
                continue
            body = self.s3.get_bytes(self.trials.bucket, key)
            try:
                record = json.loads(body)
            except ValueError:
                self._not_finished.add((key, etag))
                continue
            if (
                not isinstance(record, dict)
                or record.get("status") != "success"
                or record.get("stopped_early")
            ):
                self._not_finished.add((key, etag))
                continue
            self._finished[key] = record_values(record, self.rule.objective)
        return [v for v in self._finished.values() if v]

    def check(self) -> Decision | None:
        """Look at this trial's reports; stop it when the rule says so. The decision, once taken."""
        if self.decision is not None:
            return self.decision
        seen, rows = self._local_reports()
        if rows is None:
            return None
        values = report_values(rows, self.rule.objective)
        if len(values) < self.rule.start_step:
            self._seen = seen
            return None
        decision = self.rule.decide(values, self.finished_values())
        self._seen = seen
        if decision is None:
            return None
        self.stop(decision)
        return decision

    def stop(self, decision: Decision) -> None:
        """Record the decision in S3, then write the stop file (atomically) for the trainer."""
        self.write_stop(decision.record(self.rule))
        self.decision = decision
        if decision.best is None:
            log(
                f"checkpoint-sync: median stopping: {self.rule.objective} is not a finite number in any of "
                f"{decision.step} reports (NaN, infinite or not a number): stopping the trial ({self.stop_file})"
            )
            return
        log(
            f"checkpoint-sync: median stopping: {self.rule.objective} best {decision.best:.6g} after "
            f"{decision.step} reports is {'below' if self.rule.mode == 'max' else 'above'} the median "
            f"{decision.median:.6g} of {decision.finished_trials} finished trials' running averages: "
            f"stopping the trial ({self.stop_file})"
        )
