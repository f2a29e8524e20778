"""TrainingPodOperator: the pod it asks for, the settings and images it resolves, and how a pod that cannot start fails."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.pod_manager import AsyncPodManager, PodManager, parse_log_line
from airflow.sdk import DAG, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s
from test_pod_spec import K8S_VERSION, policy_violations

from include.devstack.stack import REPO, free_port
from kubetrain import pod_spec, settings
from kubetrain.images import ImageNotFoundError, ImageResolutionError
from kubetrain.operators.training import PodUnschedulableError, TrainingPodOperator
from kubetrain.triggers.pod import LOGS_FLUSHED_KEY, TrainingPodTrigger
from tests.plugins.imagebuild.support import push_busybox_base, start_registry

RUN_ID = "manual__2026-11-22T04:00:00.123456+00:00"
SECRET_VALUE = "sEcReT-value-that-must-not-leak-42"
TRAINER = "registry.example/kubetrain/trainer@sha256:" + "a" * 64
SYNC = "registry.example/kubetrain/sync@sha256:" + "b" * 64


class TaskInstance:
    """The parts of a running task instance that the operator reads."""

    def __init__(self, dag_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> None:
        self.dag_id, self.task_id, self.try_number, self.map_index = dag_id, task_id, try_number, map_index
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


def context_for(operator, try_number: int = 1, map_index: int = -1, **params) -> dict:
    ti = TaskInstance(operator.dag_id, operator.task_id, try_number, map_index)
    return {
        "ti": ti,
        "task_instance": ti,
        "run_id": RUN_ID,
        "dag": operator.dag,
        "params": {"gpus": 2, "epochs": 5, **params},
    }


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "default"}}],
                "current-context": "c",
            }
        )
    )
    return path


@pytest.fixture
def airflow_env(tmp_path, monkeypatch):
    """A Kubernetes connection (building a pod reads the kubeconfig, nothing is contacted) and clean settings."""
    config = kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(config), "namespace": "default"}}
        ),
    )
    for setting in settings.SETTINGS.values():
        monkeypatch.delenv(setting.env, raising=False)
        monkeypatch.delenv(f"AIRFLOW_VAR_{setting.variable.upper()}", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT", raising=False)
    # Credentials in the Airflow worker's environment must never end up in the pod.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_VALUE)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + SECRET_VALUE[:12])
    return monkeypatch


def operator(**kwargs) -> TrainingPodOperator:
    kwargs.setdefault("image", TRAINER)
    kwargs.setdefault("sync_image", SYNC)
    kwargs.setdefault("cmds", ["python", "-m", "trainer.image_classifier"])
    kwargs.setdefault("arguments", ["--epochs", "{{ params.epochs }}"])
    kwargs.setdefault("experiment", "digits")
    with DAG("train_digits", schedule=None, render_template_as_native_obj=True):
        return TrainingPodOperator(
            task_id="train",
            dataset_manifest="s3://training/manifests/digits/3f2a9c0d1e4b5a69.json",
            dataset_version="3f2a9c0d1e4b5a69",
            **kwargs,
        )


def build(op: TrainingPodOperator, context: dict) -> dict:
    op.render_template_fields(context)
    return ApiClient().sanitize_for_serialization(op.build_pod_request_obj(context))


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def test_is_a_kubernetes_pod_operator_with_training_defaults():
    op = operator()
    assert isinstance(op, KubernetesPodOperator)
    assert op.deferrable is True
    assert op.on_finish_action.value == "delete_pod"
    assert op.get_logs is True
    assert op.do_xcom_push is False
    assert op.termination_message_policy == "FallbackToLogsOnError"
    assert (op.startup_timeout_seconds, op.stage_in_timeout_seconds) == (600, 3600)
    # The task log follows the pod while the task is deferred (at most ~5 s behind), and a
    # failed pod's container states and events are logged.
    assert (op.logging_interval, op.poll_interval) == (3, 2)
    assert op.log_containers == ["stage-in", "checkpoint-sync"]
    assert op.log_events_on_failure is True
    assert set(KubernetesPodOperator.template_fields) <= set(TrainingPodOperator.template_fields)
    with pytest.raises(ValueError, match="builds container_resources itself"):
        operator(container_resources=k8s.V1ResourceRequirements(limits={"cpu": "1"}))
    with pytest.raises(TypeError, match="no_such_argument"):
        operator(no_such_argument=1)


def test_operator_pod_validates_and_follows_the_policy(airflow_env):
    op = operator(gpus="{{ params.gpus }}", image_pull_secrets="regcred", namespace="training")
    context = context_for(op)
    pod = build(op, context)

    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert policy_violations(pod, secret_values=(SECRET_VALUE,)) == []
    base = pod["spec"]["containers"][0]
    assert base["args"] == ["--epochs", "5"]
    assert (
        base["resources"]["limits"]["nvidia.com/gpu"]
        == base["resources"]["requests"]["nvidia.com/gpu"]
        == "2"
    )
    assert pod["metadata"]["namespace"] == "training"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300
    assert base["terminationMessagePolicy"] == "FallbackToLogsOnError"
    labels = pod["metadata"]["labels"]
    assert labels["kubetrain.io/dag-id"] == "train_digits" and labels["kubetrain.io/experiment"] == "digits"
    assert labels["kubetrain.io/run-id"].startswith("manual__2026-11-22T04-00-00.123456-00-00-")
    env = env_of(base)
    assert env["KUBETRAIN_RUN_URI"] == context["ti"].xcom["run_uri"]
    assert env["KUBETRAIN_RUN_URI"].startswith(
        "s3://training/runs/train_digits/manual__2026-11-22T04_00_00.123456_00_00-"
    )
    assert (base["image"], env["KUBETRAIN_IMAGE"], env["KUBETRAIN_CODE_VERSION"]) == (
        TRAINER,
        TRAINER,
        "sha256:" + "a" * 64,
    )


def test_run_uri_is_the_same_for_every_try_and_differs_per_trial(airflow_env):
    def run_uri(**kwargs):
        op = operator()
        return env_of(build(op, context_for(op, **kwargs))["spec"]["containers"][0])["KUBETRAIN_RUN_URI"]

    first = run_uri(try_number=1)
    assert run_uri(try_number=3) == first
    assert run_uri(map_index=2) == first + "/trials/2"


# -- settings: each deployment setting reaches its pod field; an argument (or Param) beats it ---------------


SETTING_CASES = [
    ("namespace", "ml-training", lambda pod: pod["metadata"]["namespace"], "ml-training"),
    (
        "s3_secret",
        "minio-creds",
        lambda pod: [c["envFrom"] for c in pod["spec"]["initContainers"]],
        [[{"secretRef": {"name": "minio-creds"}}]] * 2,
    ),
    ("service_account", "trainer-sa", lambda pod: pod["spec"]["serviceAccountName"], "trainer-sa"),
    (
        "image_pull_secrets",
        "regcred, mirror",
        lambda pod: pod["spec"]["imagePullSecrets"],
        [{"name": "regcred"}, {"name": "mirror"}],
    ),
    (
        "node_selector",
        "pool=gpu,zone=a",
        lambda pod: pod["spec"]["nodeSelector"],
        {"pool": "gpu", "zone": "a"},
    ),
    (
        "tolerations",
        '[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]',
        lambda pod: pod["spec"]["tolerations"],
        [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
        ],
    ),
    (
        "gpu_resource",
        "amd.com/gpu",
        lambda pod: (pod["spec"]["containers"][0]["resources"]["limits"], pod["spec"]["tolerations"]),
        (
            {"cpu": "1", "memory": "2Gi", "amd.com/gpu": "1"},
            [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        ),
    ),
    (
        "gpu_resource",
        "nvidia.com/mig-1g.10gb",
        lambda pod: (
            pod["spec"]["containers"][0]["resources"]["requests"],
            [t["key"] for t in pod["spec"]["tolerations"]],
        ),
        (
            {"cpu": "1", "memory": "2Gi", "nvidia.com/mig-1g.10gb": "1", "ephemeral-storage": "7Gi"},
            ["nvidia.com/mig-1g.10gb", "nvidia.com/gpu"],
        ),
    ),
    (
        "trainer_image",
        TRAINER.replace("a" * 64, "c" * 64),
        lambda pod: pod["spec"]["containers"][0]["image"],
        TRAINER.replace("a" * 64, "c" * 64),
    ),
    (
        "sync_image",
        SYNC.replace("b" * 64, "d" * 64),
        lambda pod: pod["spec"]["initContainers"][1]["image"],
        SYNC.replace("b" * 64, "d" * 64),
    ),
    (
        "training_bucket",
        "ml-runs",
        lambda pod: env_of(pod["spec"]["containers"][0])["KUBETRAIN_RUN_URI"].split("/")[2],
        "ml-runs",
    ),
]


@pytest.mark.parametrize(
    ("name", "value", "field", "expected"), SETTING_CASES, ids=[f"{c[0]}={c[1]}" for c in SETTING_CASES]
)
@pytest.mark.parametrize("source", ["env", "variable"])
def test_each_setting_reaches_the_pod(airflow_env, name, value, field, expected, source):
    setting = settings.SETTINGS[name]
    if source == "env":
        airflow_env.setenv(setting.env, value)
    else:
        airflow_env.setenv(f"AIRFLOW_VAR_{setting.variable.upper()}", value)
    images = {
        "image": None if name == "trainer_image" else TRAINER,
        "sync_image": None if name == "sync_image" else SYNC,
    }
    op = operator(gpus=1, **images)
    pod = build(op, context_for(op))
    assert field(pod) == expected
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_workload_identity_setting(airflow_env):
    airflow_env.setenv("KUBETRAIN_S3_SECRET", "")
    airflow_env.setenv("KUBETRAIN_SERVICE_ACCOUNT", "irsa-trainer")
    op = operator()
    pod = build(op, context_for(op))
    assert not any(c.get("envFrom") for c in pod["spec"]["initContainers"] + pod["spec"]["containers"])
    assert pod["spec"]["serviceAccountName"] == "irsa-trainer"
    assert pod["spec"]["automountServiceAccountToken"] is True

    airflow_env.delenv("KUBETRAIN_SERVICE_ACCOUNT")
    with pytest.raises(ValueError, match="workload identity.*needs service_account_name"):
        build(operator(), context_for(op))


def test_run_arguments_from_params_beat_the_settings(airflow_env):
    airflow_env.setenv("KUBETRAIN_NODE_SELECTOR", "pool=cpu")
    airflow_env.setenv("KUBETRAIN_IMAGE_PULL_SECRETS", "deployment-cred")
    airflow_env.setenv("KUBETRAIN_GPU_RESOURCE", "nvidia.com/gpu")
    op = operator(
        gpus="{{ params.gpus }}",
        node_selector="{{ params.node_selector }}",
        tolerations="{{ params.tolerations }}",
        image_pull_secrets="{{ params.image_pull_secrets }}",
        gpu_resource="{{ params.gpu_resource or '' }}",
    )
    params = {
        "node_selector": {"gpu-type": "a100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "image_pull_secrets": ["run-cred"],
        "gpu_resource": "nvidia.com/mig-3g.40gb",
    }
    pod = build(op, context_for(op, **params))
    assert pod["spec"]["nodeSelector"] == {"gpu-type": "a100"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "run-cred"}]
    assert [t["key"] for t in pod["spec"]["tolerations"]] == [
        "nvidia.com/mig-3g.40gb",
        "nvidia.com/gpu",
        "dedicated",
    ]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == "2"

    # Params left empty (null) fall back to the deployment's settings.
    empty = {"node_selector": None, "tolerations": None, "image_pull_secrets": None, "gpu_resource": None}
    op = operator(
        node_selector="{{ params.node_selector }}",
        tolerations="{{ params.tolerations }}",
        image_pull_secrets="{{ params.image_pull_secrets }}",
        gpu_resource="{{ params.gpu_resource or '' }}",
    )
    pod = build(op, context_for(op, **empty))
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "deployment-cred"}]


def test_the_run_s_choices_keep_the_providers_names_and_reach_the_pod_as_kubernetes_objects(airflow_env):
    """node_selector, tolerations and image_pull_secrets keep the provider's names and the values as given
    (a Param renders into them); the pod gets them as Kubernetes objects, and the next pod of the try the
    same values again."""
    op = operator(
        node_selector="{{ params.node_selector }}",
        tolerations="{{ params.tolerations }}",
        image_pull_secrets="{{ params.image_pull_secrets }}",
    )
    context = context_for(
        op,
        node_selector={"gpu-type": "a100"},
        tolerations=[{"key": "spot", "operator": "Exists"}],
        image_pull_secrets=["run-cred"],
    )
    op.render_template_fields(context)
    given = ({"gpu-type": "a100"}, [{"key": "spot", "operator": "Exists"}], ["run-cred"])
    assert (op.node_selector, op.tolerations, op.image_pull_secrets) == given
    for _ in range(2):  # a replaced pod (an interruption) is built from the same arguments
        pod = op.build_pod_request_obj(context)
        assert pod.spec.node_selector == {"gpu-type": "a100"}
        assert pod.spec.image_pull_secrets == [k8s.V1LocalObjectReference(name="run-cred")]
        assert [t.key for t in pod.spec.tolerations] == ["spot"]
        assert (op.node_selector, op.tolerations, op.image_pull_secrets) == given


@pytest.mark.parametrize(
    ("kwargs", "params", "message"),
    [
        # text where the operator takes an object: what '{{ params.x | tojson }}' renders in a DAG that
        # renders text
        (
            {"node_selector": '{"gpu-type": "a100"}'},
            {},
            'node_selector \'{"gpu-type": "a100"}\' is text, not a mapping',
        ),
        ({"node_selector": "{{ params.n }}"}, {"n": 3}, "node_selector 3 is not a mapping of node labels"),
        (
            {"node_selector": "{{ params.n }}"},
            {"n": {"a": 1}},
            "node_selector 'a'=1 is not a valid node label",
        ),
        ({"node_selector": "pool"}, {}, "node_selector item 'pool' is not key=value"),
        (
            {"tolerations": '[{"key": "spot", "operator": "Exists"}]'},
            {},
            'tolerations \'[{"key": "spot", "operator": "Exists"}]\' is not a list',
        ),
        (
            {"tolerations": "{{ params.t }}"},
            {"t": [{"key": "a", "operator": "Maybe"}]},
            "operator 'Maybe' must be Equal or Exists",
        ),
        ({"tolerations": "{{ params.t }}"}, {"t": ["spot"]}, "not a V1Toleration or a mapping"),
        ({"image_pull_secrets": '["regcred"]'}, {}, "image_pull_secrets '[\"regcred\"]' is text, not a list"),
        (
            {"image_pull_secrets": "{{ params.s }}"},
            {"s": 3},
            "image_pull_secrets 3 is not a list of Secret names",
        ),
        ({"arguments": '["--epochs=1"]'}, {}, "arguments '[\"--epochs=1\"]' is not a list: expected a list"),
        (
            {"arguments": "{{ params.a }}"},
            {"a": [["nested"]]},
            "arguments [['nested']] is not a list of strings",
        ),
        ({"cmds": "{{ params.a }}"}, {"a": {"python": 1}}, "cmds {'python': 1} is not a list of strings"),
        ({"experiment": "{{ params.e }}"}, {"e": ["x"]}, "experiment ['x'] is not text"),
    ],
)
def test_bad_run_arguments_fail_naming_the_value_and_what_was_expected(airflow_env, kwargs, params, message):
    op = operator(**kwargs)
    context = context_for(op, **params)
    if params:
        op.render_template_fields(context)
    # Text given as is (no rendering: a DAG that renders text hands the operator what its template wrote)
    with pytest.raises(ValueError, match=re.escape(message)):
        op.build_pod_request_obj(context)


def test_argument_lists_become_text(airflow_env):
    op = operator(cmds="{{ params.command }}", arguments="{{ params.args }}")
    context = context_for(
        op, command=["python", "-m", "trainer.dialogue"], args=["--dropout", 0.1, "--epochs", 3]
    )
    base = build(op, context)["spec"]["containers"][0]
    assert (base["command"], base["args"]) == (
        ["python", "-m", "trainer.dialogue"],
        ["--dropout", "0.1", "--epochs", "3"],
    )


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("KUBETRAIN_NODE_SELECTOR", "pool", "node_selector item 'pool' is not key=value"),
        (
            "KUBETRAIN_TOLERATIONS",
            '[{"key": "a", "operator": "Maybe"}]',
            "operator 'Maybe' must be Equal or Exists",
        ),
        ("KUBETRAIN_GPU_RESOURCE", "gpu", "gpu_resource='gpu' is not an extended resource name"),
        ("KUBETRAIN_NAMESPACE", "ML_Training", "namespace 'ML_Training' is not a valid DNS-1123 label"),
    ],
)
def test_bad_settings_fail_before_any_pod_is_created(airflow_env, name, value, message):
    airflow_env.setenv(name, value)
    op = operator(gpus=1)
    with pytest.raises(ValueError, match=message):
        build(op, context_for(op))


def test_bad_resources_fail_before_any_pod_is_created(airflow_env):
    op = operator(memory="lots")
    with pytest.raises(ValueError, match="memory='lots' is not a Kubernetes quantity"):
        build(op, context_for(op))


GI = 1024**3


def storage_of(pod: dict) -> dict[str, object]:
    """Each emptyDir's sizeLimit and each container's ephemeral-storage (request, limit)."""
    found: dict[str, object] = {
        v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["spec"]["volumes"] if "emptyDir" in v
    }
    for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        res = c["resources"]
        found[c["name"]] = (res["requests"].get("ephemeral-storage"), res["limits"].get("ephemeral-storage"))
    return found


@pytest.mark.parametrize(
    ("dataset_bytes", "data_size", "expected"),
    [
        # the stage task's XCom (an int) and a Jinja pull (text) alike
        (10 * GI, None, {"data": "21Gi", "base": ("28Gi", "28Gi"), "stage-in": ("25856Mi", "25856Mi")}),
        (
            "{{ params.total_bytes }}",
            None,
            {"data": "21Gi", "base": ("28Gi", "28Gi"), "stage-in": ("25856Mi", "25856Mi")},
        ),
        (
            10 * GI,
            "{{ params.data_size }}",
            {"data": "64Gi", "base": ("71Gi", "71Gi"), "stage-in": ("69888Mi", "69888Mi")},
        ),
        (None, "", {"data": None, "base": ("7Gi", None), "stage-in": ("4352Mi", None)}),
    ],
)
def test_the_dataset_size_sizes_the_pods_storage(airflow_env, dataset_bytes, data_size, expected):
    op = operator(dataset_bytes=dataset_bytes, data_size=data_size)
    pod = build(op, context_for(op, total_bytes=10 * GI, data_size="64Gi"))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    found = storage_of(pod)
    assert {k: found[k] for k in expected} == expected
    limited = expected["data"] is not None
    assert (found["checkpoints"], found["output"]) == (("4Gi", "2Gi") if limited else (None, None))
    assert found["checkpoint-sync"] == ("256Mi", "256Mi" if limited else None)


def test_checkpoint_and_output_sizes_are_arguments(airflow_env):
    op = operator(dataset_bytes=GI, checkpoint_size="{{ params.ckpt }}", output_size="1Gi")
    found = storage_of(build(op, context_for(op, ckpt="40Gi")))
    assert (found["data"], found["checkpoints"], found["output"]) == ("3Gi", "40Gi", "1Gi")
    assert found["base"] == ("45Gi", "45Gi")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"data_size": "{{ params.data_size }}"},
            "data_size='50 gigs' is not a Kubernetes quantity: expected a size such as '50Gi'",
        ),
        (
            {"dataset_bytes": "{{ params.data_size }}"},
            "dataset_bytes='50 gigs' is not valid: expected the staged manifest's total_bytes",
        ),
        ({"dataset_bytes": 10 * GI, "data_size": "2Gi"}, "data_size='2Gi' is smaller than the dataset"),
    ],
)
def test_bad_sizes_fail_before_any_pod_is_created(airflow_env, kwargs, message):
    op = operator(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        build(op, context_for(op, data_size="50 gigs"))


class XComTaskInstance(TaskInstance):
    """A task instance whose upstream tasks have pushed ``xcoms`` ({(task_id, key): value})."""

    def __init__(self, *args, xcoms: dict[tuple[str, str], object], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str, key: str, **_: object) -> object:
        return self.xcoms[(task_ids, key)]


@pytest.mark.parametrize("dag_file", ["train_image_classifier.py", "train_dialogue_transformer.py"])
@pytest.mark.parametrize(("data_size", "data", "base"), [(None, "44Gi", "51Gi"), ("100Gi", "100Gi", "107Gi")])
def test_the_training_dags_size_the_pod_from_the_staged_dataset(airflow_env, dag_file, data_size, data, base):
    """The DAG's train task gets the stage task's total_bytes and prepared_bytes (2 x 20Gi + 3Gi + the
    1Gi margin) and the data_size Param, which wins."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / dag_file))
    assert bag.import_errors == {}
    dag = bag.dags[Path(dag_file).stem]
    train = dag.get_task("train")
    xcoms = {
        ("stage_dataset", "total_bytes"): 20 * GI,
        ("stage_dataset", "prepared_bytes"): 3 * GI,
        ("stage_dataset", "manifest_uri"): "s3://training/manifests/digits/3f2a9c0d1e4b5a69.json",
        ("stage_dataset", "version"): "3f2a9c0d1e4b5a69",
        ("check_new", "image"): TRAINER,
    }
    ti = XComTaskInstance(dag.dag_id, "train", xcoms=xcoms)
    params = {name: dag.params[name] for name in dag.params}
    params["data_size"] = data_size
    context = {"ti": ti, "task_instance": ti, "run_id": RUN_ID, "dag": dag, "params": params}
    train.render_template_fields(context)
    pod = ApiClient().sanitize_for_serialization(train.build_pod_request_obj(context, dry_run=True))
    found = storage_of(pod)
    assert (found["data"], found["checkpoints"], found["output"]) == (data, "4Gi", "2Gi")
    assert found["base"] == (base, base)


