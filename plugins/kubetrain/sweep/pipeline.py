"""The task chain of a sweep DAG, built by one function beside the single-run ``training_pipeline``.

::

    stage_dataset -> plan -> round_0.suggest -> round_0.train_<p>_at_a_time  (the trials, mapped)
                          -> round_1.suggest -> round_1.train                (tpe rounds)
                          -> ...             -> leaderboard -> promote -> record

One staged snapshot of the dataset serves every trial. Each trial is a mapped
:class:`~kubetrain.sweep.operators.TrialPodOperator` (a KubernetesPodOperator) in the ``gpu``
pool with its own run prefix ``runs/<dag>/<run>/trials/<n>/``. Airflow fixes a task's
``max_active_tis_per_dagrun`` when the DAG is parsed, so round 0 has one training task per
value the ``parallel_trials`` Param offers (1, 2, 4, ... up to the DAG's bound), each with that
bound; the plan task skips all but the one the run asked for. Later rounds (tpe) ask for ``parallel_trials`` trials each, so they never
run more at once. The ``gpu`` pool bounds the GPU pods of every DAG together.

The DAG renders its templates as native objects (``render_template_as_native_obj=True``), as a
training DAG does (:mod:`kubetrain.pipeline`): the trials get the Params' mappings, lists and
numbers, and the argument templates render per trial to the values of its point. The model name
and the experiment reach their tasks as the Params themselves (``dag.param("model_name")``).

A trial that fails (after its retries) does not stop the sweep: the next round and the
leaderboard run when every trial before them is done, and the leaderboard ranks the trials
that have a result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import TaskGroup

from kubetrain.operators.promote import PromoteModelOperator
from kubetrain.operators.stage import StageDatasetOperator
from kubetrain.params import native_dag
from kubetrain.sweep.config import SweepSettings
from kubetrain.sweep.operators import (
    PlanSweepOperator,
    RecordSweepOperator,
    SuggestTrialsOperator,
    SweepReportOperator,
    TrialPodOperator,
)

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator

__all__ = ["SweepTasks", "sweep_pipeline"]


def _output(task: BaseOperator) -> Any:
    """A reference to what ``task`` returns (``_output(task)["key"]`` to one of its keys), for a templated
    argument of another task. Typed ``Any``: Airflow resolves it to the value before that task executes,
    so it stands for whatever type the argument takes (as a TaskFlow ``@task``'s result does); the
    ``XComArg`` that ``BaseOperator.output`` is annotated with is not indexable, though it builds one that is.
    """
    return task.output


@dataclass
class SweepTasks:
    stage: StageDatasetOperator
    plan: PlanSweepOperator
    suggest: list[SuggestTrialsOperator]
    trials: list[list[Any]]  # per round, its mapped training task(s)
    leaderboard: SweepReportOperator
    promote: PromoteModelOperator
    record: RecordSweepOperator


def sweep_pipeline(
    settings: SweepSettings,
    *,
    cmds: Sequence[str] | str,
    arguments: Sequence[str] | str,
    title: str,
    keep_checkpoints: int = 3,
    execution_timeout: timedelta = timedelta(hours=24),
    deferrable: bool = False,
    check_params: Callable[[Any], None] | None = None,
    **train_kwargs: Any,
) -> SweepTasks:
    """Create a sweep's task chain in the current DAG context.

    The DAG's Params must hold those of :meth:`SweepSettings.params`, ``common_params`` and the
    trainer's training Params (the fixed values of every trial).

    :param settings: the sweep's fixed settings (tunable hyperparameters, default objective,
        bound of parallel trials, tpe rounds).
    :param cmds: the base container's command, or a template that renders a list (``{{ params.command }}``).
    :param arguments: argument templates, rendered per trial with ``params`` overridden by the
        trial's hyperparameters (``{{ params.learning_rate }}``) and ``trial`` (``number``,
        ``params``), numbers becoming text; or a template that renders a list (``{{ params.args }}``).
    :param title: report title.
    :param keep_checkpoints: checkpoint sets kept in S3 after promotion (of the best trial).
    :param execution_timeout: limit of each trial.
    :param deferrable: whether each trial defers to the triggerer while its pod runs. Off by
        default: a trial waits for its pod in its task process (watches of the pod, the training
        container's log followed), which saves the hand-off from the triggerer back to a new task
        process when the pod ends (about 3 s of every trial on the dev stack, bench/README.md's
        sweep table) and holds one worker slot per running trial, at most ``parallel_trials``
        per sweep. On for sweeps of long trials where the worker slots matter more.
    :param train_kwargs: more TrialPodOperator arguments.
    """
    # the fixed Params' rules across flags, before anything is staged (each trial's in its pod)
    stage_hooks: dict[str, Any] = {"pre_execute": check_params} if check_params else {}
    stage = StageDatasetOperator(
        task_id="stage_dataset",
        source_uri="{{ params.dataset_uri }}",
        outlets=[],
        **stage_hooks,
    )
    dag = native_dag(stage, "sweep_pipeline")
    staged = _output(stage)
    plan = PlanSweepOperator(
        task_id="plan",
        settings=settings,
        dataset_version=staged["version"],
        dataset_manifest=staged["manifest_uri"],
        image="{{ params.image or '' }}",
        # pinned once for every trial (train_kwargs may name another than the deployment's)
        sync_image=train_kwargs.pop("sync_image", None),
        title=title,
    )
    planned = _output(plan)
    trial_kwargs: dict[str, Any] = dict(
        pool="gpu",
        image=planned["image"],
        sync_image=planned["sync_image"],
        cmds=cmds if isinstance(cmds, str) else list(cmds),
        dataset_manifest=staged["manifest_uri"],
        dataset_version=staged["version"],
        dataset_bytes=staged["total_bytes"],
        prepared_bytes=staged["prepared_bytes"],
        data_size="{{ params.data_size or '' }}",
        sweep=planned["trial_settings"],
        experiment=dag.param("experiment"),
        gpus="{{ params.gpus }}",
        gpu_resource="{{ params.gpu_resource or '' }}",
        node_selector="{{ params.node_selector }}",
        tolerations="{{ params.tolerations }}",
        image_pull_secrets="{{ params.image_pull_secrets }}",
        # each trial queues on its own (one Workload a pod)
        local_queue="{{ params.queue or '' }}",
        priority_class="{{ params.priority or '' }}",
        cpu="{{ params.cpu }}",
        memory="{{ params.memory }}",
        sync_interval="{{ params.sync_interval }}",
        execution_timeout=execution_timeout,
        deferrable=deferrable,
        map_index_template="trial {{ task.trial }}",
        **train_kwargs,
    )
    suggests: list[SuggestTrialsOperator] = []
    rounds: list[list[Any]] = []
    previous: Any = plan
    for number in range(settings.rounds):
        with TaskGroup(f"round_{number}", tooltip=f"Round {number} of the sweep's trials"):
            suggest = SuggestTrialsOperator(
                task_id="suggest",
                round=number,
                argument_templates=arguments if isinstance(arguments, str) else list(arguments),
                hyperparameter_args=settings.hyperparameter_args,
                dataset_version=staged["version"],
                image=planned["image"],
                # a failed trial does not stop the sweep: the next round runs once the last one is done
                trigger_rule="all_success" if number == 0 else "all_done",
            )
            if number == 0:
                tasks = [
                    TrialPodOperator.partial(
                        task_id=f"train_{p}_at_a_time",
                        max_active_tis_per_dagrun=p,
                        sweep_round=0,
                        **trial_kwargs,
                    ).expand_kwargs(suggest.output)
                    for p in settings.parallel_choices
                ]
                plan.variant_tasks = {
                    p: task.task_id for p, task in zip(settings.parallel_choices, tasks, strict=True)
                }
            else:
                tasks = [
                    TrialPodOperator.partial(
                        task_id="train",
                        max_active_tis_per_dagrun=settings.max_parallel_trials,
                        sweep_round=number,
                        **trial_kwargs,
                    ).expand_kwargs(suggest.output)
                ]
        previous >> suggest
        suggests.append(suggest)
        rounds.append(tasks)
        previous = tasks
    leaderboard = SweepReportOperator(
        task_id="leaderboard",
        model=dag.param("model_name"),
        title=title,
        trigger_rule="all_done",
    )
    previous >> leaderboard
    ranked = _output(leaderboard)
    promote = PromoteModelOperator(
        task_id="promote",
        run_uri=ranked["best_run_uri"],
        model=dag.param("model_name"),
        promote="{{ params.promote }}",
        is_better=ranked["better_than_promoted"],
        keep_checkpoints=keep_checkpoints,
    )
    record = RecordSweepOperator(task_id="record", leaderboard=ranked, promotion=_output(promote))
    stage >> plan
    leaderboard >> promote >> record
    return SweepTasks(stage, plan, suggests, rounds, leaderboard, promote, record)
