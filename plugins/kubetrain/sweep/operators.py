"""The operators of a sweep DAG: plan, suggest a round's trials, run one trial, leaderboard, record.

::

    stage_dataset -> plan -> round_0.suggest -> round_0.train_<p>_at_a_time (mapped trials)
                  -> round_1.suggest -> round_1.train (tpe only) -> ... -> leaderboard -> promote -> record

Every S3 read and write goes through the run store (:class:`~kubetrain.run_store.RunStore`),
at the keys of :mod:`kubetrain.sweep.records`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.skipmixin import SkipMixin
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from kubetrain import pod_spec
from kubetrain.hooks.registry import RegistryHook
from kubetrain.images import pin_image
from kubetrain.links import REPORT_URL_XCOM_KEY, ReportLink, report_url
from kubetrain.operators.base import RunStoreOperator
from kubetrain.operators.dedupe import NOT_TRAINING_PARAMS, fingerprint
from kubetrain.operators.training import NO_RETRY_EXIT_CODES, TrainingPodOperator, string_list
from kubetrain.run_store import FinalPassPending, RunStore, is_missing_key
from kubetrain.s3_layout import RunLocation, S3Layout, run_from_context, s3_uri, utc_stamp
from kubetrain.sweep.config import SWEEP_PARAMS, SweepSettings
from kubetrain.sweep.records import (
    EARLY_STOP_RECORD,
    EXIT_STOPPED,
    FORMAT_VERSION,
    HISTORY_CSV,
    METRICS_JSONL,
    SWEEP_KIND,
    TRIAL_KIND,
    SweepLocation,
    history_rows,
    objective_value,
    objective_values,
    ranked,
    summary,
    trial_marker_key,
)
from kubetrain.sweep.space import SpaceError, parse_space, random_points

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context

PLAN_KIND = "kubetrain/sweep-plan"
ROUND_KIND = "kubetrain/sweep-round"
# Params that do not change what one trial trains: run control, placement, the sweep's own, the model's name.
TRIAL_EXCLUDE = (*NOT_TRAINING_PARAMS, *SWEEP_PARAMS, "model_name")
# Exit codes of kubetrain's trainers (trainer/common/contract.py) that a retry cannot change:
# the trial fails at once, and its record says why.
# the single runs' table: a trial and a run fail alike on the same exit code
FINAL_EXIT_CODES = NO_RETRY_EXIT_CODES
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
    return _iso(datetime.now(UTC))


def _plan_missing(sweep: SweepLocation) -> AirflowFailException:
    return AirflowFailException(
        f"the sweep has no plan at {s3_uri(sweep.bucket, sweep.plan_key)}: the plan task did not finish (see its log)"
    )


class SweepStoreOperator(RunStoreOperator):
    """An operator that works on this DAG run's sweep prefix."""

    def sweep_location(self, context: Context) -> SweepLocation:
        return SweepLocation.of(self.store.layout, context["ti"].dag_id, context["run_id"])

    def load_plan(self, sweep: SweepLocation) -> dict[str, Any]:
        plan = self.store.read_json(sweep.bucket, sweep.plan_key)
        if not isinstance(plan, dict):
            raise _plan_missing(sweep)
        return plan


def load_trial_records(store: RunStore, sweep: SweepLocation) -> dict[int, dict[str, Any]]:
    """The sweep's trial records by trial number."""
    records: dict[int, dict[str, Any]] = {}
    for item in store.list(sweep.bucket, sweep.trials_prefix):
        number = SweepLocation.trial_number(item["Key"])
        if number is None:
            continue
        record = store.read_json(sweep.bucket, item["Key"])
        if isinstance(record, dict):
            records[number] = record
    return records


def load_rounds(store: RunStore, sweep: SweepLocation) -> dict[int, dict[str, Any]]:
    """The points each round asked for, by round number."""
    rounds: dict[int, dict[str, Any]] = {}
    for item in store.list(sweep.bucket, sweep.rounds_prefix):
        number = SweepLocation.round_number(item["Key"])
        if number is not None and isinstance(doc := store.read_json(sweep.bucket, item["Key"]), dict):
            rounds[number] = doc
    return rounds


