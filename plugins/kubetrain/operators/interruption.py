"""What an ended training pod means, and whether the task runs it again: one policy for runs, trials and replicas.

A pure function of the pod as last read (a ``kubernetes`` or ``kubernetes_asyncio`` model, or the
API's JSON as a dict; ``None`` once it is gone): :func:`pod_end`. The training container's exit
code is read here and nowhere else (:func:`exit_code`), and which exit codes a retry would only
repeat comes from the contract's table (:mod:`kubetrain_contract.exit_codes`). The cases, one row
each, are the table in tests/plugins/operators/test_interruption_policy.py.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubetrain_contract.exit_codes import final_exit_codes

__all__ = [
    "INTERRUPTION_CONDITIONS",
    "NO_RETRY_EXIT_CODES",
    "Action",
    "Outcome",
    "PodEnd",
    "TryDisruptions",
    "exit_code",
    "final_failure",
    "interruption",
    "pod_end",
    "terminated",
    "terminated_state",
]

# Exit codes of the training container that a retry would only repeat, with their meaning (2 bad
# parameters, 3 diverged, 65 unusable data, 66 DATA_DIR missing); any other failure, 75 (stopped by
# SIGTERM after a checkpoint) included, is retried.
NO_RETRY_EXIT_CODES: dict[int, str] = final_exit_codes()

# The conditions a control plane puts on a pod it ends on purpose: Kubernetes' (reasons
# PreemptionByScheduler, EvictionByEvictionAPI, DeletionByTaintManager, TerminationByKubelet) and
# Kueue's for the plain pods it preempts (WorkloadEvictedDueToPreempted).
INTERRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")


class Outcome(enum.StrEnum):
    """How the pod ended."""

    RUNNING = "running"  # the training container has not ended and nothing ended the pod
    FINISHED = "finished"  # the training container exited 0, whatever happened to the pod afterwards
    PREEMPTED = "preempted"  # a scheduler or Kueue made room for other work
    EVICTED = "evicted"  # the Eviction API (a drain), a taint or the kubelet's node pressure
    DELETED = "deleted"  # deleted, or gone, with no condition saying why
    FAILED = "failed"  # the training container (or the pod) failed by itself


class Action(enum.StrEnum):
    """What the task does about it."""

    WAIT = "wait"  # the pod still runs
    DONE = "done"  # success
    REPLACE = "replace"  # a new pod in the same try resumes from the last checkpoint; no retry used
    RETRY = "retry"  # fail the try; Airflow's retries apply
    FAIL = "fail"  # fail without retries: a retry would end the same


@dataclass(frozen=True)
class PodEnd:
    """What the pod's end means: its outcome, the training container's exit code and why.

    :param outcome: how the pod ended.
    :param exit_code: the training container's exit code, when it had terminated.
    :param reason: why the pod was ended from outside, or what a final exit code means; None otherwise.
    """

    outcome: Outcome
    exit_code: int | None = None
    reason: str | None = None

    @property
    def interrupted(self) -> bool:
        """Ended from outside before its training finished: resumed in a new pod."""
        return self.outcome in (Outcome.PREEMPTED, Outcome.EVICTED, Outcome.DELETED)

    @property
    def action(self) -> Action:
        if self.outcome is Outcome.RUNNING:
            return Action.WAIT
        if self.outcome is Outcome.FINISHED:
            return Action.DONE
        if self.interrupted:
            return Action.REPLACE
        return Action.FAIL if final_failure(self.exit_code) is not None else Action.RETRY


def _field(obj: Any, snake: str, camel: str | None = None) -> Any:
    """A field of an API model (snake_case attribute) or of the API's JSON (camelCase key)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(camel or snake, obj.get(snake))
    return getattr(obj, snake, None)


def terminated_state(container_status: Any) -> Any:
    """The ``terminated`` state of one container status (model or dict), or None while it has not ended."""
    return _field(_field(container_status, "state"), "terminated")


def terminated(pod: Any, container: str) -> Any:
    """The ``terminated`` state of ``container`` (its exit code, reason, finish), or None while it has not ended.

    :param pod: the pod (a model or the API's JSON), or its ``status``; None when it is gone.
    :param container: the container's name (``base`` for the training container; an init container's too).
    """
    status = _field(pod, "status")
    if status is None and _field(pod, "phase") is not None:
        status = pod  # given the status itself
    states = [
        *(_field(status, "container_statuses", "containerStatuses") or []),
        *(_field(status, "init_container_statuses", "initContainerStatuses") or []),
    ]
    for state in states:
        if _field(state, "name") == container:
            return terminated_state(state)
    return None


