"""The local kubelet pulls and runs images as a node does: from their registries, by digest, with their own users.

A private server here has an image store of its own (so its layers can be counted) and pulls from a
real registry (Debian's docker-registry) that the tests push small busybox-based images to, and
from the dev stack's mirror for public names.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from include.devstack import mirror as devstack_mirror
from tests.plugins.imagebuild.support import busybox_rootfs, go_arch, start_registry

from .support import KubeApi, processes_with, simple_pod, start_server, stop_server, wait_for, wait_phase

NS = "default"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory, mirror) -> tuple[KubeApi, Path]:
    tmp = tmp_path_factory.mktemp("node")
    store = tmp / "images"
    api, proc = start_server(tmp, "--image-store", str(store), mirror=mirror)
    try:
        yield api, store
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def core(node) -> client.CoreV1Api:
    return client.CoreV1Api(node[0].api_client())


def push(
    registry,
    repository: str,
    tag: str,
    work: Path,
    *,
    files: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
    **config,
) -> tuple[str, list[str]]:
    """A busybox image (``files`` added to its tree; ``extra`` as a second layer); (manifest digest, layer digests)."""
    from kubetrain.imagebuild.layer import write_layer
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, push_image

    work.mkdir(parents=True, exist_ok=True)
    rootfs = busybox_rootfs(work / "rootfs")
    for name, text in (files or {}).items():
        (rootfs / name).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / name).write_text(text)
    layers = [write_layer(rootfs, work / "base.tar.gz", excludes=()).blob(OCI_LAYER_GZIP)]
    if extra:
        added = work / "added"
        for name, text in extra.items():
            (added / name).parent.mkdir(parents=True, exist_ok=True)
            (added / name).write_text(text)
        layers.append(write_layer(added, work / "added.tar.gz", excludes=()).blob(OCI_LAYER_GZIP))
    image_config = {
        "architecture": go_arch(),
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"], **config},
    }
    digest = push_image(registry.client(), repository, tag, layers, image_config)
    return digest, [layer.digest for layer in layers]


def waiting(
    core, name: str, container: str, reasons: tuple[str, ...], init: bool = False, timeout: float = 60
):
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
    return [
        e.message for e in core.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
    ]


def run(core, name: str, image: str, script: str | None = None, **spec) -> tuple[client.V1Pod, str]:
    """Run a pod to its end; (the pod, its log). ``script`` None keeps the image's ENTRYPOINT/CMD."""
    own_command = "command" in spec.get("container", {})
    body = simple_pod(name, script or "", image=image, **spec)
    if script is None and not own_command:
        del body["spec"]["containers"][0]["command"]
    core.create_namespaced_pod(NS, body)
    pod = wait_phase(core, name, timeout=90)
    out = logs(core, name)
    core.delete_namespaced_pod(name, NS)
    return pod, out


def store_layers(store: Path) -> list[str]:
    """The compressed digests of the layers the node's store holds (containers/storage's layer list)."""
    layers = json.loads((store / "storage" / "overlay-layers" / "layers.json").read_text())
    return [layer.get("compressed-diff-digest", "") for layer in layers]


def test_sync_image_never_pushed_fails_to_pull(core, registry):
    """The training pod contract with images nobody pushed: ImagePullBackOff with containerd's words."""
    from kubernetes.client import ApiClient

    from kubetrain.pod_spec import TrainingPodConfig, training_pod

    host = registry.host
    config = TrainingPodConfig(
        image=f"{host}/kubetrain/trainer:latest",
        sync_image=f"{host}/kubetrain/sync:latest",
        run_uri="s3://training/runs/never-pushed/run-1",
        dataset_manifest="s3://training/manifests/d/1.json",
    )
    body = ApiClient().sanitize_for_serialization(training_pod(config, name="never-pushed", namespace=NS))
    core.create_namespaced_pod(NS, body)
    state = waiting(core, "never-pushed", "stage-in", ("ImagePullBackOff",), init=True)
    image = f"{host}/kubetrain/sync:latest"
    assert state.message.startswith(f'Back-off pulling image "{image}": ErrImagePull:')
    expected = (
        f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull and unpack image '
        f'"{image}": failed to resolve reference "{image}": {image}: not found'
    )
    assert any(m.startswith(expected) for m in events(core, "never-pushed"))
    pod = core.read_namespaced_pod("never-pushed", NS)
    assert (
        pod.status.phase == "Pending"
        and pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"
    )
    core.delete_namespaced_pod("never-pushed", NS, grace_period_seconds=0)


