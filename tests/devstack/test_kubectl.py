"""The real kubectl (installed by `make setup` in .tools/bin) against the local Kubernetes API."""

from __future__ import annotations

import subprocess

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
    command: ["sh", "-c", "echo tick-1; until [ -e /tmp/go ]; do sleep 0.1; done; for i in 2 3 4; do echo tick-$i; done"]
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
    # logs -f streams while the container runs (it waits for /tmp/go after tick-1) and returns when it exits
    kubectl(kubeapi, "wait", "--for=condition=Ready", "pod/kubectl-demo", "--timeout=60s", timeout=90)
    follow = subprocess.Popen(
        [KUBECTL, "--kubeconfig", str(kubeapi.kubeconfig), "logs", "-f", "kubectl-demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = follow.stdout.readline()
        phase_at_first_line = kubectl(
            kubeapi, "get", "pod", "kubectl-demo", "-o", "jsonpath={.status.phase}"
        ).stdout
        kubectl(kubeapi, "exec", "kubectl-demo", "--", "touch", "/tmp/go")
        rest, _ = follow.communicate(timeout=60)
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
    for expected in (
        "Status:           Succeeded",
        "Node:             kubetrain-dev/127.0.0.1",
        "Reason:       Completed",
        "Exit Code:    0",
        "Scheduled",
        "Started",
        "Successfully assigned default/kubectl-demo to kubetrain-dev",
    ):
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
    manifest.write_text(
        POD_YAML.replace("kubectl-demo", "kubectl-sleeper").replace(
            "echo tick-1; until [ -e /tmp/go ]; do sleep 0.1; done; for i in 2 3 4; do echo tick-$i; done",
            "sleep 60",
        )
    )
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


def test_kubectl_create_configmap_secret_namespace_job_then_logs_job(kubeapi):
    """kubectl's typed `create` commands send protobuf bodies; the server decodes them."""
    assert (
        kubectl(kubeapi, "create", "configmap", "app", "--from-literal=mode=fast").stdout
        == "configmap/app created\n"
    )
    assert kubectl(kubeapi, "get", "configmap", "app", "-o", "jsonpath={.data.mode}").stdout == "fast"
    out = kubectl(kubeapi, "create", "secret", "generic", "creds", "--from-literal=token=s3cr3t").stdout
    assert out == "secret/creds created\n"
    got = kubectl(kubeapi, "get", "secret", "creds", "-o", "jsonpath={.type} {.data.token}").stdout
    assert got == "Opaque czNjcjN0"  # base64 of s3cr3t
    assert (
        kubectl(kubeapi, "create", "namespace", "kubectl-team").stdout == "namespace/kubectl-team created\n"
    )
    assert kubectl(kubeapi, "create", "job", "hi", "--image=busybox", "--", "sh", "-c", "echo hi").stdout == (
        "job.batch/hi created\n"
    )
    kubectl(kubeapi, "wait", "--for=condition=complete", "job/hi", "--timeout=60s", timeout=90)
    assert kubectl(kubeapi, "logs", "job/hi").stdout == "hi\n"
    duplicate = kubectl(kubeapi, "create", "configmap", "app", "--from-literal=mode=slow", check=False)
    assert duplicate.returncode == 1 and 'configmaps "app" already exists' in duplicate.stderr
    for kind, name in (
        ("job", "hi"),
        ("configmap", "app"),
        ("secret", "creds"),
        ("namespace", "kubectl-team"),
    ):
        kubectl(kubeapi, "delete", kind, name, "--wait=false")


def test_kubectl_explain_reads_the_openapi_v3_schemas(kubeapi):
    pod = kubectl(kubeapi, "explain", "pod").stdout
    assert "KIND:       Pod" in pod and "VERSION:    v1" in pod and "FIELDS:" in pod
    assert "  spec\t<PodSpec>" in pod and "  status\t<PodStatus>" in pod
    assert "Container image name." in kubectl(kubeapi, "explain", "pod.spec.containers.image").stdout
    job = kubectl(kubeapi, "explain", "job.spec.completionMode").stdout
    assert "GROUP:      batch" in job and "FIELD: completionMode <string>" in job
    assert "FIELD: clusterIP <string>" in kubectl(kubeapi, "explain", "service.spec.clusterIP").stdout


def test_kubectl_server_side_apply_creates_a_new_object_and_refuses_an_existing_one(kubeapi, tmp_path):
    manifest = tmp_path / "cm.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: ssa}\ndata: {mode: fast}\n")
    assert (
        kubectl(kubeapi, "apply", "--server-side", "-f", str(manifest)).stdout
        == "configmap/ssa serverside-applied\n"
    )
    assert kubectl(kubeapi, "get", "configmap", "ssa", "-o", "jsonpath={.data.mode}").stdout == "fast"
    manifest.write_text(manifest.read_text().replace("fast", "slow"))
    again = kubectl(kubeapi, "apply", "--server-side", "-f", str(manifest), check=False)
    assert again.returncode == 1
    assert (
        "server-side apply (application/apply-patch+yaml) of an existing object is not supported"
        in again.stderr
    )
    assert kubectl(kubeapi, "get", "configmap", "ssa", "-o", "jsonpath={.data.mode}").stdout == "fast"
    kubectl(kubeapi, "delete", "configmap", "ssa")


def test_kubectl_run_shell_image_as_cmd_and_the_pod_hostname(kubeapi):
    # busybox's sh is its CMD: `-- sh -c ...` become the container's args and replace it
    assert kubectl(
        kubeapi, "run", "r", "--image=busybox", "--restart=Never", "--", "sh", "-c", "echo ran"
    ).stdout == ("pod/r created\n")
    kubectl(kubeapi, "wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/r", "--timeout=60s", timeout=90)
    assert kubectl(kubeapi, "logs", "r").stdout == "ran\n"
    # -i attaches to the container's output (kubectl prints its "command prompt" hint on stderr)
    attached = kubectl(
        kubeapi,
        "run",
        "r-hostname",
        "--image=busybox",
        "--restart=Never",
        "-i",
        "--",
        "sh",
        "-c",
        "echo ran; cat /etc/hostname; hostname",
    )
    assert attached.stdout == "ran\nr-hostname\nr-hostname\n"
    failed = kubectl(
        kubeapi,
        "run",
        "r-fails",
        "--image=busybox",
        "--restart=Never",
        "--rm",
        "-i",
        "--",
        "sh",
        "-c",
        "echo failing; exit 3",
        check=False,
    )
    assert failed.returncode == 3 and failed.stdout.startswith("failing\n")
    kubectl(kubeapi, "delete", "pod", "r", "r-hostname")


def test_kubectl_unsupported_commands_say_what_is_unsupported(kubeapi):
    kubectl(kubeapi, "run", "pf", "--image=busybox", "--restart=Never", "--", "sh", "-c", "sleep 60")
    kubectl(kubeapi, "wait", "--for=condition=Ready", "pod/pf", "--timeout=60s", timeout=90)
    forward = kubectl(kubeapi, "port-forward", "pod/pf", "0:80", check=False)
    assert (
        forward.returncode == 1
        and "port-forward is not supported by the local Kubernetes API" in forward.stderr
    )
    top = kubectl(kubeapi, "top", "pod", check=False)
    assert top.returncode == 1 and "Metrics API not available" in top.stderr
    deployment = kubectl(kubeapi, "create", "deployment", "web", "--image=busybox", check=False)
    assert (
        deployment.returncode == 1 and "the local Kubernetes API does not serve apps/v1" in deployment.stderr
    )
    tfjobs = kubectl(kubeapi, "get", "tfjobs", check=False)
    assert tfjobs.returncode == 1 and 'the server doesn\'t have a resource type "tfjobs"' in tfjobs.stderr
    assert kubectl(kubeapi, "get", "crd").stderr == "No resources found\n"
    kubectl(kubeapi, "delete", "pod", "pf", "--grace-period=0", "--force")
