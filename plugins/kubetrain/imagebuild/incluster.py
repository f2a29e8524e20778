"""The in-cluster builder: a pod that builds an image from a build context taken from S3.

The Airflow worker packs the build context into a deterministic tarball and uploads it to
S3; the pod fetches it with botocore in kubetrain's sync image (credentials from the S3
Secret, or the pod's workload identity, exactly as training pods get them), unpacks it, and
builds it with one of two tools:

* ``buildkit`` (default): rootless BuildKit, ``buildctl-daemonless.sh`` with the Dockerfile
  frontend; the image is pushed by digest only (no tag), and BuildKit's metadata file, which
  names the digest, becomes the pod's XCom result;
* ``buildah``: the official buildah image, rootless with chroot isolation and VFS storage, for
  clusters where BuildKit's daemon is not wanted; the image is pushed under a staging tag that
  the operator removes once the requested tags are moved, and the digest file written by
  ``buildah push`` becomes the same XCom result.

Registry credentials come from a ``kubernetes.io/dockerconfigjson`` Secret; no credential is
in the pod spec.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes.client import models as k8s

from kubetrain.imagebuild.builders import BuildRequest, PushTarget
from kubetrain.imagebuild.layer import LayerFile, write_layer
from kubetrain.settings import SETTINGS

BUILDKIT_IMAGE = "moby/buildkit:v0.23.2-rootless"
BUILDAH_IMAGE = "quay.io/buildah/stable:v1.41"
UNPACK_IMAGE = "busybox:1.37.0"
TOOLS = ("buildkit", "buildah")
STAGING_TAG_KEY = "kubetrain.staging_tag"
CONTEXT_EXCLUDES: tuple[str, ...] = (".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache")

WORKSPACE = "/workspace"
XCOM_RESULT = "/airflow/xcom/return.json"  # KubernetesPodOperator's XCom sidecar reads this file
BUILDKIT_HOME = "/home/user"  # the rootless image's user (uid 1000)
BUILDAH_HOME = "/home/build"  # the buildah image's unprivileged user (uid 1000)
METADATA_DIGEST = "containerimage.digest"
_HOST_RE = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$")
_S3_URI_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/\S+$")


def write_context(context: Path, out: Path, excludes: Sequence[str] = CONTEXT_EXCLUDES) -> LayerFile:
    """Pack the build context as a deterministic ``.tar.gz`` (BuildKit applies ``.dockerignore`` itself)."""
    return write_layer(context, out, excludes=excludes)


# Fetches s3://bucket/key to a file with botocore, which reads the pod's AWS_* variables (endpoint
# included) or its workload identity; the URI and the path arrive as arguments, never as code.
FETCH_SCRIPT = """\
import sys, botocore.session
bucket, key = sys.argv[1][len("s3://"):].split("/", 1)
body = botocore.session.get_session().create_client("s3").get_object(Bucket=bucket, Key=key)["Body"]
with open(sys.argv[2], "wb") as out:
    for chunk in iter(lambda: body.read(1 << 20), b""):
        out.write(chunk)
"""

# buildah: build the unpacked context, push under a staging tag, write the digest as the XCom result.
# Build flags arrive as arguments ("$@"), the names as environment values: nothing is spliced into code.
BUILDAH_SCRIPT = """\
set -eu
mkdir -p /workspace/tmp
export TMPDIR=/workspace/tmp
store="--root /workspace/storage --runroot /workspace/run --storage-driver vfs"
buildah $store build --isolation chroot --tls-verify="$TLS_VERIFY" -f "/workspace/context/$DOCKERFILE" \\
  -t "$IMAGE:$STAGING_TAG" "$@" /workspace/context
buildah $store push --tls-verify="$TLS_VERIFY" --digestfile /workspace/digest "$IMAGE:$STAGING_TAG" \\
  "docker://$IMAGE:$STAGING_TAG"
printf '{"containerimage.digest": "%s", "kubetrain.staging_tag": "%s"}' "$(cat /workspace/digest)" \\
  "$STAGING_TAG" > /airflow/xcom/return.json
