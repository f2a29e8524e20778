"""RBAC and Pod Security as pure functions: the rules Kubernetes applies, table-driven."""

from __future__ import annotations

import pytest

from include.devstack.kubeapi import podsecurity, rbac
from include.devstack.kubeapi.store import Store

WORKER = rbac.service_account_identity("airflow", "airflow-worker")


@pytest.mark.parametrize(
    ("rule", "attrs", "allowed"),
    [
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
            rbac.Attributes("get", "", "pods"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
            rbac.Attributes("list", "", "pods"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
            rbac.Attributes("delete", "", "pods"),
            True,
        ),
        (
            {"apiGroups": ["batch"], "resources": ["pods"], "verbs": ["get"]},
            rbac.Attributes("get", "", "pods"),
            False,
        ),
        (
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get"]},
            rbac.Attributes("get", "batch", "jobs"),
            True,
        ),
        # a subresource is its own resource: pods does not grant pods/exec, pods/* and */exec do
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]},
            rbac.Attributes("create", "", "pods", "exec"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
            rbac.Attributes("create", "", "pods", "exec"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["pods/*"], "verbs": ["get"]},
            rbac.Attributes("get", "", "pods", "log"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["*/log"], "verbs": ["get"]},
            rbac.Attributes("get", "", "pods", "log"),
            True,
        ),
        # resourceNames: only requests that name one of them
        (
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["kubetrain-s3"],
                "verbs": ["get"],
            },
            rbac.Attributes("get", "", "secrets", name="kubetrain-s3"),
            True,
        ),
        (
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["kubetrain-s3"],
                "verbs": ["get"],
            },
            rbac.Attributes("get", "", "secrets", name="other"),
            False,
        ),
        (
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["kubetrain-s3"],
                "verbs": ["list"],
            },
            rbac.Attributes("list", "", "secrets"),
            False,
        ),
        # non-resource URLs, with prefix wildcards
        (
            {"nonResourceURLs": ["/apis/*"], "verbs": ["get"]},
            rbac.Attributes("get", path="/apis/batch/v1"),
            True,
        ),
        ({"nonResourceURLs": ["/version"], "verbs": ["get"]}, rbac.Attributes("get", path="/api"), False),
        (
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            rbac.Attributes("get", path="/api"),
            False,
        ),
    ],
)
def test_rbac_rules(rule, attrs, allowed):
    assert rbac.rule_allows(rule, attrs) is allowed


def store_with(*objects: tuple[str, dict]) -> Store:
    store = Store()
    for resource, obj in (*rbac.bootstrap_objects(), *objects):
        store.create(resource, obj)
    return store


def role(name: str, namespace: str | None, rules: list[dict]) -> tuple[str, dict]:
    kind = "Role" if namespace else "ClusterRole"
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return ("roles" if namespace else "clusterroles"), {"kind": kind, "metadata": meta, "rules": rules}


def binding(
    name: str, namespace: str | None, role_kind: str, role_name: str, subjects: list[dict]
) -> tuple[str, dict]:
    kind = "RoleBinding" if namespace else "ClusterRoleBinding"
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return ("rolebindings" if namespace else "clusterrolebindings"), {
        "kind": kind,
        "metadata": meta,
        "roleRef": {"kind": role_kind, "name": role_name},
        "subjects": subjects,
    }


def test_bindings_grant_in_their_namespace_to_their_subjects():
    pods = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]
    sa = [{"kind": "ServiceAccount", "name": "airflow-worker", "namespace": "airflow"}]
    store = store_with(
        role("r", "kubetrain", pods),
        binding("b", "kubetrain", "Role", "r", sa),
        role("c", None, [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]),
        binding(
            "cb", None, "ClusterRole", "c", [{"kind": "Group", "name": "system:serviceaccounts:airflow"}]
        ),
    )
    authz = rbac.Authorizer(store)
    create_pod = rbac.Attributes("create", "", "pods", namespace="kubetrain")
    assert authz.allowed(WORKER, create_pod)
    assert not authz.allowed(WORKER, rbac.Attributes("create", "", "pods", namespace="default"))
    assert not authz.allowed(rbac.service_account_identity("airflow", "airflow-triggerer"), create_pod)
    assert not authz.allowed(rbac.service_account_identity("other", "airflow-worker"), create_pod)
    assert authz.allowed(
        rbac.service_account_identity("airflow", "anyone"), rbac.Attributes("list", "", "nodes")
    )
    # the bootstrap roles: discovery and access reviews for every authenticated user, /version for anyone
    assert authz.allowed(WORKER, rbac.Attributes("get", path="/apis/batch/v1"))
    assert authz.allowed(
        WORKER, rbac.Attributes("create", "authorization.k8s.io", "selfsubjectaccessreviews")
    )
    assert authz.allowed(rbac.anonymous(), rbac.Attributes("get", path="/version"))
    assert not authz.allowed(rbac.anonymous(), rbac.Attributes("get", path="/api"))
    assert authz.allowed(rbac.Identity("root", ("system:masters",)), rbac.Attributes("delete", "", "nodes"))


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        (
            rbac.Attributes("create", "", "pods", namespace="kubetrain"),
            'pods is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot create resource "pods" in API '
            'group "" in the namespace "kubetrain"',
        ),
        (
            rbac.Attributes(
                "create", "trainer.kubeflow.org", "trainingruntimes", name="j", namespace="kubetrain"
            ),
            'trainingruntimes "j" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot create resource '
            '"trainingruntimes" in API group "trainer.kubeflow.org" in the namespace "kubetrain"',
        ),
        (
            rbac.Attributes("get", "", "pods", "exec", name="p", namespace="ns"),
            'pods "p" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot get resource "pods/exec" in '
            'API group "" in the namespace "ns"',
        ),
        (
            rbac.Attributes("list", "", "nodes"),
            'nodes is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot list resource "nodes" in API '
            'group "" at the cluster scope',
        ),
        (
            rbac.Attributes("get", path="/metrics"),
            'forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot get path "/metrics"',
        ),
    ],
)
def test_forbidden_messages_read_as_the_api_server_s(attrs, message):
    assert rbac.forbidden_message(WORKER, attrs) == message


