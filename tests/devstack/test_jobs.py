"""batch/v1 Jobs through the official client: indexed completions, backoff limit, deletion policies, suspend,
deadlines and TTL."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from .support import wait_for

NS = "default"


def job_body(name: str, script: str, **spec) -> dict:
    restart = spec.pop("restartPolicy", "Never")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "metadata": {"labels": {"suite": "jobs", "job": name}},
                "spec": {
                    "restartPolicy": restart,
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{"name": "work", "image": "busybox", "command": ["sh", "-c", script]}],
                },
            },
            **spec,
        },
    }


def condition(batch, name: str) -> str | None:
    conds = batch.read_namespaced_job_status(name, NS).status.conditions or []
    final = [c.type for c in conds if c.type in ("Complete", "Failed") and c.status == "True"]
    return final[0] if final else None


def logs(core, pod: str) -> str:
    return core.read_namespaced_pod_log(pod, NS, _preload_content=False).data.decode()


def test_indexed_job_runs_every_index(core, batch):
    job = batch.create_namespaced_job(
        NS,
        job_body(
            "indexed",
            "echo index=$JOB_COMPLETION_INDEX; sleep 0.3",
            completions=3,
            parallelism=2,
            completionMode="Indexed",
        ),
    )
    uid = job.metadata.uid
    assert job.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": uid}
    # the controller created the first pods before the API answered (the provider lists them right away)
    pods = core.list_namespaced_pod(NS, label_selector="job-name=indexed").items
    assert len(pods) == 2
    for pod in pods:
        labels = pod.metadata.labels
        assert labels["controller-uid"] == uid and labels["batch.kubernetes.io/controller-uid"] == uid
        assert labels["batch.kubernetes.io/job-name"] == "indexed" and labels["suite"] == "jobs"
        assert (
            labels["batch.kubernetes.io/job-completion-index"]
            == pod.metadata.annotations["batch.kubernetes.io/job-completion-index"]
        )
        assert pod.metadata.owner_references[0].kind == "Job" and pod.metadata.owner_references[0].controller
    assert wait_for(lambda: condition(batch, "indexed"), 30, what="indexed job to finish") == "Complete"
    status = batch.read_namespaced_job_status("indexed", NS).status
    assert (status.succeeded, status.failed, status.active, status.completed_indexes) == (
        3,
        None,
        None,
        "0-2",
    )
    assert status.start_time and status.completion_time
    assert {c.type for c in status.conditions} >= {"SuccessCriteriaMet", "Complete"}
    pods = core.list_namespaced_pod(NS, label_selector="job-name=indexed").items
    assert sorted(logs(core, p.metadata.name) for p in pods) == ["index=0\n", "index=1\n", "index=2\n"]
    assert sorted(p.spec.hostname for p in pods) == ["indexed-0", "indexed-1", "indexed-2"]
    batch.delete_namespaced_job("indexed", NS, propagation_policy="Background")
    wait_for(
        lambda: not core.list_namespaced_pod(NS, label_selector="job-name=indexed").items,
        15,
        what="pods removed",
    )


def test_backoff_limit_fails_the_job(core, batch):
    batch.create_namespaced_job(NS, job_body("flaky", "echo failing; exit 3", backoffLimit=1))
    assert wait_for(lambda: condition(batch, "flaky"), 30, what="job failure") == "Failed"
    status = batch.read_namespaced_job_status("flaky", NS).status
    failed = {c.type: c for c in status.conditions if c.status == "True"}
    assert failed["Failed"].reason == "BackoffLimitExceeded" and "FailureTarget" in failed
    assert status.failed == 2 and not status.succeeded
    pods = core.list_namespaced_pod(NS, label_selector="job-name=flaky").items
    assert len(pods) == 2 and all(p.status.phase == "Failed" for p in pods)
    events = core.list_namespaced_event(
        NS, field_selector="involvedObject.name=flaky,involvedObject.kind=Job"
    ).items
    assert {"SuccessfulCreate", "BackoffLimitExceeded"} <= {e.reason for e in events}
    batch.delete_namespaced_job("flaky", NS, propagation_policy="Foreground")
    wait_for(
        lambda: not batch.list_namespaced_job(NS, field_selector="metadata.name=flaky").items,
        15,
        what="job removal",
    )
    assert not core.list_namespaced_pod(NS, label_selector="job-name=flaky").items


def test_delete_propagation_policies(core, batch):
    for name in ("orphaned", "foreground"):
        batch.create_namespaced_job(NS, job_body(name, "sleep 30"))
    wait_for(lambda: core.list_namespaced_pod(NS, label_selector="job-name=orphaned").items, 10)
    batch.delete_namespaced_job("orphaned", NS)  # the batch/v1 default: orphan the pods
    left = core.list_namespaced_pod(NS, label_selector="job-name=orphaned").items
    assert len(left) == 1 and not left[0].metadata.owner_references
    core.delete_namespaced_pod(left[0].metadata.name, NS, grace_period_seconds=0)
    batch.delete_namespaced_job("foreground", NS, propagation_policy="Foreground")
    job = batch.read_namespaced_job("foreground", NS)  # kept until its pods are gone
    assert job.metadata.deletion_timestamp is not None and "foregroundDeletion" in job.metadata.finalizers
    wait_for(
        lambda: not batch.list_namespaced_job(NS, field_selector="metadata.name=foreground").items,
        15,
        what="job removal",
    )
    assert not core.list_namespaced_pod(NS, label_selector="job-name=foreground").items


def test_suspend_deadline_and_ttl(core, batch):
    # completionTime has whole-second resolution, so the TTL may fire up to a second early: leave the
    # poll below a few seconds to see the finished job before it is removed
    batch.create_namespaced_job(NS, job_body("paused", "echo ran", suspend=True, ttlSecondsAfterFinished=3))
    assert not core.list_namespaced_pod(NS, label_selector="job-name=paused").items
    conds = {c.type: c.status for c in batch.read_namespaced_job_status("paused", NS).status.conditions}
    assert conds == {"Suspended": "True"}
    batch.patch_namespaced_job("paused", NS, {"spec": {"suspend": False}})
    assert wait_for(lambda: condition(batch, "paused"), 20, what="resumed job") == "Complete"
    # ttlSecondsAfterFinished removes the finished job and its pods
    wait_for(
        lambda: not batch.list_namespaced_job(NS, field_selector="metadata.name=paused").items, 20, what="TTL"
    )
    wait_for(
        lambda: not core.list_namespaced_pod(NS, label_selector="job-name=paused").items, 15, what="TTL pods"
    )
    batch.create_namespaced_job(NS, job_body("slow", "sleep 30", activeDeadlineSeconds=1))
    assert wait_for(lambda: condition(batch, "slow"), 20, what="deadline") == "Failed"
    reason = [
        c.reason for c in batch.read_namespaced_job_status("slow", NS).status.conditions if c.type == "Failed"
    ]
    assert reason == ["DeadlineExceeded"]
    with pytest.raises(ApiException) as err:
        batch.patch_namespaced_job("slow", NS, {"spec": {"completions": 5}})
    assert err.value.status == 422 and "spec.completions" in err.value.body
    batch.delete_namespaced_job("slow", NS, propagation_policy="Background")
