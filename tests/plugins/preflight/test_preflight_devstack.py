"""The preflight against the dev stack: all PASS with the real images, and each broken setting FAILs
with its fix; no preflight pod is left behind."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client, config

from include.devstack.stack import free_port
from kubetrain.preflight import Check, Preflight
from kubetrain.settings import Deployment

REPO = Path(__file__).resolve().parents[3]
NAMESPACE = "kubetrain"


@pytest.fixture
def stack_env(devstack, monkeypatch) -> dict[str, str]:
    env = devstack.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # In-process the kubeconfig goes by the connection: the kubernetes client read $KUBECONFIG at import.
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {
                "conn_type": "kubernetes",
                "extra": {"kube_config_path": env["KUBECONFIG"], "namespace": NAMESPACE},
            }
        ),
    )
    for name in (
        "KUBETRAIN_TRAINER_IMAGE",
        "KUBETRAIN_SYNC_IMAGE",
        "KUBETRAIN_SERVICE_ACCOUNT",
        "KUBETRAIN_IMAGE_PULL_SECRETS",
        "KUBETRAIN_NODE_SELECTOR",
        "KUBETRAIN_TOLERATIONS",
    ):
        monkeypatch.delenv(name, raising=False)
    return env


@pytest.fixture
def core(stack_env) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(stack_env["KUBETRAIN_ADMIN_KUBECONFIG"]))


def deployment(**changes) -> Deployment:
    """The deployment as the stack's environment sets it (its registry, the CPU trainer), with ``changes``."""
    import dataclasses

    return dataclasses.replace(Deployment.from_environment(), **changes)


def preflight_pods(core) -> list[str]:
    pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=preflight").items
    return [p.metadata.name for p in pods]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_all_pass_against_the_dev_stack_as_a_dag(stack_env, stack_images, core, monkeypatch, capfd):
    monkeypatch.setenv("KUBETRAIN_TRAINER_IMAGE", stack_images["trainer"].reference)
    monkeypatch.setenv("KUBETRAIN_SYNC_IMAGE", stack_images["sync"].reference)
    spec = importlib.util.spec_from_file_location(
        "kubetrain_preflight_under_test", REPO / "dags" / "kubetrain_preflight.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = module.kubetrain_preflight().test()
    assert str(run.state) == "success"

    # the task prints each line as it is decided (and returns them as its XCom)
    lines = [
        line
        for line in capfd.readouterr().out.splitlines()
        if line[:4] in ("PASS", "FAIL", "WARN", "INFO", "SKIP")
    ]
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in lines}
    assert status == {
        "api": "PASS",
        "access": "PASS",
        "s3-secret": "PASS",
        "image:trainer": "PASS",
        "image:sync": "PASS",
        "s3-from-pod": "PASS",
        "s3-region": "PASS",
        "s3-write": "PASS",
        "gpu-nodes": "INFO",  # the dev stack's node serves GPU requests on CPU, and says so
        "gpu-pool": "INFO",  # no airflow_api connection (test_preflight_airflow_api.py reads it)
        "registry": "PASS",
        "training-apis": "INFO",
        "queue": "INFO",
        "access:triggerer": "PASS",
    }, lines
    text = "\n".join(lines)
    assert stack_images["trainer"].reference in text and stack_images["sync"].reference in text
    assert "s3-from-pod: a pod listed datasets" in text
    assert "s3-region: datasets in us-east-1, training in us-east-1; pods sign for us-east-1" in text
    assert (
        "s3-write: a pod wrote, read back through the CRT and deleted 65536 bytes at s3://training/preflight/"
        in text
    )
    assert "served: Indexed Job (batch/v1); not served: Kubeflow TFJob" in text
    assert "; Kueue served (kueue.x-k8s.io v1beta2, v1beta1)" in text  # the stand-in, as Kueue v0.19
    assert "queue: no Kueue queue configured (KUBETRAIN_QUEUE)" in text
    assert (
        "gpu-nodes: none of 1 node(s) offers nvidia.com/gpu; node(s) kubetrain-dev serve GPU requests on CPU "
        "(the dev stack, annotation kubetrain.io/gpu-requests-served-on-cpu)" in text
    )
    assert "stay Pending" not in text
    assert "gpu-pool: pool 'gpu' not checked: no Airflow API configured" in text
    assert "check with `airflow pools get gpu`" in text and "ORM" not in text
    assert preflight_pods(core) == []