def test_token_file_gives_users_and_groups(tmp_path):
    path = tmp_path / "tokens.csv"
    path.write_text(
        'abc,kubetrain-admin,1,"system:masters"\nxyz,system:serviceaccount:airflow:airflow-worker,2\n'
    )
    tokens = rbac.read_token_file(path)
    assert tokens["abc"].groups == ("system:masters", "system:authenticated")
    assert tokens["xyz"].service_account == ("airflow", "airflow-worker")
    assert set(tokens["xyz"].groups) == {
        "system:authenticated",
        "system:serviceaccounts",
        "system:serviceaccounts:airflow",
    }
    path.write_text("only-a-token\n")
    with pytest.raises(ValueError, match="a line needs token,user,uid"):
        rbac.read_token_file(path)


def pod(containers: list[dict], **spec) -> dict:
    return {"metadata": {"name": "p", **spec.pop("metadata", {})}, "spec": {"containers": containers, **spec}}


RESTRICTED_OK = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.mark.parametrize(
    ("level", "body", "expected"),
    [
        ("privileged", pod([{"name": "c", "securityContext": {"privileged": True}}], hostNetwork=True), []),
        ("baseline", pod([{"name": "c"}]), []),
        (
            "baseline",
            pod([{"name": "c", "securityContext": {"privileged": True}}]),
            [("privileged", 'container "c" must not set securityContext.privileged=true')],
        ),
        (
            "baseline",
            pod([{"name": "c"}], hostNetwork=True, hostPID=True),
            [("host namespaces", "hostNetwork=true, hostPID=true")],
        ),
        (
            "baseline",
            pod([{"name": "c"}], volumes=[{"name": "h", "hostPath": {"path": "/"}}]),
            [("hostPath volumes", 'volume "h"')],
        ),
        (
            "baseline",
            pod([{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN", "CHOWN"]}}}]),
            [
                (
                    "non-default capabilities",
                    'container "c" must not include "SYS_ADMIN" in securityContext.capabilities.add',
                )
            ],
        ),
        (
            "baseline",
            pod(
                [
                    {
                        "name": "b",
                        "securityContext": {
                            "seccompProfile": {"type": "Unconfined"},
                            "appArmorProfile": {"type": "Unconfined"},
                        },
                    }
                ]
            ),
            [
                (
                    "forbidden AppArmor profile",
                    'container "b" must not set securityContext.appArmorProfile.type to "Unconfined"',
                ),
                (
                    "seccompProfile",
                    'container "b" must not set securityContext.seccompProfile.type to "Unconfined"',
                ),
            ],
        ),
        ("restricted", pod([{"name": "c", "securityContext": RESTRICTED_OK}]), []),
        (
            "restricted",
            pod(
                [{"name": "c", "securityContext": {**RESTRICTED_OK, "runAsNonRoot": None}}],
                securityContext={"runAsNonRoot": True},
            ),
            [],
        ),
        (
            "restricted",
            pod([{"name": "a"}, {"name": "b", "securityContext": RESTRICTED_OK}]),
            [
                (
                    "allowPrivilegeEscalation != false",
                    'container "a" must set securityContext.allowPrivilegeEscalation=false',
                ),
                (
                    "unrestricted capabilities",
                    'container "a" must set securityContext.capabilities.drop=["ALL"]',
                ),
                ("runAsNonRoot != true", 'pod or container "a" must set securityContext.runAsNonRoot=true'),
                (
                    "seccompProfile",
                    'pod or container "a" must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"',
                ),
            ],
        ),
        (
            "restricted",
            pod(
                [{"name": "c", "securityContext": {**RESTRICTED_OK, "runAsUser": 0}}],
                volumes=[{"name": "d", "hostPath": {"path": "/d"}}, {"name": "e", "emptyDir": {}}],
            ),
            [
                ("hostPath volumes", 'volume "d"'),
                ("restricted volume types", 'volume "d" uses restricted volume type "hostPath"'),
                ("runAsUser=0", 'container "c" must not set runAsUser=0'),
            ],
        ),
    ],
)
def test_pod_security_standards(level, body, expected):
    assert podsecurity.violations(level, body) == expected


def test_pod_security_levels_come_from_the_namespace_labels():
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/warn": "baseline",
    }
    assert podsecurity.levels({"metadata": {"labels": labels}}) == ("restricted", "baseline")
    assert podsecurity.levels({"metadata": {}}) == ("privileged", "privileged")
    assert (
        podsecurity.levels({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "strict"}}})[0]
        == "restricted"
    )
    text = podsecurity.summary("restricted", [("runAsUser=0", "pod must not set runAsUser=0")])
    assert text == 'violates PodSecurity "restricted:latest": runAsUser=0 (pod must not set runAsUser=0)'
