"""The local kubelet: Secrets and ConfigMaps in env and volumes, init containers, native sidecars, image
mapping failures, namespaces, unsupported requests."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
from kubernetes import watch
from kubernetes.client.rest import ApiException

from include.devstack.kubeapi.cluster import memory_cgroup_usable

from .support import simple_pod, wait_for, wait_phase

NS = "default"


def logs(core, name: str, container: str | None = None) -> str:
    kw = {"container": container} if container else {}
    return core.read_namespaced_pod_log(name, NS, _preload_content=False, **kw).data.decode()


def test_secrets_and_configmaps_in_env_and_volumes(core):
    core.create_namespaced_secret(
        NS, {"metadata": {"name": "app-secret"}, "stringData": {"token": "s3cr3t", "user": "ada"}}
    )
    core.create_namespaced_config_map(
        NS,
        {
            "metadata": {"name": "app-config"},
            "data": {"mode": "fast", "path": "/data/in"},
            "binaryData": {"blob.bin": base64.b64encode(b"\x00\x01").decode()},
        },
    )
    secret = core.read_namespaced_secret("app-secret", NS)
    assert base64.b64decode(secret.data["token"]) == b"s3cr3t" and secret.type == "Opaque"
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "app-secret", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "app-config", "key": "mode"}}},
        {
            "name": "OPTIONAL",
            "valueFrom": {"configMapKeyRef": {"name": "app-config", "key": "nope", "optional": True}},
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "TEAM", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['team']"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "MEM_MI",
            "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
        },
        {"name": "DERIVED", "value": "$(MODE)-$(POD_NAME)-$$(MODE)"},
    ]
    script = (
        'echo "token-len=${#TOKEN} mode=$MODE optional=${OPTIONAL-unset} name=$POD_NAME ns=$POD_NS uid=$POD_UID '
        'team=$TEAM ip=$POD_IP mem=$MEM_MI derived=$DERIVED cm_mode=$CM_mode sec_user=$SEC_user arg=$1"; '
        "cat /etc/app-secret/token-file; echo; stat -c %a /etc/app-secret/token-file; ls /etc/app-config; "
        "od -An -tx1 /etc/app-config/blob.bin"
    )
    body = simple_pod(
        "configured",
        script,
        metadata={"labels": {"team": "ml"}},
        volumes=[
            {
                "name": "sec",
                "secret": {
                    "secretName": "app-secret",
                    "defaultMode": 0o400,
                    "items": [{"key": "token", "path": "token-file"}],
                },
            },
            {"name": "cfg", "configMap": {"name": "app-config"}},
        ],
        container={
            "env": env,
            "args": ["$(MODE)"],
            "envFrom": [
                {"configMapRef": {"name": "app-config"}, "prefix": "CM_"},
                {"secretRef": {"name": "app-secret"}, "prefix": "SEC_"},
            ],
            "resources": {"limits": {"memory": "256Mi"}},
            "volumeMounts": [
                {"name": "sec", "mountPath": "/etc/app-secret", "readOnly": True},
                {"name": "cfg", "mountPath": "/etc/app-config"},
            ],
        },
    )
    body["spec"]["containers"][0]["command"] = ["sh", "-c", script, "sh"]
    pod = core.create_namespaced_pod(NS, body)
    wait_phase(core, "configured")
    lines = logs(core, "configured").splitlines()
    pod_ip = core.read_namespaced_pod("configured", NS).status.pod_ip
    assert pod_ip.startswith("127.") and pod_ip != "127.0.0.1"  # an address of its own on loopback
    assert lines[0] == (
        f"token-len=6 mode=fast optional=unset name=configured ns=default uid={pod.metadata.uid} team=ml "
        f"ip={pod_ip} mem=256 derived=fast-configured-$(MODE) cm_mode=fast sec_user=ada arg=fast"
    )
    assert lines[1:3] == ["s3cr3t", "400"]
    assert sorted(lines[3:6]) == ["blob.bin", "mode", "path"]
    assert lines[6].split() == ["00", "01"]
    core.delete_namespaced_pod("configured", NS)


def test_missing_secret_is_a_config_error_until_it_exists(core):
    body = simple_pod(
        "needs-secret",
        "echo token=$TOKEN",
        container={
            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late-secret", "key": "token"}}}]
        },
    )
    core.create_namespaced_pod(NS, body)

    def waiting_reason():
        cs = core.read_namespaced_pod("needs-secret", NS).status.container_statuses
        return cs and cs[0].state.waiting and cs[0].state.waiting.reason

    assert wait_for(waiting_reason, 10, what="config error") == "CreateContainerConfigError"
    assert core.read_namespaced_pod("needs-secret", NS).status.phase == "Pending"
    core.create_namespaced_secret(NS, {"metadata": {"name": "late-secret"}, "stringData": {"token": "abc"}})
    wait_phase(core, "needs-secret", timeout=20)
    assert logs(core, "needs-secret") == "token=abc\n"
    core.delete_namespaced_pod("needs-secret", NS)


def test_init_containers_run_one_at_a_time_in_order(core):
    inits = [
        {
            "name": f"init-{i}",
            "image": "busybox",
            "command": ["sh", "-c", f"sleep 0.{3 - i}; echo init-{i} >> /w/order"],
            "volumeMounts": [{"name": "w", "mountPath": "/w"}],
        }
        for i in (1, 2, 3)
    ]
    body = simple_pod(
        "ordered",
        "cat /w/order",
        initContainers=inits,
        volumes=[{"name": "w", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "w", "mountPath": "/w"}]},
    )
    core.create_namespaced_pod(NS, body)
    pod = wait_phase(core, "ordered")
    assert logs(core, "ordered") == "init-1\ninit-2\ninit-3\n"
    assert [(s.name, s.state.terminated.reason) for s in pod.status.init_container_statuses] == [
        ("init-1", "Completed"),
        ("init-2", "Completed"),
        ("init-3", "Completed"),
    ]
    conds = {c.type: c.status for c in pod.status.conditions}
    assert conds["Initialized"] == "True" and conds["PodScheduled"] == "True" and conds["Ready"] == "False"
    # a failing init container with restartPolicy Never fails the pod; the main container never starts
    failing = [{"name": "init-bad", "image": "busybox", "command": ["sh", "-c", "exit 2"]}]
    core.create_namespaced_pod(NS, simple_pod("init-fails", "echo never", initContainers=failing))
    pod = wait_phase(core, "init-fails", ("Failed",))
    assert pod.status.init_container_statuses[0].state.terminated.exit_code == 2
    assert pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"
    for name in ("ordered", "init-fails"):
        core.delete_namespaced_pod(name, NS)


def test_native_sidecar_starts_first_and_stops_after_main(core):
    sidecar = {
        "name": "beacon",
        "image": "busybox",
        "restartPolicy": "Always",
        "command": [
            "sh",
            "-c",
            "trap 'echo beacon-term >> /w/log; exit 0' TERM; echo beacon-up >> /w/log; "
            "while true; do sleep 0.1; done",
        ],
        "volumeMounts": [{"name": "w", "mountPath": "/w"}],
    }
    main = "for i in 1 2 3 4 5 6 7 8 9 10; do [ -s /w/log ] && break; sleep 0.1; done; cat /w/log; echo main-done >> /w/log"
    body = simple_pod(
        "with-sidecar",
        main,
        initContainers=[sidecar],
        volumes=[{"name": "w", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "w", "mountPath": "/w"}]},
    )
    core.create_namespaced_pod(NS, body)
    pod = wait_phase(core, "with-sidecar")
    assert pod.status.phase == "Succeeded"
    assert logs(core, "with-sidecar") == "beacon-up\n"
    side = pod.status.init_container_statuses[0]
    assert side.state.terminated is not None and side.state.terminated.exit_code == 0
    main_state = pod.status.container_statuses[0].state.terminated
    assert side.state.terminated.started_at <= main_state.started_at
    assert side.state.terminated.finished_at >= main_state.finished_at
    reasons = [
        (e.reason, e.involved_object.field_path)
        for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=with-sidecar").items
    ]
    assert ("Killing", "spec.initContainers{beacon}") in reasons
    core.delete_namespaced_pod("with-sidecar", NS)


def test_a_deleted_pod_with_a_native_sidecar_is_gone_once_both_have_exited(core):
    """As on Kubernetes >= 1.29: deleting a training-shaped pod sends SIGTERM to the main container, the
    sidecar's SIGTERM comes only after the main container has exited, and the pod leaves the API as soon
    as both have exited, not at the end of its 300 s grace period."""
    sidecar = {
        "name": "sync",
        "image": "busybox",
        "restartPolicy": "Always",
        # exit 0 only if the main container had exited before this SIGTERM came
        "command": [
            "sh",
            "-c",
            "trap '[ -e /w/main-done ] && exit 0; exit 9' TERM; touch /w/sync-ready; "
            "while true; do sleep 0.1; done",
        ],
        "volumeMounts": [{"name": "w", "mountPath": "/w"}],
    }
    main = (
        "trap 'touch /w/main-done; exit 75' TERM; while [ ! -e /w/sync-ready ]; do sleep 0.1; done; "
        "echo ready; while true; do sleep 0.1; done"
    )
    body = simple_pod(
        "deleted-with-sidecar",
        main,
        initContainers=[sidecar],
        terminationGracePeriodSeconds=300,
        volumes=[{"name": "w", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "w", "mountPath": "/w"}]},
    )
    core.create_namespaced_pod(NS, body)
    wait_for(lambda: pod_logs_or_empty(core, "deleted-with-sidecar") == "ready\n", 60, what="both traps set")
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    final: list = []

    def watcher():
        for ev in watch.Watch().stream(
            core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=240
        ):
            if ev["type"] == "DELETED" and ev["object"].metadata.name == "deleted-with-sidecar":
                final.append(ev["object"])
                return

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    started = time.monotonic()
    core.delete_namespaced_pod("deleted-with-sidecar", NS)
    t.join(240)
    elapsed = time.monotonic() - started
    assert final, "the pod was not deleted within 240 s"
    # seconds, not the grace period: a margin for a loaded machine, far below 300 s
    assert elapsed < 60, f"the pod stayed {elapsed:.0f} s after both containers had exited"
    main_state = final[0].status.container_statuses[0].state.terminated
    sync_state = final[0].status.init_container_statuses[0].state.terminated
    assert main_state.exit_code == 75
    assert sync_state.exit_code == 0, "the sidecar got SIGTERM before the main container had exited"


def pod_logs_or_empty(core, name: str) -> str:
    try:
        return logs(core, name)
    except ApiException:
        return ""


def test_an_image_no_registry_serves_stays_in_err_image_pull(core):
    """Neither the mirror nor quay.io (unreachable from here, as from an air-gapped node) has it."""
    core.create_namespaced_pod(NS, simple_pod("unmapped", "true", image="quay.io/example/unknown:1.0"))

    def waiting():
        cs = core.read_namespaced_pod("unmapped", NS).status.container_statuses
        return (
            cs
            and cs[0].state.waiting
            and cs[0].state.waiting.reason in ("ErrImagePull", "ImagePullBackOff")
            and cs[0].state.waiting
        )

    state = wait_for(waiting, 10, what="ErrImagePull")
    assert state.message.startswith(
        'rpc error: code = NotFound desc = failed to pull and unpack image "quay.io/example/unknown:1.0"'
    ), state.message
    assert (
        "Mirrors also failed" in state.message
    )  # the mirror was asked first, as a node's registries.conf says
    assert core.read_namespaced_pod("unmapped", NS).status.phase == "Pending"
    warnings = [
        e.message
        for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=unmapped").items
        if e.type == "Warning"
    ]
    assert any(
        m.startswith('Failed to pull image "quay.io/example/unknown:1.0": rpc error') for m in warnings
    )
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("unmapped", NS)
    assert err.value.status == 400 and "waiting to start" in json.loads(err.value.body)["message"]
    core.delete_namespaced_pod("unmapped", NS)


def test_namespaces_scope_objects(core):
    core.create_namespace({"metadata": {"name": "team-a"}})
    assert {"default", "kube-system", "kube-public", "team-a"} <= {
        n.metadata.name for n in core.list_namespace().items
    }
    assert core.read_namespace("team-a").status.phase == "Active"
    core.create_namespaced_pod("team-a", simple_pod("in-team-a", "sleep 30"))
    assert [
        p.metadata.namespace
        for p in core.list_pod_for_all_namespaces(field_selector="metadata.name=in-team-a").items
    ] == ["team-a"]
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("no-such-namespace", simple_pod("lost", "true"))
    assert (
        err.value.status == 404
        and 'namespaces "no-such-namespace" not found' in json.loads(err.value.body)["message"]
    )
    core.delete_namespace("team-a")
    wait_for(
        lambda: "team-a" not in {n.metadata.name for n in core.list_namespace().items},
        20,
        what="namespace removal",
    )
    assert not core.list_pod_for_all_namespaces(field_selector="metadata.name=in-team-a").items
    with pytest.raises(ApiException) as err:
        core.delete_namespace("default")
    assert err.value.status == 403


@pytest.mark.parametrize(
    ("method", "path", "body", "ctype", "code"),
    [
        ("GET", "/apis/apps/v1/namespaces/default/deployments", None, None, 404),
        ("GET", "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods", None, None, 404),
        (
            "POST",
            "/api/v1/namespaces/default/services",
            {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}},
            "application/json",
            422,
        ),
        ("POST", "/api/v1/namespaces/default/pods/x/portforward", None, None, 404),
        (
            "POST",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            {"metadata": {"name": "a.b"}},
            "application/json",
            405,
        ),
        ("POST", "/api/v1/namespaces/default/pods/x", {}, "application/json", 405),
        ("PATCH", "/api/v1/namespaces/default/secrets/app-secret", {}, "application/apply-patch+yaml", 415),
        ("POST", "/api/v1/nodes", {"metadata": {"name": "n2"}}, "application/json", 405),
        (
            "POST",
            "/apis/batch/v1/namespaces/default/jobs",
            {
                "metadata": {"name": "pfp"},
                "spec": {
                    "podFailurePolicy": {"rules": []},
                    "template": {
                        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}
                    },
                },
            },
            "application/json",
            422,
        ),
        (
            "POST",
            "/apis/batch/v1/namespaces/default/jobs",
            {
                "metadata": {"name": "always"},
                "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "busybox"}]}}},
            },
            "application/json",
            422,
        ),
    ],
)
def test_unsupported_requests_are_status_errors(kubeapi, method, path, body, ctype, code):
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        kubeapi.url + path, data=data, method=method, headers={"Content-Type": ctype} if ctype else {}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        kubeapi.urlopen(req)
    status = json.loads(err.value.read())
    assert err.value.code == code
    assert (
        status["kind"] == "Status"
        and status["status"] == "Failure"
        and status["code"] == code
        and status["message"]
    )


def test_node_reports_the_machine(core):
    nodes = core.list_node().items
    assert [n.metadata.name for n in nodes] == ["kubetrain-dev"]
    assert nodes[0].status.capacity["cpu"] and nodes[0].status.conditions[0].type == "Ready"


@pytest.mark.skipif(not memory_cgroup_usable(), reason="no writable memory cgroup on this machine")
def test_memory_limit_is_enforced_with_oomkilled(core):
    body = simple_pod("hog", "", image="python:3.11")
    body["spec"]["containers"][0].update(
        command=["python", "-c", "x = bytearray(400 * 2**20); print('allocated', len(x))"],
        resources={"limits": {"memory": "64Mi"}},
    )
    core.create_namespaced_pod(NS, body)
    pod = wait_phase(core, "hog", timeout=30)
    state = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, state.reason, state.exit_code) == ("Failed", "OOMKilled", 137)
    assert logs(core, "hog") == ""
    core.delete_namespaced_pod("hog", NS)
