"""Add one code layer to a base image that is already in the registry, without pulling it.

Only the base manifest and config (a few KiB) come down; the base layers stay where they
are (checked with ``HEAD``, or mounted across repositories of the same registry); one
deterministic layer, a new config and a new manifest go up. Everything is a pure function
of (base image, code, settings), so the same inputs give the same digest, and the default
tag is derived from that digest: when the tag already exists, nothing is pushed.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetrain.imagebuild.layer import DEFAULT_EXCLUDES, tree_hash, write_layer
from kubetrain.imagebuild.oci import (
    DOCKER_CONFIG,
    DOCKER_LAYER_GZIP,
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    Blob,
    RegistryClient,
    canonical_json,
    parse_platform,
    select_platform,
    sha256_digest,
)
from kubetrain.imagebuild.reference import ImageReference, check_repository, check_tag
from kubetrain.imagebuild.registry_errors import RegistryError

DEFAULT_PLATFORM = "linux/amd64"
EPOCH = "1970-01-01T00:00:00Z"
CODE_HASH_LABEL = "io.kubetrain.code.sha256"


@dataclass(frozen=True)
class AppendSpec:
    """What goes into the code layer and how the image config changes.

    ``env`` entries replace variables of the same name in the base; ``entrypoint``, ``cmd``
    and ``workdir`` replace the base's when given; ``labels`` are merged over the base's.
    """

    source: Path
    dest: str
    excludes: Sequence[str] = DEFAULT_EXCLUDES
    env: Mapping[str, str] = field(default_factory=dict)
    entrypoint: Sequence[str] | None = None
    cmd: Sequence[str] | None = None
    workdir: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    created: str | None = None

    def __post_init__(self) -> None:
        if not Path(self.source).is_dir():
            raise ValueError(f"code directory {str(self.source)!r} does not exist or is not a directory")
        if not self.dest.startswith("/") or self.dest.rstrip("/") == "":
            raise ValueError(
                f"invalid destination {self.dest!r}: expected an absolute directory such as /app/trainer"
            )
        for name in self.env:
            if not name or "=" in name:
                raise ValueError(f"invalid environment variable name {name!r}: expected a name without '='")
        for value, what in ((self.entrypoint, "entrypoint"), (self.cmd, "cmd")):
            if value is not None and (isinstance(value, str) or not all(isinstance(a, str) for a in value)):
                raise ValueError(f"invalid {what} {value!r}: expected a list of strings (exec form)")


@dataclass(frozen=True)
class AppendResult:
    """The outcome: where the image is and whether anything was pushed."""

    registry: str
    repository: str
    tag: str
    digest: str
    base_digest: str
    layer_digest: str
    code_hash: str
    pushed: bool
    stats: dict[str, Any]

    @property
    def reference(self) -> str:
        return f"{self.registry}/{self.repository}@{self.digest}"

    def as_xcom(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "reference": self.reference,
            "tag": self.tag,
            "tagged": f"{self.registry}/{self.repository}:{self.tag}",
            "base_digest": self.base_digest,
            "layer_digest": self.layer_digest,
            "code_hash": self.code_hash,
            "pushed": self.pushed,
            "stats": self.stats,
        }


def _merge_env(base: Sequence[str], updates: Mapping[str, str]) -> list[str]:
    merged: dict[str, str] = {}
    for item in base:
        key, _, value = item.partition("=")
        merged[key] = value
    merged.update(updates)
    return [f"{k}={v}" for k, v in merged.items()]


def _check_platform(base: ImageReference, config: Mapping[str, Any], platform: str) -> None:
    want = parse_platform(platform)
    got = (config.get("os"), config.get("architecture"), config.get("variant"))
    if got[0] and got[1] and (got[:2] != want[:2] or (want[2] and got[2] != want[2])):
        have = "/".join(p for p in got if p)
        raise RegistryError(
            f"base image {base} is built for {have}, not for the platform {platform} asked for"
        )


def append_layer(
    client: RegistryClient,
    *,
    base: ImageReference,
    repository: str,
    spec: AppendSpec,
    tag: str | None = None,
    platform: str | None = None,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> AppendResult:
    """Push ``base`` plus one layer holding ``spec.source`` to ``client.registry/repository``.

    :param client: client of the registry that holds ``base`` and receives the new image.
    :param base: the base image (tag or digest) in that registry.
    :param repository: the repository to push to.
    :param spec: the code and the config changes.
    :param tag: the tag to set; default ``code-<16 hex of the resulting manifest digest>``.
    :param platform: ``os/arch[/variant]`` to pick from a multi-platform base (default linux/amd64);
        for a single-platform base, given only to check it.
    :param work_dir: where the layer file is written (a temporary directory by default).
    :param log: receives progress lines.
    :raises RegistryError: base missing, wrong platform, or a registry refusal, with the reason.
    """
    check_repository(repository)
    if tag is not None:
        check_tag(tag)
    try:
        base_repository = client.relative(base)
    except RegistryError:
        raise RegistryError(
            f"base image {base} is on registry {base.registry}, but the image goes to {client.registry}: the code "
            "layer is appended without pulling base layers, so copy the base image to that registry first"
        ) from None
    parse_platform(platform or DEFAULT_PLATFORM)
    top = client.get_manifest(base_repository, base.reference)
    image = select_platform(client, base_repository, top, platform or DEFAULT_PLATFORM)
    manifest = image.data
    base_config = json.loads(client.get_blob(base_repository, manifest["config"]["digest"]))
    if not top.is_index and platform:
        _check_platform(base, base_config, platform)
    log(f"base {base} -> {base_repository}@{image.digest} ({len(manifest.get('layers', []))} layers)")

    oci = image.is_oci
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="kubetrain-layer-") as tmp:
        layer = write_layer(
            spec.source, Path(tmp) / "layer.tar.gz", dest=spec.dest, excludes=spec.excludes, opaque=True
        )
        code_hash = tree_hash(spec.source, spec.excludes)
        layer_blob = layer.blob(OCI_LAYER_GZIP if oci else DOCKER_LAYER_GZIP)
        log(
            f"code layer {layer.digest}: {layer.entries} entries, {layer.size} bytes gzipped (code {code_hash[:16]})"
        )

        config = copy.deepcopy(base_config)
        created = spec.created or base_config.get("created") or EPOCH
        container = config.setdefault("config", {}) or {}
        config["config"] = container
        container["Env"] = _merge_env(container.get("Env") or [], spec.env)
        if spec.entrypoint is not None:
            container["Entrypoint"] = list(spec.entrypoint)
        if spec.cmd is not None:
            container["Cmd"] = list(spec.cmd)
        if spec.workdir is not None:
            container["WorkingDir"] = spec.workdir
        container["Labels"] = {
            **(container.get("Labels") or {}),
            "org.opencontainers.image.base.name": str(base.with_registry(client.registry)),
            "org.opencontainers.image.base.digest": image.digest,
            CODE_HASH_LABEL: code_hash,
            **spec.labels,
        }
        config["created"] = created
        config.setdefault("history", []).append(
            {
                "created": created,
                "created_by": f"kubetrain append-layer: code {code_hash[:16]} -> {spec.dest}",
            }
        )
        config.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"] = [
            *(config.get("rootfs", {}).get("diff_ids") or []),
            layer.diff_id,
        ]
        config_blob = Blob.from_bytes(canonical_json(config), OCI_CONFIG if oci else DOCKER_CONFIG)

        new_manifest = copy.deepcopy(manifest)
        new_manifest["config"] = config_blob.descriptor()
        new_manifest["layers"] = [*manifest.get("layers", []), layer_blob.descriptor()]
        if oci:
            new_manifest["annotations"] = {
                **(manifest.get("annotations") or {}),
                "org.opencontainers.image.base.name": str(base.with_registry(client.registry)),
                "org.opencontainers.image.base.digest": image.digest,
            }
        raw = canonical_json(new_manifest)
        digest = sha256_digest(raw)
        tag = tag or f"code-{digest.removeprefix('sha256:')[:16]}"

        existing = client.manifest_digest(repository, tag)
        if existing == digest:
            log(f"{client.registry}/{repository}:{tag} already holds {digest}: nothing to push")
            return AppendResult(
                client.registry,
                repository,
                tag,
                digest,
                image.digest,
                layer.digest,
                code_hash,
                False,
                client.stats.as_dict(),
            )
        if existing:
            log(f"tag {tag} points at {existing}; it will be moved to {digest}")

        for desc in manifest.get("layers", []):
            if client.blob_exists(repository, desc["digest"]):
                continue
            if base_repository != repository and client.mount_blob(
                repository, desc["digest"], base_repository
            ):
                client.stats.blobs["mounted"] += 1
                continue
            raise RegistryError(
                f"base layer {desc['digest']} of {base} is not in {client.registry}/{repository} and the registry "
                "did not mount it; push the base image to this repository first"
            )
        for blob, what in ((layer_blob, "code layer"), (config_blob, "config")):
            outcome = client.ensure_blob(repository, blob)
            log(f"{what} {blob.digest}: {outcome}")
        client.put_manifest(repository, digest, raw, image.media_type)
        client.put_manifest(repository, tag, raw, image.media_type)
        log(f"pushed {client.registry}/{repository}@{digest} as :{tag}")
        return AppendResult(
            client.registry,
            repository,
            tag,
            digest,
            image.digest,
            layer.digest,
            code_hash,
            True,
            client.stats.as_dict(),
        )
