"""The local Kubernetes API as kube-apiserver answers three things clients rely on (issue #57, item 10):
``kubectl auth can-i --list`` (SelfSubjectRulesReview, from the same RBAC that authorizes requests),
the validation of a securityContext that asks for no_new_privs and privilege at once, and batch/v1's
Job defaulting.

The server is a private one with no registry behind it: no test here needs a container to run (pods are
refused, or the restricted namespace refuses the pods a Job would create).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from include.devstack.stack import KUBECTL, RBAC_MANIFEST

from .support import KubeApi, start_server, stop_server

WORKER = "system:serviceaccount:airflow:airflow-worker"
NO_MIRROR = "127.0.0.1:9"  # nothing is pulled here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The server with deploy/rbac.yaml applied by kubectl, as `make stack-up` sets it up; (api, worker's
    kubeconfig)."""
    tmp = tmp_path_factory.mktemp("rules")
    api, proc = start_server(tmp, mirror=NO_MIRROR, users={"worker-token": WORKER})
    try:
        admin = client.CoreV1Api(api.api_client())
        admin.create_namespace(
            {
                "metadata": {
                    "name": "kubetrain",
                    "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
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


def refusal(call, *args, **kwargs) -> tuple[int, dict]:
    with pytest.raises(ApiException) as err:
        call(*args, **kwargs)
    return err.value.status, json.loads(err.value.body)


# -- 1. SelfSubjectRulesReview ----------------------------------------------------------------------


def can_i_list(cluster, namespace: str) -> dict[tuple[str, str], set[str]]:
    """``kubectl auth can-i --list -n NS`` as the worker: {(resource or non-resource URL, resource names):
    verbs}."""
    api, worker_config = cluster
    out = kubectl(api, "auth", "can-i", "--list", "-n", namespace, kubeconfig=worker_config)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[0].split() == ["Resources", "Non-Resource", "URLs", "Resource", "Names", "Verbs"], out.stdout
    rows: dict[tuple[str, str], set[str]] = {}
    for line in lines[1:]:
        # "pods   []   []   [create get list watch patch delete]", "   [/version]   []   [get]"
        found = re.fullmatch(r"(\S*)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*", line)
        assert found, line
        resource, urls, names, verbs = found.groups()
        rows.setdefault((resource or urls, names), set()).update(verbs.split())
    return rows


def test_can_i_list_shows_what_deploy_rbac_grants_the_worker(cluster):
    rows = can_i_list(cluster, "kubetrain")
    assert rows[("pods", "")] >= {"create", "get", "list", "watch", "patch", "delete"}
    assert rows[("pods/log", "")] >= {"get"}
    assert rows[("jobs.batch", "")] >= {"create", "get", "list", "watch", "patch", "delete"}
    assert rows[("secrets", "kubetrain-s3")] == {"get"}
    assert ("secrets", "") not in rows
    # what every authenticated user holds cluster-wide (system:basic-user, system:discovery)
    assert rows[("selfsubjectrulesreviews.authorization.k8s.io", "")] == {"create"}
    assert rows[("/version", "")] == {"get"}
    assert rows[("/apis/*", "")] == {"get"}
    # nothing of the kubetrain Roles in another namespace
    elsewhere = can_i_list(cluster, "default")
    assert ("pods", "") not in elsewhere
    assert ("selfsubjectaccessreviews.authorization.k8s.io", "") in elsewhere


@pytest.mark.parametrize(
    ("args", "answer"),
    [
        (["create", "pods"], "yes"),
        (["get", "pods", "--subresource=log"], "yes"),
        (["delete", "jobs.batch"], "yes"),
        (["get", "secrets/kubetrain-s3"], "yes"),
        (["get", "secrets/other"], "no"),
        (["list", "secrets"], "no"),
        (["update", "pods"], "no"),
    ],
)
def test_the_access_review_agrees_with_the_listed_rules(cluster, args, answer):
    api, worker_config = cluster
    rows = can_i_list(cluster, "kubetrain")
    verb, what = args[0], args[1]
    resource, _, name = what.partition("/")
    if "--subresource=log" in args:
        resource = f"{resource}/log"
    listed = verb in rows.get((resource, name), set()) or verb in rows.get((resource, ""), set())
    assert listed == (answer == "yes")
    out = kubectl(api, "auth", "can-i", *args, "-n", "kubetrain", kubeconfig=worker_config)
    assert out.stdout.strip() == answer, out.stderr


def test_rules_review_body_as_kube_apiserver_answers_it(cluster):
    api, worker_config = cluster
    worker = config.new_client_from_config(str(worker_config))
    authz = client.AuthorizationV1Api(worker)
    review = authz.create_self_subject_rules_review({"spec": {"namespace": "kubetrain"}})
    assert review.kind == "SelfSubjectRulesReview"
    assert review.status.incomplete is False
    assert not review.status.evaluation_error
    secret_rules = [r for r in review.status.resource_rules if r.resources == ["secrets"]]
    assert [(r.verbs, r.api_groups, r.resource_names) for r in secret_rules] == [
        (["get"], [""], ["kubetrain-s3"])
    ]
    assert any("/version" in r.non_resource_urls for r in review.status.non_resource_rules)
    # the namespace is required
    status, body = refusal(authz.create_self_subject_rules_review, {"spec": {}})
    assert (status, body["reason"], body["message"]) == (400, "BadRequest", "no namespace on request")


# -- 2. allowPrivilegeEscalation: false with privileged or CAP_SYS_ADMIN -----------------------------

PRIVILEGED_NO_ESCALATION = {"privileged": True, "allowPrivilegeEscalation": False}
SYS_ADMIN_NO_ESCALATION = {"allowPrivilegeEscalation": False, "capabilities": {"add": ["CAP_SYS_ADMIN"]}}
PRIVILEGED_WHY = "cannot set `allowPrivilegeEscalation` to false and `privileged` to true"
SYS_ADMIN_WHY = "cannot set `allowPrivilegeEscalation` to false and `capabilities.Add` CAP_SYS_ADMIN"


def pod_with(name: str, **spec) -> dict:
    body = {
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", **spec},
    }
    body["spec"].setdefault("containers", [{"name": "main", "image": "busybox:1.36"}])
    return body


@pytest.mark.parametrize("namespace", ["default", "kubetrain"])
def test_privileged_without_privilege_escalation_is_invalid(cluster, namespace):
    api, _ = cluster
    core = client.CoreV1Api(api.api_client())
    body = pod_with(
        "contradiction",
        containers=[{"name": "main", "image": "busybox:1.36", "securityContext": PRIVILEGED_NO_ESCALATION}],
    )
    status, answer = refusal(core.create_namespaced_pod, namespace, body)
    # validation, before Pod Security admission: the same 422 with or without enforcement
    assert (status, answer["reason"]) == (422, "Invalid"), answer
    assert answer["message"].startswith(
        'Pod "contradiction" is invalid: spec.containers[0].securityContext: '
    )
    assert answer["message"].endswith(PRIVILEGED_WHY)
    assert answer["details"]["causes"][0]["field"] == "spec.containers[0].securityContext"


def test_cap_sys_admin_without_privilege_escalation_is_invalid_in_init_and_ephemeral_containers(cluster):
    api, _ = cluster
    core = client.CoreV1Api(api.api_client())
    body = pod_with(
        "sysadmin",
        initContainers=[
            {"name": "init", "image": "busybox:1.36", "securityContext": SYS_ADMIN_NO_ESCALATION}
        ],
    )
    status, answer = refusal(core.create_namespaced_pod, "default", body)
    assert status == 422
    assert answer["message"].startswith('Pod "sysadmin" is invalid: spec.initContainers[0].securityContext: ')
    assert answer["message"].endswith(SYS_ADMIN_WHY)
    body = pod_with(
        "ephemeral",
        ephemeralContainers=[
            {"name": "debug", "image": "busybox:1.36", "securityContext": PRIVILEGED_NO_ESCALATION}
        ],
    )
    status, answer = refusal(core.create_namespaced_pod, "default", body)
    assert status == 422
    fields = {c["field"]: c["message"] for c in answer["details"]["causes"]}
    assert fields["spec.ephemeralContainers[0].securityContext"].endswith(PRIVILEGED_WHY)
    assert fields["spec.ephemeralContainers"] == "Forbidden: cannot be set on create"
    # either alone is fine
    for alone in (
        {"privileged": True},
        {"allowPrivilegeEscalation": False, "capabilities": {"add": ["SYS_ADMIN"]}},
    ):
        ok = pod_with(
            "alone", containers=[{"name": "main", "image": "busybox:1.36", "securityContext": alone}]
        )
        created = core.create_namespaced_pod("default", ok, dry_run="All")
        assert created.metadata.name == "alone"


def test_a_job_template_with_the_contradiction_is_invalid(cluster):
    api, _ = cluster
    batch = client.BatchV1Api(api.api_client())
    job = {
        "metadata": {"name": "contradiction"},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "main", "image": "busybox:1.36", "securityContext": PRIVILEGED_NO_ESCALATION}
                    ],
                }
            }
        },
    }
    status, answer = refusal(batch.create_namespaced_job, "default", job)
    assert (status, answer["reason"]) == (422, "Invalid"), answer
    assert answer["message"].startswith(
        'Job.batch "contradiction" is invalid: spec.template.spec.containers[0].securityContext: '
    )
    assert answer["message"].endswith(PRIVILEGED_WHY)
    assert batch.list_namespaced_job("default").items == []