def test_the_gpu_nodes_line_says_the_dev_stack_serves_gpu_requests_on_cpu(stack_env, core):
    """The dev stack's node is annotated as serving nvidia.com/gpu on CPU: INFO, not a warning that pods stay
    Pending. For a resource it does not serve so (its pods stay Pending there too) the warning stands."""
    node = core.list_node().items[0]
    if "nvidia.com/gpu" in (node.status.allocatable or {}):
        pytest.skip("this machine has GPUs: the dev stack's node offers nvidia.com/gpu")
    assert node.metadata.annotations == {"kubetrain.io/gpu-requests-served-on-cpu": "nvidia.com/gpu"}
    check = Preflight(deployment()).cluster_checks.check_gpu_nodes()
    assert check.status == "INFO", check
    assert "node(s) kubetrain-dev serve GPU requests on CPU (the dev stack" in check.detail
    assert "train on CPU, where a cluster without GPU nodes would keep them Pending" in check.detail
    other = Preflight(deployment(gpu_resource="amd.com/gpu")).cluster_checks.check_gpu_nodes()
    assert other.status == "WARN"
    assert other.detail.startswith(
        "none of 1 node(s) offers amd.com/gpu: training pods that ask for GPUs stay"
    )


def test_the_queue_line_checks_the_configured_local_queue(stack_env):
    found = Preflight(Deployment(queue="training")).cluster_checks.check_queue()
    assert (found.status, found.detail) == (
        "PASS",
        "LocalQueue 'training' feeds ClusterQueue 'kubetrain'; WorkloadPriorityClasses: high, low",
    )
    missing = Preflight(Deployment(queue="nobody")).cluster_checks.check_queue()
    assert missing.status == "FAIL"
    assert missing.detail == f"LocalQueue 'nobody' does not exist in namespace {NAMESPACE}"
    assert "kind: LocalQueue" in missing.fix and "KUBETRAIN_QUEUE" in missing.fix
    with pytest.raises(ValueError, match="queue 'Team_A' is not a Kueue LocalQueue name"):
        Deployment(queue="Team_A")


def test_the_preflight_runs_as_the_docs_say_from_a_clean_shell(devstack, stack_images, tmp_path):
    """docs/real-cluster.md's command, word for word, in a shell with no Airflow connection, no
    KUBECONFIG and no virtual environment on PATH: it checks the dev stack (the env file's), prints
    its lines and no traceback."""
    doc = (REPO / "docs" / "real-cluster.md").read_text()
    (command,) = [
        line.split("#")[0].strip()
        for line in doc.splitlines()
        if line.startswith("    ") and "preflight" in line and "#" in line
    ][:1]
    assert command == "make preflight", command
    env = {
        # what a new login shell has: the system's PATH, a home, the machine's proxy and CA settings
        **{k: v for k, v in os.environ.items() if k.lower().endswith("_proxy") or k.startswith("SSL_CERT")},
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBETRAIN_STACK_DIR": str(devstack.state_dir),  # the test session's stack stands in for .stack
        # what `make stack-images` pushes as the defaults, this session's build
        "KUBETRAIN_TRAINER_IMAGE": stack_images["trainer"].reference,
        "KUBETRAIN_SYNC_IMAGE": stack_images["sync"].reference,
    }
    proc = subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out[-4000:]
    assert f"checking the dev stack ({devstack.state_dir}/env)" in out
    status = {
        line.split()[1].rstrip(":"): line.split()[0]
        for line in proc.stdout.splitlines()
        if line[:4] in ("PASS", "FAIL", "WARN", "INFO", "SKIP")
    }
    assert proc.returncode == 0, out[-4000:]
    assert {k: status.get(k) for k in ("api", "access", "s3-secret", "image:trainer", "s3-write")} == {
        "api": "PASS",
        "access": "PASS",
        "s3-secret": "PASS",
        "image:trainer": "PASS",
        "s3-write": "PASS",
    }, out[-4000:]


