"""The end of a sweep: the leaderboard (every trial ranked, the best one compared with the promoted
model) and the sweep record, with a run record per trial for the Training page.

::

    ... -> round_<last>.train -> leaderboard -> promote -> record
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from kubetrain.links import REPORT_URL_XCOM_KEY, ReportLink, report_url
from kubetrain.operators.base import RunStoreOperator
from kubetrain.s3_layout import RunLocation, s3_uri, utc_stamp
from kubetrain.sweep.records import counts, ranked, summary, sweep_compute
from kubetrain.sweep.store import SweepStoreOperator, all_trials
from kubetrain_contract.trial import SweepCompute, SweepRecord, TrialRecord

if TYPE_CHECKING:
    from airflow.sdk import Context

# What the sweep record keeps of the plan.
PLAN_FIELDS = (
    "id",
    "dag_id",
    "run_id",
    "uri",
    "title",
    "space",
    "algorithm",
    "seed",
    "max_trials",
    "parallel_trials",
    "objective",
    "early_stopping",
    "rounds",
    "image",
    "code_version",
    "dataset",
    "model",
    "fixed_params",
    "created_at",
)


def best_trial(order: Sequence[TrialRecord]) -> TrialRecord | None:
    """The first trial of ``order`` (best first) that succeeded with an objective value, if any."""
    return next((t for t in order if t.succeeded and t.objective.value is not None), None)


def plan_compute(plan: Mapping[str, Any], trials: Sequence[TrialRecord]) -> SweepCompute:
    """The sweep's compute (used, and had every trial run to its budget) under ``plan``'s stopping rule.

    :param plan: the sweep's plan (its ``early_stopping`` and ``fixed_params``).
    :param trials: every trial's record.
    """
    early = plan.get("early_stopping") or {}
    return sweep_compute(
        trials,
        rule=early.get("rule"),
        fixed_params=plan.get("fixed_params"),
        max_resource=early.get("max_resource"),
    )


class SweepReportOperator(SweepStoreOperator):
    """The leaderboard: every trial ranked by the objective, in HTML and Markdown, and the best trial.

    Writes ``report.html``, ``report.md`` and the plots (objective per trial, parallel coordinates
    of the hyperparameters against the objective) into the sweep's ``report/`` prefix, and
    compares the best trial with the promoted model as the single-run report does (its
    metrics.json's monitor; strictly better wins). Shows the trainers' compute and what running every
    trial to its budget would have cost (:func:`~kubetrain.sweep.records.sweep_compute`). Fails when
    no trial has a result.

    Returns (XCom) ``{"best_trial", "best_run_uri", "best_value", "better_than_promoted",
    "comparison", "report_uri", "report_url", "trials", "succeeded", "stopped_early", "failed",
    "compute"}``, each also its own XCom (``compute``: the line in words).

    :param model: the model to compare with (``None``: no comparison). (templated)
    :param title: report title. (templated)
    :param compare_on: ``final`` or ``best`` (see ReportOperator).
    """

    template_fields: Sequence[str] = (*RunStoreOperator.template_fields, "model", "title")
    operator_extra_links = (ReportLink(),)
    ui_color = "#fdf5e6"

    def __init__(
        self,
        *,
        model: str | None = None,
        title: str | None = None,
        compare_on: str = "final",
        multiple_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(multiple_outputs=multiple_outputs, **kwargs)
        self.model = model
        self.title = title
        self.compare_on = compare_on

    def execute(self, context: Context) -> dict[str, Any]:
        from kubetrain.report.inputs import compare, parse_metrics
        from kubetrain.report.sweep import SweepReportInputs, render_sweep_report

        sweep = self.sweep_location(context)
        plan = self.load_plan(sweep)
        trials = all_trials(self.store, sweep)
        metric, mode = plan["objective"]["metric"], plan["objective"]["mode"]
        order = ranked(trials, mode)
        best = best_trial(order)
        if best is None:
            raise AirflowFailException(
                f"no trial of the sweep has a {metric}: {len(trials)} trial(s), "
                + ", ".join(f"{t.number}: {t.status} {t.error or ''}".strip() for t in trials)
            )
        comparison = None
        if self.model and best.run_uri:
            best_run = RunLocation.from_uri(best.run_uri)
            raw = self.store.read(best_run.bucket, best_run.key("output", "metrics.json"))
            if raw is not None:
                version, promoted = self.store.models.promoted_metrics(self.model)
                comparison = compare(parse_metrics(raw), promoted, version, on=self.compare_on)
                self.log.info(
                    "Best trial %s against the promoted %s: %s", best.trial, self.model, comparison.reason
                )
            else:
                self.log.info(
                    "Best trial %s wrote no metrics.json: nothing to compare with the promoted model",
                    best.trial,
                )
        compute = plan_compute(plan, trials)
        files = render_sweep_report(
            SweepReportInputs(
                plan=plan,
                trials=[t.to_dict() for t in order],
                best=best.to_dict(),
                comparison=comparison,
                title=self.title,
                trial_report_url=lambda t: t.get("report_url"),
                compute=compute,
            )
        )
        report_uri = self.store.reports.write(sweep.run, files)
        url = report_url(context["ti"].dag_id, sweep.bucket, sweep.run.key("report", "report.html"))
        context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=url)
        tally = counts(trials)
        self.log.info(
            "Leaderboard of %d trial(s) (%s) at %s: best trial %s, %s %s; %s",
            len(trials),
            ", ".join(f"{v} {k}" for k, v in tally.items()),
            url,
            best.trial,
            metric,
            best.objective.value,
            compute.line,
        )
        return {
            "best_trial": best.trial,
            "best_run_uri": best.run_uri,
            "best_value": best.objective.value,
            "better_than_promoted": comparison.better if comparison else None,
            "comparison": comparison.reason if comparison else None,
            "report_uri": report_uri,
            "report_url": url,
            "trials": len(trials),
            **tally,
            "compute": compute.line,
        }


class RecordSweepOperator(SweepStoreOperator):
    """Write the sweep record, one JSON object: ``<sweep>/sweep/sweep.json`` (kind ``kubetrain/sweep``).

    It holds the plan (space, algorithm, seed, objective, early stopping, dataset version, image
    digest, code version, fixed Params), every trial's params and result (the trial records
    without their per-report history), the best trial, the leaderboard, the trainers' compute
    (used, and had every trial run to its budget) and what was promoted.

    :param leaderboard: ``leaderboard.output``. (templated)
    :param promotion: ``promote.output``. (templated)
    """

    template_fields: Sequence[str] = (*RunStoreOperator.template_fields, "leaderboard", "promotion")
    ui_color = "#f0f0f0"

    def __init__(
        self,
        *,
        leaderboard: Mapping[str, Any] | None = None,
        promotion: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.leaderboard = leaderboard
        self.promotion = promotion

    def execute(self, context: Context) -> dict[str, Any]:
        sweep = self.sweep_location(context)
        plan = self.load_plan(sweep)
        trials = all_trials(self.store, sweep)
        leaderboard = dict(self.leaderboard or {})
        where = s3_uri(sweep.bucket, sweep.record_key)
        compute = plan_compute(plan, trials)
        document = SweepRecord.from_dict(
            {
                "kind": SweepRecord.KIND,
                "format_version": SweepRecord.FORMAT_VERSION,
                **{k: plan[k] for k in PLAN_FIELDS if plan.get(k) is not None},
                "trials": [summary(t) for t in trials],
                "best": {k: leaderboard.get(k) for k in ("best_trial", "best_run_uri", "best_value")},
                "counts": {k: leaderboard.get(k) for k in ("trials", "succeeded", "stopped_early", "failed")},
                "comparison": {
                    "better_than_promoted": leaderboard.get("better_than_promoted"),
                    "reason": leaderboard.get("comparison"),
                },
                "promotion": dict(self.promotion or {}),
                "compute": dataclasses.asdict(compute),
                "report_uri": leaderboard.get("report_uri"),
                "report_url": leaderboard.get("report_url"),
                "finished_at": utc_stamp(),
            },
            where=where,
        )
        uri = self.store.write(sweep.bucket, sweep.record_key, document.to_json() + "\n")
        self.log.info("Sweep record: %s (%d trials)", uri, len(trials))
        runs = self.record_trial_runs(context, trials, document)
        return {"record_uri": uri, "run_records": runs}

    def record_trial_runs(
        self,
        context: Context,
        trials: Sequence[TrialRecord],
        document: SweepRecord,
    ) -> list[str]:
        """One run record per trial (kind ``kubetrain/run``, its ``sweep`` field set), so the Training
        page lists the trials with the model's other runs and shows the sweep's leaderboard (the
        sweep's ``compute`` is in every trial's ``sweep`` field, beside the trial's own hours)."""
        from kubetrain.operators.dedupe import RunRecorder

        model = document.model
        if not model:
            self.log.info("No model name: no run records for the trials")
            return []
        recorder = RunRecorder(self.store, self.log)
        objective, dataset = document.objective, document.dataset
        best = document.best.best_trial
        promotion = dict(document.promotion)
        uris = []
        sweep = self.sweep_location(context)
        for trial in trials:
            number = trial.trial
            if trial.reused_from:  # not trained in this sweep: its run has its own record
                continue
            run = sweep.trial_run(trial.number)
            failed = not trial.succeeded
            if str(number) == str(best) and promotion.get("promoted"):
                trial_promotion = promotion
            elif str(number) == str(best):
                trial_promotion = {
                    "reason": f"the sweep's best trial, not promoted: {promotion.get('reason') or document.comparison.reason or 'see the sweep record'}"
                }
            else:
                trial_promotion = {
                    "reason": f"not promoted: trial {best} is the sweep's best"
                    if best is not None
                    else "not promoted: the sweep has no best trial"
                }
            record = recorder.build(
                context,
                run=run,
                model=str(model),
                trial=str(number),
                status="failed" if failed else "success",
                dataset_uri=dataset.uri,
                dataset_version=trial.dataset_version or dataset.version,
                dataset_manifest=dataset.manifest,
                image=trial.image or document.image,
                fingerprint=trial.fingerprint,
                promotion=trial_promotion,
                report={"report_uri": trial.report_uri, "report_url": trial.report_url},
                failure={"task": "train", "error": trial.error or "the trial failed"} if failed else None,
                sweep={
                    "id": str(document.id),
                    "trial": str(number),
                    "algorithm": document.algorithm,
                    "params": dict(trial.params),
                    "stopped_early": trial.stopped_early,
                    "objective": {
                        "name": objective.metric,
                        "mode": objective.mode,
                        "value": trial.objective.value,
                    },
                    "accelerator": trial.accelerator,
                    "accelerator_hours": trial.accelerator_hours,
                    "compute": dataclasses.asdict(document.compute),
                },
            )
            uris.append(self.store.runs.write(record))
            recorder.track(record)  # MLflow, when a tracking URI is configured
        self.log.info("Run records of %d trial(s) trained in this sweep, model %s", len(uris), model)
        return uris
