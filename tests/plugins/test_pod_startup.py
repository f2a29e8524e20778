"""PodStartup: each start-up phase of a training pod has its own budget, and failures have classes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from airflow.sdk.exceptions import AirflowFailException
from kubernetes.client import models as k8s

from kubetrain.pod_startup import (
    EVENT_KEY,
    ImagePullError,
    PodStartup,
    PodStartupTimeout,
    PodUnschedulableError,
    StageInError,
    failure_from_event,
    failure_kind,
    gpu_served_on_cpu,
)

T0 = datetime(2026, 11, 22, 4, 0, tzinfo=UTC)
NO_GPU = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def startup(**budgets) -> PodStartup:
    values = {
        "schedule_timeout": 600,
        "unschedulable_grace": 30,
        "startup_timeout": 120,
        "stage_in_timeout": 3600,
    }
    return PodStartup(**{**values, **budgets})


def waiting(name: str, reason: str, message: str = "") -> k8s.V1ContainerStatus:
    state = k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason=reason, message=message))
    return k8s.V1ContainerStatus(name=name, image="i", image_id="", ready=False, restart_count=0, state=state)


def running(name: str, since: float) -> k8s.V1ContainerStatus:
    state = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at=at(since)))
    return k8s.V1ContainerStatus(name=name, image="i", image_id="", ready=True, restart_count=0, state=state)


def terminated(name: str, code: int, since: float, message: str = "") -> k8s.V1ContainerStatus:
    state = k8s.V1ContainerState(
        terminated=k8s.V1ContainerStateTerminated(
            exit_code=code, finished_at=at(since), message=message or None
        )
    )
    return k8s.V1ContainerStatus(name=name, image="i", image_id="", ready=False, restart_count=0, state=state)


def pod(phase="Pending", scheduled=None, init=(), containers=()) -> k8s.V1Pod:
    conditions = []
    if scheduled is not None:
        status, when, reason, message = scheduled
        conditions.append(
            k8s.V1PodCondition(
                type="PodScheduled",
                status=status,
                reason=reason,
                message=message,
                last_transition_time=at(when),
            )
        )
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="train-abc", creation_timestamp=T0),
        status=k8s.V1PodStatus(
            phase=phase,
            conditions=conditions or None,
            init_container_statuses=list(init) or None,
            container_statuses=list(containers) or None,
        ),
    )


def event(reason: str, message: str = "") -> k8s.CoreV1Event:
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(name="e"),
        involved_object=k8s.V1ObjectReference(),
        reason=reason,
        message=message,
    )


UNSCHEDULABLE = ("False", 0, "Unschedulable", NO_GPU)
SCHEDULED = ("True", 5, None, None)


@pytest.mark.parametrize(
    ("observed", "events", "now", "expected"),
    [
        # scheduling
        (pod(), [], 10, False),
        (pod(scheduled=UNSCHEDULABLE), [event("FailedScheduling", NO_GPU)], 10, False),
        (pod(scheduled=UNSCHEDULABLE), [event("FailedScheduling", NO_GPU)], 31, PodUnschedulableError),
        # an autoscaler is adding a node: wait up to the schedule timeout
        (
            pod(scheduled=UNSCHEDULABLE),
            [event("FailedScheduling", NO_GPU), event("TriggeredScaleUp")],
            300,
            False,
        ),
        (pod(scheduled=UNSCHEDULABLE), [event("TriggeredScaleUp")], 601, PodUnschedulableError),
        (pod(), [], 601, PodStartupTimeout),
        # pulling the sync image: the start-up budget counts from scheduling
        (pod(scheduled=SCHEDULED, init=[waiting("stage-in", "ContainerCreating")]), [], 120, False),
        (
            pod(scheduled=SCHEDULED, init=[waiting("stage-in", "ContainerCreating")]),
            [],
            126,
            PodStartupTimeout,
        ),
        (
            pod(scheduled=SCHEDULED, init=[waiting("stage-in", "ImagePullBackOff", "not found")]),
            [],
            126,
            ImagePullError,
        ),
        (pod(scheduled=SCHEDULED, init=[waiting("stage-in", "InvalidImageName")]), [], 6, ImagePullError),
        (
            pod(
                scheduled=SCHEDULED,
                init=[waiting("stage-in", "CreateContainerConfigError", "secret not found")],
            ),
            [],
            6,
            ImagePullError,
        ),
        # staging the dataset: its own, longer budget
        (pod(scheduled=SCHEDULED, init=[running("stage-in", 60)]), [], 1800, False),
        (pod(scheduled=SCHEDULED, init=[running("stage-in", 60)]), [], 3661, StageInError),
        (pod(scheduled=SCHEDULED, init=[terminated("stage-in", 2, 70, "no such key")]), [], 71, StageInError),
        (pod("Failed", scheduled=SCHEDULED, init=[terminated("stage-in", 1, 70)]), [], 71, StageInError),
        # then the training image: the start-up budget again, from the end of the stage-in
        (
            pod(
                scheduled=SCHEDULED,
                init=[terminated("stage-in", 0, 2000)],
                containers=[waiting("base", "ContainerCreating")],
            ),
            [],
            2100,
            False,
        ),
        (
            pod(
                scheduled=SCHEDULED,
                init=[terminated("stage-in", 0, 2000)],
                containers=[waiting("base", "ErrImagePull")],
            ),
            [],
            2121,
            ImagePullError,
        ),
        # running
        (pod("Running", scheduled=SCHEDULED, init=[terminated("stage-in", 0, 70)]), [], 80, True),
        (pod("Succeeded", scheduled=SCHEDULED), [], 80, True),
    ],
)
def test_phases(observed, events, now, expected):
    judge = startup()
    if isinstance(expected, bool):
        assert judge.observe(observed, events, at(now)) is expected
    else:
        with pytest.raises(expected) as info:
            judge.observe(observed, events, at(now))
        assert type(info.value) is expected
        assert "train-abc" in str(info.value)


def test_unschedulable_fails_without_retries_naming_the_scheduler_reason():
    with pytest.raises(
        PodUnschedulableError, match=r"FailedScheduling: 0/3 nodes .*Insufficient nvidia\.com/gpu"
    ) as info:
        startup().observe(pod(scheduled=UNSCHEDULABLE), [event("FailedScheduling", NO_GPU)], at(45))
    assert isinstance(info.value, AirflowFailException)


def test_pull_timeout_names_the_waiting_container():
    observed = pod(
        scheduled=SCHEDULED, init=[waiting("stage-in", "ImagePullBackOff", 'Back-off pulling image "r/s:1"')]
    )
    with pytest.raises(
        ImagePullError, match=r"stage-in is ImagePullBackOff: Back-off pulling image \"r/s:1\""
    ):
        startup().observe(observed, [], at(200))


def test_without_timestamps_the_clock_starts_when_first_seen():
    observed = pod(scheduled=SCHEDULED, init=[running("stage-in", 0)])
    observed.status.init_container_statuses[0].state.running.started_at = None
    judge = startup(stage_in_timeout=100)
    assert judge.observe(observed, [], at(5000)) is False  # first sight: the clock starts now
    with pytest.raises(StageInError):
        judge.observe(observed, [], at(5101))


def test_failures_travel_in_trigger_events_by_class():
    for failure in (
        PodUnschedulableError("a"),
        ImagePullError("b"),
        StageInError("c"),
        PodStartupTimeout("d"),
    ):
        event_payload = {"status": "timeout", "message": str(failure), EVENT_KEY: failure_kind(failure)}
        back = failure_from_event(event_payload)
        assert type(back) is type(failure) and str(back) == str(failure)
    assert failure_from_event({"status": "success"}) is None
    with pytest.raises(ValueError, match="unknown pod start-up failure 'gone'"):
        failure_from_event({EVENT_KEY: "gone"})


@pytest.mark.parametrize(
    "name", ["schedule_timeout", "unschedulable_grace", "startup_timeout", "stage_in_timeout"]
)
def test_budgets_must_be_positive(name):
    with pytest.raises(ValueError, match=f"{name}=0 is not valid"):
        startup(**{name: 0})


# -- a GPU request served on CPU ---------------------------------------------------------------


def gpu_pod(gpus: int, resource: str = "nvidia.com/gpu") -> k8s.V1Pod:
    limits = {"cpu": "1", **({resource: str(gpus)} if gpus else {})}
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="train-abc"),
        spec=k8s.V1PodSpec(
            node_name="node-1",
            containers=[
                k8s.V1Container(
                    name="base", resources=k8s.V1ResourceRequirements(limits=limits, requests=limits)
                )
            ],
        ),
    )


def node(**capacity: str) -> k8s.V1Node:
    capacity = {"cpu": "2", "memory": "8Gi", **{k.replace("_", "."): v for k, v in capacity.items()}}
    return k8s.V1Node(metadata=k8s.V1ObjectMeta(name="node-1"), status=k8s.V1NodeStatus(capacity=capacity))


@pytest.mark.parametrize(
    ("observed", "events", "on_node", "expected"),
    [
        (gpu_pod(1), [], node(), "node node-1 has none (its capacity lists no nvidia.com/gpu)"),
        (
            gpu_pod(2),
            [event("GPUNotAvailable", "0 free")],
            None,
            "node node-1 gave it none (event GPUNotAvailable)",
        ),
        (gpu_pod(1), [event("Scheduled")], None, None),  # no node to read, no event: nothing is said
        (gpu_pod(1), [], k8s.V1Node(status=k8s.V1NodeStatus(capacity={"nvidia.com/gpu": "4"})), None),
        (gpu_pod(0), [event("GPUNotAvailable")], node(), None),  # no GPU asked for
        (gpu_pod(1, "amd.com/gpu"), [], node(), None),  # another resource than the one GPUs are requested as
    ],
)
def test_gpu_served_on_cpu(observed, events, on_node, expected):
    line = gpu_served_on_cpu(observed, "nvidia.com/gpu", events, on_node)
    if expected is None:
        assert line is None
    else:
        assert line.startswith("GPU request served on CPU: pod train-abc asked for ") and expected in line, (
            line
        )
        assert "\n" not in line and line.endswith("so it trains on CPU")
