"""What an ended training pod means, one row per case: kubetrain.operators.interruption.pod_end.

The same policy serves a single run's pod, a sweep trial's and a replica's: the training container's
exit code is read in one place and judged against the contract's table of exit codes.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from kubetrain.operators.interruption import (
    NO_RETRY_EXIT_CODES,
    Action,
    Outcome,
    TryDisruptions,
    exit_code,
    final_failure,
    interruption,
    pod_end,
)
from kubetrain_contract import exit_codes

NOW = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)


def container(name: str, code: int | None) -> k8s.V1ContainerStatus:
    state = (
        k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at=NOW))
        if code is None
        else k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=code))
    )
    return k8s.V1ContainerStatus(
        name=name, image="i", image_id="i", ready=code is None, restart_count=0, state=state
    )


def pod(
    code: int | None = None,
    phase: str = "Running",
    condition: tuple[str, str] | None = None,
    reason: str | None = None,
    message: str | None = None,
    deleted: bool = False,
) -> k8s.V1Pod:
    """A training pod: its base container running (``code`` None) or ended with ``code``, a condition
    ``(type, reason)`` set to True, the pod's own ``reason``, and a deletion in progress."""
    conditions = [k8s.V1PodCondition(type="PodScheduled", status="True")]
    if condition is not None:
        conditions.append(
            k8s.V1PodCondition(type=condition[0], status="True", reason=condition[1], message=message)
        )
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="train-x", namespace="ml", deletion_timestamp=NOW if deleted else None
        ),
        status=k8s.V1PodStatus(
            phase=phase,
            reason=reason,
            message=message if condition is None else None,
            conditions=conditions,
            init_container_statuses=[container("stage-in", 0), container("checkpoint-sync", None)],
            container_statuses=[container("base", code)],
        ),
    )


def untrue(remote: k8s.V1Pod) -> k8s.V1Pod:
    """The pod with its conditions set to False (a disruption the control plane called off)."""
    for condition in remote.status.conditions:
        condition.status = "False"
    return remote


PREEMPTED_BY_SCHEDULER = ("DisruptionTarget", "PreemptionByScheduler")
PREEMPTED_BY_KUEUE = ("TerminationTarget", "WorkloadEvictedDueToPreempted")
DRAINED = ("DisruptionTarget", "EvictionByEvictionAPI")
TAINTED = ("DisruptionTarget", "DeletionByTaintManager")

CASES = [
    # (id, pod, outcome, action, exit code, reason)
    ("running", pod(), Outcome.RUNNING, Action.WAIT, None, None),
    ("finished", pod(0, "Succeeded"), Outcome.FINISHED, Action.DONE, 0, None),
    ("finished-sidecar-flushing", pod(0, "Running"), Outcome.FINISHED, Action.DONE, 0, None),
    (
        "finished-then-preempted",
        pod(0, "Failed", PREEMPTED_BY_SCHEDULER),
        Outcome.FINISHED,
        Action.DONE,
        0,
        None,
    ),
    ("finished-then-deleted", pod(0, "Running", deleted=True), Outcome.FINISHED, Action.DONE, 0, None),
    (
        "preempted-by-scheduler",
        pod(143, "Failed", PREEMPTED_BY_SCHEDULER, message="preempted by a higher priority pod"),
        Outcome.PREEMPTED,
        Action.REPLACE,
        143,
        "DisruptionTarget: PreemptionByScheduler: preempted by a higher priority pod",
    ),
    (
        "preempted-by-kueue-checkpointed",
        pod(exit_codes.EXIT_PREEMPTED, "Failed", PREEMPTED_BY_KUEUE),
        Outcome.PREEMPTED,
        Action.REPLACE,
        75,
        "TerminationTarget: WorkloadEvictedDueToPreempted",
    ),
    (
        "preempted-still-running",
        pod(None, "Running", PREEMPTED_BY_KUEUE),
        Outcome.PREEMPTED,
        Action.REPLACE,
        None,
        "TerminationTarget: WorkloadEvictedDueToPreempted",
    ),
    (
        "drained",
        pod(75, "Failed", DRAINED),
        Outcome.EVICTED,
        Action.REPLACE,
        75,
        "DisruptionTarget: EvictionByEvictionAPI",
    ),
    (
        "tainted-node",
        pod(137, "Failed", TAINTED),
        Outcome.EVICTED,
        Action.REPLACE,
        137,
        "DisruptionTarget: DeletionByTaintManager",
    ),
    (
        "kubelet-eviction",
        pod(137, "Failed", reason="Evicted", message="The node was low on resource: memory."),
        Outcome.EVICTED,
        Action.REPLACE,
        137,
        "Evicted: The node was low on resource: memory.",
    ),
    ("condition-not-true", untrue(pod(1, "Failed", DRAINED)), Outcome.FAILED, Action.RETRY, 1, None),
    (
        "deleted-while-running",
        pod(None, "Running", deleted=True),
        Outcome.DELETED,
        Action.REPLACE,
        None,
        "deleted",
    ),
    (
        "deleted-after-a-failure",
        pod(2, "Failed", deleted=True),
        Outcome.DELETED,
        Action.REPLACE,
        2,
        "deleted",
    ),
    ("gone", None, Outcome.DELETED, Action.REPLACE, None, "deleted"),
    ("unexpected-error", pod(1, "Failed"), Outcome.FAILED, Action.RETRY, 1, None),
    ("sigterm-checkpointed-no-condition", pod(75, "Failed"), Outcome.FAILED, Action.RETRY, 75, None),
    ("stopped-by-stop-file", pod(79, "Failed"), Outcome.FAILED, Action.RETRY, 79, None),
    ("oom-killed", pod(137, "Failed"), Outcome.FAILED, Action.RETRY, 137, None),
    ("pod-failed-without-a-status", pod(None, "Failed"), Outcome.FAILED, Action.RETRY, None, None),
    *[
        (f"final-{code}", pod(code, "Failed"), Outcome.FAILED, Action.FAIL, code, NO_RETRY_EXIT_CODES[code])
        for code in (
            exit_codes.EXIT_USAGE,
            exit_codes.EXIT_DIVERGED,
            exit_codes.EXIT_DATAERR,
            exit_codes.EXIT_NOINPUT,
        )
    ],
]