def test_a_pushed_image_runs_from_its_own_file_system_with_its_digest(core, registry, tmp_path):
    image = f"{registry.host}/team/app:pushed-later"
    core.create_namespaced_pod(NS, simple_pod("later", "cat /etc/marker; ls /", image=image))
    waiting(core, "later", "main", ("ErrImagePull", "ImagePullBackOff"))
    digest, _ = push(registry, "team/app", "pushed-later", tmp_path, files={"etc/marker": "from the image\n"})
    # the next pull retry finds it
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("later", NS)).status.phase == "Succeeded" and p,
        90,
        what="the pod to run once its image is pushed",
    )
    assert pod.status.container_statuses[0].image_id == f"{registry.host}/team/app@{digest}"
    marker, *top = logs(core, "later").splitlines()
    assert marker == "from the image"
    # the image's tree and what the runtime mounts, nothing of the host's (no /usr, /work, /root, /var)
    assert set(top) == {"bin", "dev", "etc", "proc", "sys", "tmp"}, top
    core.delete_namespaced_pod("later", NS)


def test_public_images_come_from_the_mirror_by_digest(core):
    pod, out = run(core, "public", "busybox:1.36", "echo public")
    assert out == "public\n"
    digest = devstack_mirror.digests()["docker.io/library/busybox:1.36"]
    assert pod.status.container_statuses[0].image_id == f"docker.io/library/busybox@{digest}"


@pytest.mark.parametrize(
    ("name", "image_user", "pod_sc", "problem"),
    [
        ("root-image", None, {"runAsNonRoot": True}, "container has runAsNonRoot and image will run as root"),
        (
            "root-uid",
            None,
            {"runAsNonRoot": True, "runAsUser": 0},
            "container's runAsUser breaks non-root policy",
        ),
        (
            "named-user",
            "app",
            {"runAsNonRoot": True},
            "container has runAsNonRoot and image has non-numeric user (app), cannot verify user is non-root",
        ),
        ("nonroot-image", "10001:10001", {"runAsNonRoot": True}, None),
        ("explicit-uid", None, {"runAsNonRoot": True, "runAsUser": 1000}, None),
    ],
)
def test_run_as_non_root_is_checked_against_the_image_user(
    core, registry, tmp_path, name, image_user, pod_sc, problem
):
    if image_user is None:
        body = simple_pod(
            name, "echo started", securityContext=pod_sc
        )  # busybox runs as root, as the real one does
    else:
        push(
            registry,
            f"team/{name}",
            "v1",
            tmp_path,
            User=image_user,
            files={"etc/passwd": "app:x:1234:1234::/:/bin/sh\n"},
        )
        body = simple_pod(
            name, "echo started", image=f"{registry.host}/team/{name}:v1", securityContext=pod_sc
        )
    core.create_namespaced_pod(NS, body)
    if problem is None:
        wait_for(
            lambda: core.read_namespaced_pod(name, NS).status.phase == "Succeeded", 60, what=f"{name} to run"
        )
        assert logs(core, name) == "started\n"
    else:
        state = waiting(core, name, "main", ("CreateContainerConfigError",))
        assert state.message.startswith(problem) and "container: main)" in state.message
        assert f"Error: {state.message}" in events(core, name)
    core.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def test_the_process_really_runs_as_the_image_user(core, registry, tmp_path):
    """USER app is looked up in the image's own /etc/passwd; the host sees the process under that uid."""
    passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:4321:4322:app:/home/app:/bin/sh\n"
    push(
        registry,
        "team/named",
        "v1",
        tmp_path,
        User="app",
        files={"etc/passwd": passwd, "etc/group": "app:x:4322:\n"},
    )
    marker = f"sleep {int(uuid.uuid4().int % 90000) + 10000}"
    body = simple_pod(
        "as-app",
        f"echo HOME=$HOME; grep -E '^(Uid|Gid)' /proc/self/status; exec busybox {marker}",
        image=f"{registry.host}/team/named:v1",
    )
    core.create_namespaced_pod(NS, body)
    wait_for(lambda: core.read_namespaced_pod("as-app", NS).status.phase == "Running", 60, what="running")
    pids = wait_for(lambda: processes_with(marker), 20, what="the container's process on the host")
    host_status = Path(f"/proc/{pids[0]}/status").read_text()
    assert "Uid:\t4321\t4321\t4321\t4321" in host_status and "Gid:\t4322\t4322\t4322\t4322" in host_status
    out = wait_for(lambda: (text := logs(core, "as-app")).count("\n") >= 3 and text, 20, what="the log")
    assert out.splitlines() == [
        "HOME=/home/app",
        "Uid:\t4321\t4321\t4321\t4321",
        "Gid:\t4322\t4322\t4322\t4322",
    ]
    core.delete_namespaced_pod("as-app", NS, grace_period_seconds=0)


def test_entrypoint_and_cmd_are_replaced_as_kubernetes_says(core, registry, tmp_path):
    image = f"{registry.host}/team/entry:v1"
    push(registry, "team/entry", "v1", tmp_path, Entrypoint=["/bin/echo", "entrypoint"], Cmd=["cmd"])
    assert run(core, "both", image)[1] == "entrypoint cmd\n"
    assert run(core, "args", image, None, container={"args": ["args"]})[1] == "entrypoint args\n"
    assert (
        run(core, "command", image, None, container={"command": ["/bin/echo", "command"]})[1] == "command\n"
    )


