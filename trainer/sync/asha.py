"""Asynchronous successive halving (ASHA) and Hyperband stopping of a sweep's trial, decided by its sidecar.

The rule (Li et al., "A System for Massively Parallel Hyperparameter Tuning", arXiv:1810.05934):
a trial's rungs are at ``min_resource * eta**(bracket + k)`` reports (``k = 0, 1, ...``), those of
at least ``grace`` reports and, when the trial's budget is known (``max_resource``, its reports at
full training), below it: a trial at its budget has finished and is not judged. When the trial
reaches a rung, its objective at that report is ranked among the values, at the same report, of
every trial of its bracket that has reached the rung so far, running trials included (asynchronous:
a trial never waits for its rung to fill). Of ``n`` trials ranked, the best ``max(1, n // eta)`` go
on; the others are stopped. Ties go on: a trial is promoted when its value is at least as good as
the cut-off, the ``max(1, n // eta)``-th best value (so its rank, 1 + the trials strictly better,
is within the promoted count). While fewer than ``eta`` trials have reached a rung, only a trial
that is the best there so far goes on: the first trial at a rung always does. That is Optuna's
SuccessiveHalvingPruner (``promotable_idx = 0`` for the first ``eta - 1`` trials), which, like this
sidecar, cannot pause a trial until its rung fills as the paper's synchronous version would. A
promotion is final: a trial is judged once at each rung, when it first reaches it. One difference
from Optuna: a trial is ranked by its value at the rung's report, even when the sidecar looks after
later reports, so that every trial at a rung is compared at the same training budget.

Hyperband (Li et al., arXiv:1603.06560) runs several such brackets: bracket ``b`` starts at
``min_resource * eta**b`` reports. Each trial gets its bracket from its number when the sweep proposes
it (:func:`kubetrain_contract.early_stop.hyperband_bracket`) and is ranked only against trials of
the same bracket; ``asha`` is the one bracket 0.

Why not Optuna's pruners: they read the competitors' rung values from a study's storage, in the
trial system attributes each pruner writes as its own trial passes a rung, so driving them from S3
means rebuilding an in-memory study of every competitor at every decision and keeping the hash-based
bracket of HyperbandPruner in step with the Airflow side; and the sidecar runs in the trainer image,
whose environment does not have Optuna (with SQLAlchemy and Alembic it would add tens of MB to every
trial's sidecar for a rule of twenty lines). The rule is implemented here instead, matching the
SuccessiveHalvingPruner's promotion and tie rule as stated above.

Where the competitors' reports come from: the trials' own OUTPUT_DIR reaches S3 only with the
sidecar's passes (every ``KUBETRAIN_SYNC_INTERVAL``, 30 s), too late for a rung decision a few
seconds after the report. So each sidecar, when its trial reaches a rung, first publishes the trial's
objective per report so far to ``<sweep>/sweep/rungs/<trial>.json`` (``KUBETRAIN_SWEEP_RUNGS_URI``,
a :class:`~kubetrain_contract.early_stop.RungReportRecord`), then ranks it against the other
trials' rung reports and the sweep's trial records (``KUBETRAIN_SWEEP_TRIALS_URI``; a trial reused
from an earlier sweep has a record and no rung report). Each decision lists the two prefixes once
and reads only the objects that changed since the last one (by ETag).

Reports are read as the median rule reads them (:func:`trainer.sync.median.report_values`): the
objective of each line of ``metrics.jsonl`` that has its key (else each row of ``history.csv``), in
order, ``None`` where it is not a finite number. A report's position counts whether or not its value
is usable, so a rung is the same report for every trial; a value that is not a finite number at a
rung stops the trial there unranked, even alone at the rung, and is not counted among the values
ranked there (:func:`kubetrain_contract.early_stop.rung_rank`; Optuna's SuccessiveHalvingPruner
prunes a NaN at a rung before it ranks it). A stop writes the decision to
``<run>/sync/early-stop.json``, then the stop file, as the median rule does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain_contract.early_stop import EarlyStopRecord, RungReportRecord, hyperband_bracket, rung_rank
from kubetrain_contract.records import RecordError
from kubetrain_contract.reports import best_report
from kubetrain_contract.s3uri import S3Uri
from trainer.sync.errors import S3RequestError
from trainer.sync.median import ReportStopper, check_objective, record_values, report_values
from trainer.sync.progress import log
from trainer.sync.s3 import S3

__all__ = ["RULES", "RungDecision", "RungRule", "RungStopper"]

RULES = ("asha", "hyperband")


@dataclass(frozen=True)
class RungDecision:
    """How a trial ranked at one rung; ``promoted`` is whether it goes on. ``value`` and ``rank`` are
    ``None`` when its value there was not a finite number (not ranked, not promoted)."""

    rung: int
    value: float | None
    rank: int | None
    trials: int
    promoted_count: int
    cutoff: float | None

    @property
    def promoted(self) -> bool:
        return self.rank is not None and self.rank <= self.promoted_count


@dataclass(frozen=True)
class RungRule:
    """The ASHA rung rule with its settings (see the module docstring).

    :param objective: the metric compared.
    :param mode: ``max`` or ``min``.
    :param min_resource: reports at the first rung of bracket 0.
    :param reduction_factor: eta: the top ``1/eta`` of a rung go on.
    :param grace: reports a trial makes before it may be stopped (rungs below it are not judged).
    :param max_resource: a trial's reports at full training; no rung at or above it. ``None``: unknown.
    :param bracket: this trial's bracket (Hyperband); 0 for asha.
    :param brackets: the sweep's number of brackets; 1 for asha.
    :param name: ``asha`` or ``hyperband``, as the decision names it.
    """

    objective: str
    mode: str = "max"
    min_resource: int = 1
    reduction_factor: int = 3
    grace: int = 1
    max_resource: int | None = None
    bracket: int = 0
    brackets: int = 1
    name: str = "asha"

    def __post_init__(self) -> None:
        check_objective(self.objective, self.mode)
        if self.name not in RULES:
            raise ValueError(f"rule {self.name!r} is not a rung rule: expected one of {', '.join(RULES)}")
        for field, value, least in (
            ("min_resource", self.min_resource, 1),
            ("reduction_factor", self.reduction_factor, 2),
            ("grace", self.grace, 1),
            ("brackets", self.brackets, 1),
            ("bracket", self.bracket, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{field} {value!r} is not valid: expected an integer >= {least}")
        if self.max_resource is not None and (
            not isinstance(self.max_resource, int)
            or isinstance(self.max_resource, bool)
            or self.max_resource < 1
        ):
            raise ValueError(f"max_resource {self.max_resource!r} is not valid: expected an integer >= 1")
        if self.bracket >= self.brackets:
            raise ValueError(
                f"bracket {self.bracket} is not valid: expected one of the {self.brackets} brackets, 0 to "
                f"{self.brackets - 1}"
            )

    @property
    def first_rung(self) -> int:
        """Reports at this trial's first rung, before ``grace`` applies."""
        return self.min_resource * self.reduction_factor**self.bracket

    def rungs(self, reports: int) -> list[int]:
        """The rungs, in reports, this trial is judged at once it has made ``reports`` reports."""
        out, rung = [], self.first_rung
        while rung <= reports and (self.max_resource is None or rung < self.max_resource):
            if rung >= self.grace:
                out.append(rung)
            rung *= self.reduction_factor
        return out

    @property
    def start_step(self) -> int:
        """The first report at which the rule may stop this trial."""
        rung = self.first_rung
        while rung < self.grace:
            rung *= self.reduction_factor
        return rung

    def rank(self, rung: int, value: float | None, competitors: list[list[float | None]]) -> RungDecision:
        """How ``value`` at ``rung`` ranks among the competitors that reached the rung."""
        at = [c[rung - 1] for c in competitors if len(c) >= rung]
        ranked = rung_rank(value, at, self.mode, self.reduction_factor)
        return RungDecision(
            rung, ranked.value, ranked.rank, ranked.trials, ranked.promoted_count, ranked.cutoff
        )

    def judge(
        self, values: list[float | None], competitors: list[list[float | None]], after: int = 0
    ) -> list[RungDecision]:
        """The decisions at the rungs above ``after`` that ``values`` has reached, in order; the last
        one stops the trial when it is not promoted (no rung is judged after a stop).

        :param values: this trial's objective per report (``None`` where not a finite number).
        :param competitors: the objective per report of the other trials of its bracket.
        :param after: the highest rung already judged.
        """
        out = []
        for rung in self.rungs(len(values)):
            if rung <= after:
                continue
            decision = self.rank(rung, values[rung - 1], competitors)
            out.append(decision)
            if not decision.promoted:
                break
        return out

    def record(self, decision: RungDecision, values: list[float | None]) -> EarlyStopRecord:
        """The early-stop record of a stop at ``decision`` after ``values``."""
        return EarlyStopRecord(
            rule=self.name,
            objective=self.objective,
            mode=self.mode,  # type: ignore[arg-type]
            start_step=self.start_step,
            step=len(values),
            best=best_report(values, self.mode),
            rung=decision.rung,
            value=decision.value,
            rank=decision.rank,
            rung_trials=decision.trials or None,
            promoted=decision.promoted_count or None,
            cutoff=decision.cutoff,
            min_resource=self.min_resource,
            reduction_factor=self.reduction_factor,
            grace=self.grace,
            bracket=self.bracket if self.name == "hyperband" else None,
        )


