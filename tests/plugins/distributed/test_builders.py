"""What each backend submits: the training pod contract per replica, and objects valid against the pinned schemas."""

from __future__ import annotations

import copy
import dataclasses
import json

import airflow  # noqa: F401  (puts the plugins folder on sys.path)
import jsonschema
import kubernetes_validate
import pytest
from distributed_schemas import validate_k8s, validate_tfjob, validate_trainer

from kubetrain import pod_spec
from kubetrain.distributed import builders
from kubetrain.distributed.backends import BackendUnavailableError, choose_backend
from kubetrain.distributed.spec import DistributedSpec

CONFIG = pod_spec.TrainingPodConfig(
    image="r.example/kubetrain/trainer@sha256:" + "a" * 64,
    sync_image="r.example/kubetrain/sync@sha256:" + "b" * 64,
    run_uri="s3://training/runs/train_x/manual__1",
    command=["python", "-m", "trainer.image_classifier"],
    args=["--strategy=auto"],
    dataset_manifest="s3://training/manifests/d/0123.json",
    dataset_version="0123",
    tolerations=[{"key": "spot", "operator": "Exists"}],
)
LABELS = {"kubetrain.io/dag-id": "train_x", "kubetrain.io/run-id": "manual__1"}
SPECS = {
    "mirrored": DistributedSpec(workers=3, gpus_per_worker=2, worker_cpu="4", worker_memory="8Gi"),
    "ps": DistributedSpec(workers=2, ps_replicas=1, gpus_per_worker=1, ps_cpu="2", ps_memory="3Gi"),
}


def build(backend: str, spec: DistributedSpec) -> builders.Submission:
    return builders.build(backend, CONFIG, spec, name="kt-x-1234-1", namespace="kubetrain", labels=LABELS)


def templates(sub: builders.Submission) -> dict[str, dict]:
    """role -> the pod template (as the API's JSON) of each backend's objects."""
    out = {}
    for r in sub.resources:
        body = r.body
        if r.kind == "Job":
            out[body["metadata"]["labels"][builders.ROLE_LABEL]] = body["spec"]["template"]
        elif r.kind == "TFJob":
            for kind, replica in body["spec"]["tfReplicaSpecs"].items():
                out[{"Chief": "chief", "Worker": "worker", "PS": "ps"}[kind]] = replica["template"]
        elif r.kind == "TrainingRuntime":
            for rj in body["spec"]["template"]["spec"]["replicatedJobs"]:
                out[rj["name"]] = rj["template"]["spec"]["template"]
    return out


@pytest.mark.parametrize("backend", ["indexed_job", "tfjob", "trainjob"])
@pytest.mark.parametrize("mode", ["mirrored", "ps"])
def test_every_replica_follows_the_pod_contract_and_the_chief_alone_syncs(backend, mode):
    spec = SPECS[mode]
    sub = build(backend, spec)
    roles = templates(sub)
    assert set(roles) == set(spec.replicas())
    for role, template in roles.items():
        pod = template["spec"]
        inits = [c["name"] for c in pod["initContainers"]]
        assert inits == (["stage-in", "checkpoint-sync"] if role == "chief" else ["stage-in"]), (role, inits)
        base = pod["containers"][0]
        assert (
            base["name"]
            == sub.container
            == {"tfjob": builders.TFJOB_CONTAINER, "trainjob": "node"}.get(backend, "base")
        )
        res = spec.resources(role)
        want = {
            "cpu": res.cpu,
            "memory": res.memory,
            **({"nvidia.com/gpu": str(res.gpus)} if res.gpus else {}),
        }
        # no dataset size in CONFIG: an ephemeral-storage request without a limit
        assert base["resources"]["requests"] == {**want, "ephemeral-storage": "7Gi"}
        assert base["resources"]["limits"] == want
        assert {"key": "spot", "operator": "Exists"} in pod["tolerations"]
        if res.gpus:
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
                "tolerations"
            ]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["restartPolicy"] == "Never"
        for c in pod["initContainers"]:
            assert c["envFrom"] == [{"secretRef": {"name": "kubetrain-s3"}}]
        assert "envFrom" not in base  # the trainer never sees S3 credentials
        env = {e["name"]: e.get("value") for e in base["env"]}
        assert env["KUBETRAIN_RUN_URI"] == CONFIG.run_uri and env["CHECKPOINT_DIR"] == "/checkpoints"
        if backend == "tfjob":
            assert not any(k.startswith("KUBETRAIN_TF_") for k in env)  # the training operator sets TF_CONFIG
            assert base["ports"] == [{"name": "tfjob-port", "containerPort": 2222, "protocol": "TCP"}]
        else:
            assert json.loads(env["KUBETRAIN_TF_REPLICAS"]) == spec.replicas()
            assert env["KUBETRAIN_TF_HOSTS"] == sub.hosts and env["KUBETRAIN_TF_ROLE"] == role
        assert template["metadata"]["labels"][builders.JOB_LABEL] == sub.name


@pytest.mark.parametrize("backend", ["indexed_job", "tfjob", "trainjob"])
def test_every_replica_gets_the_volumes_and_storage_of_the_dataset(backend):
    """Each replica stages the whole dataset into its own /data: each pod is sized as a single-pod run's."""
    config = dataclasses.replace(CONFIG, dataset_bytes=4 * 1024**3)
    sub = builders.build(
        backend, config, SPECS["ps"], name="kt-x-1234-1", namespace="kubetrain", labels=LABELS
    )
    for role, template in templates(sub).items():
        pod = template["spec"]
        limits = {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["volumes"] if "emptyDir" in v}
        assert limits == {"data": "9Gi", "checkpoints": "4Gi", "output": "2Gi"}, role
        containers = {c["name"]: c["resources"] for c in pod["initContainers"] + pod["containers"]}
        base = containers[sub.container]
        assert base["requests"]["ephemeral-storage"] == base["limits"]["ephemeral-storage"] == "16Gi", role
        stage_in = containers["stage-in"]
        assert stage_in["requests"]["ephemeral-storage"] == stage_in["limits"]["ephemeral-storage"], role
        assert stage_in["requests"]["ephemeral-storage"] == "13568Mi"