"""


@dataclass(frozen=True)
class InClusterSettings:
    """Tool, images, Secrets and resources of the builder pod.

    :param fetch_image: an image with Python 3 and botocore that fetches the context: kubetrain's
        sync image (the operator's default), already pulled on nodes that ran training pods.
    :param registry_secret: the ``kubernetes.io/dockerconfigjson`` Secret the builder pushes with
        (``kubectl create secret docker-registry kubetrain-registry --docker-server=<registry> ...``).
    :param image_pull_secrets: Secrets for pulling the builder's own images (the deployment's).
    :param node_selector: node labels the builder pod must match (the deployment's).
    :param tolerations: the builder pod's tolerations (the deployment's).

    The builder container runs rootless BuildKit or buildah, which create a user namespace of their
    own: it needs seccomp and AppArmor ``Unconfined``, which only Pod Security level ``privileged``
    admits (:data:`POD_SECURITY_LEVEL`). Run builds in a namespace of their own labelled so.
    """

    namespace: str = SETTINGS["namespace"].default
    tool: str = "buildkit"
    builder_image: str = ""
    fetch_image: str = ""
    unpack_image: str = UNPACK_IMAGE
    s3_secret: str | None = SETTINGS["s3_secret"].default
    registry_secret: str | None = "kubetrain-registry"
    service_account: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Mapping[str, str]] = field(
        default_factory=lambda: {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
    )
    active_deadline_seconds: int = 3600

    def __post_init__(self) -> None:
        if self.tool not in TOOLS:
            raise ValueError(
                f"invalid in-cluster build tool {self.tool!r}: expected one of {', '.join(TOOLS)}"
            )
        if not self.fetch_image:
            raise ValueError(
                "no fetch_image: expected an image with Python 3 and botocore, such as kubetrain's sync image"
            )
        if not self.builder_image:
            object.__setattr__(
                self, "builder_image", BUILDKIT_IMAGE if self.tool == "buildkit" else BUILDAH_IMAGE
            )
        if not self.s3_secret and not self.service_account:
            raise ValueError(
                "no s3_secret and no service_account: the builder pod could not fetch its context from S3"
            )
        for name, value in (
            ("namespace", self.namespace),
            ("s3_secret", self.s3_secret or "x"),
            ("registry_secret", self.registry_secret or "x"),
        ):
            if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", value) or len(value) > 253:
                raise ValueError(
                    f"invalid {name} {value!r}: expected a Kubernetes object name (lowercase, '-', '.')"
                )
        if self.active_deadline_seconds < 60:
            raise ValueError(
                f"invalid active_deadline_seconds {self.active_deadline_seconds}: expected at least 60"
            )


# The Pod Security Standards level the builder pod needs (its builder container's Unconfined profiles).
POD_SECURITY_LEVEL = "privileged"
_SNAKE = {"tolerationSeconds": "toleration_seconds"}


def pod_security_refusal(namespace: str, message: str) -> str:
    """What to do when the API server's Pod Security admission refused the builder pod in ``namespace``."""
    return (
        f"the in-cluster builder pod was refused by Pod Security admission in namespace {namespace!r} ({message}): "
        f"its rootless builder needs seccomp and AppArmor Unconfined, which only level {POD_SECURITY_LEVEL!r} admits. "
        "Run builds in a namespace of their own, labelled so, with the grants builds need "
        "(kubectl apply -f deploy/rbac-build.yaml makes kubetrain-build; docs/real-cluster.md) and named by "
        "KUBETRAIN_BUILD_NAMESPACE, or build on the Airflow worker (builder='buildah')"
    )