def test_image_precedence(airflow_env):
    assert pod_spec.resolve_image(None, "trainer") == "localhost:5000/kubetrain/trainer:latest"
    airflow_env.setenv("KUBETRAIN_REGISTRY", "127.0.0.1:5123")
    assert pod_spec.resolve_image(None, "sync") == "127.0.0.1:5123/kubetrain/sync:latest"
    airflow_env.setenv("KUBETRAIN_TRAINER_IMAGE", "127.0.0.1:5123/kubetrain/trainer:env")
    assert pod_spec.resolve_image(None, "trainer") == "127.0.0.1:5123/kubetrain/trainer:env"
    # Environment-backed Variables win over the environment, as the build DAG's Variable does.
    airflow_env.setenv("AIRFLOW_VAR_KUBETRAIN_TRAINER_IMAGE", "127.0.0.1:5123/kubetrain/trainer:variable")
    assert pod_spec.resolve_image(None, "trainer") == "127.0.0.1:5123/kubetrain/trainer:variable"
    assert pod_spec.resolve_image("example.org/explicit:1", "trainer") == "example.org/explicit:1"
    with pytest.raises(ValueError, match="unknown image kind 'builder'"):
        pod_spec.resolve_image(None, "builder")


# -- images are pinned to the digest the registry has when the pod is submitted -----------------------------


