"""The local Kubernetes API as strict as a cluster about who may do what: bearer tokens, RBAC with deploy/rbac.yaml
applied by kubectl, access reviews, service accounts, Pod Security admission, and the oldest supported version."""

from __future__ import annotations

import json
import subprocess
import warnings

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from include.devstack.stack import KUBECTL, RBAC_MANIFEST

from .support import KubeApi, simple_pod, start_server, stop_server, wait_for

WORKER = "system:serviceaccount:airflow:airflow-worker"
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mirror):
    tmp = tmp_path_factory.mktemp("access")
    api, proc = start_server(tmp, mirror=mirror, users={"worker-token": WORKER})
    admin = client.CoreV1Api(api.api_client())
    admin.create_namespace(
        {
            "metadata": {
                "name": "kubetrain",
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/warn": "restricted",
                },
            }
        }
    )
    admin.create_namespace({"metadata": {"name": "airflow"}})
    admin.create_namespaced_service_account("airflow", {"metadata": {"name": "airflow-worker"}})
    applied = kubectl(api, "apply", "-f", str(RBAC_MANIFEST))
    assert applied.returncode == 0, applied.stderr
    worker_config = tmp / "worker.kubeconfig"
    doc = json.loads(api.kubeconfig.read_text())
    doc["users"][0]["user"]["token"] = "worker-token"
    worker_config.write_text(json.dumps(doc))
    try:
        yield api, worker_config
    finally:
        stop_server(proc)