# -- 3. batch/v1 Job defaulting -----------------------------------------------------------------------


def test_kubectl_create_job_reads_back_with_batch_v1_defaults(cluster):
    api, worker_config = cluster
    made = kubectl(
        api, "create", "job", "defaults", "--image=busybox:1.36", "-n", "kubetrain", kubeconfig=worker_config
    )
    assert made.returncode == 0, made.stderr
    out = kubectl(api, "get", "job", "defaults", "-n", "kubetrain", "-o", "json", kubeconfig=worker_config)
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)["spec"]
    assert {
        k: spec.get(k)
        for k in (
            "completions",
            "parallelism",
            "completionMode",
            "backoffLimit",
            "suspend",
            "manualSelector",
            "podReplacementPolicy",
        )
    } == {
        "completions": 1,
        "parallelism": 1,
        "completionMode": "NonIndexed",
        "backoffLimit": 6,
        "suspend": False,
        "manualSelector": False,
        "podReplacementPolicy": "TerminatingOrFailed",
    }
    assert spec["selector"] == {
        "matchLabels": {"batch.kubernetes.io/controller-uid": json.loads(out.stdout)["metadata"]["uid"]}
    }


def test_job_defaults_leave_what_was_given(cluster):
    api, _ = cluster
    batch = client.BatchV1Api(api.api_client())

    def job(name: str, **spec) -> dict:
        return {
            "metadata": {"name": name},
            "spec": {
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "m", "image": "busybox:1.36"}],
                    },
                },
                **spec,
            },
        }

    # parallelism alone: completions stays unset (a work queue); the Job takes the template's labels
    made = batch.create_namespaced_job("default", job("queue", parallelism=3), dry_run="All")
    assert (made.spec.parallelism, made.spec.completions) == (3, None)
    assert made.metadata.labels == {"app": "queue"}
    # completions alone: parallelism 1
    made = batch.create_namespaced_job("default", job("serial", completions=4), dry_run="All")
    assert (made.spec.parallelism, made.spec.completions) == (1, 4)
    # an Indexed Job needs completions: not taken from parallelism
    status, answer = refusal(
        batch.create_namespaced_job,
        "default",
        job("indexed", parallelism=2, completionMode="Indexed"),
        dry_run="All",
    )
    assert status == 422
    assert {c["field"] for c in answer["details"]["causes"]} == {"spec.completions"}
