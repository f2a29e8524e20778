"""Support for the local Kubernetes API tests: start a private server, wait for pods, build pod bodies."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config

from include.devstack.stack import (
    AIRFLOW_PYTHON,
    REPO,
    free_port,
    serving_certificate,
    tls_context,
    wait_http,
)


@dataclass
class KubeApi:
    url: str
    kubeconfig: Path
    state_dir: Path
    log: Path
    ca: Path
    token: str

    def api_client(self) -> client.ApiClient:
        return config.new_client_from_config(str(self.kubeconfig))

    def urlopen(self, request: str | urllib.request.Request, timeout: float = 30):
        """``urllib.request.urlopen`` of a URL of this server, with its CA and the admin's token."""
        req = request if isinstance(request, urllib.request.Request) else urllib.request.Request(request)
        req.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(req, timeout=timeout, context=tls_context(self.ca))


ADMIN_TOKEN = "kubetrain-tests-admin"


def start_server(
    tmp: Path,
    *extra: str,
    mirror: str,
    users: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[KubeApi, subprocess.Popen]:
    """A private local Kubernetes API over ``tmp``, pulling public images from the dev stack's ``mirror``; its
    kubeconfig is a cluster admin's (group system:masters). ``users`` adds ``{token: user}`` lines."""
    port = free_port()
    state = tmp / "state"
    log = tmp / "kubeapi.log"
    tokens = tmp / "tokens.csv"
    lines = [f'{ADMIN_TOKEN},kubetrain-tests,admin,"system:masters"']
    lines += [f"{token},{user},{i}" for i, (token, user) in enumerate((users or {}).items())]
    tokens.write_text("\n".join(lines) + "\n")
    cert, key = serving_certificate(tmp)
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
                "--state-dir",
                str(state),
                "--backoff-seconds",
                "1",
                "--mirror",
                mirror,
                "--token-auth-file",
                str(tokens),
                "--tls-cert-file",
                str(cert),
                "--tls-private-key-file",
                str(key),
                *extra,
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    url = f"https://127.0.0.1:{port}"
    wait_http(f"{url}/version", 60, proc, log, ca=cert)
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "t",
                        "cluster": {
                            "server": url,
                            "certificate-authority-data": base64.b64encode(cert.read_bytes()).decode(),
                        },
                    }
                ],
                "users": [{"name": "t", "user": {"token": ADMIN_TOKEN}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t", "namespace": "default"}}],
                "current-context": "t",
            }
        )
    )
    return KubeApi(url, kubeconfig, state, log, cert, ADMIN_TOKEN), proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_for(fn: Callable[[], object], timeout: float = 30, interval: float = 0.1, what: str = "condition"):
    """Poll ``fn`` until it returns a truthy value; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


def pod_phase(core: client.CoreV1Api, name: str, ns: str = "default") -> str:
    return core.read_namespaced_pod(name, ns).status.phase


def wait_phase(
    core: client.CoreV1Api, name: str, phases: tuple[str, ...] = ("Succeeded", "Failed"), timeout: float = 60
) -> client.V1Pod:
    def check():
        pod = core.read_namespaced_pod(name, "default")
        return pod if pod.status.phase in phases else None

    return wait_for(check, timeout, what=f"pod {name} to reach {phases}")


def first_line(core: client.CoreV1Api, name: str, ns: str = "default", container: str | None = None) -> str:
    """The first line the (running) container writes, read by following its log.

    A pod's Running phase says its process started, not that a shell has set its SIGTERM trap yet:
    a SIGTERM before that finds PID 1 without a handler, which the kernel ignores, and the pod ends
    in SIGKILL (137) at its grace period's end. A script that echoes once its trap is set, read
    here, closes that window.
    """
    kwargs = {"container": container} if container else {}
    log = core.read_namespaced_pod_log(name, ns, follow=True, _preload_content=False, **kwargs)
    said = b""
    try:
        for chunk in log.stream(amt=None):
            said += chunk
            if b"\n" in said:
                break
    finally:
        log.release_conn()
    return said.decode().split("\n")[0]


def simple_pod(name: str, script: str, image: str = "busybox:1.36", **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **spec.pop("metadata", {})},
        "spec": {
            "restartPolicy": spec.pop("restartPolicy", "Never"),
            "terminationGracePeriodSeconds": spec.pop("terminationGracePeriodSeconds", 5),
            "containers": [
                {"name": "main", "image": image, "command": ["sh", "-c", script], **spec.pop("container", {})}
            ],
            **spec,
        },
    }


def processes_with(marker: str) -> list[int]:
    """Host PIDs of the processes whose command line contains ``marker`` (a container's, seen from the host)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def unschedulable(core: client.CoreV1Api, name: str, namespace: str = "default", timeout: float = 60):
    """The pod's PodScheduled=False condition, once the scheduler has set it."""

    def found():
        conds = core.read_namespaced_pod(name, namespace).status.conditions or []
        return next((c for c in conds if c.type == "PodScheduled" and c.status == "False"), None)

    return wait_for(found, timeout, what=f"PodScheduled=False of {name}")