def buildctl_args(request: BuildRequest, target: PushTarget) -> list[str]:
    """Arguments of ``buildctl-daemonless.sh``: build the unpacked context and push by digest."""
    dockerfile = PurePosixPath(request.dockerfile)
    args = [
        "build",
        "--frontend",
        "dockerfile.v0",
        "--local",
        f"context={WORKSPACE}/context",
        "--local",
        f"dockerfile={PurePosixPath(WORKSPACE, 'context', dockerfile.parent)}",
        "--opt",
        f"filename={dockerfile.name}",
    ]
    for name, value in request.build_args.items():
        args += ["--opt", f"build-arg:{name}={value}"]
    for name, value in request.labels.items():
        args += ["--opt", f"label:{name}={value}"]
    if request.target:
        args += ["--opt", f"target={request.target}"]
    if request.platform:
        args += ["--opt", f"platform={request.platform}"]
    output = f"type=image,name={target.name},push=true,push-by-digest=true"
    output += ",oci-mediatypes=true" if request.image_format == "oci" else ",oci-mediatypes=false"
    if target.insecure:
        output += ",registry.insecure=true"
    args += ["--output", output, "--metadata-file", XCOM_RESULT]
    return args


def buildkitd_config(target: PushTarget) -> str:
    """buildkitd.toml: plain HTTP for the target registry when it is insecure (pulls of FROM images too)."""
    if not _HOST_RE.match(target.registry):
        raise ValueError(f"invalid registry {target.registry!r}: expected host[:port]")
    if not (target.insecure or not target.tls_verify):
        return ""
    return f'[registry."{target.registry}"]\n  http = {str(target.insecure).lower()}\n  insecure = true\n'


def buildah_args(request: BuildRequest) -> list[str]:
    """``buildah build`` flags of ``request`` (passed to :data:`BUILDAH_SCRIPT` as its arguments)."""
    args = ["--format", request.image_format]
    for name, value in request.build_args.items():
        args += ["--build-arg", f"{name}={value}"]
    for name, value in request.labels.items():
        args += ["--label", f"{name}={value}"]
    if request.target:
        args += ["--target", request.target]
    if request.platform:
        args += ["--platform", request.platform]
    return args