@pytest.fixture
def registry(tmp_path, airflow_env):
    reg = start_registry(tmp_path / "registry")
    try:
        yield reg
    finally:
        reg.stop()


def test_images_are_pinned_to_their_digest_when_the_task_runs(registry, airflow_env, tmp_path):
    client = registry.client()
    first = push_busybox_base(client, "kubetrain/trainer", "build", tmp_path / "t1")
    sync = push_busybox_base(client, "kubetrain/sync", "latest", tmp_path / "s1")
    for name, value in registry.conn_env("kubetrain_registry_default").items():
        airflow_env.setenv(name, value)
    airflow_env.setenv("KUBETRAIN_REGISTRY", registry.host)
    op = operator(image=None, sync_image=None)  # created before the image is published, as at parse time
    airflow_env.setenv("AIRFLOW_VAR_KUBETRAIN_TRAINER_IMAGE", f"{registry.host}/kubetrain/trainer:build")

    pod = build(op, context_for(op))
    base, stage_in = pod["spec"]["containers"][0], pod["spec"]["initContainers"][0]
    assert base["image"] == f"{registry.host}/kubetrain/trainer@{first}"
    assert stage_in["image"] == f"{registry.host}/kubetrain/sync@{sync}"
    assert (
        env_of(base)["KUBETRAIN_IMAGE"] == base["image"] and env_of(base)["KUBETRAIN_CODE_VERSION"] == first
    )

    # The tag moves: the next run pins the new image.
    second = push_busybox_base(
        client, "kubetrain/trainer", "build", tmp_path / "t2", extra_layers=[_layer(tmp_path / "extra")]
    )
    assert second != first
    op = operator(image=None, sync_image=None)
    assert (
        build(op, context_for(op))["spec"]["containers"][0]["image"]
        == f"{registry.host}/kubetrain/trainer@{second}"
    )

    with pytest.raises(
        ImageNotFoundError, match=rf"{registry.host}/kubetrain/trainer:gone is not in registry"
    ):
        build(operator(image=f"{registry.host}/kubetrain/trainer:gone"), context_for(op))