def test_broken_configuration_names_each_fix(stack_env, core, devstack):
    """Run as `python -m kubetrain.preflight`: a Secret without the secret key that points pods at a
    closed port, an image the registry lacks, a registry the workers cannot reach, a missing pool."""
    closed = free_port()
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name="kubetrain-s3-partial"),
        string_data={"AWS_ACCESS_KEY_ID": "x", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}"},
    )
    core.create_namespaced_secret(NAMESPACE, secret)
    # a Secret of another name: named in the Role's resourceNames too, as deploy/rbac.yaml says to
    rbac_api = client.RbacAuthorizationV1Api(core.api_client)
    role = rbac_api.read_namespaced_role("kubetrain-airflow", NAMESPACE)
    original = copy.deepcopy(role.rules)
    for rule in role.rules:
        if rule.resource_names:
            rule.resource_names = [*rule.resource_names, "kubetrain-s3-partial"]
    rbac_api.replace_namespaced_role("kubetrain-airflow", NAMESPACE, role)
    registry = devstack.load_state()["registry"]
    env = {
        **os.environ,
        "KUBECONFIG": stack_env["KUBECONFIG"],
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": stack_env["AIRFLOW_CONN_KUBERNETES_DEFAULT"],
        "PYTHONPATH": os.pathsep.join([str(REPO / "plugins"), str(REPO)]),
        "KUBETRAIN_S3_SECRET": "kubetrain-s3-partial",
        "KUBETRAIN_TRAINER_IMAGE": f"{registry}/kubetrain-missing/trainer:never-pushed",
        "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT": json.dumps(
            {
                "conn_type": "kubetrain_registry",
                "host": "127.0.0.1",
                "port": closed,
                "extra": {"insecure": True, "timeout": 5},
            }
        ),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kubetrain.preflight", "--pool", "gpu-missing"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        core.delete_namespaced_secret("kubetrain-s3-partial", NAMESPACE)
        role = rbac_api.read_namespaced_role("kubetrain-airflow", NAMESPACE)
        role.rules = original
        rbac_api.replace_namespaced_role("kubetrain-airflow", NAMESPACE, role)
    lines = {
        line.split()[1].rstrip(":"): line
        for line in proc.stdout.splitlines()
        if line[:4] in ("PASS", "FAIL", "WARN", "INFO", "SKIP")
    }
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines["s3-secret"].startswith("FAIL") and "lacks AWS_SECRET_ACCESS_KEY" in lines["s3-secret"]
    assert "-> fix: add AWS_SECRET_ACCESS_KEY to Secret 'kubetrain-s3-partial'" in lines["s3-secret"]
    assert (
        lines["image:trainer"].startswith("FAIL")
        and "kubetrain-missing/trainer:never-pushed cannot be pulled: ErrImagePull" in lines["image:trainer"]
    )
    assert (
        "-> fix: push it (make images, or the build_trainer_image DAG) or set KUBETRAIN_TRAINER_IMAGE"
        in lines["image:trainer"]
    )
    for name in ("s3-from-pod", "s3-write"):
        assert lines[name].startswith("FAIL") and "PartialCredentialsError" in lines[name], lines[name]
        assert (
            "-> fix: give Secret 'kubetrain-s3-partial' both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            in lines[name]
        )
    assert (
        lines["registry"].startswith("FAIL")
        and "-> fix: define connection kubetrain_registry_default" in lines["registry"]
    )
    # without the airflow_api connection the pool is not read (test_preflight_airflow_api.py: the FAIL)
    assert lines["gpu-pool"].startswith("INFO") and "`airflow pools get gpu-missing`" in lines["gpu-pool"]
    assert lines["api"].startswith("PASS") and lines["image:sync"].startswith("PASS")
    assert "5 failed" in proc.stdout
    assert "x" not in [w.strip("'") for w in proc.stdout.split()]  # the Secret's value is never printed
    assert preflight_pods(core) == []


def test_a_secret_the_role_does_not_name_fails_naming_the_fix(stack_env):
    check = Preflight(deployment(s3_secret="team-s3")).s3_checks.check_s3_secret()
    assert check.status == "FAIL" and check.detail.startswith(
        "the workers may not read Secret 'team-s3': secrets"
    )
    assert check.fix.startswith(
        "name 'team-s3' in the resourceNames of deploy/rbac.yaml's Role kubetrain-airflow"
    )


def test_unreachable_s3_endpoint_names_the_secret_key(stack_env, stack_images, core):
    closed = free_port()
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name="kubetrain-s3-closed"),
        string_data={
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}",
        },
    )
    core.create_namespaced_secret(NAMESPACE, secret)
    try:
        checks = by_name(Preflight(deployment(s3_secret="kubetrain-s3-closed")).check_pods())
    finally:
        core.delete_namespaced_secret("kubetrain-s3-closed", NAMESPACE)
    check = checks["s3-from-pod"]
    assert check.status == "FAIL" and f"127.0.0.1:{closed}" in check.detail, check
    assert check.fix.startswith(
        "set AWS_ENDPOINT_URL in Secret 'kubetrain-s3-closed' to an address pods reach"
    )
    assert preflight_pods(core) == []


