"""The KubernetesPodOperator behind TrainingPodOperator, built only when the task runs.

Importing the cncf-kubernetes operator loads the ``kubernetes`` and ``kubernetes_asyncio``
clients (about three seconds on a small machine); a DAG file that only declares a training
task must not pay that at parse time, so this module is imported from the task's
``execute``, never from a DAG file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowException

from kubetrain import pod_spec
from kubetrain.operators.training import PodUnschedulableError, scheduling_problem, string_list

if TYPE_CHECKING:
    from airflow.sdk import Context
    from kubernetes.client import models as k8s

    from kubetrain.operators.training import TrainingPodOperator


class TrainingPod(KubernetesPodOperator):
    """Run the pod of one :class:`~kubetrain.operators.training.TrainingPodOperator` task.

    :param training: the task, its template fields already rendered; the pod's contract
        parts come from its :meth:`~kubetrain.operators.training.TrainingPodOperator.pod_config`.
    :param kwargs: KubernetesPodOperator arguments.
    """

    def __init__(self, *, training: TrainingPodOperator, **kwargs: Any) -> None:
        super().__init__(task_id=training.task_id, **kwargs)
        self.training = training

    @property
    def dag_id(self) -> str:
        return self.training.dag_id

    def build_pod_request_obj(self, context: Context | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        # The base class puts cmds/arguments on the container as they are: lists, never the
        # JSON text an array Param renders to.
        self.cmds = string_list("cmds", self.cmds) or []
        self.arguments = string_list("arguments", self.arguments) or []
        config = self.training.pod_config(context)
        # The contract pod is the template; the base class adds its name, namespace, task
        # labels and any extra env/volumes/secrets passed to the operator.
        self.full_pod_spec = pod_spec.training_pod(config)
        self.termination_grace_period = config.termination_grace_period
        if context is not None:
            context["ti"].xcom_push(key="run_uri", value=config.run_uri)
        self.log.info("Training pod: image %s, run %s, %d GPU(s)", config.image, config.run_uri, config.gpus)
        return super().build_pod_request_obj(context, dry_run=dry_run)

    def cleanup(
        self,
        pod: k8s.V1Pod,
        remote_pod: k8s.V1Pod,
        xcom_result: dict | None = None,
        context: Context | None = None,
    ) -> None:
        # The base class fails a never-scheduled pod with "took too long to be scheduled ...
        # check the pod events"; read the scheduler's reason before the pod is deleted so the
        # task error says what is missing (e.g. "Insufficient nvidia.com/gpu").
        problem = None
        last_phase = getattr(getattr(remote_pod, "status", None), "phase", None)
        if not self._killed and remote_pod is not None and last_phase in (None, "Pending"):
            problem = self._scheduling_problem(pod or remote_pod)
        try:
            super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)
        except AirflowException as exc:
            if problem:
                name = (pod or remote_pod).metadata.name
                raise PodUnschedulableError(
                    f"Pod {name} was not scheduled within {self.schedule_timeout_seconds} s: {problem}"
                ) from exc
            raise

    def _scheduling_problem(self, pod: k8s.V1Pod) -> str | None:
        try:
            current = self.pod_manager.read_pod(pod)
            if current.status is None or current.status.phase != "Pending":
                return None
            events = self.pod_manager.read_pod_events(pod).items or []
        except Exception as exc:  # the original failure matters more than this diagnosis
            self.log.warning("Could not read the events of pod %s: %s", pod.metadata.name, exc)
            return None
        return scheduling_problem(current, events)
