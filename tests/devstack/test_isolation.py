"""Process isolation: the path-remapping fallback (``--isolation none``), host mount points, and no orphans
once the server stops (directly or through the dev stack)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from kubernetes import client
from kubernetes.stream import stream

from include.devstack.stack import Stack

from .support import simple_pod, start_server, stop_server, wait_for, wait_phase

NS = "default"


def processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_isolation_none_remaps_mount_paths_and_guards_pid_1(tmp_path):
    api, proc = start_server(tmp_path, "--isolation", "none")
    mount = f"/kt-remap-{uuid.uuid4().hex[:8]}/data"
    try:
        core = client.CoreV1Api(api.api_client())
        script = (f'trap "echo got-int; exit 0" INT; echo payload > {mount}/file; echo "dir=$DATA_DIR"; '
                  "while true; do sleep 0.1; done")  # fmt: skip
        body = simple_pod("remapped", script, volumes=[{"name": "data", "emptyDir": {}}],
                          container={"env": [{"name": "DATA_DIR", "value": mount}],
                                     "volumeMounts": [{"name": "data", "mountPath": mount}]})  # fmt: skip
        core.create_namespaced_pod(NS, body)
        wait_for(
            lambda: core.read_namespaced_pod("remapped", NS).status.phase == "Running", 20, what="running"
        )
        out = stream(core.connect_get_namespaced_pod_exec, "remapped", NS, command=["cat", f"{mount}/file"],
                     stdout=True, stderr=True, stdin=False, tty=False)  # fmt: skip
        assert out == "payload\n"
        host_init = open("/proc/1/stat").read().split()[21]
        stream(core.connect_get_namespaced_pod_exec, "remapped", NS, command=["kill", "-s", "SIGINT", "1"],
               stdout=True, stderr=True, stdin=False, tty=False)  # fmt: skip
        wait_phase(core, "remapped", timeout=20)
        text = core.read_namespaced_pod_log("remapped", NS, _preload_content=False).data.decode()
        first, second = text.splitlines()
        assert first.startswith("dir=") and first != f"dir={mount}" and first.endswith("/volumes/data")
        assert second == "got-int"
        assert open("/proc/1/stat").read().split()[21] == host_init
        assert not Path(mount).exists()  # nothing was created on the host at the mount path
    finally:
        stop_server(proc)


def test_mount_points_stay_off_the_host_and_no_process_outlives_the_server(tmp_path):
    api, proc = start_server(tmp_path)
    marker = f"sleep {int(uuid.uuid4().int % 90000) + 10000}"
    tag = uuid.uuid4().hex[:8]
    top, nested = f"/kt-mnt-{tag}/out", f"/var/tmp/kt-mnt-{tag}/out"
    try:
        core = client.CoreV1Api(api.api_client())
        body = simple_pod("long", f"echo x > {top}/f; echo y > {nested}/f; {marker}",
                          volumes=[{"name": "o", "emptyDir": {}}, {"name": "n", "emptyDir": {}}],
                          container={"volumeMounts": [{"name": "o", "mountPath": top}, {"name": "n", "mountPath": nested}]})  # fmt: skip
        core.create_namespaced_pod(NS, body)
        wait_for(lambda: core.read_namespaced_pod("long", NS).status.phase == "Running", 20, what="running")
        assert wait_for(lambda: processes_with(marker), 5, what="container process")
        seen = stream(core.connect_get_namespaced_pod_exec, "long", NS, command=["cat", f"{top}/f", f"{nested}/f"],
                      stdout=True, stderr=True, stdin=False, tty=False)  # fmt: skip
        assert seen == "x\ny\n"
        # a new top-level path exists only in the container's private root ...
        assert not Path(top).parent.exists()
        # ... a path inside an existing host directory needs an (empty) mount point there
        assert Path(nested).is_dir() and not any(Path(nested).iterdir())
    finally:
        stop_server(proc)
    assert proc.returncode is not None
    wait_for(lambda: not processes_with(marker), 10, what="container processes to be gone")
    assert not Path(nested).parent.exists()


def test_stack_down_leaves_no_container_processes(tmp_path):
    stack = Stack(tmp_path / "stack")
    stack.up()
    marker = f"sleep {int(uuid.uuid4().int % 90000) + 10000}"
    try:
        from kubernetes import config

        core = client.CoreV1Api(config.new_client_from_config(stack.env()["KUBECONFIG"]))
        core.create_namespaced_pod(NS, simple_pod("stack-long", marker))
        wait_for(lambda: processes_with(marker), 20, what="container process")
        secret = core.read_namespaced_secret("kubetrain-s3", "kubetrain")
        assert sorted(secret.data) == [
            "AWS_ACCESS_KEY_ID",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
            "AWS_SECRET_ACCESS_KEY",
        ]
    finally:
        stack.down()
    wait_for(lambda: not processes_with(marker), 15, what="container processes after stack down")


def test_deleting_a_pod_kills_every_process_of_its_container(core):
    marker = f"sleep {int(uuid.uuid4().int % 90000) + 10000}"
    script = f"trap '' TERM; (trap '' TERM; {marker}) & {marker}"
    core.create_namespaced_pod(NS, simple_pod("forker", script, terminationGracePeriodSeconds=1))
    wait_for(lambda: len(processes_with(marker)) >= 2, 20, what="both container processes")
    start = time.monotonic()
    core.delete_namespaced_pod("forker", NS)
    wait_for(
        lambda: not core.list_namespaced_pod(NS, field_selector="metadata.name=forker").items,
        15,
        what="deletion",
    )
    assert time.monotonic() - start < 10
    assert processes_with(marker) == []  # the background child went with the container's PID 1
