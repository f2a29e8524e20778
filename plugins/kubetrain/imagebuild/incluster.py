"""The in-cluster builder: a pod running rootless BuildKit on a build context taken from S3.

The Airflow worker packs the build context into a deterministic tarball and uploads it to
S3; the pod fetches it with the AWS CLI (credentials from the S3 Secret), unpacks it, and
runs ``buildctl-daemonless.sh`` with the Dockerfile frontend. The image is pushed by digest
only (no tag), with registry credentials from a ``kubernetes.io/dockerconfigjson`` Secret;
BuildKit's metadata file, which names the digest, becomes the pod's XCom result.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from kubernetes.client import models as k8s

from kubetrain.imagebuild.builders import BuildRequest, PushTarget
from kubetrain.imagebuild.layer import LayerFile, write_layer
from kubetrain.settings import SETTINGS

BUILDKIT_IMAGE = "moby/buildkit:v0.23.2-rootless"
FETCH_IMAGE = "amazon/aws-cli:2.27.0"
UNPACK_IMAGE = "busybox:1.37.0"
CONTEXT_EXCLUDES: tuple[str, ...] = (".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache")

WORKSPACE = "/workspace"
XCOM_RESULT = "/airflow/xcom/return.json"  # KubernetesPodOperator's XCom sidecar reads this file
BUILDKIT_HOME = "/home/user"  # the rootless image's user (uid 1000)
METADATA_DIGEST = "containerimage.digest"
_HOST_RE = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$")
_S3_URI_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/\S+$")


def write_context(context: Path, out: Path, excludes: Sequence[str] = CONTEXT_EXCLUDES) -> LayerFile:
    """Pack the build context as a deterministic ``.tar.gz`` (BuildKit applies ``.dockerignore`` itself)."""
    return write_layer(context, out, excludes=excludes)


@dataclass(frozen=True)
class InClusterSettings:
    """Images, Secrets and resources of the builder pod."""

    namespace: str = SETTINGS["namespace"].default
    builder_image: str = BUILDKIT_IMAGE
    fetch_image: str = FETCH_IMAGE
    unpack_image: str = UNPACK_IMAGE
    s3_secret: str | None = SETTINGS["s3_secret"].default
    registry_secret: str | None = "kubetrain-registry"
    service_account: str | None = None
    resources: Mapping[str, Mapping[str, str]] = field(
        default_factory=lambda: {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
    )
    active_deadline_seconds: int = 3600

    def __post_init__(self) -> None:
        if not self.s3_secret and not self.service_account:
            raise ValueError("no s3_secret and no service_account: the builder pod could not fetch its context from S3")
        for name, value in (("namespace", self.namespace), ("s3_secret", self.s3_secret or "x"),
                            ("registry_secret", self.registry_secret or "x")):  # fmt: skip
            if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", value) or len(value) > 253:
                raise ValueError(f"invalid {name} {value!r}: expected a Kubernetes object name (lowercase, '-', '.')")
        if self.active_deadline_seconds < 60:
            raise ValueError(f"invalid active_deadline_seconds {self.active_deadline_seconds}: expected at least 60")


def buildctl_args(request: BuildRequest, target: PushTarget) -> list[str]:
    """Arguments of ``buildctl-daemonless.sh``: build the unpacked context and push by digest."""
    dockerfile = PurePosixPath(request.dockerfile)
    args = [
        "build",
        "--frontend", "dockerfile.v0",
        "--local", f"context={WORKSPACE}/context",
        "--local", f"dockerfile={PurePosixPath(WORKSPACE, 'context', dockerfile.parent)}",
        "--opt", f"filename={dockerfile.name}",
    ]  # fmt: skip
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
    toml = buildkitd_config(target)
    flags = "--oci-worker-no-process-sandbox" + (f" --config={WORKSPACE}/buildkitd.toml" if toml else "")

    fetch = k8s.V1Container(
        name="fetch-context",
        image=settings.fetch_image,
        args=["s3", "cp", "--only-show-errors", context_uri, f"{WORKSPACE}/context.tar.gz"],
        env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=settings.s3_secret))]
        if settings.s3_secret else None,
        volume_mounts=[workspace],
        security_context=k8s.V1SecurityContext(allow_privilege_escalation=False, run_as_non_root=True, run_as_user=1000),
        env=[k8s.V1EnvVar(name="HOME", value="/tmp")],
    )
    # The script is constant; the only variable input (buildkitd.toml) arrives as data in an env var.
    unpack = k8s.V1Container(
        name="unpack-context",
        image=settings.unpack_image,
        command=["sh", "-c"],
        args=[
            f'set -e; mkdir -p {WORKSPACE}/context; tar -xzf {WORKSPACE}/context.tar.gz -C {WORKSPACE}/context; '
            f'rm {WORKSPACE}/context.tar.gz; if [ -n "$BUILDKITD_TOML" ]; then printf "%s" "$BUILDKITD_TOML" '
            f'> {WORKSPACE}/buildkitd.toml; fi'
        ],
        env=[k8s.V1EnvVar(name="BUILDKITD_TOML", value=toml)],
        volume_mounts=[workspace],
        security_context=k8s.V1SecurityContext(allow_privilege_escalation=False, run_as_non_root=True, run_as_user=1000),
    )
    mounts = [
        workspace,
        k8s.V1VolumeMount(name="buildkitd", mount_path=f"{BUILDKIT_HOME}/.local/share/buildkit"),
    ]
    volumes = [
        k8s.V1Volume(name="workspace", empty_dir=k8s.V1EmptyDirVolumeSource()),
        k8s.V1Volume(name="buildkitd", empty_dir=k8s.V1EmptyDirVolumeSource()),
    ]
    env = [
        k8s.V1EnvVar(name="BUILDKITD_FLAGS", value=flags),
        k8s.V1EnvVar(name="DOCKER_CONFIG", value=f"{BUILDKIT_HOME}/.docker"),
    ]
    if settings.registry_secret:
        mounts.append(k8s.V1VolumeMount(name="registry-auth", mount_path=f"{BUILDKIT_HOME}/.docker", read_only=True))
        volumes.append(
            k8s.V1Volume(
                name="registry-auth",
                secret=k8s.V1SecretVolumeSource(
                    secret_name=settings.registry_secret,
                    items=[k8s.V1KeyToPath(key=".dockerconfigjson", path="config.json")],
                ),
            )
        )
    # Rootless BuildKit needs its own user namespace: unconfined seccomp/AppArmor, no privileged mode.
    build = k8s.V1Container(
        name="base",
        image=settings.builder_image,
        command=["buildctl-daemonless.sh"],
        args=buildctl_args(request, target),
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
            labels={"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/component": "image-build", **(labels or {})},
        ),
        spec=k8s.V1PodSpec(
            restart_policy="Never",
            active_deadline_seconds=settings.active_deadline_seconds,
            service_account_name=settings.service_account,
            init_containers=[fetch, unpack],
            containers=[build],
            volumes=volumes,
            security_context=k8s.V1PodSecurityContext(fs_group=1000),
        ),
    )
