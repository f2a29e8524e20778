"""TrainingPodOperator: the pod it asks for, and how an unschedulable pod fails."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import kubernetes_validate
import pytest
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.utils.pod_manager import PodLaunchTimeoutException
from airflow.sdk import DAG
from airflow.sdk.exceptions import TaskDeferred
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s
from test_pod_spec import K8S_VERSION, policy_violations

from include.devstack.stack import AIRFLOW_PYTHON, REPO, free_port, wait_http
from kubetrain.operators.training import (
    POD_OPERATOR_ARGUMENTS,
    PodUnschedulableError,
    TrainingPodOperator,
    scheduling_problem,
)
from kubetrain.pod_spec import resolve_image

RUN_ID = "manual__2026-11-22T04:00:00.123456+00:00"
KUBEAPI_MAIN = REPO / "include" / "devstack" / "kubeapi" / "__main__.py"
SECRET_VALUE = "sEcReT-value-that-must-not-leak-42"


class TaskInstance:
    """The parts of a running task instance that the operator reads."""

    def __init__(self, dag_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> None:
        self.dag_id, self.task_id, self.try_number, self.map_index = dag_id, task_id, try_number, map_index
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


def context_for(operator, try_number: int = 1, map_index: int = -1) -> dict:
    ti = TaskInstance(operator.dag_id, operator.task_id, try_number, map_index)
    return {
        "ti": ti,
        "task_instance": ti,
        "run_id": RUN_ID,
        "dag": operator.dag,
        "params": {"gpus": 2, "epochs": 5},
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
    for name in (
        "AIRFLOW_VAR_KUBETRAIN_TRAINER_IMAGE",
        "AIRFLOW_VAR_KUBETRAIN_SYNC_IMAGE",
        "KUBETRAIN_TRAINER_IMAGE",
        "KUBETRAIN_SYNC_IMAGE",
        "KUBETRAIN_REGISTRY",
        "KUBETRAIN_TRAINING_BUCKET",
        "AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET",
    ):
        monkeypatch.delenv(name, raising=False)
    # Credentials in the Airflow worker's environment must never end up in the pod.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_VALUE)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + SECRET_VALUE[:12])
    return monkeypatch


def operator(**kwargs) -> TrainingPodOperator:
    with DAG("train_digits", schedule=None):
        return TrainingPodOperator(
            task_id="train",
            cmds=["python", "-m", "trainer.image_classifier"],
            arguments=["--epochs", "{{ params.epochs }}"],
            dataset_manifest="s3://training/manifests/digits/3f2a9c0d1e4b5a69.json",
            dataset_version="3f2a9c0d1e4b5a69",
            experiment="digits",
            **kwargs,
        )


def build(op: TrainingPodOperator, context: dict) -> dict:
    op.render_template_fields(context)
    return ApiClient().sanitize_for_serialization(op.build_pod_request_obj(context))


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
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300
    assert base["terminationMessagePolicy"] == "FallbackToLogsOnError"
    labels = pod["metadata"]["labels"]
    assert labels["kubetrain.io/dag-id"] == "train_digits" and labels["kubetrain.io/experiment"] == "digits"
    assert labels["kubetrain.io/run-id"].startswith("manual__2026-11-22T04-00-00.123456-00-00-")
    env = {e["name"]: e.get("value") for e in base["env"]}
    assert env["KUBETRAIN_RUN_URI"] == context["ti"].xcom["run_uri"]
    assert env["KUBETRAIN_RUN_URI"].startswith(
        "s3://training/runs/train_digits/manual__2026-11-22T04_00_00.123456_00_00-"
    )


def test_run_uri_is_the_same_for_every_try_and_differs_per_trial(airflow_env):
    def run_uri(**kwargs):
        op = operator()
        pod = build(op, context_for(op, **kwargs))
        return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}["KUBETRAIN_RUN_URI"]

    first = run_uri(try_number=1)
    assert run_uri(try_number=3) == first
    assert run_uri(map_index=2) == first + "/trials/2"


def test_images_are_resolved_when_the_task_runs(airflow_env):
    op = operator()  # created before the image Variables exist, as at DAG parse time

    def images():
        spec = build(op, context_for(op))["spec"]
        return spec["containers"][0]["image"], spec["initContainers"][0]["image"]

    # Environment-backed Variables win over the metadata database, whatever the build DAG left there.
    airflow_env.setenv("AIRFLOW_VAR_KUBETRAIN_TRAINER_IMAGE", "127.0.0.1:5123/kubetrain/trainer:build-1")
    airflow_env.setenv("AIRFLOW_VAR_KUBETRAIN_SYNC_IMAGE", "127.0.0.1:5123/kubetrain/sync:build-1")
    assert images() == ("127.0.0.1:5123/kubetrain/trainer:build-1", "127.0.0.1:5123/kubetrain/sync:build-1")
    airflow_env.setenv("AIRFLOW_VAR_KUBETRAIN_TRAINER_IMAGE", "127.0.0.1:5123/kubetrain/trainer:build-2")
    assert images()[0] == "127.0.0.1:5123/kubetrain/trainer:build-2"

    explicit = operator(image="example.org/trainer@sha256:" + "a" * 64)
    pod = build(explicit, context_for(explicit))
    assert pod["spec"]["containers"][0]["image"] == "example.org/trainer@sha256:" + "a" * 64
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["KUBETRAIN_CODE_VERSION"] == "sha256:" + "a" * 64


def test_image_precedence(monkeypatch):
    variable = f"kubetrain_test_image_{uuid.uuid4().hex}"  # a Variable nobody else sets
    env = "KUBETRAIN_TEST_IMAGE"
    for name in ("KUBETRAIN_REGISTRY", env):
        monkeypatch.delenv(name, raising=False)

    def resolve(explicit=None):
        return resolve_image(explicit, variable=variable, env=env, repository="kubetrain/trainer")

    assert resolve() == "localhost:5000/kubetrain/trainer:latest"
    monkeypatch.setenv("KUBETRAIN_REGISTRY", "127.0.0.1:5123")
    assert resolve() == "127.0.0.1:5123/kubetrain/trainer:latest"
    monkeypatch.setenv(env, "127.0.0.1:5123/kubetrain/trainer:env")
    assert resolve() == "127.0.0.1:5123/kubetrain/trainer:env"
    monkeypatch.setenv(f"AIRFLOW_VAR_{variable.upper()}", "127.0.0.1:5123/kubetrain/trainer:variable")
    assert resolve() == "127.0.0.1:5123/kubetrain/trainer:variable"
    assert resolve("example.org/explicit:1") == "example.org/explicit:1"


def test_defaults_and_refused_arguments():
    pod = operator().pod_operator()
    assert isinstance(pod, KubernetesPodOperator)
    assert pod.deferrable is True
    assert pod.on_finish_action.value == "delete_pod"
    assert pod.get_logs is True
    assert pod.schedule_timeout_seconds == 300
    assert pod.do_xcom_push is False
    assert pod.task_id == "train" and pod.dag_id == "train_digits"
    with pytest.raises(ValueError, match="builds container_resources itself"):
        operator(container_resources=k8s.V1ResourceRequirements(limits={"cpu": "1"}))
    with pytest.raises(TypeError, match="no_such_argument"):
        operator(no_such_argument=1)


def test_pod_operator_arguments_match_the_installed_provider():
    """The DAG-side operator knows the pod operator's arguments without importing it: keep the lists current."""
    parameters = set(inspect.signature(KubernetesPodOperator.__init__).parameters) - {"self", "kwargs"}
    assert parameters == POD_OPERATOR_ARGUMENTS
    assert set(KubernetesPodOperator.template_fields) <= set(TrainingPodOperator.template_fields)