def _layer(path: Path):
    from kubetrain.imagebuild.layer import write_layer
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP

    path.mkdir()
    (path / "code.py").write_text("print('new code')\n")
    return write_layer(path, path.with_suffix(".tar.gz")).blob(OCI_LAYER_GZIP)


def test_an_unreachable_registry_fails_naming_the_image_and_a_digest_needs_no_registry(airflow_env):
    port = free_port()  # nothing listens here
    image = f"127.0.0.1:{port}/kubetrain/trainer:latest"
    op = operator(image=image)
    with pytest.raises(ImageResolutionError, match=rf"cannot resolve image {image} to a digest.*@sha256"):
        build(op, context_for(op))
    pinned = f"127.0.0.1:{port}/kubetrain/trainer@sha256:" + "e" * 64
    op = operator(image=pinned)
    assert build(op, context_for(op))["spec"]["containers"][0]["image"] == pinned


# -- the provider's methods this subclass overrides or calls, pinned to the signatures it relies on ---------


def test_provider_methods_the_subclass_relies_on():
    def parameters(function) -> list[str]:
        return list(inspect.signature(function).parameters)

    assert parameters(KubernetesPodOperator.build_pod_request_obj) == ["self", "context", "dry_run"]
    assert parameters(KubernetesPodOperator.await_pod_start) == ["self", "pod"]
    assert parameters(KubernetesPodOperator.cleanup) == [
        "self",
        "pod",
        "remote_pod",
        "xcom_result",
        "context",
    ]
    assert parameters(KubernetesPodOperator.trigger_reentry) == ["self", "context", "event"]
    assert parameters(BaseOperator.defer) == ["self", "trigger", "method_name", "kwargs", "timeout"]
    assert parameters(PodManager.read_pod) == ["self", "pod"]
    assert parameters(PodManager.read_pod_events)[:2] == ["self", "pod"]
    # The pod operator defers on a plain KubernetesPodTrigger, which the subclass extends
    # (test_the_provider_defers_on_a_plain_pod_trigger_which_the_subclass_replaces).
    classpath, kwargs = KubernetesPodTrigger(
        pod_name="p", pod_namespace="n", trigger_start_time=None, base_container_name="base"
    ).serialize()
    assert classpath == "airflow.providers.cncf.kubernetes.triggers.pod.KubernetesPodTrigger"
    assert set(kwargs) <= set(inspect.signature(KubernetesPodTrigger.__init__).parameters)
    # The trigger reads the pod and its events through its hook.
    assert inspect.signature(KubernetesPodTrigger.hook.func).return_annotation in (
        "AsyncKubernetesHook",
        AsyncKubernetesHook,
    )
    assert parameters(AsyncKubernetesHook.get_pod)[:3] == ["self", "name", "namespace"]
    assert parameters(AsyncKubernetesHook.get_pod_events)[:3] == ["self", "name", "namespace"]
    # Logs of a deferred pod: the provider's trigger reads the base container's log every
    # logging_interval through its pod manager, which TrainingPodTrigger replaces with one that
    # reads every container; the task, when it resumes, reads the base container's log again
    # only with get_logs (the two tests below run them).
    assert isinstance(inspect.getattr_static(KubernetesPodTrigger, "pod_manager"), functools.cached_property)
    assert parameters(AsyncPodManager.fetch_container_logs_before_current_sec) == [
        "self",
        "pod",
        "container_name",
        "since_time",
    ]
    assert parameters(AsyncKubernetesHook.read_logs) == [
        "self",
        "name",
        "namespace",
        "container_name",
        "since_seconds",
    ]
    assert parameters(parse_log_line) == ["line"]
    # attributes of the provider's objects that TrainingPodManager and TrainingPodTrigger use
    marker = object()
    assert PodManager(kube_client=marker)._client is marker
    trigger = KubernetesPodTrigger(
        pod_name="p", pod_namespace="n", trigger_start_time=None, base_container_name="base"
    )
    assert trigger._fired_event is False