class RungStopper(ReportStopper):
    """Applies :class:`RungRule` to this trial whenever it reaches a rung.

    Args:
        s3: the sidecar's S3 access.
        rule: the rule, its settings and this trial's bracket.
        trial: this trial's number (``KUBETRAIN_SWEEP_TRIAL``), the name of its rung report.
        run: this trial's run prefix (``KUBETRAIN_RUN_URI``).
        trials: prefix of the sweep's trial records (``KUBETRAIN_SWEEP_TRIALS_URI``).
        rungs: prefix of the sweep's rung reports (``KUBETRAIN_SWEEP_RUNGS_URI``).
        output_dir: the trial's OUTPUT_DIR.
        stop_file: where to tell the trainer to stop (``KUBETRAIN_STOP_FILE``).
    """

    def __init__(
        self,
        s3: S3,
        rule: RungRule,
        *,
        trial: int,
        run: S3Uri,
        trials: S3Uri,
        rungs: S3Uri,
        output_dir: Path,
        stop_file: Path,
    ) -> None:
        super().__init__(s3, run=run, output_dir=output_dir, stop_file=stop_file)
        self.rule = rule
        self.trial = trial
        self.trials = trials
        self.rungs = rungs
        self.judged = 0  # the highest rung this trial was promoted at
        self.decision: RungDecision | None = None
        # key -> (etag, trial, objective per report)
        self._objects: dict[str, tuple[str, int | None, list[float | None]]] = {}
        self._restored = False

    def _read(self, prefix: S3Uri, parse: Any) -> None:
        """List ``prefix`` once; read each object that is new or changed (ETag) through ``parse``."""
        for item in self.s3.list_objects(prefix.bucket, prefix.key):
            key, etag = item["Key"], item["ETag"]
            if not key.endswith(".json") or self._objects.get(key, ("",))[0] == etag:
                continue
            body = self.s3.get_bytes(prefix.bucket, key)
            try:
                number, values = parse(json.loads(body))
            except (ValueError, TypeError, KeyError, RecordError):
                number, values = None, []
            self._objects[key] = (etag, number, values)

    def _from_record(self, record: Any) -> tuple[int | None, list[float | None]]:
        if not isinstance(record, dict) or not isinstance(record.get("number"), int):
            return None, []
        number = record["number"]
        if hyperband_bracket(number, self.rule.brackets, self.rule.reduction_factor) != self.rule.bracket:
            return None, []
        return number, record_values(record, self.rule.objective)

    def _from_rung_report(self, doc: Any) -> tuple[int | None, list[float | None]]:
        report = RungReportRecord.from_dict(doc, where="rung report")
        if report.bracket != self.rule.bracket or report.objective != self.rule.objective:
            return None, []
        return report.trial, list(report.values)

    def competitors(self) -> list[list[float | None]]:
        """The objective per report of every other trial of this bracket: its record's history, or its
        latest rung report, whichever has more reports."""
        self._read(self.trials, self._from_record)
        self._read(self.rungs, self._from_rung_report)
        best: dict[int, list[float | None]] = {}
        for _, number, values in self._objects.values():
            if number is None or number == self.trial or not values:
                continue
            if len(values) > len(best.get(number, [])):
                best[number] = values
        return list(best.values())

    @property
    def report_key(self) -> str:
        """The key of this trial's rung report."""
        return f"{self.rungs.key.rstrip('/')}/{self.trial}.json"

    def restore(self) -> None:
        """Resume at the rung this trial's own rung report says it was promoted at (a restarted sidecar,
        or a retried pod): a promotion is final, the trial is not judged again at a rung it passed."""
        self._restored = True
        try:
            body = self.s3.get_bytes(self.rungs.bucket, self.report_key)
        except S3RequestError as exc:
            if exc.status == 404:
                return
            raise
        try:
            report = RungReportRecord.from_json(body, where=self.report_key)
        except RecordError as exc:
            log(f"checkpoint-sync: WARNING: {self.rule.name}: own rung report not read: {exc}")
            return
        if report.bracket == self.rule.bracket and report.objective == self.rule.objective:
            self.judged = max(self.judged, report.promoted_at)

    def publish(self, values: list[float | None]) -> None:
        """Put this trial's objective per report so far where the other trials' sidecars read it."""
        report = RungReportRecord(
            trial=self.trial,
            bracket=self.rule.bracket,
            objective=self.rule.objective,
            values=list(values),
            promoted_at=self.judged,
        )
        key = self.report_key
        self.s3.put_bytes(
            self.rungs.bucket, key, report.to_json(indent=None).encode(), content_type="application/json"
        )

    def check(self) -> RungDecision | None:
        """Look at this trial's reports; at a new rung, publish them, rank the trial, stop it when the
        rule says so. The stop decision, once taken."""
        if self.decision is not None:
            return self.decision
        seen, rows = self._local_reports()
        if rows is None:
            return None
        values = report_values(rows, self.rule.objective)
        if not [r for r in self.rule.rungs(len(values)) if r > self.judged]:
            self._seen = seen
            return None
        if not self._restored:
            self.restore()
        self.publish(values)
        decisions = self.rule.judge(values, self.competitors(), after=self.judged)
        self._seen = seen
        if decisions and decisions[-1].promoted:
            self.judged = decisions[-1].rung
            self.publish(values)
        for decision in decisions:
            if decision.promoted:
                log(
                    f"checkpoint-sync: {self.rule.name}: {self.rule.objective} {decision.value:.6g} at rung "
                    f"{decision.rung} ranks {decision.rank} of {decision.trials} (top {decision.promoted_count} "
                    f"go on, cut-off {decision.cutoff:.6g}): promoted"
                )
                continue
            self.write_stop(self.rule.record(decision, values))
            self.decision = decision
            if decision.rank is None:
                log(
                    f"checkpoint-sync: {self.rule.name}: {self.rule.objective} at rung {decision.rung} is not a "
                    f"finite number (NaN, infinite or not a number): stopping the trial unranked ({self.stop_file})"
                )
                return decision
            log(
                f"checkpoint-sync: {self.rule.name}: {self.rule.objective} {decision.value:.6g} at rung "
                f"{decision.rung} ranks {decision.rank} of {decision.trials}, outside the top "
                f"{decision.promoted_count} (cut-off {decision.cutoff:.6g}): stopping the trial ({self.stop_file})"
            )
            return decision
        return None
