"""The real kubectl (installed by `make setup` in .tools/bin) against the local Kubernetes API."""

from __future__ import annotations

import subprocess
import time

from include.devstack.stack import REPO

from .support import wait_for

KUBECTL = str(REPO / ".tools" / "bin" / "kubectl")

POD_YAML = """\
apiVersion: v1
kind: Pod
metadata:
  name: kubectl-demo
  labels: {app: demo, suite: kubectl}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: busybox:1.36
    command: ["sh", "-c", "for i in 1 2 3 4; do echo tick-$i; sleep 0.4; done"]
"""


def kubectl(kubeapi, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [KUBECTL, "--kubeconfig", str(kubeapi.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def test_kubectl_apply_logs_get_describe_delete(kubeapi, tmp_path):
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(POD_YAML)
    assert "pod/kubectl-demo created" in kubectl(kubeapi, "apply", "-f", str(manifest)).stdout
    # logs -f streams while the container runs and returns when it exits
    follow = subprocess.Popen([KUBECTL, "--kubeconfig", str(kubeapi.kubeconfig), "logs", "-f", "kubectl-demo"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        first = ""
        while not first and time.monotonic() < deadline:
            first = follow.stdout.readline()
            if not first:
                time.sleep(
                    0.2
                )  # kubectl may ask before the container has started; a retry of logs -f follows
                if follow.poll() is not None:
                    follow = subprocess.Popen([KUBECTL, "--kubeconfig", str(kubeapi.kubeconfig), "logs", "-f", "kubectl-demo"],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        phase_at_first_line = kubectl(
            kubeapi, "get", "pod", "kubectl-demo", "-o", "jsonpath={.status.phase}"
        ).stdout
        rest, _ = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert first == "tick-1\n" and rest == "tick-2\ntick-3\ntick-4\n"
    assert phase_at_first_line == "Running" and follow.returncode == 0
    wait_for(
        lambda: (
            kubectl(kubeapi, "get", "pod", "kubectl-demo", "-o", "jsonpath={.status.phase}").stdout
            == "Succeeded"
        ),
        20,
    )
    table = kubectl(kubeapi, "get", "pod", "kubectl-demo").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert table[1].split()[:4] == [
        "kubectl-demo",
        "0/1",
        "Completed",
        "0",
    ]  # kubectl's STATUS for a Succeeded pod
    by_label = kubectl(kubeapi, "get", "pods", "-l", "app=demo,suite=kubectl", "-o", "name").stdout
    assert by_label == "pod/kubectl-demo\n"
    assert (
        kubectl(kubeapi, "get", "pods", "-l", "app=other").stderr.strip()
        == "No resources found in default namespace."
    )
    described = kubectl(kubeapi, "describe", "pod", "kubectl-demo").stdout
    for expected in ("Status:           Succeeded", "Node:             kubetrain-dev/127.0.0.1", "Reason:       Completed",
                     "Exit Code:    0", "Scheduled", "Started", "Successfully assigned default/kubectl-demo to kubetrain-dev"):  # fmt: skip
        assert expected in described, expected
    # re-applying a changed manifest patches it (strategic merge computed by kubectl from last-applied)
    manifest.write_text(POD_YAML.replace("suite: kubectl}", 'suite: kubectl, extra: "yes"}'))
    assert "pod/kubectl-demo configured" in kubectl(kubeapi, "apply", "-f", str(manifest)).stdout
    assert (
        kubectl(kubeapi, "get", "pod", "kubectl-demo", "-o", "jsonpath={.metadata.labels.extra}").stdout
        == "yes"
    )
    assert 'pod "kubectl-demo" deleted' in kubectl(kubeapi, "delete", "pod", "kubectl-demo").stdout
    gone = kubectl(kubeapi, "get", "pod", "kubectl-demo", check=False)
    assert gone.returncode == 1 and 'pods "kubectl-demo" not found' in gone.stderr


def test_kubectl_exec_and_validation(kubeapi, tmp_path):
    manifest = tmp_path / "sleeper.yaml"
    manifest.write_text(POD_YAML.replace("kubectl-demo", "kubectl-sleeper").replace(
        'for i in 1 2 3 4; do echo tick-$i; sleep 0.4; done', "sleep 60"))  # fmt: skip
    kubectl(kubeapi, "apply", "-f", str(manifest))
    wait_for(
        lambda: (
            kubectl(kubeapi, "get", "pod", "kubectl-sleeper", "-o", "jsonpath={.status.phase}").stdout
            == "Running"
        ),
        20,
    )
    out = kubectl(kubeapi, "exec", "kubectl-sleeper", "--", "sh", "-c", "echo from-exec; hostname")
    assert out.stdout == "from-exec\nkubectl-sleeper\n"
    failing = kubectl(kubeapi, "exec", "kubectl-sleeper", "--", "sh", "-c", "exit 5", check=False)
    assert failing.returncode == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        POD_YAML.replace("kubectl-demo", "kubectl-bad").replace("image: busybox:1.36", "imagee: busybox:1.36")
    )
    refused = kubectl(kubeapi, "apply", "-f", str(bad), check=False)
    assert refused.returncode != 0 and 'unknown field "spec.containers[0].imagee"' in refused.stderr
    kubectl(kubeapi, "delete", "pod", "kubectl-sleeper", "--grace-period=0", "--force")
    jobs = kubectl(kubeapi, "get", "jobs", check=False)
    assert jobs.returncode == 0