def test_the_provider_defers_on_a_plain_pod_trigger_which_the_subclass_replaces(airflow_env):
    """KubernetesPodOperator.invoke_defer_method defers on a plain KubernetesPodTrigger; the subclass's
    defer() swaps exactly that type for a TrainingPodTrigger with the provider's arguments."""
    op = operator(logging_interval=7)
    op.pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="train-digits-x1", namespace="ml"))
    with pytest.raises(TaskDeferred) as deferred:
        op.invoke_defer_method()
    trigger = deferred.value.trigger
    assert type(trigger) is TrainingPodTrigger, (
        f"the provider deferred on {type(trigger).__qualname__}: TrainingPodOperator.defer replaces only a "
        "plain KubernetesPodTrigger"
    )
    assert deferred.value.method_name == "trigger_reentry"
    assert (trigger.pod_name, trigger.pod_namespace, trigger.base_container_name) == (
        "train-digits-x1",
        "ml",
        "base",
    )
    assert (trigger.logging_interval, trigger.log_containers) == (7, ["stage-in", "checkpoint-sync"])


def test_the_deferred_trigger_carries_references_to_the_credentials_never_the_credentials(
    airflow_env, tmp_path, monkeypatch
):
    """The trigger's arguments are stored in the metadata database (the trigger table): the provider's
    trigger carries the kubeconfig it read (with its token) and the connection's extras; the subclass's
    carries the kubeconfig's path and the connection's id, and the triggerer reads both itself."""
    token = "tok-" + uuid.uuid4().hex
    config = json.loads(kubeconfig(tmp_path / "worker-kubeconfig", "https://127.0.0.1:9").read_text())
    config["users"][0]["user"] = {"token": token}
    (tmp_path / "worker-kubeconfig").write_text(json.dumps(config))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "worker-kubeconfig"))
    extra_secret = "extra-" + uuid.uuid4().hex
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps({"conn_type": "kubernetes", "extra": {"namespace": "ml", "note": extra_secret}}),
    )
    op = operator()
    op.pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="train-digits-x1", namespace="ml"))
    with pytest.raises(TaskDeferred) as deferred:
        op.invoke_defer_method()
    stored = json.dumps(deferred.value.trigger.serialize()[1], default=str)
    assert token not in stored and extra_secret not in stored, stored
    _, kwargs = deferred.value.trigger.serialize()
    assert "config_dict" not in kwargs and "connection_extras" not in kwargs
    assert kwargs["config_file"] == str(tmp_path / "worker-kubeconfig")
    assert kwargs["kubernetes_conn_id"] == "kubernetes_default"
    # the triggerer's trigger, as it is built from the stored arguments, reads the kubeconfig itself
    hook = TrainingPodTrigger(**kwargs).hook
    assert hook.config_dict["users"][0]["user"]["token"] == token
    assert hook.conn_id == "kubernetes_default"
    with pytest.raises(
        ValueError, match="takes no config_dict: its arguments are stored in the metadata database"
    ):
        TrainingPodTrigger(**kwargs, config_dict=config)