def _secret_the_role_names(core, name: str, data: dict[str, str]):
    """Create Secret ``name`` and name it in the Role's resourceNames, as deploy/rbac.yaml says to; undone on exit."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        core.create_namespaced_secret(
            NAMESPACE, client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data)
        )
        rbac_api = client.RbacAuthorizationV1Api(core.api_client)
        role = rbac_api.read_namespaced_role("kubetrain-airflow", NAMESPACE)
        original = copy.deepcopy(role.rules)
        for rule in role.rules:
            if rule.resource_names:
                rule.resource_names = [*rule.resource_names, name]
        rbac_api.replace_namespaced_role("kubetrain-airflow", NAMESPACE, role)
        try:
            yield
        finally:
            core.delete_namespaced_secret(name, NAMESPACE)
            role = rbac_api.read_namespaced_role("kubetrain-airflow", NAMESPACE)
            role.rules = original
            rbac_api.replace_namespaced_role("kubetrain-airflow", NAMESPACE, role)

    return scope()


def test_buckets_in_another_region_fail_naming_the_region_to_set(stack_env, stack_images, core, devstack):
    """S3 in front of which the buckets answer as eu-west-2's do (no S3 server here checks the signing region)."""
    from tests.trainer.sync.sync_support.faultproxy import FaultProxy

    s3 = devstack.load_state()["s3"]
    with FaultProxy(s3["endpoint"], fail_rate=0.0, region="eu-west-2") as proxy:
        data = {
            "AWS_ACCESS_KEY_ID": s3["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": s3["secret_access_key"],
            "AWS_ENDPOINT_URL": proxy.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        with _secret_the_role_names(core, "kubetrain-s3-region", data):
            checks = by_name(
                Preflight(
                    deployment(
                        s3_secret="kubetrain-s3-region",
                        sync_image=stack_images["sync"].reference,
                        trainer_image=stack_images["trainer"].reference,
                    )
                ).check_pods()
            )
    region = checks["s3-region"]
    assert region.status == "FAIL", region
    assert region.detail.startswith(
        "bucket 'datasets' is in eu-west-2, 'training' is in eu-west-2, but the pods sign for us-east-1"
    )
    assert region.fix == (
        "kubectl -n kubetrain patch secret kubetrain-s3-region --type merge -p "
        '\'{"stringData": {"AWS_REGION": "eu-west-2", "AWS_DEFAULT_REGION": "eu-west-2"}}\''
    )
    # the pods' clients found the region themselves: listing and the CRT's read back both worked
    assert checks["s3-from-pod"].status == "PASS" and checks["s3-write"].status == "PASS", checks
    assert preflight_pods(core) == []


def test_a_training_bucket_the_pods_cannot_write_fails_naming_the_setting(stack_env, stack_images, core):
    checks = by_name(
        Preflight(
            deployment(
                training_bucket="kubetrain-nowhere",
                sync_image=stack_images["sync"].reference,
                trainer_image=stack_images["trainer"].reference,
            )
        ).check_pods()
    )
    write = checks["s3-write"]
    assert write.status == "FAIL" and write.detail.startswith(
        "a pod could not write, read back and delete in bucket 'kubetrain-nowhere': "
    )
    assert "NoSuchBucket" in write.detail
    assert write.fix == "create bucket 'kubetrain-nowhere' or set KUBETRAIN_TRAINING_BUCKET"
    assert checks["s3-from-pod"].status == "PASS"
    assert preflight_pods(core) == []


def test_a_sync_image_that_cannot_be_pulled_fails_and_skips_the_s3_lines(
    stack_env, stack_images, core, devstack
):
    registry = devstack.load_state()["registry"]
    missing = f"{registry}/kubetrain-missing/sync:never-pushed"
    checks = by_name(
        Preflight(
            deployment(sync_image=missing, trainer_image=stack_images["trainer"].reference)
        ).check_pods()
    )
    assert (
        checks["image:sync"].status == "FAIL"
        and f"{missing} cannot be pulled: ErrImagePull" in checks["image:sync"].detail
    )
    assert checks["image:sync"].fix.startswith(
        "push it (make images, or the build_trainer_image DAG) or set KUBETRAIN_SYNC_IMAGE"
    )
    assert checks["image:trainer"].status == "PASS"
    for name in ("s3-from-pod", "s3-region", "s3-write"):
        assert (
            checks[name].status == "SKIP"
            and checks[name].detail == f"needs the sync image ({missing}) to run"
        )
    assert preflight_pods(core) == []


def test_missing_namespace_fails_first_and_skips_what_needs_it(stack_env, core):
    checks = by_name(Preflight(deployment(namespace="kubetrain-nowhere")).run())
    assert checks["api"].status == "FAIL"
    assert (
        checks["api"].fix
        == "kubectl create namespace kubetrain-nowhere, or set KUBETRAIN_NAMESPACE to an existing one"
    )
    for name in ("s3-secret", "image:trainer", "image:sync", "s3-from-pod", "s3-region", "s3-write"):
        assert checks[name].status == "SKIP"
    assert checks["training-apis"].status == "INFO"  # the API itself answers


def test_unreachable_api_names_the_connection(stack_env, monkeypatch, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig)}}),
    )
    checks = by_name(Preflight(Deployment()).run())
    assert (
        checks["api"].status == "FAIL"
        and "connection 'kubernetes_default' does not answer" in checks["api"].detail
    )
    assert "kube_config_path" in checks["api"].fix
    assert checks["gpu-nodes"].status == "SKIP" and checks["training-apis"].status == "SKIP"


