"""The registry's lines without a cluster: which images the pods run, the image lines from how a pod of each
ended (a table of cases), and the registry line against a registry that answers and one that does not."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from include.devstack.stack import free_port
from kubetrain.imagebuild.products import default_images
from kubetrain.preflight.pods import PodOutcome
from kubetrain.preflight.registry import RESTRICTED_FIX, RegistryChecks
from kubetrain.settings import Deployment


def test_the_images_are_the_settings_else_the_defaults_make_images_pushes():
    deployment = Deployment(registry="registry.example.com:5000/ml", image_tag="v3", trainer_variant="cpu")
    assert RegistryChecks(deployment).images() == default_images("registry.example.com:5000/ml", "v3", "cpu")
    pinned = Deployment(trainer_image="team/trainer@sha256:" + "a" * 64)
    assert RegistryChecks(pinned).images() == {
        "trainer": "team/trainer@sha256:" + "a" * 64,
        "sync": default_images(pinned.registry, pinned.image_tag, pinned.trainer_variant)["sync"],
    }


PULL_SECRET_HINT = "; for a private registry name its docker-registry Secret in KUBETRAIN_IMAGE_PULL_SECRETS"


@pytest.mark.parametrize(
    ("outcome", "deployment", "status", "detail", "fix"),
    [
        (PodOutcome(True, exit_code=1), Deployment(), "PASS", "reg/trainer:1 was pulled and started", ""),
        (
            PodOutcome(False, reason="Forbidden", message='violates PodSecurity "restricted:latest"'),
            Deployment(),
            "FAIL",
            'a pod of reg/trainer:1 was refused: violates PodSecurity "restricted:latest"',
            RESTRICTED_FIX,
        ),
        (
            PodOutcome(False, reason="Forbidden", message='pods is forbidden: cannot create resource "pods"'),
            Deployment(),
            "FAIL",
            'a pod of reg/trainer:1 was refused: pods is forbidden: cannot create resource "pods"',
            "see the access line: kubectl apply -f deploy/rbac.yaml",
        ),
        (
            PodOutcome(False, reason="ErrImagePull", message="not found"),
            Deployment(),
            "FAIL",
            "reg/trainer:1 cannot be pulled: ErrImagePull not found",
            "push it (make images, or the build_trainer_image DAG) or set KUBETRAIN_TRAINER_IMAGE to an image "
            "the nodes can pull" + PULL_SECRET_HINT,
        ),
        (
            PodOutcome(False, reason="ImagePullBackOff"),
            Deployment(image_pull_secrets=("regcred",)),
            "FAIL",
            "reg/trainer:1 cannot be pulled: ImagePullBackOff",
            "push it (make images, or the build_trainer_image DAG) or set KUBETRAIN_TRAINER_IMAGE to an image "
            "the nodes can pull",
        ),
        (
            PodOutcome(False, reason="Unschedulable", message="0/3 nodes are available"),
            Deployment(namespace="team"),
            "FAIL",
            "a pod of reg/trainer:1 did not start: Unschedulable 0/3 nodes are available",
            "see `kubectl -n team get events`; the pod needs to be schedulable with the deployment's node "
            "selector and tolerations",
        ),
    ],
    ids=["pulled", "pod security", "rbac", "not pushed", "pull secret named", "unschedulable"],
)
def test_the_image_line_from_how_its_pod_ended(outcome, deployment, status, detail, fix):
    check = RegistryChecks(deployment).image_check("trainer", "reg/trainer:1", outcome)
    assert (check.name, check.status, check.detail, check.fix) == ("image:trainer", status, detail, fix)


class _Registry(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/v2/" else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def registry():
    """A registry's ``GET /v2/`` on localhost: its host:port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_without_a_connection_the_registry_setting_is_asked(registry, monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT", raising=False)
    check = RegistryChecks(Deployment(registry=registry)).check_registry()
    assert (check.status, check.detail) == (
        "PASS",
        f"the registry of KUBETRAIN_REGISTRY {registry} answers the workers",
    )


def test_a_connection_to_a_registry_that_does_not_answer_fails_naming_it(monkeypatch):
    port = free_port()
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT",
        json.dumps(
            {
                "conn_type": "kubetrain_registry",
                "host": "127.0.0.1",
                "port": port,
                "extra": {"insecure": True},
            }
        ),
    )
    check = RegistryChecks(Deployment()).check_registry()
    assert check.status == "FAIL"
    assert check.detail.startswith(
        f"the registry of connection 'kubetrain_registry_default' (127.0.0.1:{port})"
    )
    assert check.fix == (
        "define connection kubetrain_registry_default with the registry's host, port and credentials as the "
        "Airflow workers reach it"
    )


def test_a_connection_that_does_not_parse_fails_naming_it(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT",
        json.dumps(
            {"conn_type": "kubetrain_registry", "host": "r.example.com", "extra": {"insecure": "maybe"}}
        ),
    )
    check = RegistryChecks(Deployment()).check_registry()
    assert check.status == "FAIL" and check.detail.startswith("connection 'kubetrain_registry_default': ")
    assert check.fix == "fix the registry connection's host and extras"