def exit_code(pod: Any, container: str) -> int | None:
    """The exit code of ``container`` once it has terminated, else None (still running, or the pod is gone).

    :param pod: the pod (a model or the API's JSON), or its ``status``; None when it is gone.
    :param container: the container's name (``base`` for the training container; an init container's too).
    """
    return _field(terminated(pod, container), "exit_code", "exitCode")


def final_failure(code: int | None) -> str | None:
    """What the exit code means when a retry would only repeat the failure, else None (retry, or not a failure)."""
    return NO_RETRY_EXIT_CODES.get(code) if code is not None else None


def _interrupting_condition(pod: Any) -> tuple[Outcome, str] | None:
    status = _field(pod, "status")
    for condition in _field(status, "conditions") or []:
        kind = _field(condition, "type")
        if kind in INTERRUPTION_CONDITIONS and _field(condition, "status") == "True":
            why, message = _field(condition, "reason"), _field(condition, "message")
            text = f"{kind}: {why or '?'}" + (f": {message}" if message else "")
            return (Outcome.PREEMPTED if "preempt" in (why or "").lower() else Outcome.EVICTED), text
    if _field(status, "reason") == "Evicted":
        return Outcome.EVICTED, f"Evicted: {_field(status, 'message') or ''}".rstrip(": ")
    if _field(_field(pod, "metadata"), "deletion_timestamp", "deletionTimestamp") is not None:
        return Outcome.DELETED, "deleted"
    return None


def pod_end(pod: Any, base_container: str = "base") -> PodEnd:
    """What the pod's state means for the task (the table of cases: test_interruption_policy.py).

    A training container that exited 0 finished its training, whatever happens to its pod next (a
    preemption or a drain that deletes it afterwards). Otherwise a pod ended from outside
    (a DisruptionTarget or Kueue's TerminationTarget condition, kubelet eviction, deletion, or gone)
    is an interruption, whatever its training container's exit code; a training container that
    ended by itself failed, finally when its exit code says a retry would fail the same way.

    :param pod: the pod as last read (a model or the API's JSON); None when it is gone.
    :param base_container: the training container.
    """
    if pod is None:
        return PodEnd(Outcome.DELETED, None, "deleted")
    code = exit_code(pod, base_container)
    if code == 0:
        return PodEnd(Outcome.FINISHED, 0)
    found = _interrupting_condition(pod)
    if found is not None:
        return PodEnd(found[0], code, found[1])
    if code is not None or _field(_field(pod, "status"), "phase") == "Failed":
        return PodEnd(Outcome.FAILED, code, final_failure(code))
    if _field(_field(pod, "status"), "phase") == "Succeeded":
        return PodEnd(Outcome.FINISHED, code)
    return PodEnd(Outcome.RUNNING, code)


def interruption(pod: Any, base_container: str) -> str | None:
    """Why the pod was ended from outside, or None when it ended by itself (or finished its training).

    :param pod: the pod as last read; None when it is gone.
    :param base_container: the training container, whose exit code 0 means the training finished.
    """
    end = pod_end(pod, base_container)
    return end.reason if end.interrupted else None


@dataclass
class TryDisruptions:
    """The interruptions of one try so far, and the time its pods waited for Kueue's admission.

    :param max_preemptions: pods of the try that may be ended from outside and replaced.
    :param interruptions: ``{"pod", "reason", "at", "queued_s", "exit_code"}`` for each replaced pod.
    :param pod_queued_s: seconds the current pod waited for admission (None: it never queued).
    """

    max_preemptions: int
    interruptions: list[dict[str, Any]] = field(default_factory=list)
    pod_queued_s: float | None = None

    def record(self, pod: str | None, reason: str, code: int | None, at: datetime) -> int:
        """Count the current pod's interruption; the number of interruptions of the try so far."""
        self.interruptions.append(
            {
                "pod": pod,
                "reason": reason,
                "at": at.isoformat(),
                "queued_s": self.pod_queued_s,
                "exit_code": code,
            }
        )
        self.pod_queued_s = None
        return len(self.interruptions)

    @property
    def exhausted(self) -> bool:
        """More interruptions than ``max_preemptions``: the task fails instead of submitting another pod."""
        return len(self.interruptions) > self.max_preemptions

    def xcom_value(self) -> dict[str, Any]:
        """XCom ``disruptions``: the interruptions, and the seconds all the try's pods waited in the queue."""
        queued = sum(float(i.get("queued_s") or 0.0) for i in self.interruptions) + (self.pod_queued_s or 0.0)
        return {"interruptions": list(self.interruptions), "queued_s": round(queued, 3)}
