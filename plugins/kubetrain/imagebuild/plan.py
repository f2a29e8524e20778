"""Decide how to bring the trainer image up to date: nothing, a code layer, or a full build.

The code's identity is the content hash of the trainer package (what goes into the image);
the dependencies' identity is the hash of the files that shape the base (requirements,
lock, Dockerfile). A full build is tagged ``deps-<hash>`` and serves as the base that code
layers are appended to, so the registry itself records which dependency sets exist.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kubetrain.imagebuild.layer import DEFAULT_EXCLUDES, files_hash, tree_hash

MODES = ("auto", "full", "append")
DEPS_PATTERNS = ("requirements*.txt", "requirements*.lock", "Dockerfile*", ".dockerignore")


def deps_files(trainer_dir: Path) -> list[Path]:
    """The files whose change needs a full build."""
    return sorted({p for pattern in DEPS_PATTERNS for p in trainer_dir.glob(pattern) if p.is_file()})


def base_tag(trainer_dir: Path) -> str:
    """The tag of the full build for today's dependencies: ``deps-<16 hex>``."""
    return f"deps-{files_hash(deps_files(trainer_dir))[:16]}"


def git_revision(path: Path) -> str | None:
    """The commit checked out at ``path``, when it is a git work tree."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_image(
    trainer_dir: Path,
    *,
    previous: dict[str, Any] | None,
    base_exists: bool,
    mode: str = "auto",
    force: bool = False,
) -> ImagePlan:
    """Compare the trainer package with what was published last.

    :param trainer_dir: the trainer package directory (with its Dockerfile and requirements).
    :param previous: what the last successful run recorded (``code_hash``, ``deps_hash``), or None.
    :param base_exists: whether the registry holds the ``deps-<hash>`` base for today's dependencies.
    :param mode: 'auto' decides; 'full' or 'append' force that kind of build.
    :param force: build even when the code is unchanged.
    :raises ValueError: for an unknown mode, a missing directory, or 'append' without a base.
    """
    if mode not in MODES:
        raise ValueError(f"invalid mode {mode!r}: expected one of {', '.join(MODES)}")
    if not trainer_dir.is_dir():
        raise ValueError(f"trainer directory {str(trainer_dir)!r} does not exist")
    code_hash = tree_hash(trainer_dir, DEFAULT_EXCLUDES)
    deps_hash = files_hash(deps_files(trainer_dir))
    tag = base_tag(trainer_dir)
    common = {"code_hash": code_hash, "deps_hash": deps_hash, "base_tag": tag, "revision": git_revision(trainer_dir)}
    unchanged = bool(previous) and previous.get("code_hash") == code_hash
    if mode == "full":
        return ImagePlan("full", "a full build was asked for", **common)
    if mode == "append":
        if not base_exists:
            raise ValueError(f"mode 'append' needs the base image tagged {tag}, which the registry lacks: "
                             "run with mode 'full' first")  # fmt: skip
        return ImagePlan("append", "a code layer was asked for", **common)
    if unchanged and not force:
        return ImagePlan("skip", f"trainer code unchanged since the last build ({code_hash[:16]})", **common)
    if not base_exists:
        return ImagePlan("full", f"dependencies changed: no base image {tag} yet", **common)
    return ImagePlan("append", f"code changed, dependencies unchanged ({tag})", **common)
