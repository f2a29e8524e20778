"""The preflight's order and skips, with each group stood in for by its lines: what a failed ``api`` line skips,
that a check which raises is one FAIL line, the pods' checks combining the image and S3 lines, and the DAG's
verdict (test_preflight_devstack.py runs the whole against the dev stack)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from kubetrain.preflight import Check, Preflight, fail_on_failures
from kubetrain.preflight.pods import PodOutcome
from kubetrain.preflight.registry import TRAINER_COMMAND
from kubetrain.settings import Deployment

ORDER = [
    "api",
    "access",
    "s3-secret",
    "image:trainer",
    "image:sync",
    "s3-from-pod",
    "s3-region",
    "s3-write",
    "gpu-nodes",
    "gpu-pool",
    "registry",
    "training-apis",
    "queue",
]


def line(name: str, status: str = "PASS", detail: str = "ok") -> Check:
    return Check(name, status, detail)


def stubbed(api: Check, *, pods=None, access=None) -> Preflight:
    """A Preflight whose groups answer with fixed lines (``pods``/``access``: a function instead)."""
    preflight = Preflight(Deployment())
    preflight.cluster_checks = SimpleNamespace(
        check_api=lambda: api,
        check_access=access or (lambda: line("access")),
        check_gpu_nodes=lambda: line("gpu-nodes", "INFO"),
        check_training_apis=lambda: line("training-apis", "INFO"),
        check_queue=lambda: line("queue", "INFO"),
    )
    preflight.s3_checks = SimpleNamespace(check_s3_secret=lambda: line("s3-secret"))
    preflight.airflow_checks = SimpleNamespace(check_pool=lambda: line("gpu-pool", "INFO"))
    preflight.registry_checks = SimpleNamespace(check_registry=lambda: line("registry"))
    preflight.check_pods = pods or (lambda: [line(n) for n in ORDER[3:8]])
    return preflight


def test_every_line_in_order_each_emitted_as_it_is_decided():
    emitted = []
    preflight = stubbed(line("api"))
    results = preflight.run(emitted.append)
    assert [c.name for c in results] == ORDER and emitted == results
    assert preflight.failed == []
    assert fail_on_failures(preflight) == [c.line() for c in results]


def test_an_api_that_does_not_answer_skips_all_that_needs_it_but_not_airflow_or_the_registry():
    down = line("api", "FAIL", "the Kubernetes API of connection 'kubernetes_default' does not answer: ...")
    checks = {c.name: c for c in stubbed(down).run()}
    assert list(checks) == ORDER
    assert {name for name, c in checks.items() if c.status == "SKIP"} == set(ORDER) - {
        "api",
        "gpu-pool",
        "registry",
    }
    assert checks["access"].detail == "needs the API and the namespace (see api)"
    assert checks["gpu-nodes"].detail == "needs the API (see api)"


def test_a_missing_namespace_skips_what_needs_it_and_still_asks_the_api_what_it_serves():
    missing = line(
        "api", "FAIL", "API v1.31.0 at https://k8s answers, but namespace 'kubetrain' does not exist"
    )
    checks = {c.name: c for c in stubbed(missing).run()}
    assert {name for name, c in checks.items() if c.status == "SKIP"} == set(ORDER[1:8])
    assert checks["training-apis"].status == "INFO" and checks["queue"].status == "INFO"


def test_a_check_that_raises_is_one_fail_line_and_the_rest_still_run():
    def broken_pods():
        raise ConnectionResetError("connection reset by peer")

    def broken_access():
        raise KeyError("status")

    preflight = stubbed(line("api"), pods=broken_pods, access=broken_access)
    checks = {c.name: c for c in preflight.run()}
    assert checks["access"].line() == (
        "FAIL  access: could not be checked: KeyError: 'status' -> fix: check the settings and the cluster"
    )
    assert checks["image:trainer"].line() == (
        "FAIL  image:trainer: could not be checked: ConnectionResetError: connection reset by peer "
        "-> fix: check the cluster's API server"
    )
    assert "image:sync" not in checks and list(checks)[-5:] == ORDER[-5:]
    with pytest.raises(AirflowFailException, match=r"^2 preflight check\(s\) failed:\nFAIL  access: "):
        fail_on_failures(preflight)


def test_the_pods_checks_run_each_image_and_read_the_sync_pods_probe():
    preflight = Preflight(Deployment(trainer_image="reg/trainer:1", sync_image="reg/sync:1"))
    ran = []

    def run_pod(purpose, image, command, *, with_s3):
        ran.append((purpose, image, tuple(command[:4]), with_s3))
        if purpose == "trainer":
            return PodOutcome(False, reason="ErrImagePull", message="not found")
        return PodOutcome(
            True, exit_code=0, logs="Traceback ...\nModuleNotFoundError: No module named 'boto3'"
        )

    preflight.pods = SimpleNamespace(run_pod=run_pod)
    checks = preflight.check_pods()
    assert sorted(ran) == [
        ("sync", "reg/sync:1", ("python", "-m", "trainer.sync", "probe"), True),
        ("trainer", "reg/trainer:1", TRAINER_COMMAND[:4], False),
    ]
    assert [(c.name, c.status) for c in checks] == [
        ("image:trainer", "FAIL"),
        ("image:sync", "PASS"),
        ("s3-from-pod", "FAIL"),
        ("s3-region", "SKIP"),
        ("s3-write", "SKIP"),
    ]
    assert checks[2].detail.endswith("did not report: ModuleNotFoundError: No module named 'boto3'")


def test_the_groups_share_one_cluster_connection():
    preflight = Preflight(Deployment(namespace="team"), kubernetes_conn_id="k8s", pod_timeout=5)
    assert preflight.cluster_checks.cluster is preflight.cluster
    assert preflight.s3_checks.cluster is preflight.cluster and preflight.pods.cluster is preflight.cluster
    assert (preflight.cluster.kubernetes_conn_id, preflight.cluster.namespace) == ("k8s", "team")
    assert preflight.pods.pod_timeout == 5
