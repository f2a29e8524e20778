"""Decide how to bring the trainer and sync images up to date: nothing, a code layer, or a build.

The trainer's code identity is the content hash of the trainer package (what goes into the
image); its dependencies' identity is the hash of the files that shape the base (requirements,
lock, Dockerfile) and of the build arguments. A full build is tagged ``deps-<hash>`` (``-cpu``
for the CPU variant) and serves as the base that code layers are appended to, so the registry
itself records which dependency sets exist.

The sync image is small and holds only ``trainer/sync``: it is rebuilt whole when its source
(the package, ``requirements-sync.txt``, ``Dockerfile.sync``, ``.dockerignore``) or its build
arguments change, and tagged ``src-<hash>``; a tag already in the registry is reused, not rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

from kubetrain.imagebuild.layer import DEFAULT_EXCLUDES, files_hash, tree_hash

MODES = ("auto", "full", "append")
VARIANTS = ("gpu", "cpu")
DEPS_PATTERNS = ("requirements*.txt", "requirements*.lock", "Dockerfile*", ".dockerignore")
# The sync image's own inputs: they do not shape the trainer's base (its code hash covers them).
SYNC_FILES = ("Dockerfile.sync", "requirements-sync.txt", ".dockerignore")
SYNC_PACKAGE = "sync"
# The pod contract (kubetrain_contract/__init__.py): the images copy it to /app/kubetrain_contract, outside the
# package a code-only layer replaces, so a change of it needs a full build of either image.
CONTRACT_PACKAGE = "kubetrain_contract"


def contract_files(trainer_dir: Path) -> list[Path]:
    package = trainer_dir / CONTRACT_PACKAGE
    return (
        sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts) if package.is_dir() else []
    )


def deps_files(trainer_dir: Path) -> list[Path]:
    """The files whose change needs a full build of the trainer image."""
    sync_only = set(SYNC_FILES) - {".dockerignore"}
    return sorted(
        {
            p
            for pattern in DEPS_PATTERNS
            for p in trainer_dir.glob(pattern)
            if p.is_file() and p.name not in sync_only
        }
        | set(contract_files(trainer_dir))
    )


def _with_args(digest: str, build_args: Mapping[str, str] | None) -> str:
    if not build_args:
        return digest
    return hashlib.sha256((digest + json.dumps(dict(build_args), sort_keys=True)).encode()).hexdigest()


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"invalid variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    return variant


def deps_hash(trainer_dir: Path, build_args: Mapping[str, str] | None = None) -> str:
    """The trainer's dependency identity: its deps files and the build arguments."""
    return _with_args(files_hash(deps_files(trainer_dir)), build_args)


def base_tag(trainer_dir: Path, variant: str = "gpu", build_args: Mapping[str, str] | None = None) -> str:
    """The tag of the full build for today's dependencies: ``deps-<16 hex>`` (``-cpu`` for the CPU variant)."""
    suffix = "-cpu" if check_variant(variant) == "cpu" else ""
    return f"deps-{deps_hash(trainer_dir, build_args)[:16]}{suffix}"


def sync_source_hash(trainer_dir: Path, build_args: Mapping[str, str] | None = None) -> str:
    """The sync image's identity: ``trainer/sync``, its requirements, Dockerfile and build arguments."""
    package = trainer_dir / SYNC_PACKAGE
    if not package.is_dir():
        raise ValueError(f"{str(package)!r} does not exist: the sync image is built from trainer/sync")
    files = files_hash([*(trainer_dir / name for name in SYNC_FILES), *contract_files(trainer_dir)])
    return _with_args(
        hashlib.sha256(f"{files}\n{tree_hash(package, DEFAULT_EXCLUDES)}".encode()).hexdigest(), build_args
    )


