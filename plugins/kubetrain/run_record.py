"""Run records (format version 1): one small JSON document per finished training run, and its index.

The pipeline's record step writes, through :class:`~kubetrain.run_store.RunStore` (``store.runs``),
the record of every finished run (a single pod, one trial of a sweep, a distributed job): what ran
(DAG, run, trial, model, dataset version, image digest, code version, Params and hyperparameters),
how it went (final and best metrics, epochs, steps, wall time, the step it resumed from) and
what became of it (promoted or not, and why). A run that fails in training, report or
promotion leaves a record too, with ``status: failed`` and the failing task's error.

The record lives beside the run's files (``runs/<dag>/<run>/run-record.json``) and is copied
into key-ordered indexes (:mod:`kubetrain.store.index` names them), so that pages list runs
with one ListObjectsV2 request and read only the records they show.

The record is :class:`kubetrain_contract.run.RunRecord` (schema ``run-record.v1.json``, generated);
promotions (``promotions/<model>/``) are :class:`kubetrain_contract.run.PromotionEvent`
(``promotion.v1.json``). :func:`build_record` makes a run's record from its :class:`RunFacts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeVar

from kubetrain.s3_layout import RunLocation, check_name, utc_stamp
from kubetrain_contract.exit_codes import EXIT_PREEMPTED
from kubetrain_contract.json_values import json_safe
from kubetrain_contract.reports import finite_number
from kubetrain_contract.run import (
    DatasetRef,
    ImageRef,
    MetricValue,
    PromotionEvent,
    RunDisruptions,
    RunFailure,
    RunInterruption,
    RunMetrics,
    RunPromotion,
    RunRecord,
    VersionValue,
)

STATUSES = ("success", "failed")
PROMOTE_RULES: tuple[Literal["if_better", "always", "never"], ...] = ("if_better", "always", "never")
#: the rules under which the promote task promotes (``never`` does not)
PROMOTING_RULES: tuple[Literal["if_better", "always"], ...] = ("if_better", "always")
RESUME_SOURCES: tuple[Literal["metrics.json", "sync-passes"], ...] = ("metrics.json", "sync-passes")
_MAX_ERROR_CHARS = 2000


_Choice = TypeVar("_Choice", bound=str)


def _member(name: str, value: object, choices: tuple[_Choice, ...]) -> _Choice:
    """``value`` as the one of ``choices`` it equals (the record's field type); refused naming ``name``."""
    for choice in choices:
        if value == choice:
            return choice
    raise ValueError(f"{name}={value!r} is not valid: expected one of {', '.join(choices)}")


# -- why a run was or was not promoted -------------------------------------------------------------


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def promotion_reason(
    *,
    rule: str | None,
    promoted: bool,
    monitor: str | None = None,
    mode: str | None = None,
    value: float | None = None,
    other_version: str | None = None,
    other_value: float | None = None,
) -> str:
    """One sentence that says why a run was (not) promoted.

    :param rule: the run's ``promote`` Param (``if_better``, ``always``, ``never``).
    :param promoted: whether it was.
    :param monitor: the compared metric; ``mode``: ``max`` or ``min``; ``value``: this run's.
    :param other_version: the version promoted before (compared with); ``other_value``: its value.
    """
    this = f"{monitor} {_fmt(value)}" if monitor and value is not None else None
    other = f"version {other_version}" if other_version else None
    if rule == "never":
        return "not promoted: promote=never"
    if rule == "always":
        replaced = f", replacing {other}" if promoted and other else ""
        return f"promoted: promote=always{replaced}" if promoted else "not promoted (promote=always)"
    if rule != "if_better":
        return "promoted" if promoted else "not promoted"
    if other_version is None:
        if promoted:
            return "promoted: promote=if_better and no version was promoted before"
        if this is None:
            return f"not promoted: promote=if_better and this run has no {monitor or 'metric'} to compare"
        return f"not promoted: promote=if_better and {this} was not better than the promoted model"
    if this is None:
        return f"not promoted: promote=if_better and this run has no {monitor or 'metric'} to compare with {other}"
    if other_value is None:
        return (
            f"promoted: promote=if_better, {other} has no {monitor} to compare with"
            if promoted
            else f"not promoted: promote=if_better, {other} has no {monitor}"
        )
    sign = (">" if mode == "max" else "<") if promoted else ("<=" if mode == "max" else ">=")
    if promoted:
        return f"promoted: promote=if_better, {this} {sign} {_fmt(other_value)} of {other}"
    return f"not promoted: promote=if_better, lost to {other} ({monitor} {_fmt(other_value)}; this run {_fmt(value)})"


def _integer(value: Any) -> int | None:
    number = finite_number(value)
    return int(number) if number is not None and number == int(number) and number >= 0 else None


def _numbers(section: Any) -> dict[str, float | int | None]:
    """A metrics section with every value a number or null (integers such as an epoch stay integers)."""
    if not isinstance(section, dict):
        return {}
    return {
        str(k): v if isinstance(v, int) and not isinstance(v, bool) else finite_number(v)
        for k, v in section.items()
    }


@dataclass(frozen=True)
class RunFacts:
    """What the record step knows of a finished run, from which :func:`build_record` makes its record.

    :param dag_id: the DAG; ``run_id``: the DAG run; ``run``: where the run's files are.
    :param run_time: the DAG run's time (the same for every retry).
    :param model: the model name; ``status``: ``success`` or ``failed``; ``trial``: a sweep's trial.
    :param params: the DAG run's Params (what the user chose).
    :param metrics: the run's ``output/metrics.json`` (``None`` when the container wrote none).
    :param run_params: the run's ``output/params.json`` (hyperparameters, code version), if any.
    :param dataset_uri: the dataset; ``dataset_version``, ``dataset_manifest``: its staged snapshot.
    :param image: the training image by digest (``<repository>@sha256:...``).
    :param fingerprint: the train-once fingerprint.
    :param promote_rule: the ``promote`` Param; ``promotion``: the promote task's result.
    :param report: the report task's result (report URI and URL, the comparison with the promoted model).
    :param resumed_from_step: the step the last pod resumed from (0: it started fresh).
    :param resumed_from_source: where that step was found (``metrics.json``, ``sync-passes``).
    :param failure: ``{"task", "error"}`` of a failed run.
    :param sweep: a sweep trial's fields (``id``, ``trial``, ``stopped_early``, ...).
    :param distributed: a distributed run's fields (``backend``, ``workers``, ``ps_replicas``).
    :param compare_on: which section of metrics.json holds the ranked value (``final`` or ``best``).
    :param disruptions: the training task's XCom ``disruptions`` (its interruptions and time queued).
    :param checkpoints: ``{pod: (newest checkpointed step, final)}`` of each interrupted pod's last sync
        pass (:meth:`kubetrain.store.passes.PassRepository.last_checkpoints`).
    """

    dag_id: str
    run_id: str
    run: RunLocation
    run_time: datetime
    model: str
    status: str = "success"
    trial: str | None = None
    params: Mapping[str, Any] | None = None
    metrics: Mapping[str, Any] | None = None
    run_params: Mapping[str, Any] | None = None
    dataset_uri: str | None = None
    dataset_version: str | None = None
    dataset_manifest: str | None = None
    image: str | None = None
    fingerprint: str | None = None
    promote_rule: str | None = None
    promotion: Mapping[str, Any] | None = None
    report: Mapping[str, Any] | None = None
    resumed_from_step: int | None = None
    resumed_from_source: str | None = None
    failure: Mapping[str, Any] | None = None
    sweep: Mapping[str, Any] | None = None
    distributed: Mapping[str, Any] | None = None
    compare_on: str = "final"
    disruptions: Mapping[str, Any] | None = None
    checkpoints: Mapping[str, tuple[int | None, bool]] | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(
                f"run status {self.status!r} is not valid: expected one of {', '.join(STATUSES)}"
            )
        if self.promote_rule is not None and self.promote_rule not in PROMOTE_RULES:
            raise ValueError(
                f"promote={self.promote_rule!r} is not valid: expected one of {', '.join(PROMOTE_RULES)}"
            )
        if self.resumed_from_source not in (None, "metrics.json", "sync-passes"):
            raise ValueError(
                f"resumed_from_source={self.resumed_from_source!r} is not valid: expected 'metrics.json', "
                "'sync-passes' or None"
            )
        if self.compare_on not in ("final", "best"):
            raise ValueError(f"compare_on={self.compare_on!r} is not valid: expected 'final' or 'best'")
        check_name("model", self.model)


def _section(document: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = document.get(name)
    return value if isinstance(value, dict) else {}


def _objective(facts: RunFacts, metrics: Mapping[str, Any], report: Mapping[str, Any]) -> RunMetrics:
    """The run's objective: from metrics.json, else from what the report task found."""
    monitor = metrics.get("monitor") if isinstance(metrics.get("monitor"), str) else report.get("monitor")
    mode = metrics.get("monitor_mode")
    mode = mode if mode in ("max", "min") else report.get("monitor_mode")
    value = finite_number(_section(metrics, facts.compare_on).get(monitor)) if monitor else None
    if value is None:
        value = finite_number(report.get("value"))
    return RunMetrics(
        monitor=monitor or None,
        monitor_mode=mode if mode in ("max", "min") else None,
        compare_on="best" if facts.compare_on == "best" else "final",
        value=value,
        final=_numbers(metrics.get("final") or report.get("final")),
        best=_numbers(metrics.get("best") or report.get("best")),
    )


def _promotion(facts: RunFacts, objective: RunMetrics, report: Mapping[str, Any]) -> RunPromotion:
    """Whether the run was promoted, and the sentence that says why."""
    promotion = dict(facts.promotion or {})
    promoted = bool(promotion.get("promoted"))
    other_version = promotion.get("previous_version") or report.get("promoted_version")
    other_value = finite_number(report.get("promoted_metric"))
    if facts.failure is not None:
        reason = f"not promoted: the run failed in {facts.failure.get('task')}"
    else:
        reason = promotion.get("reason") or promotion_reason(
            rule=facts.promote_rule,
            promoted=promoted,
            monitor=objective.monitor,
            mode=objective.monitor_mode,
            value=objective.value,
            other_version=other_version,
            other_value=other_value,
        )
    return RunPromotion(
        rule=_member("promote", facts.promote_rule, PROMOTE_RULES)
        if facts.promote_rule is not None
        else None,
        promoted=promoted,
        version=promotion.get("model_version") if promoted else None,
        model_uri=promotion.get("model_uri") if promoted else None,
        reason=reason,
        compared_with=VersionValue(str(other_version), other_value) if other_version else None,
    )


def interrupted_pods(disruptions: Mapping[str, Any] | None) -> list[str]:
    """The names of the pods the XCom ``disruptions`` lists as ended from outside."""
    listed = disruptions.get("interruptions") if isinstance(disruptions, Mapping) else None
    return [str(i["pod"]) for i in listed or [] if isinstance(i, Mapping) and i.get("pod")]


def disruptions_of(
    disruptions: Mapping[str, Any] | None, checkpoints: Mapping[str, tuple[int | None, bool]] | None
) -> RunDisruptions | None:
    """The run's preemptions, evictions and time queued; None when the cluster never queued or interrupted it.

    A pod's steps lost are 0 when its training container exited 75 (it checkpointed on SIGTERM, the
    pod contract) and its sidecar's shutdown pass kept that checkpoint; otherwise they are not known
    (a container that ignores SIGTERM loses what it trained since its last checkpoint, and only it
    knows how much).

    :param disruptions: the training task's XCom ``disruptions``.
    :param checkpoints: ``{pod: (newest checkpointed step, final)}`` of the interrupted pods' last passes.
    """
    found = disruptions if isinstance(disruptions, Mapping) else {}
    queued = finite_number(found.get("queued_s")) or 0.0
    listed = [i for i in found.get("interruptions") or [] if isinstance(i, Mapping)]
    if not listed and queued <= 0:
        return None
    checkpoints = checkpoints or {}
    interruptions = []
    for item in listed:
        pod = str(item["pod"]) if item.get("pod") else None
        step, final = checkpoints.get(pod or "", (None, False))
        code = _integer(item.get("exit_code"))
        at = item.get("at")
        interruptions.append(
            RunInterruption(
                pod=pod,
                reason=str(item.get("reason") or "")[:2000],
                at=at if isinstance(at, str) and at else utc_stamp(),
                queued_s=finite_number(item.get("queued_s")),
                exit_code=code,
                resume_step=step,
                steps_lost=0 if code == EXIT_PREEMPTED and final and step is not None else None,
            )
        )
    lost = [i.steps_lost for i in interruptions]
    return RunDisruptions(
        preemptions=len(interruptions),
        queued_s=round(max(queued, 0.0), 3),
        steps_lost=None if None in lost else sum(lost),  # type: ignore[arg-type]
        interruptions=interruptions,
    )


def build_record(facts: RunFacts) -> RunRecord:
    """The run record of a finished run.

    :param facts: what the record step knows of the run.
    :raises ValueError: a fact the record cannot hold (an invalid dataset version, image digest...).
    """
    metrics = facts.metrics if isinstance(facts.metrics, dict) else {}
    run_params = facts.run_params if isinstance(facts.run_params, dict) else {}
    report = dict(facts.report or {})
    image = facts.image
    digest = image.rsplit("@", 1)[1] if isinstance(image, str) and "@sha256:" in image else None
    code_version = run_params.get("code_version")
    if not code_version and image:
        from kubetrain.pod_spec import code_version_of

        code_version = code_version_of(image)
    objective = _objective(facts, metrics, report)
    resumed, source = facts.resumed_from_step, facts.resumed_from_source
    if resumed is None and _integer(metrics.get("resumed_from_step")) is not None:
        resumed, source = _integer(metrics.get("resumed_from_step")), "metrics.json"
    failure = facts.failure
    return RunRecord(
        dag_id=facts.dag_id,
        run_id=facts.run_id,
        trial=str(facts.trial) if facts.trial not in (None, "") else None,
        run_uri=facts.run.uri,
        run_time=utc_stamp(facts.run_time),
        recorded_at=utc_stamp(),
        status="failed" if facts.status == "failed" else "success",
        failure=RunFailure(str(failure.get("task")), str(failure.get("error") or "")[:_MAX_ERROR_CHARS])
        if failure is not None
        else None,
        model=facts.model,
        trainer=metrics.get("trainer") or run_params.get("trainer") or report.get("trainer"),
        dataset=DatasetRef(
            uri=facts.dataset_uri or None,
            version=facts.dataset_version or run_params.get("dataset_version") or None,
            manifest_uri=facts.dataset_manifest or None,
        ),
        image=ImageRef(reference=image or run_params.get("image") or None, digest=digest),
        code_version=code_version or None,
        fingerprint=facts.fingerprint or None,
        params=json_safe(dict(facts.params or {})),
        hyperparameters=json_safe(run_params.get("hyperparameters") or {}),
        metrics=objective,
        # metrics.json's, else the report's (a container of the user's own: the epochs of its history.csv)
        epochs=_integer(metrics.get("epochs", report.get("epochs"))),
        steps=_integer(metrics.get("steps")),
        wall_time_s=finite_number(metrics.get("wall_time_s")),
        examples_per_s=finite_number(metrics.get("examples_per_s")),
        resumed_from_step=resumed,
        resumed_from_source=(
            _member("resumed_from_source", source, RESUME_SOURCES)
            if resumed is not None and source is not None
            else None
        ),
        promotion=_promotion(facts, objective, report),
        report_uri=report.get("report_uri") or None,
        report_url=report.get("report_url") or None,
        sweep=json_safe(dict(facts.sweep)) if facts.sweep else None,
        distributed=json_safe(dict(facts.distributed)) if facts.distributed else None,
        mlflow=None,
        disruptions=disruptions_of(facts.disruptions, facts.checkpoints),
    )


def promotion_event(
    *,
    model: str,
    version: str,
    model_uri: str,
    dag_id: str,
    run_id: str,
    trial: str | None,
    run_uri: str,
    rule: str,
    reason: str,
    monitor: str | None,
    value: float | None,
    previous_version: str | None,
    previous_value: float | None,
    promoted_at: str | None = None,
) -> PromotionEvent:
    """One entry of a model's promotion history (``store.promotions.record`` writes it)."""
    if rule not in PROMOTING_RULES:
        raise ValueError(f"promote={rule!r} does not promote: expected 'if_better' or 'always'")
    return PromotionEvent(
        model=check_name("model", model),
        version=version,
        model_uri=model_uri,
        promoted_at=promoted_at or utc_stamp(),
        dag_id=dag_id,
        run_id=run_id,
        trial=str(trial) if trial not in (None, "") else None,
        run_uri=run_uri,
        rule=_member("promote", rule, PROMOTING_RULES),
        reason=reason,
        metric=MetricValue(monitor, finite_number(value)),
        previous=VersionValue(previous_version, finite_number(previous_value)) if previous_version else None,
    )