def test_an_appended_layer_unpacks_only_itself(core, registry, node, tmp_path):
    """As a snapshotter keyed by digest does: the code layer AppendLayerOperator adds is the only new one."""
    _, store = node
    base, base_layers = push(registry, "team/code", "base", tmp_path / "base", files={"app/v": "1\n"})
    run(core, "code-base", f"{registry.host}/team/code@{base}", "cat /app/v")
    before = store_layers(store)
    assert base_layers[0] in before
    appended, layers = push(
        registry, "team/code", "v2", tmp_path / "v2", files={"app/v": "1\n"}, extra={"app/v": "2\n"}
    )
    assert layers[0] == base_layers[0]
    pod, out = run(core, "code-v2", f"{registry.host}/team/code:v2", "cat /app/v")
    assert out == "2\n" and pod.status.container_statuses[0].image_id.endswith(appended)
    after = store_layers(store)
    assert len(after) == len(before) + 1 and set(after) - set(before) == {layers[1]}


def test_pull_policies_trust_the_node_s_copy_only_where_they_say(core, registry, tmp_path):
    image = f"{registry.host}/team/policy:v1"
    push(registry, "team/policy", "v1", tmp_path / "1", files={"v": "one\n"})
    assert run(core, "first", image, "cat /v", container={"imagePullPolicy": "IfNotPresent"})[1] == "one\n"
    push(registry, "team/policy", "v1", tmp_path / "2", files={"v": "two\n"})  # the tag moves
    assert run(core, "cached", image, "cat /v", container={"imagePullPolicy": "IfNotPresent"})[1] == "one\n"
    assert run(core, "always", image, "cat /v", container={"imagePullPolicy": "Always"})[1] == "two\n"
    never = f"{registry.host}/team/policy:never-pulled"
    core.create_namespaced_pod(
        NS, simple_pod("never", "true", image=never, container={"imagePullPolicy": "Never"})
    )
    state = waiting(core, "never", "main", ("ErrImageNeverPull",))
    assert state.message == f'Container image "{never}" is not present with pull policy of Never'
    core.delete_namespaced_pod("never", NS, grace_period_seconds=0)


def test_a_private_registry_needs_the_pod_s_pull_secret(core, tmp_path):
    import base64

    private = start_registry(tmp_path / "private", users={"puller": "s3cr3t-pull"})
    try:
        from kubetrain.imagebuild.layer import write_layer
        from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, push_image

        layer = write_layer(busybox_rootfs(tmp_path / "rootfs"), tmp_path / "l.tar.gz", excludes=()).blob(
            OCI_LAYER_GZIP
        )
        config = {
            "architecture": go_arch(),
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        }
        push_image(private.client("puller", "s3cr3t-pull"), "team/secret", "v1", [layer], config)
        image = f"{private.host}/team/secret:v1"
        core.create_namespaced_pod(NS, simple_pod("no-secret", "echo in", image=image))
        state = waiting(core, "no-secret", "main", ("ErrImagePull", "ImagePullBackOff"))
        assert "pull access denied, repository does not exist or may require authorization" in state.message
        core.delete_namespaced_pod("no-secret", NS, grace_period_seconds=0)
        auth = base64.b64encode(b"puller:s3cr3t-pull").decode()
        dockerconfig = json.dumps({"auths": {private.host: {"auth": auth}}})
        core.create_namespaced_secret(
            NS,
            {
                "metadata": {"name": "pull"},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": dockerconfig},
            },
        )
        _, out = run(core, "with-secret", image, "echo in", imagePullSecrets=[{"name": "pull"}])
        assert out == "in\n"
        assert not any("s3cr3t-pull" in m for m in events(core, "no-secret"))
    finally:
        private.stop()


def test_missing_secret_key_and_unknown_namespace(core):
    core.create_namespaced_secret(NS, {"metadata": {"name": "creds"}, "stringData": {"user": "u"}})
    body = simple_pod(
        "missing-key",
        "echo $PASSWORD",
        container={
            "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}}]
        },
    )
    core.create_namespaced_pod(NS, body)
    state = waiting(core, "missing-key", "main", ("CreateContainerConfigError",))
    assert state.message == f"couldn't find key password in Secret {NS}/creds"
    # adding the key lets the container start, as the kubelet retries
    core.patch_namespaced_secret("creds", NS, {"stringData": {"password": "p"}})
    wait_for(
        lambda: core.read_namespaced_pod("missing-key", NS).status.phase == "Succeeded", 60, what="key added"
    )
    core.delete_namespaced_pod("missing-key", NS)
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("no-such-team", simple_pod("x", "true"))
    body = json.loads(err.value.body)
    assert err.value.status == 404 and body["message"] == 'namespaces "no-such-team" not found'
