"""Which images a training run uses: the configured reference, pinned to its digest in the registry.

A tag such as ``latest`` moves; a run must record, and run, what the tag named when the run
was submitted. :func:`pin_image` asks the registry for the digest behind a tag, so that the
pod spec, the train-once fingerprint and the report all name ``<repository>@sha256:...``.

Images in the configured registry (setting ``registry``, or the host of the registry
connection) are looked up with the registry connection's credentials
(:class:`~kubetrain.hooks.registry.RegistryHook`); images elsewhere anonymously, the way a
node pulls a public image. A reference that already carries a digest is used as it is, with
no registry call. When the registry cannot say, the task fails naming the image: a run never
falls back to a tag silently.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowNotFoundException

from kubetrain import settings

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_LOOPBACK = ("localhost", "127.0.0.1", "[::1]")


class ImageResolutionError(AirflowException):
    """The registry could not be asked for an image's digest (unreachable, or an unexpected answer)."""


class ImageNotFoundError(AirflowFailException):
    """The registry has no such image; a retry would not change that."""


def has_digest(image: str) -> bool:
    return "@sha256:" in image


def registry_client(image: str, *, registry_conn_id: str | None = None) -> tuple[Any, str, str]:
    """``(client, repository, where)``: a registry client that may ask for ``image``, the image's
    repository as that client names it, and the registry in words for messages.

    Images in the configured registry are asked with the registry connection's credentials, others
    anonymously (see the module's docstring); the caller closes the client (``with client:``).

    :param image: an image reference, by tag or by digest.
    :param registry_conn_id: the registry connection (default ``kubetrain_registry_default``).
    """
    from kubetrain.hooks.registry import RegistryHook
    from kubetrain.imagebuild.oci import RegistryClient
    from kubetrain.imagebuild.reference import parse_reference

    ref = parse_reference(image, default_registry=DOCKER_HUB)
    repository = ref.repository
    host = ref.registry
    if host == DOCKER_HUB:
        host = DOCKER_HUB_API
        if "/" not in repository:
            repository = f"library/{repository}"
    hook = RegistryHook(registry_conn_id or RegistryHook.default_conn_name)
    try:
        connection_registry = hook.registry
    except AirflowNotFoundException:  # no registry connection: every registry is asked anonymously
        connection_registry = None
    # A configured registry may keep its repositories under a path (Artifact Registry's
    # <region>-docker.pkg.dev/<project>/<repository>): the image is in it when its name starts with it.
    full_name = f"{ref.registry}/{ref.repository}"
    configured = [r for r in (connection_registry, settings.get("registry")) if r]
    within = next((r for r in configured if full_name.startswith(r.rstrip("/") + "/")), None)
    if within is not None and within == connection_registry:
        where = f"registry {connection_registry} (connection {hook.registry_conn_id!r})"
        return hook.get_conn(), full_name[len(within.rstrip("/")) + 1 :], where
    # the host without its port: "[::1]:5000" -> "[::1]", "localhost:5000" -> "localhost"
    name = host[: host.index("]") + 1] if host.startswith("[") else host.split(":")[0]
    return RegistryClient(host, insecure=name in _LOOPBACK, timeout=30), repository, f"registry {host}"


def image_labels(image: str, *, registry_conn_id: str | None = None) -> dict[str, str]:
    """The labels of an image pinned by digest (its config's ``Labels``; of a multi-platform index,
    the linux/amd64 image's, else the first platform's), e.g. ``org.opencontainers.image.revision``.

    :param image: ``<repository>@sha256:...``.
    :param registry_conn_id: the registry connection (default ``kubetrain_registry_default``).
    :raises ValueError: the reference carries no digest.
    :raises kubetrain.imagebuild.registry_errors.RegistryError: the registry could not say.
    """
    import json

    from kubetrain.imagebuild.oci import select_platform
    from kubetrain.imagebuild.registry_errors import RegistryError

    if not has_digest(image):
        raise ValueError(f"image {image!r} carries no digest: expected <repository>@sha256:<digest>")
    digest = image.rsplit("@", 1)[1]
    client, repository, _ = registry_client(image, registry_conn_id=registry_conn_id)
    with client:
        manifest = client.get_manifest(repository, digest)
        if manifest.is_index:
            platforms = [
                "/".join(p for p in ((e.get("platform") or {}).get(k) for k in ("os", "architecture")) if p)
                for e in manifest.data.get("manifests", [])
            ]
            wanted = "linux/amd64" if "linux/amd64" in platforms else next((p for p in platforms if p), "")
            if not wanted:
                raise RegistryError(f"{image} is an index that names no platform")
            manifest = select_platform(client, repository, manifest, wanted)
        config_digest = (manifest.data.get("config") or {}).get("digest")
        if not isinstance(config_digest, str):
            raise RegistryError(f"the manifest of {image} names no config blob")
        config = json.loads(client.get_blob(repository, config_digest))
    labels = (config.get("config") or {}).get("Labels") if isinstance(config, dict) else None
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def pin_image(image: str, *, registry_conn_id: str | None = None) -> str:
    """``image`` as ``<registry>/<repository>@sha256:<digest>``, the digest its tag names now.

    :param image: an image reference; one with a digest is returned unchanged.
    :param registry_conn_id: the registry connection for images in the configured registry
        (default ``kubetrain_registry_default``).
    :raises ImageNotFoundError: the registry has no such tag, or points the worker at a host it may not ask
        (a Bearer realm, a redirect elsewhere): not retried, a retry would meet the same answer.
    :raises ImageResolutionError: the registry cannot be reached or refuses the credentials (retried: a token
        may have expired and be renewed).
    """
    from kubetrain.imagebuild.reference import parse_reference
    from kubetrain.imagebuild.registry_errors import (
        ManifestNotFound,
        RegistryAuthError,
        RegistryError,
        TargetRefused,
    )

    if has_digest(image):
        parse_reference(image)  # refuse a malformed reference before it reaches a pod
        return image
    ref = parse_reference(image, default_registry=DOCKER_HUB)
    tag = ref.tag or "latest"
    try:
        client, repository, where = registry_client(image, registry_conn_id=registry_conn_id)
        with client:
            digest = client.manifest_digest(repository, tag)
    except (ManifestNotFound, TargetRefused) as exc:  # TargetRefused covers RealmRefused
        raise ImageNotFoundError(f"cannot resolve image {image} to a digest: {exc}") from exc
    except RegistryAuthError as exc:
        # retried: a registry token expires (ECR's after 12 hours) and a secrets backend or Variable may renew it
        raise ImageResolutionError(
            f"cannot resolve image {image} to a digest: {exc}; if the connection's password is a token that expires "
            "(an ECR password lasts 12 hours), renew it, or give the connection the extra aws_conn_id so that each "
            "run asks ECR for a fresh one"
        ) from exc
    except RegistryError as exc:
        raise ImageResolutionError(
            f"cannot resolve image {image} to a digest: {exc}; a run records the digest it ran, never a "
            "moving tag: make the registry reachable, or give the image by digest (<image>@sha256:...)"
        ) from exc
    if digest is None:
        raise ImageNotFoundError(
            f"image {image} is not in {where}: build and push it (make images IMAGE_TAG=<tag>, or the "
            "build_trainer_image DAG), or point the image_tag and trainer_variant settings (or the image) at one "
            "that was pushed"
        )
    name = image.strip()
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]  # the tag goes: the digest says it all, and a tag beside it misleads
    return f"{name}@{digest}"
