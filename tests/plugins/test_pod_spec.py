"""The training pod built by kubetrain.pod_spec: schema, security policy and the pod contract."""

from __future__ import annotations

import re
from typing import Any

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import kubernetes_validate
import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from kubetrain import pod_spec
from kubetrain.pod_spec import TrainingPodConfig, label_value, training_pod

K8S_VERSION = "1.37.0"
RUN_URI = "s3://training/runs/train_digits/scheduled__2026-11-22"
MANIFEST = "s3://training/manifests/digits/3f2a9c0d1e4b5a69.json"
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIAL)", re.IGNORECASE)


def as_dict(pod: k8s.V1Pod) -> dict[str, Any]:
    return ApiClient().sanitize_for_serialization(pod)


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]


def policy_violations(pod: dict[str, Any], secret_values: tuple[str, ...] = ()) -> list[str]:
    """Everything in a serialized pod that breaks the project's pod policy."""
    problems = []
    spec = pod["spec"]
    psc = spec.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        problems.append("pod: runAsNonRoot is not true")
    if not isinstance(psc.get("runAsUser"), int) or psc["runAsUser"] == 0:
        problems.append(f"pod: runAsUser {psc.get('runAsUser')!r} is not a numeric non-root user")
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        problems.append("pod: uses a host namespace")
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            problems.append(f"volume {volume['name']}: hostPath")
    for c in all_containers(pod):
        name = c["name"]
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if (sc.get("capabilities") or {}).get("add"):
            problems.append(f"{name}: adds capabilities")
        if sc.get("runAsUser") == 0 or sc.get("runAsNonRoot") is False:
            problems.append(f"{name}: runs as root")
        resources = c.get("resources") or {}
        for kind in ("cpu", "memory"):
            if kind not in (resources.get("limits") or {}):
                problems.append(f"{name}: no {kind} limit")
            if kind not in (resources.get("requests") or {}):
                problems.append(f"{name}: no {kind} request")
        gpu_request = (resources.get("requests") or {}).get(pod_spec.GPU_RESOURCE)
        gpu_limit = (resources.get("limits") or {}).get(pod_spec.GPU_RESOURCE)
        if gpu_request != gpu_limit:
            problems.append(f"{name}: GPU request {gpu_request} != limit {gpu_limit}")
        for env in c.get("env") or []:
            if "value" in env and SECRET_NAME.search(env["name"]):
                problems.append(f"{name}: env {env['name']} has a literal value")
            if "valueFrom" in env and set(env["valueFrom"]) - {
                "secretKeyRef",
                "fieldRef",
                "resourceFieldRef",
            }:
                problems.append(f"{name}: env {env['name']} comes from {env['valueFrom']}")
        for source in c.get("envFrom") or []:
            if set(source) - {"secretRef", "prefix"}:
                problems.append(f"{name}: envFrom {source} is not a Secret reference")
    text = repr(pod)
    for value in secret_values:
        if value and value in text:
            problems.append("a secret value appears literally in the pod")
    return problems


def config(**changes: Any) -> TrainingPodConfig:
    values: dict[str, Any] = {
        "image": "registry.example:5000/kubetrain/trainer:1.4.0",
        "sync_image": "registry.example:5000/kubetrain/sync:1.4.0",
        "run_uri": RUN_URI,
        "command": ["python", "-m", "trainer.image_classifier"],
        "args": ["--epochs", "3"],
        "dataset_manifest": MANIFEST,
        "dataset_version": "3f2a9c0d1e4b5a69",
        "labels": {"kubetrain.io/dag-id": "train_digits", "kubetrain.io/experiment": "digits CNN / v2"},
    }
    values.update(changes)
    return TrainingPodConfig(**values)


@pytest.mark.parametrize("gpus", [0, 2])
def test_pod_validates_against_the_kubernetes_schema_and_policy(gpus):
    pod = as_dict(training_pod(config(gpus=gpus), name="train-abc", namespace="default"))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert policy_violations(pod) == []


