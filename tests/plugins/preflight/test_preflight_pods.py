"""The preflight's pods without a cluster: the pod as built (restricted, placed as training pods are), how a
pod's status is read (a table of cases), and a pod the API refuses (test_preflight_devstack.py runs real ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from include.devstack.kubeapi import podsecurity
from kubetrain.preflight.pods import LABELS, PodOutcome, PodRunner
from kubetrain.settings import Deployment


def body(runner: PodRunner, **kwargs) -> dict:
    kwargs.setdefault("with_s3", True)
    return ApiClient().sanitize_for_serialization(runner.pod("sync", "registry/sync:1", ["probe"], **kwargs))


def test_a_preflight_pod_is_restricted_and_placed_as_training_pods_are(fake_cluster):
    deployment = Deployment(
        namespace="team",
        service_account="trainer",
        image_pull_secrets=("regcred",),
        node_selector={"pool": "gpu"},
        tolerations=({"key": "dedicated", "operator": "Equal", "value": "ml", "tolerationSeconds": 60},),
    )
    pod = body(PodRunner(fake_cluster(deployment), pod_timeout=45))
    assert podsecurity.violations("restricted", pod) == []
    assert pod["metadata"]["name"].startswith("kubetrain-preflight-sync-")
    assert pod["metadata"]["namespace"] == "team"
    assert pod["metadata"]["labels"] == {**LABELS, "kubetrain.io/preflight": "sync"}
    spec = pod["spec"]
    assert (spec["restartPolicy"], spec["activeDeadlineSeconds"]) == ("Never", 90)
    assert spec["serviceAccountName"] == "trainer" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {
        "key": "dedicated",
        "operator": "Equal",
        "value": "ml",
        "tolerationSeconds": 60,
    } in spec["tolerations"]
    (container,) = spec["containers"]
    assert (container["image"], container["command"]) == ("registry/sync:1", ["probe"])
    assert container["envFrom"] == [{"secretRef": {"name": "kubetrain-s3"}}]


def test_only_a_pod_that_needs_s3_gets_the_secret_and_a_short_timeout_still_allows_a_minute(fake_cluster):
    pod = body(PodRunner(fake_cluster(), pod_timeout=5), with_s3=False)
    assert "envFrom" not in pod["spec"]["containers"][0]
    assert pod["spec"]["activeDeadlineSeconds"] == 60


def status(phase="Pending", *, waiting=None, terminated=None, running=False, unschedulable=None, reason=None):
    state = k8s.V1ContainerState(
        waiting=k8s.V1ContainerStateWaiting(reason=waiting, message=f"{waiting} detail") if waiting else None,
        terminated=k8s.V1ContainerStateTerminated(exit_code=terminated, reason="Completed")
        if terminated is not None
        else None,
        running=k8s.V1ContainerStateRunning() if running else None,
    )
    conditions = (
        [
            k8s.V1PodCondition(
                type="PodScheduled", status="False", reason="Unschedulable", message=unschedulable
            )
        ]
        if unschedulable
        else None
    )
    statuses = (
        [
            k8s.V1ContainerStatus(
                name="check", image="i", image_id="", ready=False, restart_count=0, state=state
            )
        ]
        if waiting or terminated is not None or running
        else None
    )
    return k8s.V1Pod(
        status=k8s.V1PodStatus(phase=phase, reason=reason, conditions=conditions, container_statuses=statuses)
    )


@pytest.mark.parametrize(
    ("pod", "outcome"),
    [
        (k8s.V1Pod(), None),
        (status(), None),
        (
            status(unschedulable="0/3 nodes are available"),
            PodOutcome(False, reason="Unschedulable", message="0/3 nodes are available"),
        ),
        (
            status(waiting="ErrImagePull"),
            PodOutcome(False, reason="ErrImagePull", message="ErrImagePull detail"),
        ),
        (
            status(waiting="CreateContainerConfigError"),
            PodOutcome(
                False, reason="CreateContainerConfigError", message="CreateContainerConfigError detail"
            ),
        ),
        (status(waiting="ContainerCreating"), None),
        (status("Running", running=True), PodOutcome(True)),
        (status("Succeeded", terminated=0), PodOutcome(True, exit_code=0, reason="Completed")),
        (status("Failed", terminated=1), PodOutcome(True, exit_code=1, reason="Completed")),
        (status("Failed", reason="DeadlineExceeded"), PodOutcome(False, reason="DeadlineExceeded")),
    ],
    ids=[
        "no status",
        "pending",
        "unschedulable",
        "pull failure",
        "config failure",
        "creating",
        "running",
        "succeeded",
        "failed with code",
        "failed before starting",
    ],
)
def test_how_a_pods_status_is_read(pod, outcome):
    assert PodRunner._decide(pod) == outcome


def test_a_pod_the_api_refuses_is_an_outcome_not_an_exception(fake_cluster, api_error):
    refused = api_error(403, 'pods "kubetrain-preflight-trainer-x" is forbidden: violates PodSecurity')
    cluster = fake_cluster(create_namespaced_pod=refused)
    outcome = PodRunner(cluster).run_pod("trainer", "img", ["true"], with_s3=False)
    assert outcome == PodOutcome(
        False,
        reason="Forbidden",
        message='pods "kubetrain-preflight-trainer-x" is forbidden: violates PodSecurity',
    )
    assert [name for name, _, _ in cluster.core.calls] == ["create_namespaced_pod"]  # nothing to delete


def test_a_pods_log_is_read_once_it_ran_and_an_unreadable_log_says_why(fake_cluster):
    ran = PodOutcome(True, exit_code=0)
    logs = SimpleNamespace(data=b"line 1\nKUBETRAIN_PROBE {}\n")
    read = PodRunner(fake_cluster(read_namespaced_pod_log=logs))._with_logs("p", ran)
    assert read.logs == "line 1\nKUBETRAIN_PROBE {}\n" and read.exit_code == 0
    lost = PodRunner(fake_cluster(read_namespaced_pod_log=TimeoutError("read timed out")))._with_logs(
        "p", ran
    )
    assert lost.logs == "(log unavailable: TimeoutError: read timed out)"
    not_pulled = PodOutcome(False, reason="ErrImagePull")
    assert PodRunner(fake_cluster())._with_logs("p", not_pulled) is not_pulled


def test_a_pod_already_gone_is_deleted_without_waiting(fake_cluster, api_error):
    cluster = fake_cluster(delete_namespaced_pod=api_error(404))
    PodRunner(cluster)._delete("p")
    assert [name for name, _, _ in cluster.core.calls] == ["delete_namespaced_pod"]
    gone = fake_cluster(delete_namespaced_pod={}, read_namespaced_pod=api_error(404))
    PodRunner(gone)._delete("p")
    assert [name for name, _, _ in gone.core.calls] == ["delete_namespaced_pod", "read_namespaced_pod"]