def _ended_pod(base_exit: int, phase: str) -> k8s.V1Pod:
    terminated = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=base_exit))
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="train-digits-x1", namespace="ml"),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base")]),
        status=k8s.V1PodStatus(
            phase=phase,
            container_statuses=[
                k8s.V1ContainerStatus(
                    name="base", image="i", image_id="i", ready=False, restart_count=0, state=terminated
                )
            ],
        ),
    )


class _GonePodManager:
    """The API's answers once the pod is deleted (a preemption or a drain right after it ended): 404."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def read_pod(self, pod):
        from kubernetes.client.exceptions import ApiException

        raise ApiException(status=404, reason="Not Found")

    def delete_pod(self, pod):
        self.deleted.append(pod.metadata.name)


@pytest.mark.parametrize(
    ("base_exit", "phase", "interrupted"),
    [
        (0, "Succeeded", False),  # finished, then deleted: finished
        (137, "Failed", True),  # killed, then deleted: an interruption, resumed in a new pod
    ],
    ids=["finished-then-deleted", "killed-then-deleted"],
)
def test_a_pod_deleted_after_its_training_container_ended_is_judged_by_that_end(
    airflow_env, base_exit, phase, interrupted
):
    """A pod gone when the task reads it again (deleted by Kueue's preemption after its training
    container ended) was interrupted only if the training container had not exited 0."""
    from kubetrain.operators.resumable import PodInterrupted

    op = operator()
    manager = _GonePodManager()
    op.__dict__["pod_manager"] = manager
    pod = _ended_pod(base_exit, phase)
    if interrupted:
        with pytest.raises(PodInterrupted, match="pod train-digits-x1: deleted"):
            op.cleanup(pod=pod, remote_pod=pod)
    else:
        op.cleanup(pod=pod, remote_pod=pod)  # no interruption: no new pod, the task succeeds
        assert manager.deleted == ["train-digits-x1"]  # the base class's on_finish_action, as usual


class PodAPI:
    """What the Kubernetes API answers about one pod: its base container runs until the pod has been
    read ``polls`` times, then the pod has succeeded; each container's log is one line. It serves
    both hooks' calls (the trigger's async ones and the operator's) and records every log read."""

    def __init__(self, polls: int) -> None:
        self.polls, self.reads = polls, 0
        self.log_reads: list[tuple[str, bool]] = []  # (container, whether the base container still ran)

    @property
    def running(self) -> bool:
        return self.reads < self.polls

    def pod(self) -> k8s.V1Pod:
        def status(name: str, running: bool) -> k8s.V1ContainerStatus:
            state = (
                k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at="2026-11-22T04:00:00Z"))
                if running
                else k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=0))
            )
            return k8s.V1ContainerStatus(
                name=name, image="i", image_id="i", ready=running, restart_count=0, state=state
            )

        return k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="train-digits-x1", namespace="ml"),
            spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base")]),
            status=k8s.V1PodStatus(
                phase="Running" if self.running else "Succeeded",
                conditions=[k8s.V1PodCondition(type="PodScheduled", status="True")],
                init_container_statuses=[status("stage-in", False), status("checkpoint-sync", self.running)],
                container_statuses=[status("base", self.running)],
            ),
        )

    async def get_pod(self, name: str, namespace: str) -> k8s.V1Pod:
        self.reads += 1
        return self.pod()

    async def get_pod_events(self, name: str, namespace: str) -> k8s.CoreV1EventList:
        return k8s.CoreV1EventList(items=[])

    async def read_logs(
        self, name: str, namespace: str, container_name: str, since_seconds=None
    ) -> list[str]:
        self.log_reads.append((container_name, self.running))
        return [f"2026-11-22T04:00:0{len(self.log_reads) % 10}Z {container_name} says hello"]

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs) -> k8s.V1Pod:
        return self.pod()

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str, **kwargs) -> list[bytes]:
        self.log_reads.append((container, self.running))
        return [b"base says hello again\n"]


