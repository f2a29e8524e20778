"""The in-cluster builder: context tarball in a real S3 server, and a BuildKit pod spec that the
Kubernetes schema accepts and that carries no credential."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import boto3
import kubernetes_validate
import pytest
from kubernetes.client import ApiClient

from kubetrain import pod_spec
from kubetrain.imagebuild.builders import PushTarget
from kubetrain.imagebuild.incluster import XCOM_RESULT, InClusterSettings
from kubetrain.operators.build import BuildImageOperator, context_key

K8S_VERSION = "1.33.0"
SYNC_IMAGE = "registry.internal:5000/kubetrain/sync:latest"
SECRET_VALUES = ("s3cr3t-registry-password", "AKIA-not-in-specs")


@pytest.fixture
def context_dir(tmp_path):
    root = tmp_path / "ctx"
    (root / "src").mkdir(parents=True)
    (root / "Dockerfile.gpu").write_text("FROM busybox\nCOPY src/ /src/\n")
    (root / "src" / "main.py").write_text("print(1)\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".dockerignore").write_text("*.md\n")
    return root


def operator(context_dir, **kwargs) -> BuildImageOperator:
    kwargs.setdefault("registry_conn_id", "registry_cluster")
    return BuildImageOperator(
        task_id="build_image",
        context=str(context_dir),
        repository="kubetrain/trainer",
        dockerfile="Dockerfile.gpu",
        builder="in-cluster",
        tags=["v1"],
        target="runtime",
        build_args={"PYTHON": "3.11"},
        labels={"team": "ml"},
        revision="abc",
        **kwargs,
    )


@pytest.fixture
def registry_conn(monkeypatch):
    conn = {
        "conn_type": "kubetrain_registry",
        "host": "registry.internal",
        "port": 5000,
        "login": "ci",
        "password": SECRET_VALUES[0],
        "extra": {"insecure": True},
    }
    monkeypatch.setenv("AIRFLOW_CONN_REGISTRY_CLUSTER", json.dumps(conn))


def pod_dict(
    op: BuildImageOperator, uri: str = "s3://training/build-contexts/d/r/t/context-0123.tar.gz"
) -> dict:
    settings = op.hook.settings
    target = PushTarget(settings.registry, op.repository, insecure=settings.insecure)
    pod = op.builder_pod(op.build_request(), target, uri)
    return ApiClient().sanitize_for_serialization(pod)


def test_pod_spec_is_valid_kubernetes(registry_conn, context_dir):
    body = pod_dict(operator(context_dir))
    kubernetes_validate.validate(body, K8S_VERSION, strict=True)


def test_pod_spec_builds_and_pushes_by_digest(registry_conn, context_dir):
    body = pod_dict(operator(context_dir, cluster_registry="registry.kube-system.svc:5000"))
    spec = body["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["fetch-context", "unpack-context"]
    fetch, unpack = spec["initContainers"]
    assert fetch["args"] == [
        "s3://training/build-contexts/d/r/t/context-0123.tar.gz",
        "/workspace/context.tar.gz",
    ]
    assert fetch["command"][:2] == ["python3", "-c"] and fetch["image"] == pod_spec.resolve_image(
        None, "sync"
    )
    assert fetch["envFrom"] == [{"secretRef": {"name": "kubetrain-s3"}}]
    (build,) = spec["containers"]
    assert (
        build["name"] == "base"
        and build["image"].startswith("moby/buildkit:")
        and "rootless" in build["image"]
    )
    assert build["command"] == ["buildctl-daemonless.sh"]
    args = build["args"]
    assert args[args.index("--output") + 1] == (
        "type=image,name=registry.kube-system.svc:5000/kubetrain/trainer,push=true,push-by-digest=true,"
        "oci-mediatypes=true,registry.insecure=true"
    )
    opts = [args[i + 1] for i, a in enumerate(args) if a == "--opt"]
    assert "filename=Dockerfile.gpu" in opts and "target=runtime" in opts and "build-arg:PYTHON=3.11" in opts
    assert "label:team=ml" in opts and "label:org.opencontainers.image.revision=abc" in opts
    assert args[args.index("--metadata-file") + 1] == XCOM_RESULT
    # Rootless: no privileged mode, its own user, unconfined seccomp/AppArmor for user namespaces.
    sc = build["securityContext"]
    assert sc["runAsUser"] == 1000 and not sc.get("privileged")
    assert sc["seccompProfile"] == {"type": "Unconfined"}
    env = {e["name"]: e["value"] for e in build["env"]}
    assert "--oci-worker-no-process-sandbox" in env["BUILDKITD_FLAGS"]
    assert "--config=/workspace/buildkitd.toml" in env["BUILDKITD_FLAGS"]  # plain HTTP registry
    toml = {e["name"]: e["value"] for e in unpack["env"]}["BUILDKITD_TOML"]
    assert '[registry."registry.kube-system.svc:5000"]' in toml and "http = true" in toml
    registry_volume = next(v for v in spec["volumes"] if v["name"] == "registry-auth")
    assert registry_volume["secret"] == {
        "secretName": "kubetrain-registry",
        "items": [{"key": ".dockerconfigjson", "path": "config.json"}],
    }


def test_pod_spec_holds_no_credentials(registry_conn, context_dir, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_VALUES[1])
    text = json.dumps(pod_dict(operator(context_dir)))
    for secret in SECRET_VALUES:
        assert secret not in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": "Bad_NS"}, "invalid namespace 'Bad_NS'"),
        ({"registry_secret": "UPPER"}, "invalid registry_secret 'UPPER'"),
    ],
)
def test_bad_settings_are_refused(registry_conn, context_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pod_dict(operator(context_dir, **kwargs))


def test_bad_context_uri_is_refused(registry_conn, context_dir):
    with pytest.raises(ValueError, match="invalid context URI 'file:///tmp/x': expected s3://bucket/key"):
        pod_dict(operator(context_dir), uri="file:///tmp/x")


def test_defaults_validate():
    # the shipped defaults must pass their own checks
    assert InClusterSettings(fetch_image=SYNC_IMAGE).builder_image.startswith("moby/buildkit:")
    assert InClusterSettings(tool="buildah", fetch_image=SYNC_IMAGE).builder_image.startswith(
        "quay.io/buildah/stable:"
    )
    with pytest.raises(
        ValueError, match="invalid in-cluster build tool 'kaniko': expected one of buildkit, buildah"
    ):
        InClusterSettings(tool="kaniko", fetch_image=SYNC_IMAGE)
    with pytest.raises(ValueError, match="no fetch_image: expected an image with Python 3 and botocore"):
        InClusterSettings()


def test_buildah_pod_builds_pushes_a_staging_tag_and_reports_the_digest(
    registry_conn, context_dir, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_VALUES[1])
    op = operator(context_dir, in_cluster_tool="buildah", fetch_image=SYNC_IMAGE)
    body = pod_dict(op)
    kubernetes_validate.validate(body, K8S_VERSION, strict=True)
    text = json.dumps(body)
    for secret in SECRET_VALUES:
        assert secret not in text
    (build,) = body["spec"]["containers"]
    assert build["image"].startswith("quay.io/buildah/stable:") and build["command"][:2] == ["sh", "-c"]
    assert "buildah $store push" in build["command"][2] and "/airflow/xcom/return.json" in build["command"][2]
    args = build["args"]
    assert args[:2] == ["--format", "oci"] and ["--build-arg", "PYTHON=3.11"] == args[2:4]
    assert "--target" in args and args[args.index("--target") + 1] == "runtime"
    assert "org.opencontainers.image.revision=abc" in args
    env = {e["name"]: e["value"] for e in build["env"]}
    assert (
        env["IMAGE"] == "registry.internal:5000/kubetrain/trainer" and env["DOCKERFILE"] == "Dockerfile.gpu"
    )
    assert env["STAGING_TAG"].startswith("kubetrain-staging-") and env["TLS_VERIFY"] == "false"
    assert env["REGISTRY_AUTH_FILE"] == "/home/build/.docker/config.json"
    assert {v["name"] for v in body["spec"]["volumes"]} == {"workspace", "registry-auth"}
    assert body["spec"]["initContainers"][0]["image"] == SYNC_IMAGE


def test_context_upload_to_s3(s3_server, registry_conn, context_dir, monkeypatch):
    aws = {
        "conn_type": "aws",
        "login": s3_server.access_key_id,
        "password": s3_server.secret_access_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.region},
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_BUILD", json.dumps(aws))
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
        region_name=s3_server.region,
    )
    s3.create_bucket(
        Bucket="build-test"
    )  # a bucket of its own: the shared server's buckets belong to other tests
    op = operator(context_dir, aws_conn_id="aws_build", context_bucket="build-test")
    context = {"run_id": "manual__2026-11-22T04:00:00+00:00"}
    uri = op.upload_context(op.build_request(), context)
    again = op.upload_context(op.build_request(), context)
    assert uri == again  # named by content: the same context gives the same key
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    assert bucket == "build-test" and key.startswith(
        "build-contexts/adhoc/manual__2026-11-22T04_00_00_00_00/build/context-"
    )
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(body))) as tar:
        names = sorted(tar.getnames())
        assert tar.extractfile("src/main.py").read() == b"print(1)\n"
    assert names == [".dockerignore", "Dockerfile.gpu", "src", "src/main.py"]  # .git stays home


def test_context_key_is_safe():
    key = context_key(
        "build-contexts/", {"run_id": "scheduled__2026-01-01T00:00:00+00:00"}, "sha256:" + "ab" * 32
    )
    assert (
        key
        == "build-contexts/adhoc/scheduled__2026-01-01T00_00_00_00_00/build/context-abababababababab.tar.gz"
    )


def test_the_builder_pod_is_placed_and_pulls_as_training_pods_are(registry_conn, context_dir, monkeypatch):
    """The deployment's pull Secrets, node selector and tolerations apply to the builder pod too; its namespace is
    the build namespace when one is set."""
    monkeypatch.setenv("KUBETRAIN_IMAGE_PULL_SECRETS", "regcred, mirror-cred")
    monkeypatch.setenv("KUBETRAIN_NODE_SELECTOR", "pool=build")
    monkeypatch.setenv(
        "KUBETRAIN_TOLERATIONS",
        '[{"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}]',
    )
    monkeypatch.setenv("KUBETRAIN_BUILD_NAMESPACE", "kubetrain-build")
    body = pod_dict(operator(context_dir))
    kubernetes_validate.validate(body, K8S_VERSION, strict=True)
    spec = body["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-cred"}]
    assert spec["nodeSelector"] == {"pool": "build"}
    assert spec["tolerations"] == [
        {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
    ]
    assert body["metadata"]["namespace"] == "kubetrain-build"
    # and what it needs of Pod Security is stated where the pod is built: Unconfined profiles, level privileged
    from kubetrain.imagebuild.incluster import POD_SECURITY_LEVEL

    (build,) = spec["containers"]
    assert (
        build["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}
        and POD_SECURITY_LEVEL == "privileged"
    )


def test_a_pod_security_refusal_says_which_level_the_builder_needs(registry_conn, context_dir, monkeypatch):
    """The API server's Pod Security admission refuses the pod (here its 403 as the API server sends it, until the dev
    stack enforces Pod Security): the task fails once, naming the level and the way out, not with a traceback."""
    from airflow.sdk.exceptions import AirflowFailException
    from kubernetes.client.exceptions import ApiException

    refusal = ApiException(status=403, reason="Forbidden")
    refusal.body = json.dumps(
        {
            "kind": "Status",
            "status": "Failure",
            "reason": "Forbidden",
            "code": 403,
            "message": 'pods "kubetrain-build-1" is forbidden: violates PodSecurity "restricted:latest": '
            'seccompProfile (pod or container "base" must not set securityContext.seccompProfile.type '
            'to "Unconfined")',
        }
    )
    op = operator(context_dir)

    def refuse(launcher):
        raise refusal

    with pytest.raises(AirflowFailException) as err:
        op._run_launcher(refuse, None, "kubetrain")
    message = str(err.value)
    assert "refused by Pod Security admission in namespace 'kubetrain'" in message
    assert 'violates PodSecurity "restricted:latest"' in message
    assert "level 'privileged'" in message and "KUBETRAIN_BUILD_NAMESPACE" in message
    assert "kubectl apply -f deploy/rbac-build.yaml" in message