def test_workload_identity_without_its_service_account_fails(stack_env):
    check = Preflight(
        deployment(s3_secret=None, service_account="kubetrain-irsa")
    ).s3_checks.check_s3_secret()
    assert (
        check.status == "FAIL"
        and "service account 'kubetrain-irsa' does not exist in 'kubetrain'" in check.detail
    )
    assert check.fix.startswith("kubectl -n kubetrain create serviceaccount kubetrain-irsa")


def test_a_cluster_older_than_the_minimum_fails_with_the_reason(stack_env, devstack, tmp_path, monkeypatch):
    """A server that reports 1.28 (the dev stack's own API, started as an older cluster)."""
    from tests.devstack.support import start_server, stop_server

    api, proc = start_server(
        tmp_path, "--kubernetes-version", "1.28.9", mirror=devstack.load_state()["mirror"]
    )
    try:
        monkeypatch.setenv(
            "AIRFLOW_CONN_KUBERNETES_DEFAULT",
            json.dumps(
                {
                    "conn_type": "kubernetes",
                    "extra": {"kube_config_path": str(api.kubeconfig), "namespace": "default"},
                }
            ),
        )
        check = Preflight(Deployment(namespace="default")).cluster_checks.check_api()
    finally:
        stop_server(proc)
    assert check.status == "FAIL" and check.detail.startswith("API v1.28.9-kubetrain at")
    assert (
        "older than 1.29, the oldest Kubernetes kubetrain supports" in check.detail
        and "native sidecar" in check.detail
    )
    assert check.fix == "upgrade the cluster to Kubernetes 1.29 or later"


