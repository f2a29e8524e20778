"""One trial of a sweep: a training pod with the trial's hyperparameters, then its trial record.

The record (:class:`~kubetrain_contract.trial.TrialRecord`) is written to
``<sweep>/sweep/trials/<n>.json`` and, for a successful trial, to
``trained/<dag>/trials/<fingerprint>.json``, where a later sweep finds it to reuse.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from kubetrain import pod_spec
from kubetrain.links import REPORT_URL_XCOM_KEY, ReportLink, report_url
from kubetrain.operators.interruption import exit_code, final_failure, terminated_state
from kubetrain.operators.training import TrainingPodOperator
from kubetrain.run_store import FinalPassPending, RunStore
from kubetrain.s3_layout import RunLocation, S3Layout, run_from_context, s3_uri, utc_stamp
from kubetrain.sweep.records import (
    EXIT_STOPPED,
    HISTORY_CSV,
    METRICS_JSONL,
    SweepLocation,
    assemble_trial,
    compute_fields,
    history_rows,
    trainer_seconds,
    trial_marker_key,
    trial_outcome,
)
from kubetrain.sweep.stopping import MedianStopping, RungStopping
from kubetrain.sweep.store import early_stop_key, parse_early_stop, read_early_stop, read_trial, write_trial
from kubetrain_contract.early_stop import hyperband_bracket
from kubetrain_contract.trial import TrialRecord

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context
    from kubernetes.client import models as k8s

# Seconds a finishing trial looks for the sidecar's final pass in its worker slot before it defers.
FINAL_PASS_CHECK_SECONDS = 20.0


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return str(value)


def _now() -> str:
    """Now, as the trial record's timing stamps it (ISO 8601 UTC, sub-second)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def pod_state(pod: k8s.V1Pod | None) -> dict[str, Any]:
    """When the pod was created, and each container's start, finish and exit code, as ``pod`` says."""
    status = getattr(pod, "status", None)
    out: dict[str, Any] = {
        "pod_created": _iso(getattr(getattr(pod, "metadata", None), "creation_timestamp", None))
    }
    for container in [
        *(getattr(status, "init_container_statuses", None) or []),
        *(getattr(status, "container_statuses", None) or []),
    ]:
        terminated = terminated_state(container)
        running = getattr(getattr(container, "state", None), "running", None)
        out[container.name] = {
            "started": _iso(getattr(terminated, "started_at", None) or getattr(running, "started_at", None)),
            "finished": _iso(getattr(terminated, "finished_at", None)),
            "exit_code": exit_code(pod, container.name),
        }
    return out


class TrialPodCallbacks(KubernetesPodOperatorCallback):
    """Keeps the pod's state when its training container has finished, for the trial record.

    The KubernetesPodOperator calls ``on_pod_completion`` with the pod as it reads it then, both
    in its worker process and when a deferred task resumes, before it raises for a failed pod; so
    one code path sees the training container's exit code and times, whichever way the task waited.

    A task that waits for its pod in its worker process (``on_pod_starting`` is called only there)
    loads what rendering the trial's report takes while the trainer starts, instead of after the
    pod's end, while the trial holds one of the sweep's ``parallel_trials`` (about 0.4 s a trial).
    """

    @staticmethod
    def on_pod_starting(*, operator: Any, **kwargs: Any) -> None:
        if isinstance(operator, TrialPodOperator):
            from kubetrain.report.render import warm_up

            try:
                warm_up()
            except Exception as exc:  # a renderer that cannot load fails at the trial's end, as without this
                operator.log.warning("The report renderer did not load ahead of the trial's end: %s", exc)

    @staticmethod
    def on_pod_completion(*, pod: k8s.V1Pod, operator: Any, **kwargs: Any) -> None:
        if isinstance(operator, TrialPodOperator):
            operator.pod_state = pod_state(pod)