@pytest.mark.timeout(60)
def test_the_providers_wait_reads_logs_through_the_triggers_pod_manager():
    """While the base container runs, the provider's trigger calls its pod manager every logging_interval;
    TrainingPodTrigger's pod manager then reads every container's log, not only the base container's."""
    api = PodAPI(polls=6)
    trigger = TrainingPodTrigger(
        pod_name="train-digits-x1",
        pod_namespace="ml",
        trigger_start_time=datetime.now(UTC),
        base_container_name="base",
        poll_interval=0.01,
        startup_check_interval=0.01,
        logging_interval=0.001,
        get_logs=True,
        stage_in_timeout=60,
        unschedulable_grace=60,
        log_containers=["stage-in", "checkpoint-sync"],
    )
    trigger.__dict__["hook"] = api  # the trigger's hook is a cached property: the stand-in API serves it

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "success", event
    while_running = {container for container, running in api.log_reads if running}
    assert while_running == {"stage-in", "checkpoint-sync", "base"}, (
        f"log reads while the pod ran: {api.log_reads}: the provider's wait no longer reads logs through "
        "trigger.pod_manager.fetch_container_logs_before_current_sec"
    )
    assert trigger.last_log_time is not None  # the provider keeps the time the pod manager returns


@pytest.mark.parametrize("flushed", [True, False], ids=["trigger-read-the-logs", "trigger-did-not"])
def test_the_resumed_task_reads_the_base_log_again_only_when_the_trigger_did_not(airflow_env, flushed):
    """The provider's trigger_reentry reads the base container's log when get_logs is set; the subclass
    clears it for the one call when the trigger read every log to its end, so no line is logged twice."""
    op = operator(on_finish_action="keep_pod")
    api = PodAPI(polls=0)
    op.__dict__["hook"] = SimpleNamespace(get_pod=lambda name, namespace: api.pod())
    op.__dict__["client"] = api
    event = {"status": "success", "name": "train-digits-x1", "namespace": "ml"}
    if flushed:
        event[LOGS_FLUSHED_KEY] = True
    op.trigger_reentry(context_for(op), event)
    assert api.log_reads == ([] if flushed else [("base", False)])
    assert op.get_logs is True  # restored after the call