def test_pod_operator_arguments_are_passed_on_and_rendered(airflow_env):
    op = operator(
        namespace="{{ params.namespace }}",
        env_vars={"EPOCHS": "{{ params.epochs }}"},
        labels={"team": "vision"},
        annotations={"note": "{{ params.gpus }} gpus"},
        service_account_name="trainer",
        startup_check_interval_seconds=2,
    )
    context = context_for(op)
    context["params"]["namespace"] = "ml-{{ 'training' }}"  # a Param value is rendered once, not twice
    pod = build(op, context)
    assert pod["metadata"]["namespace"] == "ml-{{ 'training' }}"
    assert pod["metadata"]["labels"]["team"] == "vision"
    assert pod["metadata"]["annotations"]["note"] == "2 gpus"
    assert pod["spec"]["serviceAccountName"] == "trainer"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["EPOCHS"] == "5"
    assert op.pod_operator().startup_check_interval_seconds == 2


def test_dag_file_does_not_load_the_kubernetes_clients():
    """Declaring a training task must not import the pod operator or the kubernetes client (parse time)."""
    code = (
        "import sys, runpy; runpy.run_path('dags/train_image_classifier.py');"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('kubernetes', 'kubernetes_asyncio', 'boto3',"
        " 'tensorflow') or m == 'airflow.providers.cncf.kubernetes.operators.pod');"
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "plugins")},  # as Airflow's plugins folder
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_bad_resources_fail_before_any_pod_is_created(airflow_env):
    op = operator(memory="lots")
    with pytest.raises(ValueError, match="memory='lots' is not a Kubernetes quantity"):
        build(op, context_for(op))