def git_revision(path: Path) -> str | None:
    """The commit checked out at ``path``, when it is a git work tree."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


@dataclass(frozen=True)
class ImagePlan:
    """``action`` is 'skip', 'full' or 'append'; ``reason`` says why, for the task log."""

    action: str
    reason: str
    code_hash: str
    deps_hash: str
    base_tag: str
    revision: str | None = None
    variant: str = "gpu"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _PlanIdentity(TypedDict):
    """The :class:`ImagePlan` fields that every action shares."""

    code_hash: str
    deps_hash: str
    base_tag: str
    revision: str | None
    variant: str


def plan_image(
    trainer_dir: Path,
    *,
    previous: dict[str, Any] | None,
    base_exists: bool,
    mode: str = "auto",
    force: bool = False,
    variant: str = "gpu",
    build_args: Mapping[str, str] | None = None,
) -> ImagePlan:
    """Compare the trainer package with what was published last.

    :param trainer_dir: the trainer package directory (with its Dockerfile and requirements).
    :param previous: what the last successful run recorded (``code_hash``, ``deps_hash``), or None.
    :param base_exists: whether the registry holds the ``deps-<hash>`` base for today's dependencies.
    :param mode: 'auto' decides; 'full' or 'append' force that kind of build.
    :param force: build even when the code is unchanged.
    :param variant: ``gpu`` or ``cpu``: which trainer base the full build and the code layer use.
    :param build_args: the full build's build arguments (part of the base's identity).
    :raises ValueError: for an unknown mode or variant, a missing directory, or 'append' without a base.
    """
    if mode not in MODES:
        raise ValueError(f"invalid mode {mode!r}: expected one of {', '.join(MODES)}")
    if not trainer_dir.is_dir():
        raise ValueError(f"trainer directory {str(trainer_dir)!r} does not exist")
    check_variant(variant)
    code_hash = tree_hash(trainer_dir, DEFAULT_EXCLUDES)
    tag = base_tag(trainer_dir, variant, build_args)
    common: _PlanIdentity = {
        "code_hash": code_hash,
        "deps_hash": deps_hash(trainer_dir, build_args),
        "base_tag": tag,
        "revision": git_revision(trainer_dir),
        "variant": variant,
    }
    unchanged = (
        previous is not None  # an empty record ({}) has no code_hash: not unchanged either
        and previous.get("code_hash") == code_hash
        and previous.get("variant", "gpu") == variant
        and previous.get("deps_hash") == common["deps_hash"]
    )
    if mode == "full":
        return ImagePlan("full", "a full build was asked for", **common)
    if mode == "append":
        if not base_exists:
            raise ValueError(
                f"mode 'append' needs the base image tagged {tag}, which the registry lacks: "
                "run with mode 'full' first"
            )
        return ImagePlan("append", "a code layer was asked for", **common)
    if unchanged and not force:
        return ImagePlan(
            "skip", f"trainer code unchanged since the last build ({code_hash[:16]}, {variant})", **common
        )
    if not base_exists:
        return ImagePlan("full", f"dependencies changed: no base image {tag} yet", **common)
    return ImagePlan("append", f"code changed, dependencies unchanged ({tag})", **common)


@dataclass(frozen=True)
class SyncPlan:
    """``action`` is 'skip' (published already), 'reuse' (in the registry, not yet published) or 'build'."""

    action: str
    reason: str
    source_hash: str
    tag: str
    digest: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_sync_image(
    trainer_dir: Path,
    *,
    previous: dict[str, Any] | None,
    existing_digest: str | None,
    force: bool = False,
    build_args: Mapping[str, str] | None = None,
) -> SyncPlan:
    """Compare the sync image's source with what was published last and what the registry holds.

    :param trainer_dir: the trainer directory (the build context, with ``sync/`` and ``Dockerfile.sync``).
    :param previous: what the last successful run recorded for the sync image (``source_hash``), or None.
    :param existing_digest: the digest the registry has for the ``src-<hash>`` tag of today's source, or None.
    :param force: build even when the source is unchanged.
    :param build_args: the build's arguments (part of the image's identity).
    """
    source = sync_source_hash(trainer_dir, build_args)
    tag = sync_tag(trainer_dir, build_args)
    if force:
        return SyncPlan("build", "a build was asked for", source, tag)
    if previous and previous.get("source_hash") == source:
        return SyncPlan("skip", f"sync source unchanged since the last build ({source[:16]})", source, tag)
    if existing_digest:
        return SyncPlan("reuse", f"the registry already has {tag}", source, tag, existing_digest)
    return SyncPlan("build", f"sync source changed: no image {tag} yet", source, tag)


def sync_tag(trainer_dir: Path, build_args: Mapping[str, str] | None = None) -> str:
    """The tag of the sync image built from today's source: ``src-<16 hex>``."""
    return f"src-{sync_source_hash(trainer_dir, build_args)[:16]}"
