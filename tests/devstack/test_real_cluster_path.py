"""docs/real-cluster.md's path from an empty EKS or GKE cluster to a first queued run, checked as far as
this machine can: every `kubectl` command runs word for word (placeholders filled) against a private local
Kubernetes API, in the doc's order, and the objects it leaves are what the later steps need; the commands
for Airflow's containers, the charts and `make` are checked against what they name; the cloud CLIs' commands
are listed as what cannot run here. A command the test does not know fails it, so the doc and the test move
together."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from .support import start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "real-cluster.md"
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
# what needs a cloud account, Docker or the network: never run here (the reason is the value)
CLOUD_ONLY = {
    "aws": "the AWS CLI and an AWS account",
    "gcloud": "the Google Cloud CLI and a project",
    "docker": "a Docker engine",
    "helm repo add": "the chart repository (network)",
}


def path_commands() -> list[str]:
    text = DOC.read_text()
    start = text.index("## The path:")
    section = text[start : text.index("\n## ", start + 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert blocks, "the path has no ```sh blocks"
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def filled(command: str) -> str:
    """Placeholders as a user fills them: ``<training role>`` -> ``training-role``."""
    return re.sub(r"<([^>]+)>", lambda m: re.sub(r"[^a-z0-9.]+", "-", m.group(1).lower()).strip("-"), command)


@pytest.fixture(scope="module")
def api(tmp_path_factory, mirror):
    server, proc = start_server(tmp_path_factory.mktemp("real-cluster-path"), mirror=mirror)
    try:
        yield server
    finally:
        stop_server(proc)


def test_the_path_covers_every_step_in_order():
    commands = path_commands()
    order = [
        "kubectl create namespace kubetrain",
        "kubectl apply -f deploy/rbac.yaml",
        "helm install kueue",
        "kubectl apply --server-side -f deploy/kueue/queues.yaml",
        "make images",
        "kubectl -n airflow create secret generic kubetrain-connections",
        "helm upgrade --install airflow",
        "airflow pools set --include-deferred gpu",
        "kubetrain-preflight",
    ]
    positions = []
    for step in order:
        found = [i for i, c in enumerate(commands) if step in c]
        assert found, f"the path lacks {step!r}"
        positions.append(found[0])
    assert positions == sorted(positions), f"the path's steps are out of order: {positions}"


def test_every_command_of_the_path_runs_or_is_checked(api, tmp_path):
    assert KUBECTL.exists(), f"{KUBECTL} is missing: `make setup` installs it"
    env = {
        "PATH": f"{KUBECTL.parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(api.kubeconfig),
    }
    unknown, cloud = [], []
    for command in path_commands():
        words = shlex.split(command)
        if words[:4] == ["kubectl", "-n", "airflow", "exec"]:
            check_in_scheduler(words[words.index("--") + 1 :])
        elif command == "kubectl apply --server-side -f deploy/kueue/queues.yaml":
            # The stand-in starts with this file's objects (include/devstack/kueue.yaml applies it), and
            # this server refuses server-side apply of existing objects: tests/deploy/test_kueue_manifests.py
            # checks the file against Kueue's own CRD schemas, tests/devstack/test_kueue_queue_objects.py
            # what the stand-in makes of it.
            assert (REPO / "deploy" / "kueue" / "queues.yaml").is_file()
        elif words[0] == "kubectl":
            proc = subprocess.run(
                ["bash", "-o", "pipefail", "-c", filled(command)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, f"{command}\n{proc.stdout}{proc.stderr}"
        elif words[:2] == ["helm", "install"] or words[:3] == ["helm", "upgrade", "--install"]:
            values = words[words.index("--values") + 1]
            assert (REPO / values).is_file(), (
                values
            )  # its content: tests/deploy/test_kueue_manifests.py, test_helm_values.py
        elif words[0] == "export":
            name, _, value = words[1].partition("=")
            assert name == "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT", name
            check_registry_connection(json.loads(filled(value)))
        elif words[0] == "make":
            proc = subprocess.run(
                ["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=120
            )
            assert proc.returncode == 0 and "kubetrain.imagebuild.release" in proc.stdout, (
                proc.stdout + proc.stderr
            )
            assert "--tag v1" in proc.stdout
        elif any(command.startswith(prefix) for prefix in CLOUD_ONLY):
            cloud.append(command)
        else:
            unknown.append(command)
    assert not unknown, f"commands of the path this test neither runs nor checks: {unknown}"
    assert cloud, "the cloud CLIs' steps are gone from the path"
    check_what_the_path_left(api)


def check_in_scheduler(inner: list[str]) -> None:
    """What the doc runs in the chart's scheduler: Airflow's CLI and the preflight's console script."""
    if inner[:3] == ["airflow", "pools", "set"]:
        airflow = REPO / ".venv" / "bin" / "airflow"
        env = {**os.environ, "AIRFLOW_HOME": os.environ.get("AIRFLOW_HOME", str(REPO / ".airflow"))}
        usage = subprocess.run(
            [str(airflow), "pools", "set", "--help"], capture_output=True, text=True, env=env, timeout=300
        )
        assert usage.returncode == 0, usage.stderr[-2000:]
        for option in (w for w in inner if w.startswith("--")):
            assert option in usage.stdout, f"`airflow pools set` has no {option}"
        assert len([w for w in inner[3:] if not w.startswith("--")]) == 3  # name, slots, description
    elif inner[0] == "kubetrain-preflight":
        pyproject = (REPO / "pyproject.toml").read_text()
        assert re.search(r'^kubetrain-preflight = "kubetrain\.preflight\.cli:main"', pyproject, re.M)
        usage = subprocess.run(
            [str(REPO / ".venv" / "bin" / "python"), "-m", "kubetrain.preflight", "--help"],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO / "plugins")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert usage.returncode == 0, usage.stderr[-2000:]
        for option in (w for w in inner if w.startswith("--")):
            assert option in usage.stdout, f"the preflight has no {option}"
    else:
        raise AssertionError(f"a command in the scheduler this test does not know: {inner}")


def check_registry_connection(conn: dict) -> None:
    from kubetrain.provider_info import get_provider_info

    types = {c["connection-type"] for c in get_provider_info()["connection-types"]}
    assert conn["conn_type"] in types, (
        f"{conn['conn_type']!r} is not kubetrain's registry connection type {types}"
    )
    assert conn["host"] and "password" not in conn  # a fresh login each time, no pasted token


def check_what_the_path_left(api) -> None:
    core = client.CoreV1Api(api.api_client())
    rbac = client.RbacAuthorizationV1Api(api.api_client())
    namespace = core.read_namespace("kubetrain")
    assert namespace.metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    core.read_namespace("airflow")
    roles = {r.metadata.name for r in rbac.list_namespaced_role("kubetrain").items}
    shipped = {
        d["metadata"]["name"]
        for d in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text())
        if d and d["kind"] == "Role"
    }
    assert shipped <= roles, shipped - roles
    account = core.read_namespaced_service_account("kubetrain-training", "kubetrain")
    assert account.metadata.annotations["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    s3 = core.read_namespaced_secret("kubetrain-s3", "kubetrain").data
    assert set(s3) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"}
    connections = core.read_namespaced_secret("kubetrain-connections", "airflow").data
    for name in ("AIRFLOW_CONN_AWS_DEFAULT", "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT"):
        assert json.loads(base64.b64decode(connections[name]))["conn_type"]