def test_trigger_serializes_to_plain_arguments_and_back():
    trigger = TrainingPodTrigger(
        pod_name="p",
        pod_namespace="n",
        trigger_start_time=None,
        base_container_name="base",
        startup_timeout=120,
        schedule_timeout=600,
        stage_in_timeout=3600,
        unschedulable_grace=30,
        logging_interval=15,
        log_containers=["stage-in", "checkpoint-sync"],
        gpu_resource="nvidia.com/gpu",
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "kubetrain.triggers.pod.TrainingPodTrigger"
    json.dumps({k: v for k, v in kwargs.items() if k != "trigger_start_time"})  # plain arguments
    again = TrainingPodTrigger(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert (again.logging_interval, again.log_containers, again.gpu_resource) == (
        15,
        ["stage-in", "checkpoint-sync"],
        "nvidia.com/gpu",
    )
    startup = again.startup()
    assert (startup.stage_in_timeout, startup.unschedulable_grace, startup.startup_timeout) == (3600, 30, 120)


# -- against the dev stack's Kubernetes API, with no GPU to give -------------------------------------------


@pytest.fixture
def gpu_less_cluster(tmp_path, airflow_env, devstack):
    from tests.devstack.support import start_server, stop_server

    api, proc = start_server(tmp_path, "--strict-gpu", mirror=devstack.load_state()["mirror"])
    try:
        airflow_env.setenv(
            "AIRFLOW_CONN_KUBERNETES_DEFAULT",
            json.dumps(
                {
                    "conn_type": "kubernetes",
                    "extra": {"kube_config_path": str(api.kubeconfig), "namespace": "default"},
                }
            ),
        )
        from kubernetes import client
        from kubernetes import config as kube_config

        yield client.CoreV1Api(kube_config.new_client_from_config(str(api.kubeconfig)))
    finally:
        stop_server(proc)


def _pods_left(api) -> list[str]:
    pods = api.list_namespaced_pod("default", label_selector="kubetrain.io/dag-id=train_digits").items
    return [p.metadata.name for p in pods if not p.metadata.deletion_timestamp]


def _unschedulable(**kwargs) -> TrainingPodOperator:
    # No autoscaler will come: the pod fails after the grace, long before the schedule timeout.
    return operator(
        gpus=1, namespace="default", unschedulable_grace_seconds=2, startup_check_interval_seconds=1, **kwargs
    )


@pytest.mark.timeout(120)
def test_unschedulable_pod_fails_once_with_the_scheduler_message(gpu_less_cluster):
    op = _unschedulable(deferrable=False)
    context = context_for(op)
    op.render_template_fields(context)
    with pytest.raises(
        PodUnschedulableError, match=r"cannot be scheduled: FailedScheduling: .*nvidia\.com/gpu"
    ) as info:
        op.execute(context)
    assert isinstance(info.value, AirflowFailException)  # not retried
    assert _pods_left(gpu_less_cluster) == []  # deleted on failure


@pytest.mark.timeout(120)
def test_unschedulable_pod_fails_once_with_the_scheduler_message_when_deferred(gpu_less_cluster):
    op = _unschedulable()
    context = context_for(op)
    op.render_template_fields(context)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    trigger = deferred.value.trigger
    assert isinstance(trigger, TrainingPodTrigger) and trigger.unschedulable_grace == 2
    trigger = TrainingPodTrigger(**trigger.serialize()[1])  # as the triggerer builds it

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert (event["status"], event["kubetrain_startup"]) == ("timeout", "unschedulable"), event
    with pytest.raises(PodUnschedulableError, match=r"FailedScheduling: .*nvidia\.com/gpu"):
        getattr(op, deferred.value.method_name)(context, event)
    assert _pods_left(gpu_less_cluster) == []


def test_dry_run_needs_no_registry_or_cluster(airflow_env, capsys):
    op = operator(image=f"127.0.0.1:{free_port()}/kubetrain/trainer:{uuid.uuid4().hex[:6]}")
    op.dry_run()
    assert "kind: Pod" in capsys.readouterr().out


def test_exit_codes_that_fail_without_retries_are_the_contracts():
    """One table (kubetrain_contract.exit_codes), which the trainers exit with and the operators read: bad
    parameters, divergence, unusable data and a missing DATA_DIR fail without retries; not 75, which resumes."""
    from kubetrain.operators.interruption import NO_RETRY_EXIT_CODES
    from kubetrain_contract import exit_codes

    assert (
        sorted(NO_RETRY_EXIT_CODES)
        == [exit_codes.EXIT_USAGE, exit_codes.EXIT_DIVERGED, exit_codes.EXIT_DATAERR, exit_codes.EXIT_NOINPUT]
        == [2, 3, 65, 66]
    )
    assert (
        exit_codes.EXIT_PREEMPTED not in NO_RETRY_EXIT_CODES
        and exit_codes.EXIT_FAILURE not in NO_RETRY_EXIT_CODES
    )
    assert NO_RETRY_EXIT_CODES[65] == "unusable data (empty, a single class, no parsable pairs, ...)"


def test_a_queued_run_carries_kueues_labels(airflow_env):
    op = operator(local_queue="{{ params.queue }}", priority_class="{{ params.priority }}")
    labels = build(op, context_for(op, queue="training", priority="high"))["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "training"
    assert labels["kueue.x-k8s.io/priority-class"] == "high"
    plain = operator()
    assert not any(
        k.startswith("kueue.x-k8s.io/") for k in build(plain, context_for(plain))["metadata"]["labels"]
    )
    airflow_env.setenv("KUBETRAIN_QUEUE", "team-a")
    default = operator()
    assert build(default, context_for(default))["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"local_queue": "Team_A"}, "queue 'Team_A' is not a Kueue object name"),
        ({"local_queue": "gpus", "priority_class": "-high"}, "priority '-high' is not a Kueue object name"),
        ({"priority_class": "high"}, "priority 'high' needs a queue"),
        ({"local_queue": "gpus", "queue_timeout_seconds": 0}, "queue_timeout 0 is not valid"),
    ],
)
def test_a_bad_queue_setting_is_refused_naming_it(airflow_env, kwargs, message):
    op = operator(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        build(op, context_for(op))
        op.pod_startup()
