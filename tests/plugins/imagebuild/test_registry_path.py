"""A registry that keeps its repositories under a path, as Artifact Registry does
(``<region>-docker.pkg.dev/<project>/<repository>``), end to end: `make images` pushes under the path,
runs pin the default names through the connection's credentials, the code layer is appended there,
and the dev stack's kubelet pulls the images from there with a pull Secret (the preflight's pods).
"""

from __future__ import annotations

import base64
import json

import pytest
from kubernetes import client, config

from kubetrain import settings
from kubetrain.imagebuild import release
from kubetrain.imagebuild.oci import RegistryClient
from kubetrain.imagebuild.reference import parse_reference, split_registry
from kubetrain.imagebuild.registry_errors import RegistryError
from kubetrain.images import pin_image
from kubetrain.pod_spec import resolve_image
from kubetrain.preflight import Preflight
from kubetrain.settings import Deployment
from tests.conftest import IMAGE_ROOTFS, REPO
from tests.plugins.imagebuild.support import start_registry

USER, PASSWORD = "oauth2accesstoken", "ya29.not-a-real-token"
NAMESPACE = "kubetrain"


@pytest.mark.parametrize(
    ("registry", "expected"),
    [
        ("registry.example.com:5000", ("registry.example.com:5000", "")),
        ("europe-west4-docker.pkg.dev/my-project/ml", ("europe-west4-docker.pkg.dev", "my-project/ml")),
        ("127.0.0.1:5000/team", ("127.0.0.1:5000", "team")),
    ],
)
def test_a_registry_name_may_carry_a_path(registry, expected):
    assert split_registry(registry) == expected


@pytest.mark.parametrize("registry", ["", "host/Upper/Case", "has space:5000", "host//double"])
def test_a_bad_registry_name_is_refused_naming_it(registry):
    with pytest.raises(
        ValueError, match=r"invalid registry .*expected host\[:port\], optionally with a path"
    ):
        split_registry(registry)


def test_the_client_speaks_to_the_host_about_repositories_under_the_path():
    c = RegistryClient("europe-west4-docker.pkg.dev/my-project/ml")
    assert (
        c.base_url == "https://europe-west4-docker.pkg.dev"
        and c.registry == "europe-west4-docker.pkg.dev/my-project/ml"
    )
    assert c._pull("kubetrain/trainer") == ("repository:my-project/ml/kubetrain/trainer:pull",)
    assert (
        c.relative(parse_reference("europe-west4-docker.pkg.dev/my-project/ml/kubetrain/sync:v1"))
        == "kubetrain/sync"
    )
    with pytest.raises(RegistryError, match="is not in registry europe-west4-docker.pkg.dev/my-project/ml"):
        c.relative(parse_reference("europe-west4-docker.pkg.dev/other/ml/kubetrain/sync:v1"))


@pytest.fixture(scope="module")
def private(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("ar"), users={USER: PASSWORD})
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def under_a_path(private, devstack, monkeypatch):
    """The deployment's registry is ``<private registry>/proj/ml``, with a connection holding its credentials."""
    name = f"{private.host}/proj/ml"
    conn = {
        "conn_type": "kubetrain_registry",
        "host": "127.0.0.1/proj/ml",
        "port": private.port,
        "login": USER,
        "password": PASSWORD,
        "extra": {"insecure": True},
    }
    monkeypatch.setenv("AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT", json.dumps(conn))
    for key, value in {
        "KUBETRAIN_REGISTRY": name,
        "KUBETRAIN_IMAGE_TAG": "v7",
        "KUBETRAIN_TRAINER_VARIANT": "cpu",
        "KUBETRAIN_IMAGE_PULL_SECRETS": "ar-pull",
        "KUBETRAIN_NAMESPACE": NAMESPACE,
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("KUBETRAIN_TRAINER_IMAGE", "KUBETRAIN_SYNC_IMAGE", "KUBETRAIN_SERVICE_ACCOUNT", "KUBECONFIG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(settings, "_variable", lambda _name: None)
    env = devstack.env()
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {
                "conn_type": "kubernetes",
                "extra": {"kube_config_path": env["KUBECONFIG"], "namespace": NAMESPACE},
            }
        ),
    )
    core = client.CoreV1Api(config.new_client_from_config(env["KUBETRAIN_ADMIN_KUBECONFIG"]))
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    secret = {
        "metadata": {"name": "ar-pull"},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": json.dumps({"auths": {private.host: {"auth": auth}}})},
    }
    core.create_namespaced_secret(NAMESPACE, secret)
    try:
        yield name
    finally:
        core.delete_namespaced_secret("ar-pull", NAMESPACE)


def test_images_go_under_the_path_and_run_from_there(under_a_path, private, capsys):
    # `make images IMAGE_TAG=v7` with the Debian-made bases (the build itself is cached from the session's)
    code = release.main(
        [
            "--images",
            "trainer-cpu,sync",
            "--tag",
            "v7",
            "--base",
            "debian",
            "--rootfs",
            str(IMAGE_ROOTFS),
            "--trainer-dir",
            str(REPO / "trainer"),
            "--storage-root",
            str(REPO / ".tools" / "buildah"),
            "--layouts",
            str(REPO / ".tools" / "images" / "oci"),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    pushed = {item["name"]: item for item in map(json.loads, out.out.splitlines())}
    assert pushed["trainer-cpu"]["reference"].startswith(f"{under_a_path}/kubetrain/trainer@sha256:")
    assert pushed["sync"]["reference"].startswith(f"{under_a_path}/kubetrain/sync@sha256:")
    requests = private.requests()
    assert any(
        r.path.startswith("/v2/proj/ml/kubetrain/trainer/manifests/v7-cpu") and r.method == "PUT"
        for r in requests
    )
    assert not any(r.path.startswith("/v2/kubetrain/") for r in requests)  # nothing outside the path

    # runs pin the default names through the connection's credentials (anonymous access is refused here)
    trainer = pin_image(resolve_image(None, "trainer"))
    assert trainer == pushed["trainer-cpu"]["reference"]
    assert pin_image(resolve_image(None, "sync")) == pushed["sync"]["reference"]

    # the preflight's pods pull both default names from under the path, with the pull Secret
    preflight = Preflight(Deployment.from_environment())
    checks = {c.name: c for c in preflight.check_pods()}
    assert checks["image:trainer"].status == "PASS", checks["image:trainer"]
    assert f"{under_a_path}/kubetrain/trainer:v7-cpu" in checks["image:trainer"].detail
    assert checks["image:sync"].status == "PASS" and checks["s3-from-pod"].status == "PASS", checks
    assert preflight.registry_checks.check_registry().status == "PASS"


def test_a_code_layer_is_appended_under_the_path(under_a_path, private, tmp_path):
    from airflow.sdk import DAG

    from kubetrain.operators.build import AppendLayerOperator

    code = tmp_path / "code"
    (code / "trainer").mkdir(parents=True)
    (code / "trainer" / "marker.py").write_text("VALUE = 7\n")
    with DAG("append_under_path", schedule=None):
        op = AppendLayerOperator(
            task_id="append",
            source=str(code),
            base_image="kubetrain/sync:v7",
            repository="kubetrain/sync",
            dest="/app",
            tag="code-under-path",
        )
    result = op.execute({})
    assert result["reference"].startswith(f"{under_a_path}/kubetrain/sync@sha256:"), result
    with RegistryClient(under_a_path, insecure=True, username=USER, password=PASSWORD) as c:
        assert c.manifest_digest("kubetrain/sync", "code-under-path") == result["reference"].rsplit("@", 1)[1]
