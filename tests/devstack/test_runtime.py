"""Containers under runc: the image's root, nothing of the host's but what the pod mounts, and no orphans
once a pod, the server or the whole dev stack stops (or the server is killed and starts again)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from kubernetes import client
from kubernetes.stream import stream

from include.devstack.kubeapi import images
from include.devstack.stack import Stack

from .support import processes_with, simple_pod, start_server, stop_server, wait_for, wait_phase

NS = "default"


def sleeper() -> str:
    return f"sleep {int(uuid.uuid4().int % 90000) + 10000}"


def test_the_container_sees_its_image_and_its_volumes_not_the_host(core, tmp_path):
    host_file = Path("/tmp") / f"kt-host-{uuid.uuid4().hex[:8]}"
    host_file.write_text("on the host")
    tag = uuid.uuid4().hex[:8]
    top, nested = f"/kt-mnt-{tag}/out", f"/var/tmp/kt-mnt-{tag}/out"
    script = (
        f"echo x > {top}/f; echo y > {nested}/f; cat {top}/f {nested}/f; test -e {host_file} || echo no-host-file; "
        "test -e /work || echo no-checkout; cat /etc/os-release 2>/dev/null || echo busybox-image"
    )
    try:
        body = simple_pod(
            "isolated",
            script,
            volumes=[{"name": "o", "emptyDir": {}}, {"name": "n", "emptyDir": {}}],
            container={"volumeMounts": [{"name": "o", "mountPath": top}, {"name": "n", "mountPath": nested}]},
        )
        core.create_namespaced_pod(NS, body)
        wait_phase(core, "isolated", timeout=60)
        out = core.read_namespaced_pod_log("isolated", NS, _preload_content=False).data.decode()
        assert out.splitlines() == ["x", "y", "no-host-file", "no-checkout", "busybox-image"]
        # mount points are made inside the container's own root: nothing appears on the host
        assert not Path(top).parent.exists() and not Path(nested).parent.exists()
        core.delete_namespaced_pod("isolated", NS)
    finally:
        host_file.unlink()


def test_exec_runs_in_the_container_as_its_user_with_its_environment(core):
    marker = sleeper()
    body = simple_pod(
        "exec-target",
        f"exec {marker}",
        securityContext={"runAsUser": 4242},
        container={"env": [{"name": "GREETING", "value": "hello"}]},
    )
    core.create_namespaced_pod(NS, body)
    wait_for(
        lambda: core.read_namespaced_pod("exec-target", NS).status.phase == "Running", 60, what="running"
    )
    out = stream(
        core.connect_get_namespaced_pod_exec,
        "exec-target",
        NS,
        command=[
            "sh",
            "-c",
            "echo $GREETING; grep ^Uid /proc/self/status; cat /proc/1/cmdline | tr '\\0' ' '",
        ],
        stdout=True,
        stderr=True,
        stdin=False,
        tty=False,
    )
    assert out.splitlines() == ["hello", "Uid:\t4242\t4242\t4242\t4242", marker + " "]
    core.delete_namespaced_pod("exec-target", NS, grace_period_seconds=0)


def test_no_process_outlives_the_server(tmp_path, mirror):
    api, proc = start_server(tmp_path, mirror=mirror)
    marker = sleeper()
    try:
        core = client.CoreV1Api(api.api_client())
        core.create_namespaced_pod(NS, simple_pod("long", f"exec {marker}"))
        assert wait_for(lambda: processes_with(marker), 60, what="container process")
    finally:
        stop_server(proc)
    assert proc.returncode is not None
    wait_for(lambda: not processes_with(marker), 10, what="container processes to be gone")


def test_a_killed_server_s_containers_are_removed_when_it_starts_again(tmp_path, mirror):
    """A server killed outright cannot stop its containers (runc keeps them, as containerd would): the next
    start on the same state directory deletes them, as a restarted kubelet reconciles its runtime's."""
    api, proc = start_server(tmp_path, mirror=mirror)
    marker = sleeper()
    try:
        core = client.CoreV1Api(api.api_client())
        core.create_namespaced_pod(NS, simple_pod("orphan", f"exec {marker}"))
        pids = wait_for(lambda: processes_with(marker), 60, what="container process")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert processes_with(marker) == pids  # still running: only the next start can reconcile
    again, proc = start_server(tmp_path, mirror=mirror)
    try:
        wait_for(lambda: not processes_with(marker), 30, what="the orphaned container to be deleted")
        # and its root file system with it (the store's containers of this state directory)
        prefix = "kt-" + hashlib.sha256(str((tmp_path / "state").resolve()).encode()).hexdigest()[:10]
        store = images.DEFAULT_STORE
        listed = subprocess.run(
            [
                "buildah",
                "--root",
                str(store / "storage"),
                "--runroot",
                str(store / "run"),
                "--storage-driver",
                "overlay",
                "containers",
                "--noheading",
                "--format",
                "{{.ContainerName}}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert not [name for name in listed.split() if name.startswith(prefix)]
    finally:
        stop_server(proc)


def test_stack_down_leaves_no_container_processes(tmp_path):
    stack = Stack(tmp_path / "stack")
    stack.up()
    marker = sleeper()
    try:
        from kubernetes import config

        core = client.CoreV1Api(config.new_client_from_config(stack.env()["KUBETRAIN_ADMIN_KUBECONFIG"]))
        core.create_namespaced_pod(NS, simple_pod("stack-long", marker))
        wait_for(lambda: processes_with(marker), 60, what="container process")
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
    marker = sleeper()
    script = f"trap '' TERM; (trap '' TERM; {marker}) & {marker}"
    core.create_namespaced_pod(NS, simple_pod("forker", script, terminationGracePeriodSeconds=1))
    wait_for(lambda: len(processes_with(marker)) >= 2, 60, what="both container processes")
    start = time.monotonic()
    core.delete_namespaced_pod("forker", NS)
    wait_for(
        lambda: not core.list_namespaced_pod(NS, field_selector="metadata.name=forker").items,
        15,
        what="deletion",
    )
    assert time.monotonic() - start < 10
    assert processes_with(marker) == []  # the background child went with the container's PID 1


def test_a_pod_deleted_while_runc_creates_its_container_leaves_no_container(tmp_path, mirror):
    """SIGKILL for a container that runc is still creating: the shim kills it once it exists, so nothing is
    orphaned and the pod goes. The fault, a `runc run` held between the shim's start and runc's create, is
    injected with a runc on PATH that waits for a gate file before it runs the real one."""
    import shutil

    real = shutil.which("runc")
    assert real, "runc is not installed: run `make setup`"
    bin_dir, gate, entered = tmp_path / "bin", tmp_path / "gate", tmp_path / "entered"
    bin_dir.mkdir()
    wrapper = bin_dir / "runc"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do if [ "$a" = run ] && [ -e ' + str(gate) + " ]; then\n"
        f"  touch {entered}; while [ -e {gate} ]; do sleep 0.05; done\n"
        "fi; done\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    (tmp_path / "server").mkdir()
    api, proc = start_server(
        tmp_path / "server", mirror=mirror, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    marker = sleeper()
    try:
        core = client.CoreV1Api(api.api_client())
        gate.touch()
        core.create_namespaced_pod(NS, simple_pod("racing", f"exec {marker}"))
        wait_for(entered.exists, 120, what="the shim's runc run to start")
        since = core.read_namespaced_pod("racing", NS).metadata.resource_version
        core.delete_namespaced_pod("racing", NS, grace_period_seconds=0)
        gate.unlink()  # runc goes on to create the container the server has already killed
        from kubernetes import watch

        removed = False
        for event in watch.Watch().stream(
            core.list_namespaced_pod,
            NS,
            field_selector="metadata.name=racing",
            resource_version=since,
            timeout_seconds=120,
        ):
            if event["type"] == "DELETED":
                removed = True
                break
        assert removed, "the pod was never removed"
        wait_for(lambda: not processes_with(marker), 30, what="no container process")
        states = subprocess.run(
            [real, "--root", str(tmp_path / "server" / "state" / "runc"), "list", "-q"],
            capture_output=True,
            text=True,
        )
        assert not states.stdout.strip(), f"runc still holds containers: {states.stdout}"
    finally:
        gate.unlink(missing_ok=True)
        stop_server(proc)
