"""A pod that Kueue holds is queued, not starting: its wait is bounded by queue_timeout alone, the
scheduling budget counts from its admission, and the task log says why it waits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from kubernetes.client import models as k8s

from kubetrain.operators.interruption import interruption
from kubetrain.pod_startup import (
    KUEUE_GATE,
    PodStartup,
    PodStartupTimeout,
    QueueRefused,
    QueueTimeout,
    failure_from_event,
    failure_kind,
    queue_message,
    queue_refusal,
    queued,
)

T0 = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def startup(**budgets) -> PodStartup:
    values = {
        "schedule_timeout": 60,
        "unschedulable_grace": 30,
        "startup_timeout": 60,
        "stage_in_timeout": 600,
        "queue_timeout": 3600,
    }
    return PodStartup(**{**values, **budgets})


def pod(
    *,
    gated: bool,
    scheduled: tuple[str, str] | None = None,
    bound_at: float | None = None,
    managed: bool = False,
    phase: str = "Pending",
) -> k8s.V1Pod:
    conditions = None
    if scheduled is not None:
        status, reason = scheduled
        moved = at(bound_at) if bound_at is not None else None
        conditions = [
            k8s.V1PodCondition(type="PodScheduled", status=status, reason=reason, last_transition_time=moved)
        ]
    labels = {"kueue.x-k8s.io/queue-name": "training"}
    if managed:
        labels["kueue.x-k8s.io/managed"] = "true"
    gates = [k8s.V1PodSchedulingGate(name=KUEUE_GATE)] if gated else None
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="train-abc",
            uid="u-1",
            creation_timestamp=T0,
            labels=labels,
        ),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base")], scheduling_gates=gates),
        status=k8s.V1PodStatus(phase=phase, conditions=conditions),
    )


def test_a_queued_pod_outwaits_every_start_up_budget():
    judge = startup()
    held = pod(gated=True, scheduled=("False", "SchedulingGated"))
    assert queued(held)
    for seconds in (1, 600, 3599):
        assert judge.observe(held, [], at(seconds)) is False
    assert judge.queued_s == 3599


def test_the_time_queued_ends_where_the_scheduler_bound_the_admitted_pod():
    judge = startup()
    judge.observe(pod(gated=True, managed=True), [], at(3))
    assert judge.queued_s == 3
    bound = pod(gated=False, managed=True, scheduled=("True", None), bound_at=50, phase="Running")
    assert judge.observe(bound, [], at(55)) is True
    assert judge.queued_s == 50


def test_a_wait_seen_gated_is_not_lost_to_whole_second_timestamps():
    # gated when looked at 0.8 s after its creation; its bind stamped in its creation's second
    judge = startup()
    judge.observe(pod(gated=True, managed=True), [], at(0.8))
    bound = pod(gated=False, managed=True, scheduled=("True", None), bound_at=0, phase="Running")
    assert judge.observe(bound, [], at(1.2)) is True
    assert judge.queued_s == pytest.approx(0.8)


def test_a_managed_pod_admitted_between_two_looks_still_counts_its_time_queued():
    # Kueue gated the pod at creation and admitted it before the watcher's first look: the pod's own
    # timestamps say how long it waited
    judge = startup()
    running = pod(gated=False, managed=True, scheduled=("True", None), bound_at=42, phase="Running")
    assert judge.observe(running, [], at(60)) is True
    assert judge.queued_s == 42
    # a pod Kueue does not manage was never queued, however long it took to schedule
    plain = startup()
    assert plain.observe(pod(gated=False, scheduled=("True", None), bound_at=42, phase="Running"), [], at(60))
    assert plain.queued_s is None


def test_queue_timeout_ends_the_wait_without_a_retry():
    judge = startup(queue_timeout=120)
    with pytest.raises(
        QueueTimeout, match=r"not admitted by Kueue within queue_timeout=120 s \(LocalQueue 'training'\)"
    ):
        judge.observe(pod(gated=True), [], at(121))
    event = {"kubetrain_startup": failure_kind(QueueTimeout("x")), "message": "m"}
    assert isinstance(failure_from_event(event), QueueTimeout)


def test_scheduling_counts_from_admission_not_from_creation():
    judge = startup(schedule_timeout=60)
    judge.observe(pod(gated=True), [], at(1000))
    admitted = pod(gated=False)  # no PodScheduled yet: the scheduler is on it
    assert judge.observe(admitted, [], at(1001)) is False
    assert judge.observe(admitted, [], at(1060)) is False  # 59 s after admission, 1060 s after creation
    with pytest.raises(PodStartupTimeout, match="was not scheduled within 60 s"):
        judge.observe(admitted, [], at(1062))


def test_an_unqueued_pod_keeps_its_scheduling_budget_from_creation():
    judge = startup(schedule_timeout=60)
    with pytest.raises(PodStartupTimeout):
        judge.observe(pod(gated=False), [], at(61))


def test_the_queue_line_names_the_workloads_reason_and_the_queue_length():
    workloads = [
        {"metadata": {"name": "other", "ownerReferences": [{"uid": "u-0"}]}},
        {
            "metadata": {"name": "pod-train-abc-1a2b3", "ownerReferences": [{"uid": "u-1"}]},
            "status": {
                "conditions": [
                    {
                        "type": "QuotaReserved",
                        "status": "False",
                        "reason": "Pending",
                        "message": "insufficient unused quota for nvidia.com/gpu in flavor default-flavor, 1 more needed",
                    }
                ]
            },
        },
    ]
    line = queue_message(pod(gated=True), 75.4, workloads, {"status": {"pendingWorkloads": 3}})
    assert line == (
        "pod train-abc is queued in Kueue LocalQueue 'training' for 75 s: Pending: insufficient unused quota "
        "for nvidia.com/gpu in flavor default-flavor, 1 more needed (Workload pod-train-abc-1a2b3); "
        "3 workload(s) pending in the queue"
    )
    assert (
        queue_message(pod(gated=True), 5, [], None)
        == "pod train-abc is queued in Kueue LocalQueue 'training' for 5 s"
    )


def ended(
    *,
    exit_code: int,
    conditions: tuple[tuple[str, str, str], ...] = (),
    deleting: bool = False,
    reason: str = "",
) -> k8s.V1Pod:
    state = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=exit_code))
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="train-abc", deletion_timestamp=T0 if deleting else None),
        status=k8s.V1PodStatus(
            phase="Failed" if exit_code else "Succeeded",
            reason=reason or None,
            message="The node was low on resource: memory." if reason else None,
            conditions=[k8s.V1PodCondition(type=t, status=s, reason=r) for t, s, r in conditions] or None,
            container_statuses=[
                k8s.V1ContainerStatus(
                    name="base", image="i", image_id="", ready=False, restart_count=0, state=state
                )
            ],
        ),
    )


@pytest.mark.parametrize(
    ("remote", "expected"),
    [
        (None, "deleted"),
        (
            ended(exit_code=75, conditions=(("DisruptionTarget", "True", "PreemptionByScheduler"),)),
            "DisruptionTarget: PreemptionByScheduler",
        ),
        (
            ended(exit_code=143, conditions=(("DisruptionTarget", "True", "EvictionByEvictionAPI"),)),
            "DisruptionTarget: EvictionByEvictionAPI",
        ),
        (
            ended(exit_code=137, conditions=(("DisruptionTarget", "True", "DeletionByTaintManager"),)),
            "DisruptionTarget: DeletionByTaintManager",
        ),
        (
            ended(exit_code=75, conditions=(("TerminationTarget", "True", "WorkloadEvictedDueToPreempted"),)),
            "TerminationTarget: WorkloadEvictedDueToPreempted",
        ),
        (ended(exit_code=137, reason="Evicted"), "Evicted: The node was low on resource: memory."),
        (ended(exit_code=75, deleting=True), "deleted"),
        # ended by itself: a failure (retried or not by its exit code), or a finished training
        (ended(exit_code=1), None),
        (ended(exit_code=75, conditions=(("DisruptionTarget", "False", "x"),)), None),
        (ended(exit_code=0, conditions=(("DisruptionTarget", "True", "PreemptionByScheduler"),)), None),
    ],
)
def test_an_interruption_is_told_from_a_failure(remote, expected):
    assert interruption(remote, "base") == expected


# -- a queued pod that Kueue will never admit fails at once, naming the fix (pod_startup.queue_refusal) ------


def _queued_pod(uid: str = "u1") -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="train-1",
            namespace="kubetrain",
            uid=uid,
            labels={"kueue.x-k8s.io/queue-name": "training", "kueue.x-k8s.io/managed": "true"},
        ),
        spec=k8s.V1PodSpec(
            containers=[], scheduling_gates=[k8s.V1PodSchedulingGate(name="kueue.x-k8s.io/admission")]
        ),
    )


def _workload(uid: str, message: str | None) -> dict:
    conditions = [{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}]
    return {
        "metadata": {"name": "pod-train-1-abcde", "ownerReferences": [{"kind": "Pod", "uid": uid}]},
        "status": {"conditions": conditions if message else []},
    }


@pytest.mark.parametrize(
    ("waited", "workloads", "events", "expected"),
    [
        # waiting helps: quota in use, or Kueue not yet at it
        (
            30,
            [
                _workload(
                    "u1",
                    "insufficient unused quota for nvidia.com/gpu in flavor default-flavor, 1 more needed",
                )
            ],
            [],
            None,
        ),
        (30, [], [], None),
        (30, None, [], None),  # the Workloads cannot be read: the queue_timeout bounds the wait
        (600, None, [], None),
        # waiting cannot help
        (
            5,
            [
                _workload(
                    "u1",
                    "couldn't assign flavors to pod set main: insufficient quota for cpu in flavor "
                    "default-flavor, request > maximum capacity (1100m > 1)",
                )
            ],
            [],
            "request > maximum capacity (1100m > 1). Ask for less",
        ),
        (
            5,
            [_workload("u1", "resource ephemeral-storage unavailable in ClusterQueue")],
            [],
            "unavailable in ClusterQueue",
        ),
        (
            5,
            [],
            [
                k8s.CoreV1Event(
                    involved_object=k8s.V1ObjectReference(name="train-1"),
                    metadata=k8s.V1ObjectMeta(name="e"),
                    reason="WorkloadPriorityClassNotFound",
                    message='WorkloadPriorityClass "hihg" not found',
                )
            ],
            'WorkloadPriorityClass "hihg" not found. Create the WorkloadPriorityClass',
        ),
        (
            61,
            [_workload("other", None)],
            [],
            "Kueue made no Workload for pod train-1 (LocalQueue 'training') in 61 s",
        ),
    ],
)
def test_a_queued_pod_fails_only_when_waiting_cannot_help(waited, workloads, events, expected):
    refusal = queue_refusal(_queued_pod(), waited, workloads, events)
    if expected is None:
        assert refusal is None
    else:
        assert isinstance(refusal, QueueRefused) and expected in str(refusal)
        assert failure_kind(refusal) == "queue_refused"  # it travels in a trigger event, not retried