def test_parameter_servers_request_no_gpu_unless_asked():
    roles = templates(build("indexed_job", SPECS["ps"]))
    assert "nvidia.com/gpu" not in roles["ps"]["spec"]["containers"][0]["resources"]["requests"]
    assert "nvidia.com/gpu" not in roles["chief"]["spec"]["containers"][0]["resources"]["requests"]
    assert roles["worker"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1"
    with_gpu = templates(build("indexed_job", SPECS["ps"].replace(gpus_per_ps=1)))
    assert with_gpu["ps"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("mode", ["mirrored", "ps"])
def test_indexed_jobs_and_service_are_valid_kubernetes_objects(mode):
    sub = build("indexed_job", SPECS[mode])
    service, *jobs = sub.resources
    assert (
        service.body["spec"]["clusterIP"] == "None"
        and service.body["spec"]["publishNotReadyAddresses"] is True
    )
    assert service.body["spec"]["selector"] == {builders.JOB_LABEL: sub.name}
    for resource in sub.resources:
        validate_k8s(resource.body)
    for job in jobs:
        spec = job.body["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
        assert spec["template"]["spec"]["subdomain"] == sub.name
    assert [j.name for j in jobs] == [f"{sub.name}-{role}" for role in SPECS[mode].replicas()]


@pytest.mark.parametrize("mode", ["mirrored", "ps"])
def test_tfjob_is_valid_against_the_training_operators_models(mode):
    (resource,) = build("tfjob", SPECS[mode]).resources
    validate_tfjob(resource.body)
    assert resource.body["apiVersion"] == "kubeflow.org/v1" and resource.body["kind"] == "TFJob"
    assert set(resource.body["spec"]["tfReplicaSpecs"]) == (
        {"Chief", "Worker", "PS"} if mode == "ps" else {"Chief", "Worker"}
    )
    # The schema is strict: an unknown field, or a bad pod template, is refused.
    bad = copy.deepcopy(resource.body)
    bad["spec"]["tfReplicaSpecs"]["Chief"]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_tfjob(bad)
    bad = copy.deepcopy(resource.body)
    bad["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_tfjob(bad)


@pytest.mark.parametrize("mode", ["mirrored", "ps"])
def test_trainjob_and_runtime_are_valid_against_the_trainer_api_models(mode):
    runtime, train = build("trainjob", SPECS[mode]).resources
    validate_trainer(runtime.body)
    validate_trainer(train.body)
    assert train.body["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime.name,
    }
    jobset = runtime.body["spec"]["template"]["spec"]
    assert jobset["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["chief"]}
    bad = copy.deepcopy(train.body)
    bad["spec"]["runtimeRef"] = {"kind": "TrainingRuntime"}  # no name
    with pytest.raises(jsonschema.ValidationError):
        validate_trainer(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 0}, "workers=0 is not valid: expected an integer from 1 to 64"),
        ({"workers": 65}, "workers=65 is not valid"),
        ({"ps_replicas": 17}, "ps_replicas=17 is not valid: expected an integer from 0 to 16"),
        ({"workers": "two"}, "workers='two' is not valid"),
    ],
)
def test_bad_replica_counts_are_refused(kwargs, message):
    with pytest.raises(ValueError) as err:
        DistributedSpec(**kwargs)
    assert message in str(err.value)


def test_backend_choice_names_the_missing_api_and_what_is_served():
    assert choose_backend("auto", ["indexed_job"]) == "indexed_job"
    assert choose_backend("auto", ["trainjob", "indexed_job"]) == "trainjob"
    with pytest.raises(BackendUnavailableError) as err:
        choose_backend("tfjob", ["indexed_job"])
    assert str(err.value) == (
        "backend 'tfjob' needs the API kubeflow.org/v1 (tfjobs), which this cluster does not serve "
        "(install the Kubeflow training operator v1 (TFJob CRD)); it serves: indexed_job"
    )
    with pytest.raises(ValueError, match="backend='mpi' is not valid"):
        choose_backend("mpi", ["indexed_job"])


def test_replica_pods_write_the_contract_plus_the_cluster_variables():
    from pathlib import Path

    contract = json.loads(
        (Path(__file__).resolve().parents[3] / "trainer/sync/schemas/pod-env.v1.json").read_text()
    )
    # A multi-worker job is no sweep trial: the early-stopping variables of trials are not written.
    expected = {
        n
        for n, s in contract["written"].items()
        if "base" in s["containers"] and not s["description"].startswith("Sweep trials")
    }
    expected |= set(contract["written_for_replicas"])
    sized = dataclasses.replace(CONFIG, dataset_bytes=1024**3)  # /data sized: KUBETRAIN_DATA_SIZE_BYTES too
    submission = builders.build(
        "indexed_job", sized, SPECS["ps"], name="kt-x-1234-1", namespace="kubetrain", labels=LABELS
    )
    for role, template in templates(submission).items():
        names = {e["name"] for e in template["spec"]["containers"][0]["env"]}
        assert names == expected, role
