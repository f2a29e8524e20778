"""Multi-worker runs in a Kueue queue: the job objects carry Kueue's labels, and an Indexed Job run is
one Job of every replica, which Kueue admits all or nothing."""

from __future__ import annotations

import airflow  # noqa: F401  (puts the plugins folder on sys.path)
import pytest
from distributed_schemas import validate_k8s
from test_builders import CONFIG, LABELS, SPECS

from kubetrain.distributed import builders
from kubetrain_contract.cluster import REPLICAS_ENV, cluster_spec, tf_config_of

QUEUE = {"kueue.x-k8s.io/queue-name": "training", "kueue.x-k8s.io/priority-class": "high"}


def build(backend: str, mode: str, queue=QUEUE) -> builders.Submission:
    return builders.build(
        backend, CONFIG, SPECS[mode], name="kt-x-1234-1", namespace="kubetrain", labels=LABELS, queue=queue
    )


def test_a_queued_indexed_job_run_is_one_job_of_every_replica():
    sub = build("indexed_job", "mirrored")
    service, job = sub.resources
    for resource in sub.resources:
        validate_k8s(resource.body)
    assert sub.gang and sub.job_roles == ["all"] and job.name == "kt-x-1234-1-all"
    labels = job.body["metadata"]["labels"]
    assert {k: labels[k] for k in QUEUE} == QUEUE  # Kueue reads the Job's labels, not its pods'
    spec = job.body["spec"]
    # one workload of 3 pods: Kueue admits the whole parallelism or none of it
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "kt-x-1234-1"
    base = next(c for c in pod["containers"] if c["name"] == "base")
    env = {e["name"]: e.get("value") for e in base["env"]}
    assert "KUBETRAIN_TF_ROLE" not in env  # each replica's role comes from its index
    assert base["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # index 0 is the chief; the hosts are the Job's pods under the Service
    assert tf_config_of({"chief": 1, "worker": 2}, env["KUBETRAIN_TF_HOSTS"], 0)["task"] == {
        "type": "chief",
        "index": 0,
    }
    assert cluster_spec({"chief": 1, "worker": 2}, env["KUBETRAIN_TF_HOSTS"]) == {
        "chief": ["kt-x-1234-1-all-0.kt-x-1234-1:2222"],
        "worker": ["kt-x-1234-1-all-1.kt-x-1234-1:2222", "kt-x-1234-1-all-2.kt-x-1234-1:2222"],
    }
    assert sub.cluster() == cluster_spec({"chief": 1, "worker": 2}, env["KUBETRAIN_TF_HOSTS"])
    # the sidecar is in the shared template: it learns from the replica values whether it is the chief's
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "checkpoint-sync")
    assert {e["name"]: e.get("value") for e in sidecar["env"]}[REPLICAS_ENV] == '{"chief": 1, "worker": 2}'
    assert (
        sub.chief_selector
        == "kubetrain.io/distributed-job=kt-x-1234-1,batch.kubernetes.io/job-completion-index=0"
    )


def test_an_unqueued_indexed_job_run_keeps_one_job_per_role():
    sub = build("indexed_job", "mirrored", queue={})
    assert not sub.gang and [r.name for r in sub.resources[1:]] == ["kt-x-1234-1-chief", "kt-x-1234-1-worker"]
    assert all("kueue.x-k8s.io/queue-name" not in r.body["metadata"]["labels"] for r in sub.resources)


def test_a_queued_parameter_server_run_needs_an_engine_kueue_admits_as_one():
    with pytest.raises(
        ValueError, match=r"backend 'indexed_job' cannot queue a parameter-server run .*'training'"
    ):
        build("indexed_job", "ps")


@pytest.mark.parametrize("mode", ["mirrored", "ps"])
def test_tfjob_and_trainjob_carry_the_queue_labels(mode):
    (tfjob,) = build("tfjob", mode).resources
    assert {k: tfjob.body["metadata"]["labels"][k] for k in QUEUE} == QUEUE
    runtime, train = build("trainjob", mode).resources
    assert {k: train.body["metadata"]["labels"][k] for k in QUEUE} == QUEUE
    # the runtime is a template, not a workload: Kueue queues the TrainJob
    assert "kueue.x-k8s.io/queue-name" not in runtime.body["metadata"]["labels"]
