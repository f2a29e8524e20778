"""A KubernetesPodOperator for long pods on a shared cluster: start-up budgets, Kueue's queue, and
pods ended from outside replaced in the same try.

What an ended pod means (finished, preempted, evicted, deleted, failed) and whether the task runs it
again is :func:`kubetrain.operators.interruption.pod_end`'s; this class acts on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.pod_manager import PodNotFoundException
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from kubernetes.client.rest import ApiException

from kubetrain import pod_spec, settings
from kubetrain.operators import training_args as args
from kubetrain.operators.interruption import Action, TryDisruptions, exit_code, pod_end
from kubetrain.operators.training_pods import TrainingPodManager
from kubetrain.pod_startup import (
    INTERRUPTED_EXIT_KEY,
    INTERRUPTED_KEY,
    NOTES_KEY,
    QUEUED_KEY,
    STARTUP_FAILURES,
    PodStartup,
    failure_from_event,
)
from kubetrain.triggers.pod import LOGS_FLUSHED_KEY, TrainingPodTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.triggers.base import BaseTrigger
    from kubernetes.client import models as k8s

__all__ = ["DISRUPTIONS_XCOM_KEY", "NOTES_XCOM_KEY", "PodInterrupted", "ResumablePodOperator"]

# The interruptions of this try so far, carried from one pod's trigger to the next.
INTERRUPTIONS_KEY = "kubetrain_interruptions"
# XCom of the lines a run's report shows at the top (e.g. a GPU request served on CPU).
NOTES_XCOM_KEY = "notes"
# XCom of what the cluster did to the try: ``{"interruptions": [{"pod", "reason", "at", "queued_s",
# "exit_code"}, ...], "queued_s": seconds all its pods waited for Kueue's admission}``; the report
# and the run record count preemptions, time queued and steps lost from it.
DISRUPTIONS_XCOM_KEY = "disruptions"


class PodInterrupted(AirflowException):
    """The training pod was ended from outside before its training finished: preempted, evicted,
    drained or deleted. The task submits a new pod in the same try, which resumes from the last
    checkpoint; it is not a failure and costs no retry.

    :param message: which pod and why.
    :param exit_code: the training container's exit code, when it had ended (75: checkpointed on SIGTERM).
    """

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ResumablePodOperator(KubernetesPodOperator):
    """The KubernetesPodOperator with kubetrain's start-up budgets, queue wait and pod replacement.

    The pod's start is judged by :class:`kubetrain.pod_startup.PodStartup` (in the task process,
    or in :class:`~kubetrain.triggers.pod.TrainingPodTrigger` when the task defers). When the pod
    ends, :func:`kubetrain.operators.interruption.pod_end` says what that means: a pod ended from
    outside is replaced in the same try by a new pod (up to ``max_preemptions``), a final exit code
    fails the task without retries, and what the cluster did is pushed as XCom ``disruptions`` and
    ``notes``. :class:`~kubetrain.operators.training.TrainingPodOperator` documents the arguments.

    :param stage_in_timeout_seconds: seconds the stage-in container may download the dataset.
    :param unschedulable_grace_seconds: seconds an unschedulable pod waits for an autoscaler before it fails.
    :param queue_timeout_seconds: seconds the pod may wait for Kueue's admission (default: the deployment's).
    :param queue_log_interval_seconds: seconds between the task log's lines about a queued pod.
    :param max_preemptions: pods of one try that may be ended from outside and replaced.
    :param log_containers: containers whose lines go to the task log besides the training container.
    :param kwargs: everything KubernetesPodOperator and BaseOperator accept.
    """

    # the extended resource GPUs are requested as (a subclass's argument; default: the setting)
    gpu_resource: str | None = None

    def __init__(
        self,
        *,
        startup_timeout_seconds: int = 600,
        stage_in_timeout_seconds: int = 3600,
        schedule_timeout_seconds: int = 900,
        unschedulable_grace_seconds: int = 60,
        queue_timeout_seconds: float | None = None,
        queue_log_interval_seconds: float = 60,
        max_preemptions: int = 20,
        deferrable: bool = True,
        on_finish_action: str = "delete_pod",
        get_logs: bool = True,
        logging_interval: int | None = 3,
        log_containers: Sequence[str] = (pod_spec.STAGE_IN_CONTAINER, pod_spec.SYNC_CONTAINER),
        log_events_on_failure: bool = True,
        termination_message_policy: str = "FallbackToLogsOnError",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            deferrable=deferrable,
            on_finish_action=on_finish_action,
            get_logs=get_logs,
            logging_interval=logging_interval,
            log_events_on_failure=log_events_on_failure,
            startup_timeout_seconds=startup_timeout_seconds,
            schedule_timeout_seconds=schedule_timeout_seconds,
            # A crashed trainer's last log lines become the task's error message.
            termination_message_policy=termination_message_policy,
            **kwargs,
        )
        self.stage_in_timeout_seconds = stage_in_timeout_seconds
        self.unschedulable_grace_seconds = unschedulable_grace_seconds
        self.queue_timeout_seconds = queue_timeout_seconds
        self.queue_log_interval_seconds = queue_log_interval_seconds
        self.max_preemptions = max_preemptions
        self.log_containers = list(log_containers)
        if (
            not self.deferrable
            and not self.init_container_logs
            and pod_spec.STAGE_IN_CONTAINER in self.log_containers
        ):
            # The task follows the training container's log itself; the stage-in container's
            # log, complete by then, comes first (the sidecar's comes when the pod ends: cleanup()).
            self.init_container_logs = [pod_spec.STAGE_IN_CONTAINER]
        self._disruptions = TryDisruptions(max_preemptions)
        self._startup_failure: AirflowException | None = None
        self._notes: list[str] = []

    @cached_property
    def pod_manager(self) -> TrainingPodManager:
        return TrainingPodManager(kube_client=self.client, callbacks=self.callbacks)

    def _queue_timeout(self) -> float:
        return args.queue_timeout(self.queue_timeout_seconds)

    # -- start-up ----------------------------------------------------------------------------

    def pod_startup(self) -> PodStartup:
        """The start-up judge with this task's budgets."""
        return PodStartup(
            schedule_timeout=self.schedule_timeout_seconds,
            unschedulable_grace=self.unschedulable_grace_seconds,
            startup_timeout=self.startup_timeout_seconds,
            stage_in_timeout=self.stage_in_timeout_seconds,
            stage_in_container=pod_spec.STAGE_IN_CONTAINER,
            queue_timeout=self._queue_timeout(),
        )

    def await_pod_start(self, pod: k8s.V1Pod) -> None:
        """Wait until the pod runs, each start-up phase within its budget (the task is not deferred)."""
        startup = self.pod_startup()
        try:
            remote = self.pod_manager.await_start(
                pod, startup, self.startup_check_interval_seconds, self.queue_log_interval_seconds
            )
        except STARTUP_FAILURES as exc:
            self._startup_failure = exc
            raise
        finally:
            self._disruptions.pod_queued_s = startup.queued_s
        note = self.pod_manager.gpu_note(remote, self._gpu_resource())
        if note:
            self.log.warning("%s", note)
            self._notes.append(note)

    def _gpu_resource(self) -> str:
        return str(self.gpu_resource or settings.get("gpu_resource"))

    # -- interruptions: what an ended pod means is kubetrain.operators.interruption's --------

    def execute(self, context: Context) -> Any:
        while True:
            try:
                return super().execute(context)
            except (PodInterrupted, PodNotFoundException) as exc:
                if self.deferrable:
                    raise  # the trigger's resumption handles it (trigger_reentry)
                self._replace_interrupted(context, exc)

    def _replace_interrupted(
        self, context: Context, exc: BaseException, pod_name: str | None = None, code: int | None = None
    ) -> None:
        """Count an interruption and forget the pod, so that the next execution submits a new one;
        fail past ``max_preemptions``.

        :param code: the training container's exit code, when it was seen (75: it checkpointed on SIGTERM).
        """
        name = pod_name or (self.pod.metadata.name if self.pod is not None else None)
        reason = str(exc)
        count = self._disruptions.record(
            name, reason, getattr(exc, "exit_code", None) if code is None else code, datetime.now(UTC)
        )
        self._push_disruptions(context)
        if self._disruptions.exhausted:
            raise AirflowFailException(
                f"the training pod was ended from outside {count} times in this try (last: {reason}), more "
                f"than max_preemptions={self.max_preemptions}: the cluster keeps preempting or evicting it; "
                "raise the run's priority, its queue's quota or max_preemptions"
            ) from exc
        note = (
            f"pod {name} was ended from outside ({reason}); a new pod resumes from the last checkpoint "
            f"in the same try (interruption {count} of at most {self.max_preemptions})"
        )
        self.log.warning("%s", note)
        self._notes.append(note)
        self.trigger_kwargs = {
            k: v
            for k, v in (self.trigger_kwargs or {}).items()
            if k not in ("_redefer_count", INTERRUPTIONS_KEY)
        }
        self.trigger_kwargs[INTERRUPTIONS_KEY] = list(self._disruptions.interruptions)
        self.trigger_kwargs[NOTES_KEY] = list(self._notes)
        self.pod = None
        self.pod_request_obj = None
        self.remote_pod = None
        self._startup_failure = None

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: timedelta | float | None = None,
    ) -> NoReturn:
        """Defer as the base class does, with its pod trigger extended by kubetrain's start-up phases and logs."""
        if type(trigger) is KubernetesPodTrigger:
            # without the kubeconfig the provider read (its token) and the connection's extras
            trigger = TrainingPodTrigger.of(
                trigger,
                self.config_file,
                stage_in_timeout=self.stage_in_timeout_seconds,
                unschedulable_grace=self.unschedulable_grace_seconds,
                stage_in_container=pod_spec.STAGE_IN_CONTAINER,
                log_containers=self.log_containers,
                gpu_resource=self._gpu_resource(),
                queue_timeout=self._queue_timeout(),
                queue_log_interval=self.queue_log_interval_seconds,
            )
        super().defer(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)

    def _push_disruptions(self, context: Context | None) -> None:
        """XCom ``disruptions``: this try's interruptions and the time its pods waited in the queue."""
        if context is not None:
            context["ti"].xcom_push(key=DISRUPTIONS_XCOM_KEY, value=self._disruptions.xcom_value())

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> Any:
        self._startup_failure = failure_from_event(event)
        self._disruptions.interruptions = list(event.get(INTERRUPTIONS_KEY) or [])
        if event.get(QUEUED_KEY) is not None:
            self._disruptions.pod_queued_s = float(event[QUEUED_KEY])
        # the notes of earlier pods of this try (interruptions) come back in the event, then this pod's
        self._notes = [str(note) for note in event.get(NOTES_KEY) or []]
        # The trigger read every container's log to its end: reading the training container's
        # log again from the last interval would repeat its last lines.
        get_logs = self.get_logs
        if event.get(LOGS_FLUSHED_KEY):
            self.get_logs = False
        try:
            return super().trigger_reentry(context, event)
        except (PodInterrupted, PodNotFoundException) as exc:
            if isinstance(exc, PodNotFoundException) and event.get("status") == "success":
                # the trigger saw the training container exit 0 before the pod went: it finished
                self.log.warning(
                    "pod %s was deleted after its training container finished (exit 0): taken as finished",
                    event.get("name"),
                )
                return None
            if isinstance(exc, PodNotFoundException):  # gone already: the trigger saw why, if it could
                reason = event.get(INTERRUPTED_KEY) or "deleted"
                exc = PodInterrupted(f"pod {event.get('name')}: {reason}")
            self._replace_interrupted(context, exc, event.get("name"), event.get(INTERRUPTED_EXIT_KEY))
            self.get_logs = get_logs
            return self.execute(context)  # a new pod: defers again
        except AirflowException as exc:
            if event.get(INTERRUPTED_KEY) and self.pod is None and not isinstance(exc, STARTUP_FAILURES):
                # The trigger saw the pod ended from outside, and it was gone (deleted by Kueue or a drain)
                # before the base class's wait for its completion: that wait forgot the pod, so the cleanup
                # that tells an interruption from a failure never ran, and "Container state failed" is not
                # this task's failure.
                interrupted = PodInterrupted(f"pod {event.get('name')}: {event[INTERRUPTED_KEY]}")
                self._replace_interrupted(
                    context, interrupted, event.get("name"), event.get(INTERRUPTED_EXIT_KEY)
                )
                self.get_logs = get_logs
                return self.execute(context)  # a new pod: defers again
            if self._startup_failure is None or isinstance(exc, STARTUP_FAILURES):
                raise
            raise self._startup_failure from exc
        finally:
            self.get_logs = get_logs

    def cleanup(
        self,
        pod: k8s.V1Pod,
        remote_pod: k8s.V1Pod,
        xcom_result: dict | None = None,
        context: Context | None = None,
    ) -> None:
        if context is not None:
            context["ti"].xcom_push(key=NOTES_XCOM_KEY, value=list(self._notes))
            self._push_disruptions(context)
        if not self.deferrable and self.get_logs and remote_pod is not None:
            self._log_sidecar_lines(remote_pod)
        # A training container that exited 0 finished its training, whatever happens to its pod next: a
        # preemption or a drain that deletes the pod afterwards (read again below: gone, or marked with
        # a DisruptionTarget) does not make it an interruption to run again.
        finished = exit_code(remote_pod, self.base_container_name) == 0
        if self._startup_failure is None and not self._killed and remote_pod is not None and not finished:
            # the pod as it is now: a task that waited in the worker holds an older copy, and a pod
            # deleted meanwhile is gone (a pod never created has no remote_pod and is not read)
            try:
                remote_pod = self.pod_manager.read_pod(remote_pod)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                remote_pod = None
            end = pod_end(remote_pod, self.base_container_name)
            if end.interrupted:
                # the base class deletes (or marks as checked) the old pod; its "returned a failure" is
                # not this task's failure
                with contextlib.suppress(AirflowException):
                    super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)
                name = remote_pod.metadata.name if remote_pod is not None else pod.metadata.name
                raise PodInterrupted(f"pod {name}: {end.reason}", end.exit_code)
        # The base class deletes the pod that never started and fails with "Pod ... returned a
        # failure"; the start-up failure says why, and its class says whether to retry.
        try:
            super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)
        except AirflowException as exc:
            if isinstance(exc, STARTUP_FAILURES):
                raise
            if self._startup_failure is not None:
                raise self._startup_failure from exc
            end = pod_end(remote_pod, self.base_container_name)
            if end.action is not Action.FAIL:
                raise
            raise AirflowFailException(
                f"the {self.base_container_name} container of pod {remote_pod.metadata.name} exited with "
                f"{end.exit_code}: {end.reason}; not retried, a retry would fail the same way "
                "(its last lines are in the log above)"
            ) from exc

    def _log_sidecar_lines(self, remote_pod: k8s.V1Pod) -> None:
        """Log the lines of the containers that ran beside the training container (a task that did not defer).

        The base class follows only the training container's log while the pod runs; the
        checkpoint-sync sidecar's lines (uploads, its final pass, an early stop) are read once
        the pod has ended, before it is deleted.
        """
        init = self.init_container_logs  # the provider's: a name, names, or True for every init container
        if init is True:
            return  # the sidecar, a native sidecar, is an init container: its lines were followed already
        followed = {self.base_container_name, *([init] if isinstance(init, str) else init or ())}
        self.pod_manager.log_containers_once(
            remote_pod,
            [name for name in self.log_containers if name not in followed],
            container_name_log_prefix_enabled=self.container_name_log_prefix_enabled,
            log_formatter=self.log_formatter,
        )