def _event(reason: str, message: str) -> k8s.CoreV1Event:
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(name="e"),
        involved_object=k8s.V1ObjectReference(),
        reason=reason,
        message=message,
    )


def _pod(phase: str, conditions: list[k8s.V1PodCondition] | None = None) -> k8s.V1Pod:
    return k8s.V1Pod(status=k8s.V1PodStatus(phase=phase, conditions=conditions))


@pytest.mark.parametrize(
    ("pod", "events", "expected"),
    [
        (
            _pod("Pending"),
            [
                _event("Scheduled", "x"),
                _event("FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."),
            ],
            "FailedScheduling: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        ),
        (
            _pod(
                "Pending",
                [
                    k8s.V1PodCondition(
                        type="PodScheduled", status="False", reason="Unschedulable", message="no GPU"
                    )
                ],
            ),
            [],
            "Unschedulable: no GPU",
        ),
        (
            _pod("Pending", [k8s.V1PodCondition(type="PodScheduled", status="True")]),
            [_event("FailedScheduling", "old")],
            None,
        ),
        (_pod("Running"), [_event("FailedScheduling", "old")], None),
        (_pod("Pending"), [_event("Pulling", "image")], None),
    ],
)
def test_scheduling_problem(pod, events, expected):
    assert scheduling_problem(pod, events) == expected


# -- against the dev stack's Kubernetes API, with no GPU to give -------------------------------------


@pytest.fixture
def gpu_less_cluster(tmp_path, airflow_env):
    if not KUBEAPI_MAIN.exists():
        pytest.skip("include/devstack/kubeapi cannot run yet")
    port = free_port()
    log = tmp_path / "kubeapi.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(AIRFLOW_PYTHON),
                "-m",
                "include.devstack.kubeapi",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            + ["--state-dir", str(tmp_path / "kube"), "--strict-gpu"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/version", 60, proc, log)
        config = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        airflow_env.setenv(
            "AIRFLOW_CONN_KUBERNETES_DEFAULT",
            json.dumps(
                {
                    "conn_type": "kubernetes",
                    "extra": {"kube_config_path": str(config), "namespace": "default"},
                }
            ),
        )
        from kubernetes import client
        from kubernetes import config as kube_config

        yield client.CoreV1Api(kube_config.new_client_from_config(str(config)))
    finally:
        proc.terminate()
        proc.wait(10)


def _pods_left(api) -> list[str]:
    return [
        p.metadata.name
        for p in api.list_namespaced_pod("default", label_selector="kubetrain.io/dag-id=train_digits").items
    ]


@pytest.mark.timeout(120)
def test_unschedulable_pod_fails_with_the_scheduler_message(gpu_less_cluster):
    op = operator(gpus=1, deferrable=False, schedule_timeout_seconds=3, startup_check_interval_seconds=1)
    context = context_for(op)
    op.render_template_fields(context)
    with pytest.raises(
        PodUnschedulableError, match=r"not scheduled within 3 s: FailedScheduling: .*nvidia\.com/gpu"
    ) as info:
        op.execute(context)
    chain, error = [], info.value
    while error is not None:
        chain.append(type(error))
        error = error.__context__
    assert PodLaunchTimeoutException in chain  # the provider's timeout, explained by the scheduler's message
    assert _pods_left(gpu_less_cluster) == []  # deleted on failure


@pytest.mark.timeout(120)
def test_unschedulable_pod_fails_with_the_scheduler_message_when_deferred(gpu_less_cluster):
    op = operator(gpus=1, schedule_timeout_seconds=3, startup_check_interval_seconds=1)
    context = context_for(op)
    op.render_template_fields(context)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)

    async def first_event():
        async for event in deferred.value.trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "timeout"
    with pytest.raises(PodUnschedulableError, match=r"FailedScheduling: .*nvidia\.com/gpu"):
        getattr(op, deferred.value.method_name)(context, event)
    assert _pods_left(gpu_less_cluster) == []
