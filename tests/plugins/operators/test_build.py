"""BuildImageOperator's in-cluster build past the deferral, on the dev stack.

The builder pod runs as a dev stack pod (context fetched from the stack's S3 with the sync image,
unpacked, built and pushed by buildah to the stack's registry); the task defers to the provider's
pod trigger, the trigger runs for real against the stack's API, and the operator resumes through
the method it deferred to: the XCom sidecar's metadata names the pushed digest, the requested tag
moves onto it, and no builder pod is left behind.

The training namespace enforces Pod Security level restricted, which the rootless builder cannot
pass: builds run in a namespace of their own, labelled privileged, made by deploy/rbac-build.yaml as
docs/real-cluster.md says; the worker's account builds and the triggerer's follows, under that
manifest's grants alone.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import TaskDeferred
from kubernetes import client as kube_client
from kubernetes import config as kube_config

from include.devstack.stack import KUBECTL, NAMESPACE, RBAC_MANIFEST
from kubetrain.imagebuild.oci import RegistryClient
from kubetrain.operators.build import BuildImageOperator
from kubetrain.triggers.pod import PodTriggerByReference
from tests.plugins.imagebuild.support import push_busybox_base, skopeo_pull, tags

RUN_ID = "manual__2026-11-23T10:00:00+00:00"


class TaskInstance:
    def __init__(self, task_id: str) -> None:
        self.dag_id, self.task_id, self.try_number, self.map_index = "build_images", task_id, 1, -1
        self.start_date = datetime.now(UTC)
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


BUILD_NAMESPACE = "kubetrain-build"
BUILD_RBAC = RBAC_MANIFEST.with_name("rbac-build.yaml")


def build_namespace_like_the_docs_say(admin, admin_kubeconfig: str) -> str:
    """deploy/rbac-build.yaml applied as docs/real-cluster.md says (the namespace, labelled privileged, and
    its two Roles), and the S3 Secret copied into it: the build then runs under those grants alone."""
    core = kube_client.CoreV1Api(admin)
    if any(n.metadata.name == BUILD_NAMESPACE for n in core.list_namespace().items):
        return BUILD_NAMESPACE
    applied = subprocess.run(
        [str(KUBECTL), "--kubeconfig", admin_kubeconfig, "apply", "-f", str(BUILD_RBAC)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert applied.returncode == 0, applied.stderr
    secret = core.read_namespaced_secret("kubetrain-s3", NAMESPACE)
    core.create_namespaced_secret(
        BUILD_NAMESPACE, {"metadata": {"name": "kubetrain-s3"}, "data": secret.data}
    )
    return BUILD_NAMESPACE


def builder_pods(core) -> list[str]:
    pods = core.list_namespaced_pod(
        BUILD_NAMESPACE, label_selector="app.kubernetes.io/component=image-build"
    ).items
    return [p.metadata.name for p in pods if not p.metadata.deletion_timestamp]


@pytest.mark.slow
def test_in_cluster_build_defers_then_resumes_and_tags_the_pushed_image(
    devstack, stack_images, monkeypatch, tmp_path
):
    env = devstack.env()
    registry = env["KUBETRAIN_REGISTRY"]
    admin = kube_config.new_client_from_config(env["KUBETRAIN_ADMIN_KUBECONFIG"])
    build_namespace = build_namespace_like_the_docs_say(admin, env["KUBETRAIN_ADMIN_KUBECONFIG"])
    monkeypatch.setenv("KUBETRAIN_BUILD_NAMESPACE", build_namespace)
    for name in (
        "AIRFLOW_CONN_AWS_DEFAULT",
        "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT",
        "KUBETRAIN_REGISTRY",
        "KUBETRAIN_NAMESPACE",
        "KUBETRAIN_S3_SECRET",
    ):
        monkeypatch.setenv(name, env[name])
    for name in ("KUBETRAIN_SYNC_IMAGE", "AIRFLOW_VAR_KUBETRAIN_SYNC_IMAGE", "KUBETRAIN_TRAINING_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    # In-process, the kubeconfig goes by the connection (the client read $KUBECONFIG at import).
    monkeypatch.delenv("KUBECONFIG", raising=False)
    worker_conn = json.dumps(
        {"conn_type": "kubernetes", "extra": {"kube_config_path": env["KUBECONFIG"], "namespace": NAMESPACE}}
    )
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", worker_conn)
    core = kube_client.CoreV1Api(admin)

    with RegistryClient(registry, insecure=True) as registry_client:
        push_busybox_base(registry_client, "base/busybox", "1", tmp_path / "base")
    marker = uuid.uuid4().hex
    context_dir = tmp_path / "context"
    (context_dir / "app").mkdir(parents=True)
    (context_dir / "Dockerfile").write_text("ARG BASE\nFROM ${BASE}\nCOPY app/ /app/\nLABEL stage=built\n")
    (context_dir / "app" / "marker.txt").write_text(marker)
    repository = f"build-test/in-cluster-{marker[:8]}"

    with DAG("build_images", schedule=None):
        op = BuildImageOperator(
            task_id="build_image",
            context=str(context_dir),
            repository=repository,
            tags=["v1"],
            build_args={"BASE": f"{registry}/base/busybox:1"},
            labels={"team": "ml"},
            builder="in-cluster",
            in_cluster_tool="buildah",
            registry_secret=None,  # the stack's registry has no auth
            startup_timeout_seconds=120,
        )
    ti = TaskInstance(op.task_id)
    context = {"ti": ti, "task_instance": ti, "run_id": RUN_ID, "dag": op.dag}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    assert deferred.value.method_name == "execute_in_cluster_complete"
    assert builder_pods(core), "the builder pod runs while the task is deferred"
    classpath, kwargs = deferred.value.trigger.serialize()
    assert classpath == "kubetrain.triggers.pod.PodTriggerByReference"
    # what the trigger table stores names the connection and holds none of its credentials
    worker = json.loads(Path(env["KUBECONFIG"]).read_text())
    (token,) = [u["user"]["token"] for u in worker["users"] if u["user"].get("token")]
    assert token not in json.dumps(kwargs, default=str)
    assert "config_dict" not in kwargs and "connection_extras" not in kwargs
    assert kwargs["kubernetes_conn_id"] == "kubernetes_default"
    # the triggerer follows the builder pod under its own account (deploy/rbac-build.yaml's second Role)
    triggerer_kubeconfig = str(Path(env["KUBECONFIG"]).with_name("kubeconfig-triggerer"))
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {
                "conn_type": "kubernetes",
                "extra": {"kube_config_path": triggerer_kubeconfig, "namespace": NAMESPACE},
            }
        ),
    )
    trigger = PodTriggerByReference(**kwargs)  # as the triggerer builds it

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "success", event
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", worker_conn)  # the worker resumes the task
    result = getattr(op, deferred.value.method_name)(context, event)

    digest = result["digest"]
    assert result["reference"] == f"{registry}/{repository}@{digest}"
    assert result["tags"] == [f"{registry}/{repository}:v1"] and result["builder"] == "in-cluster"
    with RegistryClient(registry, insecure=True) as registry_client:
        assert registry_client.manifest_digest(repository, "v1") == digest
    pulled = skopeo_pull(f"{registry}/{repository}@{digest}", tmp_path / "oci")
    assert pulled.filesystem()["app/marker.txt"] == marker.encode()
    assert pulled.labels["team"] == "ml" and pulled.labels["stage"] == "built"
    # the staging tag goes where the registry can delete tags; where it cannot (as this one), it names the same image
    staging = [t for t in tags(_Registry(registry), repository) if t.startswith("kubetrain-staging-")]
    with RegistryClient(registry, insecure=True) as registry_client:
        assert {registry_client.manifest_digest(repository, t) for t in staging} <= {digest}
    assert builder_pods(core) == []


class _Registry:
    """What support.tags needs of a registry: its host, and no users."""

    def __init__(self, host: str) -> None:
        self.host, self.users = host, {}