def test_an_account_without_the_roles_fails_the_access_review_naming_what_it_lacks(
    stack_env, devstack, monkeypatch
):
    """The triggerer's account reviewed as if it were the workers': it may follow pods, not create them."""
    triggerer = devstack.load_state()["kubeconfig_triggerer"]
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": triggerer, "namespace": NAMESPACE}}
        ),
    )
    preflight = Preflight(deployment())
    check = preflight.cluster_checks.check_access()
    assert check.status == "FAIL" and check.detail.startswith(
        "the workers' account may not create pods, patch pods"
    )
    assert "in namespace 'kubetrain'" in check.detail and "more)" in check.detail
    assert check.fix.startswith("kubectl apply -f deploy/rbac.yaml in namespace kubetrain")
    # and the pods it would start are refused with the API's 403, as one line
    checks = by_name(preflight.check_pods())
    assert (
        checks["image:trainer"].status == "FAIL"
        and "was refused: pods is forbidden: User " in checks["image:trainer"].detail
    )
    assert 'cannot create resource "pods"' in checks["image:trainer"].detail
    assert checks["image:trainer"].fix == "see the access line: kubectl apply -f deploy/rbac.yaml"


def test_the_triggerer_reviews_its_own_access_from_the_triggerer(stack_env, devstack):
    """The trigger the preflight DAG defers to, run as the triggerer's account: its grants pass, and a list of what
    only the workers may do fails naming it."""
    import asyncio

    from kubetrain.preflight.cluster import (
        TRIGGERER_ACCESS,
        WORKER_ACCESS,
        access_attributes,
        triggerer_check,
    )
    from kubetrain.triggers.access import AccessReviewTrigger

    triggerer = devstack.load_state()["kubeconfig_triggerer"]

    def review(access) -> Check:
        trigger = AccessReviewTrigger(
            attributes=access_attributes(access, NAMESPACE, "kubetrain-s3"), config_file=triggerer
        )
        classpath, kwargs = trigger.serialize()
        assert classpath == "kubetrain.triggers.access.AccessReviewTrigger"

        async def first():
            async for event in AccessReviewTrigger(**kwargs).run():
                return event.payload

        return triggerer_check(asyncio.run(first()), NAMESPACE)

    ok = review(TRIGGERER_ACCESS)
    assert ok.status == "PASS" and ok.detail.startswith("the triggerer's account may do all")
    refused = review(WORKER_ACCESS)
    assert refused.status == "FAIL" and refused.detail.startswith(
        "the triggerer's account may not create pods"
    )


def test_preflight_pods_pass_restricted_and_tolerate_the_gpu_taint(stack_env):
    from kubernetes.client import ApiClient

    from include.devstack.kubeapi import podsecurity

    body = ApiClient().sanitize_for_serialization(
        Preflight(deployment()).pods.pod("sync", "img", ["true"], with_s3=True)
    )
    assert podsecurity.violations("restricted", body) == []
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in body["spec"][
        "tolerations"
    ]
    assert body["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "kubetrain-s3"}}]


def test_gke_workload_identity_alone_fails_and_irsa_passes(stack_env, core):
    """S3's SigV4 needs AWS keys: a GCP service account annotation gives pods GCP tokens only."""
    annotations = {
        "kubetrain-gke": {"iam.gke.io/gcp-service-account": "trainer@proj.iam.gserviceaccount.com"},
        "kubetrain-irsa-ok": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/kubetrain"},
    }
    for name, notes in annotations.items():
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": name, "annotations": notes}})
    try:
        gke = Preflight(
            deployment(s3_secret=None, service_account="kubetrain-gke")
        ).s3_checks.check_s3_secret()
        irsa = Preflight(
            deployment(s3_secret=None, service_account="kubetrain-irsa-ok")
        ).s3_checks.check_s3_secret()
    finally:
        for name in annotations:
            core.delete_namespaced_service_account(name, NAMESPACE)
    assert (
        gke.status == "FAIL"
        and "gives pods GCP tokens, which the pods' S3 client (SigV4) cannot use" in gke.detail
    )
    assert "HMAC keys with AWS_ENDPOINT_URL=https://storage.googleapis.com" in gke.fix
    assert irsa.status == "PASS" and "eks.amazonaws.com/role-arn" in irsa.detail