def kubectl(api: KubeApi, *args: str, kubeconfig=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(kubeconfig or api.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def worker(cluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(cluster[1])))


def refusal(call, *args, **kwargs) -> tuple[int, str]:
    with pytest.raises(ApiException) as err:
        call(*args, **kwargs)
    return err.value.status, json.loads(err.value.body)["message"]


def test_the_worker_may_do_what_the_role_grants_and_nothing_else(cluster):
    core = worker(cluster)
    pod = simple_pod("allowed", "echo ok", container={"securityContext": RESTRICTED})
    core.create_namespaced_pod("kubetrain", pod)
    assert core.read_namespaced_pod("allowed", "kubetrain").metadata.name == "allowed"
    status, message = refusal(core.create_namespaced_pod, "default", simple_pod("elsewhere", "true"))
    assert status == 403 and message == (
        f'pods is forbidden: User "{WORKER}" cannot create resource "pods" in API group '
        '"" in the namespace "default"'
    )
    status, message = refusal(core.read_namespaced_secret, "some-other-secret", "kubetrain")
    assert status == 403 and message.startswith('secrets "some-other-secret" is forbidden')
    status, message = refusal(core.list_namespaced_secret, "kubetrain")
    assert status == 403 and 'cannot list resource "secrets"' in message
    assert core.list_node().items  # the optional ClusterRole: the preflight's GPU line
    status, message = refusal(core.delete_node, "kubetrain-dev")
    assert status == 403 and message.endswith(
        'cannot delete resource "nodes" in API group "" at the cluster scope'
    )
    core.delete_namespaced_pod("allowed", "kubetrain", grace_period_seconds=0)


def test_kubectl_asks_the_server_what_it_may_do(cluster):
    api, worker_config = cluster
    yes = kubectl(api, "auth", "can-i", "create", "pods", "-n", "kubetrain", kubeconfig=worker_config)
    assert yes.stdout.strip() == "yes"
    no = kubectl(api, "auth", "can-i", "delete", "secrets", "-n", "kubetrain", kubeconfig=worker_config)
    assert no.stdout.strip() == "no" and no.returncode == 1
    named = kubectl(
        api, "auth", "can-i", "get", "secrets/kubetrain-s3", "-n", "kubetrain", kubeconfig=worker_config
    )
    assert named.stdout.strip() == "yes"


def test_no_token_is_anonymous_and_a_bad_one_is_refused(cluster):
    import urllib.error
    import urllib.request

    api, _ = cluster
    from include.devstack.stack import tls_context

    with urllib.request.urlopen(f"{api.url}/version", context=tls_context(api.ca)) as resp:
        assert json.load(resp)["gitVersion"].startswith("v1.29.")
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(f"{api.url}/api/v1/namespaces/kubetrain/pods", context=tls_context(api.ca))
    body = json.loads(anonymous.value.read())
    assert (
        anonymous.value.code == 403
        and 'User "system:anonymous" cannot list resource "pods"' in body["message"]
    )
    bad = urllib.request.Request(f"{api.url}/api", headers={"Authorization": "Bearer made-up"})
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(bad, context=tls_context(api.ca))
    assert unauthorized.value.code == 401


def test_pod_security_admission_refuses_what_restricted_refuses(cluster):
    core = worker(cluster)
    status, message = refusal(core.create_namespaced_pod, "kubetrain", simple_pod("rooty", "true"))
    assert status == 403
    assert message.startswith(
        'pods "rooty" is forbidden: violates PodSecurity "restricted:latest": '
        'allowPrivilegeEscalation != false (container "main" must set '
        "securityContext.allowPrivilegeEscalation=false), unrestricted capabilities"
    )
    assert (
        'seccompProfile (pod or container "main" must set securityContext.seccompProfile.type to "RuntimeDefault"'
        in message
    )
    # the same pod is admitted where the namespace enforces nothing
    admin = client.CoreV1Api(cluster[0].api_client())
    admin.create_namespaced_pod("default", simple_pod("rooty", "true"))
    admin.delete_namespaced_pod("rooty", "default", grace_period_seconds=0)


def test_a_job_whose_pods_break_the_level_reports_failed_create(cluster):
    api, _ = cluster
    batch = client.BatchV1Api(api.api_client())
    batch.create_namespaced_job(
        "kubetrain",
        {
            "metadata": {"name": "privileged-job"},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "c",
                                "image": "busybox:1.36",
                                "command": ["true"],
                                # privileged with allowPrivilegeEscalation false is invalid before any
                                # admission (kube-apiserver's validation), so the escalation is allowed too
                                "securityContext": {
                                    **RESTRICTED,
                                    "privileged": True,
                                    "allowPrivilegeEscalation": True,
                                },
                            }
                        ],
                    }
                },
            },
        },
    )
    core = client.CoreV1Api(api.api_client())

    def failed_create():
        events = core.list_namespaced_event(
            "kubetrain", field_selector="involvedObject.name=privileged-job"
        ).items
        return next((e.message for e in events if e.reason == "FailedCreate"), None)

    message = wait_for(failed_create, 30, what="the Job's FailedCreate event")
    assert 'violates PodSecurity "restricted:latest": ' in message
    assert 'privileged (container "c" must not set securityContext.privileged=true)' in message
    batch.delete_namespaced_job("privileged-job", "kubetrain", propagation_policy="Background")


def test_a_pod_of_a_service_account_that_does_not_exist_is_refused(cluster):
    core = worker(cluster)
    pod = simple_pod("nobody", "true", serviceAccountName="ghost", container={"securityContext": RESTRICTED})
    status, message = refusal(core.create_namespaced_pod, "kubetrain", pod)
    assert status == 403 and message == (
        'pods "nobody" is forbidden: error looking up service account kubetrain/ghost: '
        'serviceaccount "ghost" not found'
    )


def test_a_field_newer_than_1_29_is_dropped_with_a_warning(cluster):
    """securityContext.appArmorProfile came in 1.30: a 1.29 server drops it (and warns), kubectl's Strict refuses it."""
    admin = client.CoreV1Api(cluster[0].api_client())
    body = simple_pod(
        "newer", "true", container={"securityContext": {"appArmorProfile": {"type": "RuntimeDefault"}}}
    )
    with warnings.catch_warnings(record=True):
        created = admin.create_namespaced_pod("default", body)
    assert (
        created.spec.containers[0].security_context is None
        or created.spec.containers[0].security_context.app_armor_profile is None
    )
    admin.delete_namespaced_pod("newer", "default", grace_period_seconds=0)