def all_trials(store: RunStore, sweep: SweepLocation) -> list[dict[str, Any]]:
    """Every trial the sweep planned, by number: its record, or a ``failed`` stand-in when it left none."""
    records = load_trial_records(store, sweep)
    trials: dict[int, dict[str, Any]] = {}
    for round_number, doc in sorted(load_rounds(store, sweep).items()):
        for planned in doc.get("trials") or []:
            number = int(planned["number"])
            trials[number] = records.get(number) or {
                "kind": TRIAL_KIND,
                "trial": str(number),
                "number": number,
                "round": round_number,
                "params": planned.get("params"),
                "fingerprint": planned.get("fingerprint"),
                "status": "failed",
                "stopped_early": False,
                "error": "the trial's task failed without a record (see its log)",
                "objective": {"value": None, "values": []},
                "run_uri": sweep.trial_run(number).uri,
            }
    for number, record in records.items():
        trials.setdefault(number, record)
    return [trials[n] for n in sorted(trials)]


class PlanSweepOperator(SweepStoreOperator, SkipMixin):
    """Check a sweep's settings before any pod starts, pin the training image, and write the plan.

    Refuses, naming the field and without retries, a space that cannot be searched: an unknown
    hyperparameter, an empty list, ``low`` > ``high``, a value that the hyperparameter's own Param
    refuses, a grid larger than ``max_trials``, more tpe trials than the DAG's rounds can hold.
    Writes ``<sweep>/sweep/plan.json``.

    Round 0 has one training task per ``parallel_trials`` value the DAG offers
    (``variant_tasks``, set by :func:`~kubetrain.sweep.pipeline.sweep_pipeline`); this task
    skips all but the one the run asked for.

    Pushes (XCom) ``plan``, ``image`` and ``trial_settings``, and the three as ``return_value``.

    :param settings: the DAG's sweep settings.
    :param dataset_version: ``stage.output["version"]``. (templated)
    :param dataset_manifest: ``stage.output["manifest_uri"]``. (templated)
    :param image: the training image (default: the deployment's), pinned to its digest here. (templated)
    :param registry_conn_id: registry connection to resolve the image's digest with.
    :param title: the sweep's title (reports). (templated)
    """

    template_fields: Sequence[str] = (
        *RunStoreOperator.template_fields,
        "dataset_version",
        "dataset_manifest",
        "image",
        "title",
    )
    ui_color = "#f0f0f0"
    inherits_from_skipmixin = True

    def __init__(
        self,
        *,
        settings: SweepSettings,
        dataset_version: str,
        dataset_manifest: str | None = None,
        image: str | None = None,
        registry_conn_id: str = RegistryHook.default_conn_name,
        title: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.settings = settings
        self.dataset_version = dataset_version
        self.dataset_manifest = dataset_manifest
        self.image = image
        self.registry_conn_id = registry_conn_id
        self.title = title
        # parallel_trials -> task id of round 0's training task for it
        self.variant_tasks: dict[int, str] = {}

    def execute(self, context: Context) -> dict[str, Any]:
        params = dict(context["params"])
        try:
            plan = self.settings.plan(params)
        except SpaceError as exc:
            raise AirflowFailException(f"the sweep's settings are refused, no trial started: {exc}") from exc
        image = pin_image(
            pod_spec.resolve_image(self.image, "trainer"), registry_conn_id=self.registry_conn_id
        )
        dag_id, run_id = context["ti"].dag_id, context["run_id"]
        sweep = self.sweep_location(context)
        document = {
            "kind": PLAN_KIND,
            "format_version": FORMAT_VERSION,
            "id": f"{dag_id}/{run_id}",
            "dag_id": dag_id,
            "run_id": run_id,
            "uri": sweep.uri,
            "title": self.title,
            **plan,
            "image": image,
            "code_version": pod_spec.code_version_of(image),
            "dataset": {
                "uri": params.get("dataset_uri"),
                "version": self.dataset_version,
                "manifest": self.dataset_manifest,
            },
            "model": params.get("model_name"),
            "fixed_params": self.settings.fixed_params(params, ()),
            "hyperparameter_args": self.settings.hyperparameter_args,
            "created_at": utc_stamp(),
        }
        self.store.write_json(sweep.bucket, sweep.plan_key, document)
        self.log.info(
            "Sweep %s: %s over %s, %s trial(s) in round(s) %s, %d at a time; objective %s (%s); early stopping %s; image %s",
            sweep.uri,
            plan["algorithm"],
            ", ".join(plan["space"]),
            sum(plan["rounds"]),
            plan["rounds"],
            plan["parallel_trials"],
            plan["objective"]["metric"],
            plan["objective"]["mode"],
            plan["early_stopping"]["rule"],
            image,
        )
        trial_settings = {
            "id": document["id"],
            "dag_id": dag_id,
            "run_id": run_id,
            "uri": sweep.uri,
            "trials_uri": sweep.trials_uri,
            "algorithm": plan["algorithm"],
            "objective": plan["objective"],
            "early_stopping": plan["early_stopping"],
            "title": self.title,
        }
        result = {"plan": document, "image": image, "trial_settings": trial_settings}
        others = {task_id for p, task_id in self.variant_tasks.items() if p != plan["parallel_trials"]}
        if not others:
            return result
        ti = context["ti"]
        for key, value in result.items():
            ti.xcom_push(key=key, value=value)
        ti.xcom_push(key="return_value", value=result)
        self.log.info(
            "Round 0 trains with %s; skipping %s",
            self.variant_tasks[plan["parallel_trials"]],
            ", ".join(sorted(others)),
        )
        # ends the task (a success) by raising what tells the task runner to skip these tasks
        self.skip(ti, [task for task in self.downstream_list if task.task_id in others])
        return result


class SuggestTrialsOperator(SweepStoreOperator):
    """Ask for one round's trials and hand them to the round's mapped training task.

    grid: every point of the space (round 0); random: ``max_trials`` points drawn with the
    seed (round 0); tpe: a batch of ``parallel_trials`` points from Optuna's TPE, the study
    rebuilt from the sweep's trial records (and failures) in S3, so no database is needed.

    A point already finished in this run, or trained before with the same fingerprint (DAG,
    dataset version, image digest, every training Param with the point's values) and recorded
    in ``trained/<dag>/trials/``, starts no pod: its record is reused (unless the ``force`` Param
    is set; a point finished earlier in this run is never trained again). The points asked for are
    written to ``<sweep>/sweep/rounds/<round>.json``.

    Returns (XCom) the round's ``expand_kwargs`` entries for its training task, one per trial
    to train: ``{"trial", "hyperparameters", "fingerprint", "arguments"}``.

    :param round: the round (0-based).
    :param argument_templates: the trainer's argument templates, rendered per trial with
        ``params`` overridden by the trial's values and ``trial`` (``number``, ``params``).
    :param hyperparameter_args: append ``--name=value`` of each hyperparameter to the arguments.
    :param dataset_version: ``stage.output["version"]``. (templated)
    :param image: ``plan.output["image"]``, pinned by digest. (templated)
    """

    template_fields: Sequence[str] = (*RunStoreOperator.template_fields, "dataset_version", "image")
    ui_color = "#f0f0f0"

    def __init__(
        self,
        *,
        round: int,
        argument_templates: Sequence[str] | str,
        dataset_version: str,
        image: str,
        hyperparameter_args: bool = False,
        exclude_params: Sequence[str] = TRIAL_EXCLUDE,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.round = round
        self.argument_templates = argument_templates
        self.dataset_version = dataset_version
        self.image = image
        self.hyperparameter_args = hyperparameter_args
        self.exclude_params = tuple(exclude_params)

    def points(self, plan: dict[str, Any], numbers: range, sweep: SweepLocation) -> list[dict[str, Any]]:
        """The round's points, one per trial number (fewer when a finite space runs out)."""
        space = parse_space(plan["space"])
        algorithm = plan["algorithm"]
        if algorithm == "grid":
            return list(space.grid())[numbers.start : numbers.stop]
        if algorithm == "random":
            return random_points(space, plan["max_trials"], plan["seed"])[numbers.start : numbers.stop]
        from kubetrain.sweep.tpe import tpe_points

        history = all_trials(self.store, sweep)
        self.log.info("tpe round %d: the study is rebuilt from %d earlier trial(s)", self.round, len(history))
        return tpe_points(
            space,
            history,
            count=len(numbers),
            seed=plan["seed"] + self.round,
            mode=plan["objective"]["mode"],
            startup_trials=plan["rounds"][0],
        )

    def render_arguments(self, context: Context, point: Mapping[str, Any], number: int) -> list[str]:
        """The trial's container arguments: the templates with ``params`` overridden by the point."""
        trial_context = dict(context)
        trial_context["params"] = {**dict(context["params"]), **point}
        trial_context["trial"] = {"number": number, "params": dict(point)}
        rendered = self.render_template(self.argument_templates, trial_context)
        arguments = string_list("arguments", rendered) or []
        if self.hyperparameter_args:
            arguments += [f"--{name}={_argument(value)}" for name, value in point.items()]
        return arguments

    def execute(self, context: Context) -> list[dict[str, Any]]:
        sweep = self.sweep_location(context)
        plan = self.load_plan(sweep)
        sizes = plan["rounds"]
        if self.round >= len(sizes):
            self.log.info(
                "Round %d: the %s sweep has %d round(s); nothing to ask for",
                self.round,
                plan["algorithm"],
                len(sizes),
            )
            return []
        start = sum(sizes[: self.round])
        numbers = range(start, start + sizes[self.round])
        points = self.points(plan, numbers, sweep)
        dag_id = context["ti"].dag_id
        params = dict(context["params"])
        done = set(load_trial_records(self.store, sweep))
        entries, planned = [], []
        for number, point in zip(numbers, points, strict=False):
            trial_params = {**params, **point}
            fp = fingerprint(dag_id, self.dataset_version, trial_params, self.image, self.exclude_params)
            item: dict[str, Any] = {"number": number, "params": point, "fingerprint": fp, "reused_from": None}
            planned.append(item)
            if number in done:
                self.log.info("Trial %d %s: finished earlier in this run", number, point)
                continue
            # force (the training Param): train every point again, whatever was trained before
            reused = None if params.get("force") else self.reuse(context, sweep, plan, number, point, fp)
            if reused is not None:
                item["reused_from"] = reused
                continue
            entries.append(
                {
                    "trial": str(number),
                    "hyperparameters": point,
                    "fingerprint": fp,
                    "arguments": self.render_arguments(context, point, number),
                }
            )
        self.store.write_json(
            sweep.bucket,
            sweep.round_key(self.round),
            {
                "kind": ROUND_KIND,
                "format_version": FORMAT_VERSION,
                "round": self.round,
                "algorithm": plan["algorithm"],
                "trials": planned,
                "asked_at": utc_stamp(),
            },
        )
        self.log.info(
            "Round %d: %d point(s), %d to train, %d reused or done: %s",
            self.round,
            len(planned),
            len(entries),
            len(planned) - len(entries),
            "; ".join(f"{p['number']}: {p['params']}" for p in planned),
        )
        return entries

    def reuse(
        self,
        context: Context,
        sweep: SweepLocation,
        plan: dict[str, Any],
        number: int,
        point: dict[str, Any],
        fp: str,
    ) -> dict[str, Any] | None:
        """Copy a finished trial with the same fingerprint into this sweep; where it came from, or ``None``."""
        dag_id = context["ti"].dag_id
        marker = self.store.read_json(self.store.layout.training_bucket, trial_marker_key(dag_id, fp))
        if not isinstance(marker, dict) or marker.get("status") != "success":
            return None
        if marker.get("stopped_early") and marker.get("early_stopping") != plan["early_stopping"]:
            self.log.info(
                "Trial %d %s was stopped early under other early-stopping settings: training it again",
                number,
                point,
            )
            return None
        metric, mode = plan["objective"]["metric"], plan["objective"]["mode"]
        values = objective_values(marker.get("history") or [], metric)
        source = {
            "run_uri": marker.get("run_uri"),
            "sweep": (marker.get("sweep") or {}).get("id"),
            "trial": marker.get("trial"),
        }
        record = {
            **marker,
            "sweep": _sweep_fields(plan),
            "trial": str(number),
            "number": number,
            "round": self.round,
            "params": point,
            "objective": {
                "name": metric,
                "mode": mode,
                "values": values,
                "value": objective_value({"final": marker.get("final_metrics")}, values, metric, mode),
            },
            "reused_from": source,
            "finished_at": utc_stamp(),
        }
        self.store.write_json(sweep.bucket, sweep.trial_record_key(number), record)
        self.log.info(
            "Trial %d %s: trained before (%s), its result is reused: no pod", number, point, source["run_uri"]
        )
        return source


def _argument(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _sweep_fields(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": settings.get("id"),
        "dag_id": settings.get("dag_id"),
        "run_id": settings.get("run_id"),
        "uri": settings.get("uri"),
        "algorithm": settings.get("algorithm"),
    }


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
    :param kwargs: TrainingPodOperator arguments (``trial`` is the trial number).
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
        super().__init__(**kwargs)
        # When this task process reached each step after the pod (the trial record's timing).
        self._stamps: dict[str, str] = {}
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
        if early.get("rule") != "median":
            return config
        objective = self.settings()["objective"]
        return dataclasses.replace(
            config,
            early_stopping=pod_spec.MedianStopping(
                objective=objective["metric"],
                mode=objective["mode"],
                trials_uri=self.settings()["trials_uri"],
                min_trials=early.get("min_trials", 3),
                start_step=early.get("start_step", 4),
            ),
        )

    # -- the pod ------------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        sweep = self.sweep_location()
        existing = self.store.read_json(sweep.bucket, sweep.trial_record_key(self.number))
        if isinstance(existing, dict) and existing.get("status") == "success":
            self.log.info(
                "Trial %s finished earlier in this run (%s): no pod", self.trial, existing.get("run_uri")
            )
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

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> Any:
        self._stamps["resumed"] = _now()
        try:
            super().trigger_reentry(context, event)
        except AirflowException as exc:
            return self._after_failure(context, exc)
        return self.finish(context)

    def _base_state(self) -> dict[str, Any]:
        """Exit code and times of the pod's containers, as its last status said."""
        # A deferred task reads the pod again when it resumes (self.pod); one that waited in its
        # process keeps the pod's last state from the watch in self.remote_pod.
        pod = getattr(self, "pod", None) if self.deferrable else getattr(self, "remote_pod", None)
        status = getattr(pod, "status", None)
        out: dict[str, Any] = {
            "pod_created": _iso(getattr(getattr(pod, "metadata", None), "creation_timestamp", None))
        }
        containers = [
            *(getattr(status, "init_container_statuses", None) or []),
            *(getattr(status, "container_statuses", None) or []),
        ]
        for container in containers:
            terminated = getattr(getattr(container, "state", None), "terminated", None)
            running = getattr(getattr(container, "state", None), "running", None)
            entry = {
                "started": _iso(
                    getattr(terminated, "started_at", None) or getattr(running, "started_at", None)
                ),
                "finished": _iso(getattr(terminated, "finished_at", None)),
                "exit_code": getattr(terminated, "exit_code", None),
            }
            out[container.name] = entry
        return out

    def _after_failure(self, context: Context, exc: AirflowException) -> Any:
        state = self._base_state()
        exit_code = (state.get(self.base_container_name) or {}).get("exit_code")
        run = self.trial_run(context)
        if exit_code == EXIT_STOPPED and self.store.read_json(
            run.bucket, f"{run.prefix}/sync/{EARLY_STOP_RECORD}"
        ):
            self.log.info(
                "Trial %s was stopped early by the median rule (exit code %d): a success",
                self.trial,
                exit_code,
            )
            return self.finish(context, state=state)
        if exit_code in FINAL_EXIT_CODES:
            reason = f"the trainer exited with {exit_code} ({FINAL_EXIT_CODES[exit_code]}); a retry would end the same"
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
        state = state if state is not None else self._base_state()
        self._stamps["pod_done"] = _now()
        run = self.trial_run(context)
        deadline = time.monotonic() + FINAL_PASS_CHECK_SECONDS
        while True:
            try:
                self.store.final_pass(run, checksums=False)
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
        try:
            return self.store.read(run.bucket, run.key(area, name))
        except Exception as exc:
            if is_missing_key(exc):
                return None
            raise

    def record(self, context: Context, state: dict[str, Any]) -> dict[str, Any]:
        """Read the trial's outputs, render its report, and write its records."""
        from kubetrain.report.inputs import load_run_inputs, parse_json

        self._stamps["final_pass"] = _now()
        settings = self.settings()
        run = self.trial_run(context)
        metric, mode = settings["objective"]["metric"], settings["objective"]["mode"]
        raw_metrics = self._read(run, "output", "metrics.json")
        metrics = parse_json("metrics.json", raw_metrics) if raw_metrics is not None else None
        metrics = metrics if isinstance(metrics, dict) else None
        rows = history_rows(
            metrics_jsonl=self._read(run, "output", METRICS_JSONL),
            history_csv=self._read(run, "output", HISTORY_CSV),
        )
        values = objective_values(rows, metric)
        early_stop = self.store.read_json(run.bucket, f"{run.prefix}/sync/{EARLY_STOP_RECORD}")
        exit_code = (state.get(self.base_container_name) or {}).get("exit_code")
        stopped_by = (
            ((metrics or {}).get("stopped_early") or {}).get("by")
            if isinstance((metrics or {}).get("stopped_early"), dict)
            else None
        )
        stopped = early_stop is not None and (exit_code == EXIT_STOPPED or stopped_by == "stop file")
        report_uri = url = None
        inputs = load_run_inputs(lambda name: self._read(run, "output", name), run.uri, title=self._title())
        if inputs is not None:
            from kubetrain.report.render import render_report

            report_uri = self.store.write_report(run, render_report(inputs))
            url = report_url(context["ti"].dag_id, run.bucket, run.key("report", "report.html"))
            context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=url)
            self._stamps["report"] = _now()
        ti = context["ti"]
        record = {
            "kind": TRIAL_KIND,
            "format_version": FORMAT_VERSION,
            "sweep": _sweep_fields(settings),
            "trial": str(self.trial),
            "number": self.number,
            "round": self.sweep_round,
            "params": dict(self.hyperparameters or {}),
            "fingerprint": self.fingerprint,
            "status": "success",
            "stopped_early": stopped,
            "early_stop": early_stop if stopped else None,
            "stop_requested": early_stop if (early_stop is not None and not stopped) else None,
            "early_stopping": settings.get("early_stopping"),
            "objective": {
                "name": metric,
                "mode": mode,
                "value": objective_value(metrics, values, metric, mode),
                "values": values,
            },
            "final_metrics": (metrics or {}).get("final"),
            "steps": (metrics or {}).get("steps") or (rows[-1].get("step") if rows else None),
            "epochs": (metrics or {}).get("epochs"),
            "reports": len(rows),
            "wall_time_s": (metrics or {}).get("wall_time_s"),
            "resumed_from_step": (metrics or {}).get("resumed_from_step"),
            "exit_code": exit_code,
            "image": self.image,
            "dataset_version": self.dataset_version,
            "arguments": list(self.arguments or []),
            "timing": {
                "task_started": _iso(getattr(ti, "start_date", None)),
                "try_number": getattr(ti, "try_number", None),
                **state,
                **self._stamps,
                "recorded": _now(),
            },
            "history": rows,
            "run_uri": run.uri,
            "report_uri": report_uri,
            "report_url": url,
            "reused_from": None,
            "finished_at": utc_stamp(),
        }
        sweep = self.sweep_location()
        self.store.write_json(sweep.bucket, sweep.trial_record_key(self.number), record)
        if self.fingerprint:
            self.store.write_json(
                self.store.layout.training_bucket, trial_marker_key(ti.dag_id, self.fingerprint), record
            )
        self.log.info(
            "Trial %s %s: %s %s = %s after %d report(s)%s; record %s",
            self.trial,
            record["params"],
            "stopped early," if stopped else "finished,",
            metric,
            record["objective"]["value"],
            len(rows),
            f" (median rule at report {early_stop.get('step')}: best {early_stop.get('best')} vs median {early_stop.get('median')})"
            if stopped
            else "",
            s3_uri(sweep.bucket, sweep.trial_record_key(self.number)),
        )
        return self._result(context, record)

    def write_failed(self, context: Context, reason: str, state: dict[str, Any]) -> None:
        settings = self.settings()
        run = self.trial_run(context)
        sweep = self.sweep_location()
        record = {
            "kind": TRIAL_KIND,
            "format_version": FORMAT_VERSION,
            "sweep": _sweep_fields(settings),
            "trial": str(self.trial),
            "number": self.number,
            "round": self.sweep_round,
            "params": dict(self.hyperparameters or {}),
            "fingerprint": self.fingerprint,
            "status": "failed",
            "stopped_early": False,
            "error": reason,
            "objective": {
                "name": settings["objective"]["metric"],
                "mode": settings["objective"]["mode"],
                "value": None,
                "values": [],
            },
            "exit_code": (state.get(self.base_container_name) or {}).get("exit_code"),
            "timing": state,
            "run_uri": run.uri,
            "finished_at": utc_stamp(),
        }
        self.store.write_json(sweep.bucket, sweep.trial_record_key(self.number), record)

    def _title(self) -> str:
        title = self.settings().get("title") or "Sweep"
        return f"{title}: trial {self.trial}"

    def _result(self, context: Context, record: Mapping[str, Any]) -> dict[str, Any]:
        if record.get("report_url"):
            context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=record["report_url"])
        return {
            "trial": record.get("trial"),
            "status": record.get("status"),
            "stopped_early": bool(record.get("stopped_early")),
            "objective": (record.get("objective") or {}).get("value"),
            "run_uri": record.get("run_uri"),
            "report_url": record.get("report_url"),
        }


class SweepReportOperator(SweepStoreOperator):
    """The leaderboard: every trial ranked by the objective, in HTML and Markdown, and the best trial.

    Writes ``report.html``, ``report.md`` and the plots (objective per trial, parallel coordinates
    of the hyperparameters against the objective) into the sweep's ``report/`` prefix, and
    compares the best trial with the promoted model as the single-run report does (its
    metrics.json's monitor; strictly better wins). Fails when no trial has a result.

    Returns (XCom) ``{"best_trial", "best_run_uri", "best_value", "better_than_promoted",
    "comparison", "report_uri", "report_url", "trials", "succeeded", "stopped_early", "failed"}``,
    each also its own XCom.

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
        candidates = [
            t
            for t in order
            if t.get("status") == "success" and (t.get("objective") or {}).get("value") is not None
        ]
        if not candidates:
            raise AirflowFailException(
                f"no trial of the sweep has a {metric}: {len(trials)} trial(s), "
                + ", ".join(
                    f"{t['number']}: {t.get('status')} {t.get('error') or ''}".strip() for t in trials
                )
            )
        best = candidates[0]
        comparison = None
        if self.model:
            best_run = RunLocation.from_uri(best["run_uri"])
            raw = self.store.read(best_run.bucket, best_run.key("output", "metrics.json"))
            if raw is not None:
                version, promoted = self.store.promoted_metrics(self.model)
                comparison = compare(parse_metrics(raw), promoted, version, on=self.compare_on)
                self.log.info(
                    "Best trial %s against the promoted %s: %s", best["trial"], self.model, comparison.reason
                )
            else:
                self.log.info(
                    "Best trial %s wrote no metrics.json: nothing to compare with the promoted model",
                    best["trial"],
                )
        files = render_sweep_report(
            SweepReportInputs(
                plan=plan,
                trials=order,
                best=best,
                comparison=comparison,
                title=self.title,
                trial_report_url=lambda t: t.get("report_url"),
            )
        )
        report_uri = self.store.write_report(sweep.run, files)
        url = report_url(context["ti"].dag_id, sweep.bucket, sweep.run.key("report", "report.html"))
        context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=url)
        counts = {
            "succeeded": sum(
                1 for t in trials if t.get("status") == "success" and not t.get("stopped_early")
            ),
            "stopped_early": sum(1 for t in trials if t.get("stopped_early")),
            "failed": sum(1 for t in trials if t.get("status") != "success"),
        }
        self.log.info(
            "Leaderboard of %d trial(s) (%s) at %s: best trial %s, %s %s",
            len(trials),
            ", ".join(f"{v} {k}" for k, v in counts.items()),
            url,
            best["trial"],
            metric,
            best["objective"]["value"],
        )
        return {
            "best_trial": best["trial"],
            "best_run_uri": best["run_uri"],
            "best_value": best["objective"]["value"],
            "better_than_promoted": comparison.better if comparison else None,
            "comparison": comparison.reason if comparison else None,
            "report_uri": report_uri,
            "report_url": url,
            "trials": len(trials),
            **counts,
        }


class RecordSweepOperator(SweepStoreOperator):
    """Write the sweep record, one JSON object: ``<sweep>/sweep/sweep.json`` (kind ``kubetrain/sweep``).

    It holds the plan (space, algorithm, seed, objective, early stopping, dataset version, image
    digest, code version, fixed Params), every trial's params and result (the trial records
    without their per-report history), the best trial, the leaderboard and what was promoted.

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
        document = {
            "kind": SWEEP_KIND,
            "format_version": FORMAT_VERSION,
            **{
                k: plan.get(k)
                for k in (
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
                )
            },
            "trials": [summary(t) for t in trials],
            "best": {k: leaderboard.get(k) for k in ("best_trial", "best_run_uri", "best_value")},
            "counts": {k: leaderboard.get(k) for k in ("trials", "succeeded", "stopped_early", "failed")},
            "comparison": {
                "better_than_promoted": leaderboard.get("better_than_promoted"),
                "reason": leaderboard.get("comparison"),
            },
            "promotion": dict(self.promotion or {}),
            "report_uri": leaderboard.get("report_uri"),
            "report_url": leaderboard.get("report_url"),
            "created_at": plan.get("created_at"),
            "finished_at": utc_stamp(),
        }
        uri = self.store.write_json(sweep.bucket, sweep.record_key, document)
        self.log.info("Sweep record: %s (%d trials)", uri, len(trials))
        runs = self.record_trial_runs(context, plan, trials, document)
        return {"record_uri": uri, "run_records": runs}

    def record_trial_runs(
        self,
        context: Context,
        plan: Mapping[str, Any],
        trials: Sequence[Mapping[str, Any]],
        document: Mapping[str, Any],
    ) -> list[str]:
        """One run record per trial (kind ``kubetrain/run``, its ``sweep`` field set), so the Training
        page lists the trials with the model's other runs and shows the sweep's leaderboard."""
        from kubetrain.operators.dedupe import RunRecorder

        model = plan.get("model")
        if not model:
            self.log.info("No model name: no run records for the trials")
            return []
        recorder = RunRecorder(self.store, self.log)
        objective = plan.get("objective") or {}
        dataset = plan.get("dataset") or {}
        best = (document.get("best") or {}).get("best_trial")
        promotion = dict(document.get("promotion") or {})
        uris = []
        sweep = self.sweep_location(context)
        for trial in trials:
            number = trial.get("trial")
            if trial.get("reused_from"):  # not trained in this sweep: its run has its own record
                continue
            run = sweep.trial_run(trial.get("number"))
            failed = trial.get("status") != "success"
            if str(number) == str(best) and promotion.get("promoted"):
                trial_promotion = promotion
            elif str(number) == str(best):
                trial_promotion = {
                    "reason": f"the sweep's best trial, not promoted: {promotion.get('reason') or (document.get('comparison') or {}).get('reason') or 'see the sweep record'}"
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
                dataset_uri=dataset.get("uri"),
                dataset_version=trial.get("dataset_version") or dataset.get("version"),
                dataset_manifest=dataset.get("manifest"),
                image=trial.get("image") or plan.get("image"),
                fingerprint=trial.get("fingerprint"),
                promotion=trial_promotion,
                report={"report_uri": trial.get("report_uri"), "report_url": trial.get("report_url")},
                failure={"task": "train", "error": str(trial.get("error") or "the trial failed")}
                if failed
                else None,
                sweep={
                    "id": str(document.get("id") or plan.get("id")),
                    "trial": str(number),
                    "algorithm": plan.get("algorithm"),
                    "params": dict(trial.get("params") or {}),
                    "stopped_early": bool(trial.get("stopped_early")),
                    "objective": {
                        "name": objective.get("metric"),
                        "mode": objective.get("mode"),
                        "value": (trial.get("objective") or {}).get("value"),
                    },
                },
            )
            uris.append(self.store.write_run_record(record))
            recorder.track(record)  # MLflow, when a tracking URI is configured
        self.log.info("Run records of %d trial(s) trained in this sweep, model %s", len(uris), model)
        return uris
