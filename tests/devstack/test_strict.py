"""A local Kubernetes API as strict as a cluster: images of the stack's registry, runAsNonRoot, Secret keys.

The server here runs with ``--registry`` (the dev stack's registry check) and ``--strict``, beside a
real registry (Debian's docker-registry) that the tests push small busybox-based images to.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from include.devstack import registry as devstack_registry
from include.devstack.stack import free_port, wait_http
from tests.plugins.imagebuild.support import busybox_rootfs, go_arch, push_busybox_base

from .support import KubeApi, simple_pod, start_server, stop_server, wait_for

NS = "default"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    log = root / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(devstack_registry.command(root, port), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/", 30, proc, log)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def strict(tmp_path_factory, registry) -> KubeApi:
    api, proc = start_server(tmp_path_factory.mktemp("strict"), "--strict", "--registry", registry)
    try:
        yield api
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def core(strict) -> client.CoreV1Api:
    return client.CoreV1Api(strict.api_client())


def registry_client(host: str):
    from kubetrain.imagebuild.oci import RegistryClient

    return RegistryClient(host, insecure=True, timeout=30)


def push_with_user(host: str, repository: str, tag: str, user: str, work) -> str:
    """A busybox image whose config says ``User: user``; returns the manifest digest."""
    from kubetrain.imagebuild.layer import write_layer
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, push_image

    layer = write_layer(busybox_rootfs(work / "rootfs"), work / "layer.tar.gz", excludes=())
    config = {"architecture": go_arch(), "os": "linux", "config": {"User": user, "Cmd": ["/bin/sh"]}}
    return push_image(registry_client(host), repository, tag, [layer.blob(OCI_LAYER_GZIP)], config)


def waiting(core, name: str, container: str, reasons: tuple[str, ...], init: bool = False, timeout: float = 60):
    def check():
        status = core.read_namespaced_pod(name, NS).status
        for cs in (status.init_container_statuses if init else status.container_statuses) or []:
            if cs.name == container and cs.state.waiting and cs.state.waiting.reason in reasons:
                return cs.state.waiting
        return None

    return wait_for(check, timeout, what=f"{name}/{container} waiting in {reasons}")


def logs(core, name: str) -> str:
    return core.read_namespaced_pod_log(name, NS, _preload_content=False).data.decode()


def events(core, name: str) -> list[str]:
    return [e.message for e in core.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items]


def test_sync_image_never_pushed_fails_to_pull(core, registry):
    """The training pod contract with images of the stack's registry that nobody pushed: ImagePullBackOff,
    although the image map runs */kubetrain/sync* from trainer/.venv."""
    from kubernetes.client import ApiClient

    from kubetrain.pod_spec import TrainingPodConfig, training_pod

    config = TrainingPodConfig(image=f"{registry}/kubetrain/trainer:latest", sync_image=f"{registry}/kubetrain/sync:latest",
                               run_uri="s3://training/runs/never-pushed/run-1", dataset_manifest="s3://training/manifests/d/1.json")  # fmt: skip
    body = ApiClient().sanitize_for_serialization(training_pod(config, name="never-pushed", namespace=NS))
    core.create_namespaced_pod(NS, body)
    state = waiting(core, "never-pushed", "stage-in", ("ImagePullBackOff",), init=True)
    image = f"{registry}/kubetrain/sync:latest"
    assert state.message.startswith(f'Back-off pulling image "{image}": ErrImagePull:')
    expected = (f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull and unpack image '
                f'"{image}": failed to resolve reference "{image}": {image}: not found')  # fmt: skip
    assert expected in events(core, "never-pushed")
    pod = core.read_namespaced_pod("never-pushed", NS)
    assert pod.status.phase == "Pending" and pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"
    core.delete_namespaced_pod("never-pushed", NS, grace_period_seconds=0)


def test_a_pushed_image_runs_through_the_image_map_with_its_digest(core, registry, tmp_path):
    image = f"{registry}/kubetrain/sync:pushed-later"
    core.create_namespaced_pod(NS, simple_pod("later", "unused", image=image,
                                              container={"command": ["python", "-c", "print('ran from', __import__('sys').prefix.split('/')[-2])"]}))  # fmt: skip
    waiting(core, "later", "main", ("ErrImagePull", "ImagePullBackOff"))
    digest = push_busybox_base(registry_client(registry), "kubetrain/sync", "pushed-later", tmp_path)
    # the next pull retry finds it: the container runs the image map's runtime for */kubetrain/sync*
    pod = wait_for(lambda: (p := core.read_namespaced_pod("later", NS)).status.phase == "Succeeded" and p, 60,
                   what="the pod to run once its image is pushed")  # fmt: skip
    assert pod.status.container_statuses[0].image_id == f"{registry}/kubetrain/sync@{digest}"
    assert logs(core, "later") == "ran from trainer\n"
    core.delete_namespaced_pod("later", NS)


def test_public_images_keep_the_image_map(core):
    core.create_namespaced_pod(NS, simple_pod("public", "echo public"))
    wait_for(lambda: core.read_namespaced_pod("public", NS).status.phase == "Succeeded", 60, what="public pod")
    assert logs(core, "public") == "public\n"
    core.delete_namespaced_pod("public", NS)


@pytest.mark.parametrize(
    ("name", "image_user", "pod_sc", "problem"),
    [
        ("root-image", None, {"runAsNonRoot": True}, "container has runAsNonRoot and image will run as root"),
        ("root-uid", None, {"runAsNonRoot": True, "runAsUser": 0}, "container's runAsUser breaks non-root policy"),
        ("named-user", "app", {"runAsNonRoot": True},
         "container has runAsNonRoot and image has non-numeric user (app), cannot verify user is non-root"),
        ("nonroot-image", "10001:10001", {"runAsNonRoot": True}, None),
        ("explicit-uid", None, {"runAsNonRoot": True, "runAsUser": 1000}, None),
    ],
)  # fmt: skip
def test_run_as_non_root_is_checked_against_the_image_user(core, registry, tmp_path, name, image_user, pod_sc, problem):
    if image_user is None:
        body = simple_pod(name, "echo started", securityContext=pod_sc)  # busybox runs as root, as the real one does
    else:
        # a pushed image's config User decides; */kubetrain/sync* runs through the image map's trainer runtime
        push_with_user(registry, f"kubetrain/sync-{name}", "v1", image_user, tmp_path)
        body = simple_pod(name, "", image=f"{registry}/kubetrain/sync-{name}:v1", securityContext=pod_sc)
        body["spec"]["containers"][0]["command"] = ["python", "-c", "print('started')"]
    core.create_namespaced_pod(NS, body)
    if problem is None:
        wait_for(lambda: core.read_namespaced_pod(name, NS).status.phase == "Succeeded", 60, what=f"{name} to run")
        assert logs(core, name) == "started\n"
    else:
        state = waiting(core, name, "main", ("CreateContainerConfigError",))
        assert state.message.startswith(problem) and "container: main)" in state.message
        assert f"Error: {state.message}" in events(core, name)
    core.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def test_missing_secret_key_and_unknown_namespace(core):
    core.create_namespaced_secret(NS, {"metadata": {"name": "creds"}, "stringData": {"user": "u"}})
    body = simple_pod("missing-key", "echo $PASSWORD", container={"env": [
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}}]})  # fmt: skip
    core.create_namespaced_pod(NS, body)
    state = waiting(core, "missing-key", "main", ("CreateContainerConfigError",))
    assert state.message == f"couldn't find key password in Secret {NS}/creds"
    # adding the key lets the container start, as the kubelet retries
    core.patch_namespaced_secret("creds", NS, {"stringData": {"password": "p"}})
    wait_for(lambda: core.read_namespaced_pod("missing-key", NS).status.phase == "Succeeded", 60, what="key added")
    core.delete_namespaced_pod("missing-key", NS)
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("no-such-team", simple_pod("x", "true"))
    body = json.loads(err.value.body)
    assert err.value.status == 404 and body["message"] == 'namespaces "no-such-team" not found'
