"""Operators that build training images and push them to the private registry.

* :class:`BuildImageOperator`: a full build of a Dockerfile, with buildah on the worker or
  with rootless BuildKit in a pod on the cluster; the requested tags move only after the
  whole image is in the registry.
* :class:`AppendLayerOperator`: a code-only update: one deterministic layer on top of a
  base image already in the registry, pushed without pulling the base.

Both return, as XCom, the pushed digest and the full reference ``registry/repo@sha256:...``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from kubetrain.doc_md import class_doc_md
from kubetrain.hooks.registry import RegistryHook
from kubetrain.settings import environ

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk import Context
    from kubernetes.client import models as k8s

    from kubetrain.imagebuild.builders import BuildOutput, BuildRequest, PushTarget
    from kubetrain.imagebuild.incluster import InClusterSettings

BUILDERS = ("buildah", "in-cluster")
DEFAULT_BUILDAH_ROOT = "~/.local/share/kubetrain/buildah"


class BuildImageOperator(BaseOperator):
    """Build a Dockerfile and push the image; tags move only after the image is complete.

    :param context: the build context directory on the worker.
    :param repository: the repository in the registry, e.g. ``kubetrain/trainer``.
    :param tags: tags to set on the pushed image.
    :param dockerfile: the Dockerfile, relative to ``context``.
    :param builder: ``buildah`` (on the worker, daemonless) or ``in-cluster`` (a BuildKit pod).
    :param build_args: ``--build-arg`` values.
    :param target: the stage to build (``--target``).
    :param labels: image labels; ``org.opencontainers.image.created`` is set to the build time and
        ``org.opencontainers.image.revision`` to ``revision`` unless given here.
    :param revision: the source revision (git sha) recorded in the image.
    :param platform: ``os/arch`` to build for (default: the builder's own).
    :param image_format: ``oci`` or ``docker`` manifests.
    :param registry_conn_id: connection of the registry (see :class:`RegistryHook`).
    :param buildah_root: buildah's private storage (layer cache); default ``$KUBETRAIN_BUILDAH_ROOT``
        or ``~/.local/share/kubetrain/buildah``.
    :param kubernetes_conn_id: cluster connection for the in-cluster builder.
    :param namespace: namespace of the builder pod (default: the ``namespace`` setting).
    :param aws_conn_id: S3 connection used to upload the build context (in-cluster).
    :param context_bucket: bucket for build contexts (in-cluster; default: the training bucket).
    :param context_prefix: key prefix for build contexts (in-cluster).
    :param cluster_registry: ``host[:port]`` by which pods reach the registry, when it differs
        from the connection's host (in-cluster).
    :param registry_secret: the ``kubernetes.io/dockerconfigjson`` Secret with push credentials
        (in-cluster); None for a registry without auth.
    :param s3_secret: the Secret with the AWS variables for fetching the context (in-cluster;
        default: the ``s3_secret`` setting; none with workload identity, then the pod runs as the
        ``service_account`` setting).
    :param in_cluster_tool: ``buildkit`` (rootless BuildKit) or ``buildah`` (rootless buildah) in the
        builder pod (in-cluster).
    :param builder_image: the image of that tool (in-cluster; default: the tool's official image).
    :param fetch_image: the image that fetches the context from S3, with Python 3 and botocore
        (in-cluster; default: the sync image that training pods use).
    :param startup_timeout_seconds: how long the builder pod may stay pending (in-cluster).
    :param deferrable: wait for the builder pod in the triggerer, not in a worker slot (in-cluster).
    """

    template_fields: Sequence[str] = (
        "context",
        "repository",
        "tags",
        "dockerfile",
        "build_args",
        "target",
        "labels",
        "revision",
        "context_bucket",
        "context_prefix",
    )
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        context: str,
        repository: str,
        tags: Sequence[str] = ("latest",),
        dockerfile: str = "Dockerfile",
        builder: str = "buildah",
        build_args: Mapping[str, str] | None = None,
        target: str | None = None,
        labels: Mapping[str, str] | None = None,
        revision: str | None = None,
        platform: str | None = None,
        image_format: str = "oci",
        registry_conn_id: str = RegistryHook.default_conn_name,
        buildah_root: str | None = None,
        kubernetes_conn_id: str = "kubernetes_default",
        namespace: str | None = None,
        aws_conn_id: str = "aws_default",
        context_bucket: str | None = None,
        context_prefix: str = "build-contexts",
        cluster_registry: str | None = None,
        registry_secret: str | None = "kubetrain-registry",
        s3_secret: str | None = None,
        in_cluster_tool: str = "buildkit",
        builder_image: str | None = None,
        fetch_image: str | None = None,
        startup_timeout_seconds: int = 600,
        deferrable: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("doc_md", class_doc_md(type(self)))  # the task's documentation in the UI
        super().__init__(**kwargs)
        if builder not in BUILDERS:
            raise ValueError(f"invalid builder {builder!r}: expected one of {', '.join(BUILDERS)}")
        self.context = context
        self.repository = repository
        self.tags = tags
        self.dockerfile = dockerfile
        self.builder = builder
        self.build_args = build_args or {}
        self.target = target
        self.labels = labels or {}
        self.revision = revision
        self.platform = platform
        self.image_format = image_format
        self.registry_conn_id = registry_conn_id
        self.buildah_root = buildah_root
        self.kubernetes_conn_id = kubernetes_conn_id
        self.namespace = namespace
        self.aws_conn_id = aws_conn_id
        self.context_bucket = context_bucket
        self.context_prefix = context_prefix
        self.cluster_registry = cluster_registry
        self.registry_secret = registry_secret
        self.s3_secret = s3_secret
        self.in_cluster_tool = in_cluster_tool
        self.builder_image = builder_image
        self.fetch_image = fetch_image
        self.startup_timeout_seconds = startup_timeout_seconds
        self.deferrable = deferrable

    @cached_property
    def hook(self) -> RegistryHook:
        return RegistryHook(self.registry_conn_id)

    def build_request(self) -> BuildRequest:
        """The validated build request (bad input raises ``ValueError`` here, before anything runs)."""
        from kubetrain.imagebuild.builders import BuildRequest

        labels = {"org.opencontainers.image.created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        if self.revision:
            labels["org.opencontainers.image.revision"] = str(self.revision)
        labels.update(self.labels)
        tags = [self.tags] if isinstance(self.tags, str) else list(self.tags)
        return BuildRequest(
            context=Path(self.context),
            repository=self.repository,
            tags=tuple(tags),
            dockerfile=self.dockerfile,
            build_args=dict(self.build_args),
            target=self.target or None,
            labels=labels,
            platform=self.platform,
            image_format=self.image_format,
        )

    def _target(self, request: BuildRequest) -> PushTarget:
        from kubetrain.imagebuild.builders import PushTarget

        settings = self.hook.settings
        return PushTarget(
            registry=settings.registry,
            repository=request.repository,
            insecure=settings.insecure,
            ca_bundle=settings.ca_bundle,
            tls_verify=settings.tls_verify,
        )

    def execute(self, context: Context) -> dict[str, Any]:
        request = self.build_request()
        with self.hook.get_conn() as client:
            client.ping()  # unreachable registry or bad credentials fail before a long build
        target = self._target(request)
        if self.builder == "buildah":
            output = self._build_buildah(request, target)
        else:
            output = self._build_in_cluster(request, target, context)
        return self._publish(request, output)

    def _publish(self, request: BuildRequest, output: BuildOutput) -> dict[str, Any]:
        """Move the requested tags onto the complete image; the XCom names it by digest."""
        registry = self.hook.registry
        self.log.info(
            "image complete in the registry as %s/%s@%s; tagging %s",
            registry,
            request.repository,
            output.digest,
            ", ".join(request.tags),
        )
        with self.hook.get_conn() as client:
            client.tag(request.repository, output.digest, request.tags)
            if output.staging_tag:
                if client.delete_tag(request.repository, output.staging_tag):
                    self.log.info("removed staging tag %s", output.staging_tag)
                else:
                    self.log.info(
                        "staging tag %s stays (this registry cannot delete tags)", output.staging_tag
                    )
        reference = f"{registry}/{request.repository}@{output.digest}"
        self.log.info("pushed %s", reference)
        return {
            "digest": output.digest,
            "reference": reference,
            "tags": [f"{registry}/{request.repository}:{t}" for t in request.tags],
            "builder": self.builder,
        }

    def _build_buildah(self, request: BuildRequest, target: PushTarget) -> BuildOutput:
        from dataclasses import replace

        from kubetrain.imagebuild.buildah import BuildahBuilder

        root = Path(
            os.path.expanduser(self.buildah_root or environ("KUBETRAIN_BUILDAH_ROOT") or DEFAULT_BUILDAH_ROOT)
        )
        root.mkdir(parents=True, exist_ok=True)
        builder = BuildahBuilder(root, log=lambda line: self.log.info("%s", line))
        with tempfile.TemporaryDirectory(prefix="auth-", dir=root) as tmp:
            authfile = self.hook.write_authfile(Path(tmp) / "auth.json")
            return builder.build_and_push(request, replace(target, authfile=authfile))

    def _in_cluster_settings(self) -> InClusterSettings:
        from kubetrain import pod_spec, settings
        from kubetrain.imagebuild.incluster import InClusterSettings

        deployment = settings.Deployment.from_environment()
        return InClusterSettings(
            namespace=self.namespace or settings.get("build_namespace") or deployment.namespace,
            tool=self.in_cluster_tool,
            fetch_image=pod_spec.resolve_image(self.fetch_image, "sync"),
            s3_secret=self.s3_secret if self.s3_secret is not None else deployment.s3_secret,
            registry_secret=self.registry_secret,
            service_account=deployment.service_account,
            image_pull_secrets=deployment.image_pull_secrets,
            node_selector=deployment.node_selector,
            tolerations=deployment.tolerations,
            builder_image=self.builder_image or InClusterSettings.builder_image,  # unset: the default
        )

    @property
    def bucket(self) -> str:
        """The bucket of build contexts: ``context_bucket``, else the deployment's training bucket."""
        from kubetrain.s3_layout import S3Layout

        return self.context_bucket or S3Layout.from_environment().training_bucket

    def upload_context(self, request: BuildRequest, context: Context) -> str:
        """Pack the build context and upload it to S3; returns its ``s3://`` URI."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from kubetrain.imagebuild.incluster import write_context

        with tempfile.TemporaryDirectory(prefix="kubetrain-context-") as tmp:
            tarball = write_context(request.context, Path(tmp) / "context.tar.gz")
            key = context_key(self.context_prefix, context, tarball.digest)
            S3Hook(aws_conn_id=self.aws_conn_id).load_file(
                str(tarball.path), key, bucket_name=self.bucket, replace=True
            )
        uri = f"s3://{self.bucket}/{key}"
        self.log.info("build context (%s bytes) uploaded to %s", tarball.size, uri)
        return uri

    def builder_pod(self, request: BuildRequest, target: PushTarget, context_uri: str) -> k8s.V1Pod:
        """The BuildKit pod that builds ``request`` from ``context_uri`` and pushes it by digest."""
        from dataclasses import replace

        from kubetrain.imagebuild.incluster import builder_pod

        if self.cluster_registry:
            target = replace(target, registry=self.cluster_registry)
        return builder_pod(request, target, context_uri, self._in_cluster_settings())

    def _launcher(self, pod: k8s.V1Pod | None, namespace: str) -> KubernetesPodOperator:
        """The provider's pod operator that runs the builder pod: creation, deferral to its trigger,
        log streaming (init containers too), the XCom sidecar with BuildKit's metadata, cleanup."""
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

        return KubernetesPodOperator(
            task_id=f"{self.task_id}-builder",
            kubernetes_conn_id=self.kubernetes_conn_id,
            namespace=namespace,
            full_pod_spec=pod,
            do_xcom_push=True,
            get_logs=True,
            init_container_logs=True,
            on_finish_action="delete_pod",
            startup_timeout_seconds=self.startup_timeout_seconds,
            deferrable=self.deferrable,
        )

    def _build_in_cluster(self, request: BuildRequest, target: PushTarget, context: Context) -> BuildOutput:
        pod = self.builder_pod(request, target, self.upload_context(request, context))
        result = self._run_launcher(lambda launcher: launcher.execute(context), pod, pod.metadata.namespace)
        return self._builder_output(result)

    def execute_in_cluster_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the builder pod ended (the provider's trigger fired): logs, XCom, cleanup, tags."""
        result = self._run_launcher(
            lambda launcher: launcher.trigger_reentry(context, event), None, event["namespace"]
        )
        return self._publish(self.build_request(), self._builder_output(result))

    def _run_launcher(self, call: Any, pod: k8s.V1Pod | None, namespace: str) -> Any:
        from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
        from kubernetes.client.exceptions import ApiException

        from kubetrain.imagebuild.incluster import pod_security_refusal

        try:
            return call(self._launcher(pod, namespace))
        except ApiException as exc:
            body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
            if exc.status == 403 and "PodSecurity" in body:
                try:
                    message = json.loads(body).get("message", body)
                except ValueError:
                    message = body
                raise AirflowFailException(pod_security_refusal(namespace, message)) from None
            raise
        except TaskDeferred as deferred:
            # The provider's trigger watches the pod from the triggerer; this task, not the inner
            # pod operator, resumes when it fires. Its arguments go to the metadata database: without
            # the kubeconfig the provider read (its token) and the connection's extras.
            from kubetrain.triggers.pod import PodTriggerByReference

            self.defer(
                trigger=PodTriggerByReference.of(deferred.trigger, None),
                method_name="execute_in_cluster_complete",
                timeout=deferred.timeout,
            )

    @staticmethod
    def _builder_output(result: Any) -> BuildOutput:
        from kubetrain.imagebuild.builders import BuildError, BuildOutput
        from kubetrain.imagebuild.incluster import METADATA_DIGEST, STAGING_TAG_KEY
        from kubetrain.imagebuild.reference import check_digest, check_tag

        digest = result.get(METADATA_DIGEST) if isinstance(result, dict) else None
        if not digest:
            raise BuildError(
                f"the builder pod finished without reporting an image digest (metadata: {result!r})"
            )
        staging = result.get(STAGING_TAG_KEY)
        return BuildOutput(check_digest(digest), check_tag(staging) if staging else None)


def context_key(prefix: str, context: Context, digest: str) -> str:
    """S3 key of a build context: per DAG, run and task, named by its content digest."""
    ti = context.get("ti")
    parts = [
        getattr(ti, "dag_id", None) or "adhoc",
        str(context.get("run_id") or "manual"),
        getattr(ti, "task_id", None) or "build",
    ]
    safe = [re.sub(r"[^A-Za-z0-9._=-]+", "_", p) for p in parts]
    return "/".join([prefix.strip("/"), *safe, f"context-{digest.removeprefix('sha256:')[:16]}.tar.gz"])


class AppendLayerOperator(BaseOperator):
    """Add one layer holding a code directory to a base image in the registry, and push it.

    Nothing of the base image is pulled; the new image's tag defaults to a hash of the result,
    and when that tag already exists, nothing is pushed.

    :param base_image: the base image, ``repo:tag`` or ``repo@sha256:...`` in the connection's
        registry (a full reference must name that registry).
    :param repository: the repository to push to.
    :param source: the code directory on the worker (e.g. the trainer package).
    :param dest: where the directory lands in the image; it replaces what the base had there.
    :param tag: the tag to set (default: ``code-<hash>``).
    :param excludes: patterns left out of the layer (default: .venv, __pycache__, *.pyc, tests, caches).
    :param env: environment variables set in the image config.
    :param entrypoint: new entrypoint (exec form).
    :param cmd: new command (exec form).
    :param workdir: new working directory.
    :param labels: labels merged over the base image's.
    :param platform: ``os/arch`` picked from a multi-platform base (default linux/amd64).
    :param registry_conn_id: connection of the registry (see :class:`RegistryHook`).
    """

    template_fields: Sequence[str] = (
        "base_image",
        "repository",
        "source",
        "dest",
        "tag",
        "env",
        "entrypoint",
        "cmd",
        "workdir",
        "labels",
        "platform",
    )
    ui_color = "#d5f5e3"

    def __init__(
        self,
        *,
        base_image: str,
        repository: str,
        source: str,
        dest: str = "/app/trainer",
        tag: str | None = None,
        excludes: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        entrypoint: Sequence[str] | None = None,
        cmd: Sequence[str] | None = None,
        workdir: str | None = None,
        labels: Mapping[str, str] | None = None,
        platform: str | None = None,
        registry_conn_id: str = RegistryHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("doc_md", class_doc_md(type(self)))  # the task's documentation in the UI
        super().__init__(**kwargs)
        self.base_image = base_image
        self.repository = repository
        self.source = source
        self.dest = dest
        self.tag = tag
        self.excludes = tuple(excludes) if excludes is not None else None
        self.env = env or {}
        self.entrypoint = entrypoint
        self.cmd = cmd
        self.workdir = workdir
        self.labels = labels or {}
        self.platform = platform
        self.registry_conn_id = registry_conn_id

    @cached_property
    def hook(self) -> RegistryHook:
        return RegistryHook(self.registry_conn_id)

    def execute(self, context: Context) -> dict[str, Any]:
        from kubetrain.imagebuild.append import AppendSpec, append_layer
        from kubetrain.imagebuild.layer import DEFAULT_EXCLUDES
        from kubetrain.imagebuild.reference import parse_reference

        spec = AppendSpec(
            source=Path(self.source),
            dest=self.dest,
            excludes=self.excludes if self.excludes is not None else DEFAULT_EXCLUDES,
            env=dict(self.env),
            entrypoint=self.entrypoint,
            cmd=self.cmd,
            workdir=self.workdir or None,
            labels=dict(self.labels),
        )
        base = parse_reference(self.base_image, default_registry=self.hook.registry)
        with self.hook.get_conn() as client:
            result = append_layer(
                client,
                base=base,
                repository=self.repository,
                spec=spec,
                tag=self.tag or None,
                platform=self.platform or None,
                log=lambda line: self.log.info("%s", line),
            )
        stats = result.stats
        self.log.info(
            "%s %s (%d requests, %d bytes sent, %d bytes received)",
            "pushed" if result.pushed else "already present:",
            result.reference,
            stats["requests"],
            stats["bytes_sent"],
            stats["bytes_received"],
        )
        return result.as_xcom()