class TrialPodOperator(TrainingPodOperator):
    """One trial of a sweep: a training pod with the trial's hyperparameters, then its record.

    A :class:`~kubetrain.operators.training.TrainingPodOperator` (a KubernetesPodOperator) whose
    run prefix is ``<sweep>/trials/<trial>``. With median early stopping, the pod's checkpoint-sync
    sidecar gets the rule's settings and may stop the trainer (exit code 79, its decision in
    ``<trial>/sync/early-stop.json``): the task then succeeds and the trial is marked
    ``stopped_early``. Exit codes no retry can change (2, 3, 65, 66) fail the trial at once.

    When the pod has finished, the task waits for the sidecar's final pass, reads the trial's
    metrics (``metrics.json``; ``metrics.jsonl`` or ``history.csv`` per report), renders its report
    (when it wrote metrics.json) and writes the trial record
    (``<sweep>/sweep/trials/<n>.json``) and, for a successful trial, its fingerprint record
    (``trained/<dag>/trials/<fingerprint>.json``). A trial already recorded in this run starts
    no pod.

    Returns (XCom) ``{"trial", "status", "stopped_early", "objective", "run_uri", "report_url"}``.

    :param sweep: ``plan.output["trial_settings"]``: the sweep's id, objective and early stopping. (templated)
    :param hyperparameters: the trial's point of the space. (templated)
    :param fingerprint: the trial's fingerprint. (templated)
    :param sweep_round: the round the trial belongs to.
    :param aws_conn_id: Airflow connection for S3.
    :param kwargs: TrainingPodOperator arguments (``trial`` is the trial number; ``callbacks`` are
        kept, :class:`TrialPodCallbacks` is added).
    """

    template_fields: Sequence[str] = (
        *TrainingPodOperator.template_fields,
        "sweep",
        "hyperparameters",
        "fingerprint",
    )
    operator_extra_links = (ReportLink(),)

    def __init__(
        self,
        *,
        sweep: Mapping[str, Any] | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
        sweep_round: int | None = None,
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        given = kwargs.pop("callbacks", None) or []
        given = list(given) if isinstance(given, list | tuple) else [given]
        super().__init__(callbacks=[*given, TrialPodCallbacks], **kwargs)
        # When this task process reached each step (the trial record's timing; a trial that deferred
        # keeps those of the process that resumed it).
        self._stamps: dict[str, str] = {}
        self._prefetched: dict[str, bytes | None] = {}
        # The pod as it stood when its training container finished (TrialPodCallbacks sets it).
        self.pod_state: dict[str, Any] = {}
        self.sweep = sweep
        self.hyperparameters = hyperparameters
        self.fingerprint = fingerprint
        self.sweep_round = sweep_round
        self.aws_conn_id = aws_conn_id

    @cached_property
    def s3_hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    @cached_property
    def store(self) -> RunStore:
        return RunStore(self.s3_hook, S3Layout.from_environment(training_bucket=self.training_bucket))

    @property
    def number(self) -> int:
        try:
            return int(str(self.trial))
        except ValueError:
            raise ValueError(f"trial={self.trial!r} is not a trial number") from None

    def settings(self) -> dict[str, Any]:
        if not isinstance(self.sweep, Mapping) or not self.sweep.get("trials_uri"):
            raise ValueError(
                f"sweep={self.sweep!r} is not a sweep's trial settings: expected plan.output['trial_settings']"
            )
        return dict(self.sweep)

    def sweep_location(self) -> SweepLocation:
        return SweepLocation.from_uri(self.settings()["uri"])

    def pod_config(self, context: Context | None, *, pin: bool = True) -> pod_spec.TrainingPodConfig:
        config = super().pod_config(context, pin=pin)
        early = self.settings().get("early_stopping") or {}
        objective = self.settings()["objective"]
        if early.get("rule") in ("asha", "hyperband"):
            brackets = early.get("brackets") or 1
            sweep = self.sweep_location()
            return dataclasses.replace(
                config,
                early_stopping=RungStopping(
                    rule=early["rule"],
                    objective=objective["metric"],
                    mode=objective["mode"],
                    trials_uri=self.settings()["trials_uri"],
                    rungs_uri=s3_uri(sweep.bucket, sweep.key("rungs/")),
                    trial=self.number,
                    min_resource=early.get("min_resource", 1),
                    reduction_factor=early.get("reduction_factor", 3),
                    grace=early.get("grace", 1),
                    max_resource=early.get("max_resource"),
                    brackets=brackets,
                    bracket=hyperband_bracket(self.number, brackets, early.get("reduction_factor", 3)),
                ),
            )
        if early.get("rule") != "median":
            return config
        return dataclasses.replace(
            config,
            early_stopping=MedianStopping(
                objective=objective["metric"],
                mode=objective["mode"],
                trials_uri=self.settings()["trials_uri"],
                min_trials=early.get("min_trials", 3),
                start_step=early.get("start_step", 4),
            ),
        )

    # -- the pod ------------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        self._stamps["executing"] = _now()
        sweep = self.sweep_location()
        existing = read_trial(self.store, sweep.bucket, sweep.trial_record_key(self.number))
        if existing is not None and existing.succeeded:
            self.log.info("Trial %s finished earlier in this run (%s): no pod", self.trial, existing.run_uri)
            return self._result(context, existing)
        self.log.info("Trial %s: %s (fingerprint %s)", self.trial, self.hyperparameters, self.fingerprint)
        # The task runner renders the "Training report" link when the task defers, before the
        # report exists: an empty URL (no link yet) rather than a lookup that fails with a logged
        # "XCom not found" error on every trial. record() pushes the real one.
        context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value="")
        try:
            super().execute(context)
        except AirflowException as exc:  # the synchronous path (deferrable=False) ends here
            return self._after_failure(context, exc)
        return self.finish(context)

    def get_or_create_pod(self, pod_request_obj: k8s.V1Pod, context: Context) -> k8s.V1Pod:
        # The pod's spec is built (its images pinned): when the task asked for the pod, and when
        # the API server had it (its creationTimestamp has whole seconds only).
        self._stamps["pod_requested"] = _now()
        pod = super().get_or_create_pod(pod_request_obj, context)
        self._stamps["pod_accepted"] = _now()
        return pod

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> Any:
        # The callbacks' on_operator_resuming would stamp this, but the provider (10.x) declares it
        # and never calls it; and the failure below is caught here, as in execute().
        self._stamps["resumed"] = _now()
        try:
            super().trigger_reentry(context, event)
        except AirflowException as exc:
            return self._after_failure(context, exc)
        return self.finish(context)

    def _exit_code(self, state: Mapping[str, Any]) -> int | None:
        return (state.get(self.base_container_name) or {}).get("exit_code")

    def _after_failure(self, context: Context, exc: AirflowException) -> Any:
        # skip_on_exit_code cannot stand for this: an early stop (79) is a success with a record,
        # which downstream tasks and the leaderboard count, not a skipped task; and the provider
        # has no hook for a failed pod other than the exception its cleanup raises.
        state = dict(self.pod_state)
        code = self._exit_code(state)
        if code == EXIT_STOPPED and read_early_stop(self.store, self.trial_run(context)) is not None:
            self.log.info(
                "Trial %s was stopped early by the sweep's early-stopping rule (exit code %d): a success",
                self.trial,
                code,
            )
            return self.finish(context, state=state)
        # the single runs' rule (kubetrain.operators.interruption): a trial and a run fail alike on the same code
        final = final_failure(code)
        if final is not None:
            reason = f"the trainer exited with {code} ({final}); a retry would end the same"
            self.write_failed(context, reason, state)
            raise AirflowFailException(f"trial {self.trial} failed: {reason}\n{exc}") from exc
        raise exc

    def trial_run(self, context: Context) -> RunLocation:
        return run_from_context(
            context, run_uri=self.run_uri, trial=self.trial, training_bucket=self.training_bucket
        )

    # -- after the pod ------------------------------------------------------------------------

    def finish(self, context: Context, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Wait briefly for the sidecar's final pass (else defer), then record the trial."""
        state = state if state is not None else dict(self.pod_state)
        self._stamps["pod_done"] = _now()
        run = self.trial_run(context)
        deadline = time.monotonic() + FINAL_PASS_CHECK_SECONDS
        while True:
            try:
                self.store.passes.final(run, checksums=False)
                break
            except FinalPassPending as exc:
                if time.monotonic() >= deadline:
                    from kubetrain.triggers.sync import FinalSyncPassTrigger

                    self.log.info("Waiting, deferred, for the sidecar's final sync pass: %s", exc)
                    self.defer(
                        trigger=FinalSyncPassTrigger(
                            run_uri=run.uri, aws_conn_id=self.aws_conn_id, timeout=300
                        ),
                        method_name="final_pass_landed",
                        kwargs={"state": state},
                    )
                time.sleep(0.5)
        return self.record(context, state)

    def final_pass_landed(
        self, context: Context, event: dict[str, Any], state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Resume when the sidecar's final pass has landed."""
        if event.get("status") != "final":
            raise AirflowException(
                event.get("message") or f"no final sync pass for trial {self.trial}: {event}"
            )
        return self.record(context, state or {})

    def _read(self, run: RunLocation, area: str, name: str) -> bytes | None:
        key = run.key(area, name)
        return self._prefetched[key] if key in self._prefetched else self.store.read(run.bucket, key)

    def record(self, context: Context, state: dict[str, Any]) -> dict[str, Any]:
        """Read the trial's outputs, render its report, and write its records."""
        from kubetrain.report.inputs import REPORT_FILES, load_run_inputs, parse_json

        self._stamps["final_pass"] = _now()
        settings = self.settings()
        run = self.trial_run(context)
        metric, mode = settings["objective"]["metric"], settings["objective"]["mode"]
        # every file the record and the report read, in parallel: a dozen small GETs one after the
        # other were a second of each trial's end under a sweep's load
        self._prefetched = self.store.read_files(
            run.bucket,
            [run.key("output", name) for name in (*REPORT_FILES, METRICS_JSONL)] + [early_stop_key(run)],
        )
        raw_metrics = self._read(run, "output", "metrics.json")
        metrics = parse_json("metrics.json", raw_metrics) if raw_metrics is not None else None
        metrics = metrics if isinstance(metrics, dict) else None
        rows = history_rows(
            metrics_jsonl=self._read(run, "output", METRICS_JSONL),
            history_csv=self._read(run, "output", HISTORY_CSV),
        )
        early_stop = parse_early_stop(run, self._prefetched[early_stop_key(run)])
        outcome = trial_outcome(metrics, rows, early_stop, self._exit_code(state), metric, mode)
        report_uri = url = None
        inputs = load_run_inputs(lambda name: self._read(run, "output", name), run.uri, title=self._title())
        ti = context["ti"]
        if inputs is not None:
            from kubetrain.report.render import render_report

            report_uri = self.store.reports.write(run, render_report(inputs))
            url = report_url(ti.dag_id, run.bucket, run.key("report", "report.html"))
            ti.xcom_push(key=REPORT_URL_XCOM_KEY, value=url)
            self._stamps["report"] = _now()
        record = self._assemble(
            context,
            **outcome,
            early_stopping=settings.get("early_stopping"),
            image=self.image,
            dataset_version=self.dataset_version,
            arguments=[str(a) for a in self.arguments or []],
            timing={
                "task_started": _iso(getattr(ti, "start_date", None)),
                "try_number": getattr(ti, "try_number", None),
                **state,
                **self._stamps,
                "recorded": _now(),
            },
            report_uri=report_uri,
            report_url=url,
            **self._compute(state, outcome.get("wall_time_s")),
        )
        sweep = self.sweep_location()
        write_trial(self.store, sweep.bucket, sweep.trial_record_key(self.number), record)
        if self.fingerprint:
            marker = trial_marker_key(ti.dag_id, self.fingerprint)
            write_trial(self.store, self.store.layout.training_bucket, marker, record)
        self.log.info(
            "Trial %s %s: %s %s = %s after %d report(s)%s; record %s",
            self.trial,
            record.params,
            "stopped early," if record.stopped_early else "finished,",
            metric,
            record.objective.value,
            len(rows),
            (
                f" (median rule at report {early_stop.step}: best {early_stop.best} vs median {early_stop.median})"
                if early_stop.rung is None
                else f" ({early_stop.rule} rule at rung {early_stop.rung}: no usable value there (NaN, infinite "
                "or not a number), ranked worst)"
                if early_stop.value is None
                else f" ({early_stop.rule} rule at rung {early_stop.rung}: rank {early_stop.rank} of "
                f"{early_stop.rung_trials}, {early_stop.value} vs cut-off {early_stop.cutoff})"
            )
            if record.stopped_early and early_stop is not None
            else "",
            s3_uri(sweep.bucket, sweep.trial_record_key(self.number)),
        )
        return self._result(context, record)

    def _assemble(self, context: Context, **fields: Any) -> TrialRecord:
        """This trial's record with ``fields`` (see :func:`~kubetrain.sweep.records.assemble_trial`)."""
        return assemble_trial(
            self.settings(),
            self.number,
            round=self.sweep_round,
            params=self.hyperparameters,
            fingerprint=self.fingerprint,
            run_uri=self.trial_run(context).uri,
            finished_at=utc_stamp(),
            **fields,
        )

    def _compute(self, state: Mapping[str, Any], wall_time_s: Any = None) -> dict[str, Any]:
        """The record's trainer seconds (the training container's start to finish in ``state``, else
        the trainer's ``wall_time_s``) and the GPUs, else CPU cores, its pod asked for."""
        seconds = trainer_seconds(state, wall_time_s, self.base_container_name)
        return compute_fields(seconds, gpus=self.gpus, cpu=self.cpu)

    def write_failed(self, context: Context, reason: str, state: dict[str, Any]) -> None:
        """Write the record of a trial that failed for good, with ``reason``."""
        record = self._assemble(
            context, error=reason, exit_code=self._exit_code(state), timing=state, **self._compute(state)
        )
        sweep = self.sweep_location()
        write_trial(self.store, sweep.bucket, sweep.trial_record_key(self.number), record)

    def _title(self) -> str:
        title = self.settings().get("title") or "Sweep"
        return f"{title}: trial {self.trial}"

    def _result(self, context: Context, record: TrialRecord) -> dict[str, Any]:
        if record.report_url:
            context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=record.report_url)
        return {
            "trial": record.trial,
            "status": record.status,
            "stopped_early": record.stopped_early,
            "objective": record.objective.value,
            "run_uri": record.run_uri,
            "report_url": record.report_url,
        }