@pytest.mark.parametrize(
    ("remote", "outcome", "action", "code", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_what_an_ended_pod_means(remote, outcome, action, code, reason):
    end = pod_end(remote, "base")
    assert (end.outcome, end.action, end.exit_code, end.reason) == (outcome, action, code, reason)
    assert end.interrupted is (action is Action.REPLACE)
    assert interruption(remote, "base") == (reason if end.interrupted else None)


@pytest.mark.parametrize(
    ("remote", "outcome", "action", "code", "reason"),
    [c[1:] for c in CASES if c[1]],
    ids=[c[0] for c in CASES if c[1]],
)
def test_the_apis_json_means_the_same_as_the_model(remote, outcome, action, code, reason):
    """The pod as the API's JSON (camelCase keys), as a trigger's event or a stored record may carry it."""
    document = ApiClient().sanitize_for_serialization(remote)
    end = pod_end(document, "base")
    assert (end.outcome, end.action, end.exit_code, end.reason) == (outcome, action, code, reason)


def test_the_exit_code_is_read_from_any_container_and_from_the_status_alone():
    remote = pod(65, "Failed")
    assert exit_code(remote, "base") == 65
    assert exit_code(remote, "stage-in") == 0  # an init container's, as a trial's record keeps them
    assert exit_code(remote, "checkpoint-sync") is None  # still running
    assert exit_code(remote, "no-such-container") is None
    assert exit_code(remote.status, "base") == 65
    assert exit_code(None, "base") is None
    assert (
        exit_code(
            {"status": {"containerStatuses": [{"name": "base", "state": {"terminated": {"exitCode": 3}}}]}},
            "base",
        )
        == 3
    )


def test_final_exit_codes_are_the_contracts_table():
    """Each exit code of kubetrain_contract.exit_codes: final exactly when its retry is False (0 is a success)."""
    for entry in exit_codes.EXIT_CODES:
        assert (final_failure(entry.code) is not None) is (entry.code != 0 and not entry.retry), entry
        if final_failure(entry.code) is not None:
            assert final_failure(entry.code) == entry.meaning
    assert final_failure(None) is None
    assert final_failure(137) is None  # a signal: retried


def test_a_try_counts_its_interruptions_and_the_time_its_pods_queued():
    disruptions = TryDisruptions(max_preemptions=1)
    assert disruptions.xcom_value() == {"interruptions": [], "queued_s": 0.0}
    disruptions.pod_queued_s = 12.5
    assert disruptions.record("train-a", "DisruptionTarget: PreemptionByScheduler", 75, NOW) == 1
    assert disruptions.pod_queued_s is None  # the next pod's wait is its own
    assert not disruptions.exhausted
    disruptions.pod_queued_s = 2.0
    assert disruptions.xcom_value() == {
        "interruptions": [
            {
                "pod": "train-a",
                "reason": "DisruptionTarget: PreemptionByScheduler",
                "at": "2026-11-29T09:00:00+00:00",
                "queued_s": 12.5,
                "exit_code": 75,
            }
        ],
        "queued_s": 14.5,
    }
    assert disruptions.record("train-b", "deleted", None, NOW) == 2
    assert disruptions.exhausted  # one more than max_preemptions: the task fails