def builder_pod(
    request: BuildRequest,
    target: PushTarget,
    context_uri: str,
    settings: InClusterSettings,
    *,
    name: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> k8s.V1Pod:
    """The builder pod for ``request``; ``context_uri`` is the uploaded context tarball.

    No credential appears in the spec: S3 access comes from ``settings.s3_secret`` via
    ``envFrom``, registry access from ``settings.registry_secret`` mounted as the Docker config.
    """
    if not _S3_URI_RE.match(context_uri):
        raise ValueError(f"invalid context URI {context_uri!r}: expected s3://bucket/key")
    name = name or f"kubetrain-build-{secrets.token_hex(4)}"
    workspace = k8s.V1VolumeMount(name="workspace", mount_path=WORKSPACE)
    buildah = settings.tool == "buildah"
    toml = "" if buildah else buildkitd_config(target)
    flags = "--oci-worker-no-process-sandbox" + (f" --config={WORKSPACE}/buildkitd.toml" if toml else "")

    fetch = k8s.V1Container(
        name="fetch-context",
        image=settings.fetch_image,
        command=["python3", "-c", FETCH_SCRIPT],
        args=[context_uri, f"{WORKSPACE}/context.tar.gz"],
        env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=settings.s3_secret))]
        if settings.s3_secret
        else None,
        volume_mounts=[workspace],
        security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False, run_as_non_root=True, run_as_user=1000
        ),
        env=[k8s.V1EnvVar(name="HOME", value="/tmp")],
    )
    # The script is constant; the only variable input (buildkitd.toml) arrives as data in an env var.
    unpack = k8s.V1Container(
        name="unpack-context",
        image=settings.unpack_image,
        command=["sh", "-c"],
        args=[
            f"set -e; mkdir -p {WORKSPACE}/context; tar -xzf {WORKSPACE}/context.tar.gz -C {WORKSPACE}/context; "
            f'rm {WORKSPACE}/context.tar.gz; if [ -n "$BUILDKITD_TOML" ]; then printf "%s" "$BUILDKITD_TOML" '
            f"> {WORKSPACE}/buildkitd.toml; fi"
        ],
        env=[k8s.V1EnvVar(name="BUILDKITD_TOML", value=toml)],
        volume_mounts=[workspace],
        security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False, run_as_non_root=True, run_as_user=1000
        ),
    )
    home = BUILDAH_HOME if buildah else BUILDKIT_HOME
    mounts = [workspace]
    if not buildah:
        mounts.append(
            k8s.V1VolumeMount(name="buildkitd", mount_path=f"{BUILDKIT_HOME}/.local/share/buildkit")
        )
    volumes = [k8s.V1Volume(name="workspace", empty_dir=k8s.V1EmptyDirVolumeSource())]
    if not buildah:
        volumes.append(k8s.V1Volume(name="buildkitd", empty_dir=k8s.V1EmptyDirVolumeSource()))
    if buildah:
        env = [
            k8s.V1EnvVar(name="IMAGE", value=target.name),
            k8s.V1EnvVar(name="STAGING_TAG", value=f"kubetrain-staging-{secrets.token_hex(6)}"),
            k8s.V1EnvVar(name="DOCKERFILE", value=str(PurePosixPath(request.dockerfile))),
            k8s.V1EnvVar(
                name="TLS_VERIFY", value=str(not (target.insecure or not target.tls_verify)).lower()
            ),
            k8s.V1EnvVar(name="BUILDAH_ISOLATION", value="chroot"),
            k8s.V1EnvVar(name="HOME", value=home),
        ]
        if settings.registry_secret:
            env.append(k8s.V1EnvVar(name="REGISTRY_AUTH_FILE", value=f"{home}/.docker/config.json"))
    else:
        env = [
            k8s.V1EnvVar(name="BUILDKITD_FLAGS", value=flags),
            k8s.V1EnvVar(name="DOCKER_CONFIG", value=f"{BUILDKIT_HOME}/.docker"),
        ]
    if settings.registry_secret:
        mounts.append(k8s.V1VolumeMount(name="registry-auth", mount_path=f"{home}/.docker", read_only=True))
        volumes.append(
            k8s.V1Volume(
                name="registry-auth",
                secret=k8s.V1SecretVolumeSource(
                    secret_name=settings.registry_secret,
                    items=[k8s.V1KeyToPath(key=".dockerconfigjson", path="config.json")],
                ),
            )
        )
    # Rootless BuildKit and rootless buildah need their own user namespace: unconfined
    # seccomp/AppArmor, no privileged mode.
    build = k8s.V1Container(
        name="base",
        image=settings.builder_image,
        command=["sh", "-c", BUILDAH_SCRIPT, "buildah-build"] if buildah else ["buildctl-daemonless.sh"],
        args=buildah_args(request) if buildah else buildctl_args(request, target),
        env=env,
        volume_mounts=mounts,
        resources=k8s.V1ResourceRequirements(
            requests=dict(settings.resources.get("requests", {})) or None,
            limits=dict(settings.resources.get("limits", {})) or None,
        ),
        security_context=k8s.V1SecurityContext(
            run_as_user=1000,
            run_as_group=1000,
            seccomp_profile=k8s.V1SeccompProfile(type="Unconfined"),
            app_armor_profile=k8s.V1AppArmorProfile(type="Unconfined"),
        ),
    )
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=settings.namespace,
            labels={
                "app.kubernetes.io/name": "kubetrain",
                "app.kubernetes.io/component": "image-build",
                **(labels or {}),
            },
        ),
        spec=k8s.V1PodSpec(
            restart_policy="Never",
            active_deadline_seconds=settings.active_deadline_seconds,
            service_account_name=settings.service_account,
            image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in settings.image_pull_secrets]
            or None,
            node_selector=dict(settings.node_selector) or None,
            tolerations=[
                k8s.V1Toleration(**{_SNAKE.get(k, k): v for k, v in t.items()}) for t in settings.tolerations
            ]
            or None,
            init_containers=[fetch, unpack],
            containers=[build],
            volumes=volumes,
            security_context=k8s.V1PodSecurityContext(fs_group=1000),
        ),
    )
