"""The plan and the rounds of a sweep: check the settings and pin the image, then ask for each round's trials.

::

    stage_dataset -> plan -> round_0.suggest -> round_0.train_<p>_at_a_time -> round_1.suggest -> ...

The plan is written to ``<sweep>/sweep/plan.json``, each round's points to
``<sweep>/sweep/rounds/<round>.json``; a point trained before with the same fingerprint starts no
pod, its trial record is copied into the sweep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from airflow.sdk.bases.skipmixin import SkipMixin
from airflow.sdk.exceptions import AirflowFailException

from kubetrain import pod_spec
from kubetrain.hooks.registry import RegistryHook
from kubetrain.images import pin_image
from kubetrain.operators.base import RunStoreOperator
from kubetrain.operators.dedupe import NOT_TRAINING_PARAMS, fingerprint
from kubetrain.operators.training_args import string_list
from kubetrain.s3_layout import utc_stamp
from kubetrain.sweep.config import SWEEP_PARAMS, SweepSettings
from kubetrain.sweep.records import (
    FORMAT_VERSION,
    SweepLocation,
    assemble_trial,
    objective_value,
    objective_values,
    trial_marker_key,
)
from kubetrain.sweep.space import SpaceError, parse_space, random_points
from kubetrain.sweep.store import SweepStoreOperator, all_trials, load_trial_records, read_trial, write_trial
from kubetrain_contract.records import RecordError
from kubetrain_contract.trial import PlannedTrial, ReusedFrom, SweepRoundRecord

if TYPE_CHECKING:
    from airflow.sdk import Context

PLAN_KIND = "kubetrain/sweep-plan"
ROUND_KIND = SweepRoundRecord.KIND
# Params that do not change what one trial trains: run control, placement, the sweep's own, the model's name.
TRIAL_EXCLUDE = (*NOT_TRAINING_PARAMS, *SWEEP_PARAMS, "model_name")


class PlanSweepOperator(SweepStoreOperator, SkipMixin):
    """Check a sweep's settings before any pod starts, pin the images, and write the plan.

    Refuses, naming the field and without retries, a space that cannot be searched: an unknown
    hyperparameter, an empty list, ``low`` > ``high``, a value that the hyperparameter's own Param
    refuses, a grid larger than ``max_trials``, more tpe trials than the DAG's rounds can hold.
    Writes ``<sweep>/sweep/plan.json``.

    Round 0 has one training task per ``parallel_trials`` value the DAG offers
    (``variant_tasks``, set by :func:`~kubetrain.sweep.pipeline.sweep_pipeline`); this task
    skips all but the one the run asked for.

    Both images are pinned to their digests once, here, so every trial of the sweep runs the same
    trainer and the same sync tool (whose sidecar applies the early-stopping rule), whatever is
    pushed to their tags while the sweep runs; no trial asks the registry again.

    Pushes (XCom) ``plan``, ``image``, ``sync_image`` and ``trial_settings``, and the four as
    ``return_value``.

    :param settings: the DAG's sweep settings.
    :param dataset_version: ``stage.output["version"]``. (templated)
    :param dataset_manifest: ``stage.output["manifest_uri"]``. (templated)
    :param image: the training image (default: the deployment's), pinned to its digest here. (templated)
    :param sync_image: the image of the trials' stage-in and checkpoint-sync containers (default:
        the deployment's), pinned to its digest here. (templated)
    :param registry_conn_id: registry connection to resolve the images' digests with.
    :param title: the sweep's title (reports). (templated)
    """

    template_fields: Sequence[str] = (
        *RunStoreOperator.template_fields,
        "dataset_version",
        "dataset_manifest",
        "image",
        "sync_image",
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
        sync_image: str | None = None,
        registry_conn_id: str = RegistryHook.default_conn_name,
        title: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.settings = settings
        self.dataset_version = dataset_version
        self.dataset_manifest = dataset_manifest
        self.image = image
        self.sync_image = sync_image
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
        sync_image = pin_image(
            pod_spec.resolve_image(self.sync_image, "sync"), registry_conn_id=self.registry_conn_id
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
            "sync_image": sync_image,
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
        result = {
            "plan": document,
            "image": image,
            "sync_image": sync_image,
            "trial_settings": trial_settings,
        }
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
            [trial.to_dict() for trial in history],
            count=len(numbers),
            seed=plan["seed"] + self.round,
            mode=plan["objective"]["mode"],
            startup_trials=plan["rounds"][0],
        )

    def render_arguments(self, context: Context, point: Mapping[str, Any], number: int) -> list[str]:
        """The trial's container arguments: the templates with ``params`` overridden by the point."""
        trial_context: dict[str, Any] = dict(context)
        trial_context["params"] = {**dict(context["params"]), **point}
        trial_context["trial"] = {"number": number, "params": dict(point)}
        # the task's Context plus one key, trial, which the Context TypedDict cannot name
        rendered = self.render_template(self.argument_templates, cast("Context", trial_context))
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
        entries: list[dict[str, Any]] = []
        planned: list[PlannedTrial] = []
        for number, point in zip(numbers, points, strict=False):
            trial_params = {**params, **point}
            fp = fingerprint(dag_id, self.dataset_version, trial_params, self.image, self.exclude_params)
            if number in done:
                self.log.info("Trial %d %s: finished earlier in this run", number, point)
                planned.append(PlannedTrial(number=number, params=point, fingerprint=fp))
                continue
            # force (the training Param): train every point again, whatever was trained before
            reused = None if params.get("force") else self.reuse(context, sweep, plan, number, point, fp)
            planned.append(PlannedTrial(number=number, params=point, fingerprint=fp, reused_from=reused))
            if reused is not None:
                continue
            entries.append(
                {
                    "trial": str(number),
                    "hyperparameters": point,
                    "fingerprint": fp,
                    "arguments": self.render_arguments(context, point, number),
                }
            )
        document = SweepRoundRecord(
            round=self.round, algorithm=plan["algorithm"], trials=planned, asked_at=utc_stamp()
        )
        self.store.write(sweep.bucket, sweep.round_key(self.round), document.to_json() + "\n")
        self.log.info(
            "Round %d: %d point(s), %d to train, %d reused or done: %s",
            self.round,
            len(planned),
            len(entries),
            len(planned) - len(entries),
            "; ".join(f"{p.number}: {p.params}" for p in planned),
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
    ) -> ReusedFrom | None:
        """Copy a finished trial with the same fingerprint into this sweep; where it came from, or ``None``."""
        dag_id = context["ti"].dag_id
        bucket, key = self.store.layout.training_bucket, trial_marker_key(dag_id, fp)
        try:
            marker = read_trial(self.store, bucket, key)
        except RecordError as exc:
            self.log.warning(
                "Trial %d %s: the record of its fingerprint is unreadable (%s): training it",
                number,
                point,
                exc,
            )
            return None
        if marker is None or not marker.succeeded:
            return None
        if marker.stopped_early and marker.early_stopping != plan["early_stopping"]:
            self.log.info(
                "Trial %d %s was stopped early under other early-stopping settings: training it again",
                number,
                point,
            )
            return None
        metric, mode = plan["objective"]["metric"], plan["objective"]["mode"]
        values = objective_values(marker.history, metric)
        source = ReusedFrom(
            run_uri=marker.run_uri, sweep=marker.sweep.id if marker.sweep else None, trial=marker.trial
        )
        record = assemble_trial(
            plan,
            number,
            round=self.round,
            params=point,
            fingerprint=marker.fingerprint,
            run_uri=marker.run_uri,
            finished_at=utc_stamp(),
            value=objective_value({"final": marker.final_metrics}, values, metric, mode),
            values=values,
            outcome=marker,
            reused_from=source,
        )
        write_trial(self.store, sweep.bucket, sweep.trial_record_key(number), record)
        self.log.info(
            "Trial %d %s: trained before (%s), its result is reused: no pod", number, point, source.run_uri
        )
        return source


def _argument(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)