def test_pod_contract():
    pod = as_dict(training_pod(config(gpus=1, cpu="4", memory="16Gi", memory_limit="24Gi")))
    spec = pod["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["stage-in", "checkpoint-sync"]
    stage_in, sidecar = spec["initContainers"]
    (base,) = spec["containers"]
    assert stage_in["command"] == ["python", "-m", "trainer.sync", "stage-in"]
    assert "restartPolicy" not in stage_in
    assert sidecar["command"] == ["python", "-m", "trainer.sync", "checkpoint-sync"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert base["image"] == "registry.example:5000/kubetrain/trainer:1.4.0"
    assert stage_in["image"] == sidecar["image"] == "registry.example:5000/kubetrain/sync:1.4.0"
    assert base["command"] == ["python", "-m", "trainer.image_classifier"] and base["args"] == [
        "--epochs",
        "3",
    ]

    env = {e["name"]: e.get("value") for e in base["env"]}
    assert (
        env["DATA_DIR"] == "/data"
        and env["CHECKPOINT_DIR"] == "/checkpoints"
        and env["OUTPUT_DIR"] == "/output"
    )
    assert env["KUBETRAIN_RUN_URI"] == RUN_URI
    assert env["KUBETRAIN_DATASET_MANIFEST"] == MANIFEST
    assert env["KUBETRAIN_DATASET_VERSION"] == "3f2a9c0d1e4b5a69"
    assert env["KUBETRAIN_IMAGE"] == base["image"] and env["KUBETRAIN_CODE_VERSION"] == "1.4.0"
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert sidecar_env["KUBETRAIN_SYNC_INTERVAL"] == "30" and sidecar_env["KUBETRAIN_SYNC_QUIET"] == "2"
    assert int(sidecar_env["KUBETRAIN_SYNC_GRACE"]) < spec["terminationGracePeriodSeconds"] == 300
    # A native sidecar's SIGTERM comes after the trainer's exit: its final pass waits for no writer.
    assert sidecar_env["KUBETRAIN_SYNC_SETTLE"] == "0"

    # Credentials reach only the sync containers, and only by Secret reference.
    assert stage_in["envFrom"] == sidecar["envFrom"] == [{"secretRef": {"name": "kubetrain-s3"}}]
    assert not base.get("envFrom")

    # No dataset size: an ephemeral-storage request (checkpoints 4Gi + output 2Gi + 1Gi), no limit.
    assert base["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1", "ephemeral-storage": "7Gi"},
        "limits": {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": "1"},
    }
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {v["name"]: v for v in spec["volumes"]} == {
        n: {"name": n, "emptyDir": {}} for n in ("data", "checkpoints", "output")
    }
    assert {m["mountPath"] for m in base["volumeMounts"]} == {"/data", "/checkpoints", "/output"}
    assert all(m.get("readOnly") for m in sidecar["volumeMounts"])
    assert spec["restartPolicy"] == "Never"
    assert pod["metadata"]["annotations"]["kubetrain.io/run-uri"] == RUN_URI


def test_labels_are_label_safe():
    labels = as_dict(training_pod(config()))["metadata"]["labels"]
    assert labels["kubetrain.io/dag-id"] == "train_digits"
    assert re.fullmatch(r"digits-CNN---v2-[0-9a-f]{8}", labels["kubetrain.io/experiment"])
    long = label_value("x" * 100)
    assert len(long) <= 63 and long != label_value("x" * 99)
    assert label_value("manual__2026-11-22T04:00:00+00:00").endswith(tuple("0123456789abcdef"))


def test_workload_identity_has_no_secret_reference():
    pod = as_dict(training_pod(config(s3_secret=None, service_account_name="trainer")))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert all(not c.get("envFrom") for c in all_containers(pod))
    assert policy_violations(pod) == []


def test_without_a_dataset_the_init_container_only_restores():
    pod = as_dict(training_pod(config(dataset_manifest=None, dataset_version=None)))
    stage_in = pod["spec"]["initContainers"][0]
    assert stage_in["command"] == ["python", "-m", "trainer.sync", "restore"]
    assert "KUBETRAIN_DATASET_MANIFEST" not in {e["name"] for e in stage_in["env"]}


def test_options_reach_the_pod():
    toleration = k8s.V1Toleration(key="team", operator="Equal", value="ml", effect="NoSchedule")
    pod = as_dict(
        training_pod(
            config(
                image_pull_secrets=("regcred",),
                node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
                tolerations=(toleration,),
                cache_claim="dataset-cache",
                data_size="20Gi",
                run_as_user=2000,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"},
            )
        )
    )
    spec = pod["spec"]
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert spec["tolerations"] == [
        {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    ]
    assert spec["securityContext"]["runAsUser"] == 2000
    assert {"name": "dataset-cache", "persistentVolumeClaim": {"claimName": "dataset-cache"}} in spec[
        "volumes"
    ]
    assert {"name": "data", "emptyDir": {"sizeLimit": "20Gi"}} in spec["volumes"]
    stage_env = {e["name"]: e.get("value") for e in spec["initContainers"][0]["env"]}
    assert stage_env["KUBETRAIN_CACHE_DIR"] == "/cache"
    assert {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"} in spec["containers"][0]["env"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus": -1}, "gpus=-1 is not valid"),
        ({"gpus": "two"}, "gpus='two' is not valid"),
        ({"gpus": True}, "gpus=True is not valid"),
        ({"cpu": "lots"}, "cpu='lots' is not a Kubernetes quantity"),
        ({"memory": "0"}, "memory='0' must be greater than zero"),
        ({"memory": "8Gi", "memory_limit": "4Gi"}, "memory_limit='4Gi' is below memory='8Gi'"),
        ({"run_as_user": 0}, "run_as_user=0 is not valid"),
        ({"s3_secret": None}, "needs service_account_name"),
        ({"s3_secret": "Bad_Secret"}, "s3_secret 'Bad_Secret' is not a valid"),
        ({"image": "has space:1"}, "image='has space:1' is not an image reference"),
        ({"run_uri": "s3://training/runs/x/"}, "run_uri='s3://training/runs/x/' is not valid"),
        ({"dataset_manifest": "/tmp/m.json"}, "dataset_manifest='/tmp/m.json' is not valid"),
        ({"env": {"BAD NAME": "1"}}, "environment variable name 'BAD NAME'"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(**changes)


GI = 1024**3


def storage(container: dict[str, Any]) -> tuple[str | None, str | None]:
    resources = container.get("resources") or {}
    return (
        (resources.get("requests") or {}).get("ephemeral-storage"),
        (resources.get("limits") or {}).get("ephemeral-storage"),
    )


def size_limits(pod: dict[str, Any]) -> dict[str, str | None]:
    return {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["spec"]["volumes"] if "emptyDir" in v}


def by_name(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in all_containers(pod)}


@pytest.mark.parametrize(
    ("dataset_bytes", "data"),
    [
        (0, "1Gi"),  # the floor alone
        (10 * GI, "21Gi"),  # twice the dataset + 1Gi
        ("10737418240", "21Gi"),  # a rendered template
        (1, "1025Mi"),  # rounded up to a MiB
        (3 * 1024**2 + 1, "1031Mi"),
    ],
)
def test_the_data_volume_is_sized_from_the_dataset(dataset_bytes, data):
    pod = as_dict(training_pod(config(dataset_bytes=dataset_bytes, gpus=1), name="t", namespace="default"))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert policy_violations(pod) == []
    assert size_limits(pod) == {"data": data, "checkpoints": "4Gi", "output": "2Gi"}
    data_mi = {"Gi": 1024, "Mi": 1}[data[-2:]] * int(data[:-2])
    containers = by_name(pod)
    # request == limit: /data + /checkpoints + /output + 1Gi for the trainer itself
    base_mi = data_mi + (4 + 2 + 1) * 1024
    expected_base = f"{base_mi // 1024}Gi" if base_mi % 1024 == 0 else f"{base_mi}Mi"
    assert storage(containers["base"]) == (expected_base, expected_base)
    # the stage-in writes /data and /checkpoints; the sidecar only reads them
    stage_mi = data_mi + 4 * 1024 + 256
    assert storage(containers["stage-in"]) == (f"{stage_mi}Mi", f"{stage_mi}Mi")
    assert storage(containers["checkpoint-sync"]) == ("256Mi", "256Mi")


def pod_storage_request(pod: dict[str, Any]) -> int:
    """The pod's effective ephemeral-storage request, as the scheduler computes it with native sidecars."""
    from kubernetes.utils.quantity import parse_quantity

    def request(c: dict[str, Any]) -> int:
        return int(parse_quantity(storage(c)[0] or "0"))

    running = sum(request(c) for c in pod["spec"]["containers"])
    sidecars, init_peak = 0, 0
    for c in pod["spec"]["initContainers"]:
        if c.get("restartPolicy") == "Always":
            sidecars += request(c)
        else:
            init_peak = max(init_peak, sidecars + request(c))
    return max(init_peak, running + sidecars)


def test_the_pod_requests_all_the_node_must_hold():
    pod = as_dict(training_pod(config(dataset_bytes=10 * GI, checkpoint_size="4Gi", output_size="2Gi")))
    assert size_limits(pod) == {"data": "21Gi", "checkpoints": "4Gi", "output": "2Gi"}
    # every volume at its sizeLimit, the trainer's own 1Gi and the sidecar's 256Mi
    assert pod_storage_request(pod) == (21 + 4 + 2 + 1) * GI + 256 * 1024**2


def test_an_explicit_data_size_beats_the_derived_one():
    pod = as_dict(training_pod(config(dataset_bytes=10 * GI, data_size="100Gi")))
    assert size_limits(pod)["data"] == "100Gi"
    assert storage(by_name(pod)["base"]) == ("107Gi", "107Gi")
    # without a dataset size too: the limits apply once the size is known
    pod = as_dict(training_pod(config(data_size="50Gi")))
    assert size_limits(pod) == {"data": "50Gi", "checkpoints": "4Gi", "output": "2Gi"}
    assert storage(by_name(pod)["base"]) == ("57Gi", "57Gi")
    # a rendered empty Param is no override
    assert size_limits(as_dict(training_pod(config(dataset_bytes=GI, data_size="None"))))["data"] == "3Gi"


def test_without_a_dataset_size_the_volumes_stay_unlimited_but_storage_is_requested():
    for unknown in (None, "", "None"):
        pod = as_dict(training_pod(config(dataset_bytes=unknown), name="t", namespace="default"))
        assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert size_limits(pod) == {"data": None, "checkpoints": None, "output": None}
        containers = by_name(pod)
        assert storage(containers["base"]) == ("7Gi", None)
        assert storage(containers["stage-in"]) == ("4352Mi", None)
        assert storage(containers["checkpoint-sync"]) == ("256Mi", None)


def test_memory_backed_dev_shm_is_not_ephemeral_storage():
    pod = as_dict(training_pod(config(dataset_bytes=GI, gpus=2, memory="16Gi")))
    assert size_limits(pod) == {"data": "3Gi", "checkpoints": "4Gi", "output": "2Gi", "dshm": "16Gi"}
    assert storage(by_name(pod)["base"]) == ("10Gi", "10Gi")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"data_size": "lots"},
            "data_size='lots' is not a Kubernetes quantity: expected a size such as '50Gi' or '500Mi'",
        ),
        (
            {"data_size": "50GB"},
            "data_size='50GB' is not a Kubernetes quantity: expected a size such as '50Gi'",
        ),
        ({"data_size": "-5Gi"}, "data_size='-5Gi' must be greater than zero"),
        ({"data_size": "50"}, "data_size='50' is too small for a volume: expected at least 1Mi"),
        ({"checkpoint_size": "big"}, "checkpoint_size='big' is not a Kubernetes quantity"),
        ({"output_size": None}, "output_size must be set"),
        (
            {"dataset_bytes": "12 GB"},
            "dataset_bytes='12 GB' is not valid: expected the staged manifest's total_bytes",
        ),
        ({"dataset_bytes": -1}, "dataset_bytes=-1 is not valid"),
        ({"dataset_bytes": True}, "dataset_bytes=True is not valid"),
        (
            {"dataset_bytes": 10 * GI, "data_size": "5Gi"},
            "data_size='5Gi' is smaller than the dataset (10737418240 bytes, the manifest's total_bytes): expected at "
            "least 10Gi, or empty to derive it (21Gi)",
        ),
    ],
)
def test_bad_sizes_are_refused_naming_the_value(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(**changes)


def test_templated_numbers_are_accepted():
    assert config(gpus="2").gpus == 2
    assert config(sync_interval="10").sync_interval == 10


def test_policy_check_catches_violations():
    """The policy check itself must fail on a pod that breaks the rules."""
    pod = as_dict(training_pod(config(gpus=1)))
    base = pod["spec"]["containers"][0]
    base["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "hunter2hunter2"})
    base["securityContext"]["allowPrivilegeEscalation"] = True
    del base["resources"]["limits"]["memory"]
    base["resources"]["limits"]["nvidia.com/gpu"] = "2"
    pod["spec"]["initContainers"][1]["envFrom"] = [{"configMapRef": {"name": "creds"}}]
    problems = policy_violations(pod, secret_values=("hunter2hunter2",))
    assert sorted(problems) == sorted(
        [
            "base: allowPrivilegeEscalation is not false",
            "base: no memory limit",
            "base: GPU request 1 != limit 2",
            "base: env AWS_SECRET_ACCESS_KEY has a literal value",
            "checkpoint-sync: envFrom {'configMapRef': {'name': 'creds'}} is not a Secret reference",
            "a secret value appears literally in the pod",
        ]
    )


@pytest.mark.parametrize(("gpus", "shm"), [(0, False), (1, False), (2, True), (8, True)])
def test_several_gpus_get_a_memory_backed_dev_shm(gpus, shm):
    """NCCL between a pod's GPUs goes through /dev/shm; the runtime's 64 MiB default starves MirroredStrategy."""
    pod = as_dict(training_pod(config(gpus=gpus, memory="16Gi", memory_limit="24Gi")))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (base,) = pod["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in base["volumeMounts"]}
    assert ("/dev/shm" in mounts) is shm
    if shm:
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "24Gi"}
        from include.devstack.kubeapi import podsecurity

        assert podsecurity.violations("restricted", pod) == []  # emptyDir stays within the restricted level


def test_the_single_pod_is_the_default_pod_template():
    """One builder: the pod and the pod template of a job hold the same spec."""
    settings = config(
        gpus=2, dataset_bytes=GI, tolerations=(k8s.V1Toleration(key="team", operator="Exists"),)
    )
    pod = as_dict(training_pod(settings, name="train-abc", namespace="ml"))
    template = as_dict(pod_spec.pod_template(settings))
    assert pod["spec"] == template["spec"]
    assert pod["metadata"] == {**template["metadata"], "name": "train-abc", "namespace": "ml"}
    assert (pod["apiVersion"], pod["kind"]) == ("v1", "Pod")
    # the config's namespace unless one is given
    assert as_dict(training_pod(config(namespace="team-a")))["metadata"]["namespace"] == "team-a"


def test_a_replica_template_differs_only_where_a_replica_does():
    settings = config(dataset_bytes=GI)
    port = k8s.V1ContainerPort(name="tf", container_port=2222, protocol="TCP")
    chief = as_dict(
        pod_spec.pod_template(
            settings,
            sync=True,
            env={"KUBETRAIN_TF_ROLE": "chief"},
            sidecar_env={"KUBETRAIN_TF_REPLICAS": '{"chief": 1}'},
            ports=[port],
            labels={"kubetrain.io/role": "chief / 0"},
            subdomain="job-1",
            restart_policy="OnFailure",
            container_name="tensorflow",
        )
    )
    single = as_dict(training_pod(settings))
    spec, plain = chief["spec"], single["spec"]
    assert (spec["restartPolicy"], spec["subdomain"]) == ("OnFailure", "job-1")
    (base,) = spec["containers"]
    (plain_base,) = plain["containers"]
    assert base["name"] == "tensorflow" and base["ports"] == [
        {"name": "tf", "containerPort": 2222, "protocol": "TCP"}
    ]
    assert base["env"] == [*plain_base["env"], {"name": "KUBETRAIN_TF_ROLE", "value": "chief"}]
    sidecar = spec["initContainers"][1]
    assert sidecar["env"] == [
        *plain["initContainers"][1]["env"],
        {"name": "KUBETRAIN_TF_REPLICAS", "value": '{"chief": 1}'},
    ]
    assert re.fullmatch(r"chief---0-[0-9a-f]{8}", chief["metadata"]["labels"]["kubetrain.io/role"])
    # everything else is the single pod's
    unchanged = {
        k: v
        for k, v in spec.items()
        if k not in ("restartPolicy", "subdomain", "containers", "initContainers")
    }
    assert unchanged == {
        k: v for k, v in plain.items() if k not in ("restartPolicy", "containers", "initContainers")
    }
    assert {k: v for k, v in base.items() if k not in ("name", "ports", "env")} == {
        k: v for k, v in plain_base.items() if k not in ("name", "env")
    }
    assert spec["initContainers"][0] == plain["initContainers"][0]
    # a worker has no sidecar: only the chief syncs
    worker = as_dict(pod_spec.pod_template(settings, sync=False))
    assert [c["name"] for c in worker["spec"]["initContainers"]] == ["stage-in"]


def test_early_stopping_must_be_a_rule():
    with pytest.raises(
        ValueError, match=re.escape("early_stopping={'rule': 'median'} is not valid: expected a")
    ):
        config(early_stopping={"rule": "median"})
