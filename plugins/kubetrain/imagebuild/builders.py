"""What every builder gets (a :class:`BuildRequest`, a :class:`PushTarget`) and gives back."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kubetrain.imagebuild.oci import parse_platform
from kubetrain.imagebuild.reference import check_repository, check_tag

BUILD_ARG_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TARGET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")
IMAGE_FORMATS = ("oci", "docker")


class BuildError(RuntimeError):
    """A build or push failed; the message holds the exit code and the last log lines."""

    def __init__(self, message: str, exit_code: int | None = None, tail: list[str] | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.tail = tail or []


@dataclass(frozen=True)
class BuildRequest:
    """One image build: a context directory, a Dockerfile in it, and how to tag the result.

    :raises ValueError: from ``__post_init__``, naming the bad value and what was expected.
    """

    context: Path
    repository: str
    tags: tuple[str, ...]
    dockerfile: str = "Dockerfile"
    build_args: Mapping[str, str] = field(default_factory=dict)
    target: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    platform: str | None = None
    image_format: str = "oci"

    def __post_init__(self) -> None:
        context = Path(self.context)
        if not context.is_dir():
            raise ValueError(f"build context {str(context)!r} does not exist or is not a directory")
        dockerfile = self.dockerfile_path
        if not dockerfile.is_file():
            raise ValueError(
                f"Dockerfile {str(dockerfile)!r} does not exist: expected a file inside the build context "
                f"{str(context)!r} (dockerfile is relative to the context)"
            )
        if context.resolve() not in dockerfile.resolve().parents:
            raise ValueError(f"Dockerfile {self.dockerfile!r} is outside the build context {str(context)!r}")
        check_repository(self.repository)
        if not self.tags:
            raise ValueError("no tags given: expected at least one tag for the built image")
        for tag in self.tags:
            check_tag(tag)
        for name in self.build_args:
            if not BUILD_ARG_RE.match(name):
                raise ValueError(f"invalid build argument name {name!r}: expected letters, digits and '_'")
        if self.target is not None and not TARGET_RE.match(self.target):
            raise ValueError(f"invalid build target {self.target!r}: expected a stage name such as 'runtime'")
        for name in self.labels:
            if not LABEL_RE.match(name):
                raise ValueError(
                    f"invalid label key {name!r}: expected e.g. org.opencontainers.image.revision"
                )
        if self.platform is not None:
            parse_platform(self.platform)
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(
                f"invalid image format {self.image_format!r}: expected one of {', '.join(IMAGE_FORMATS)}"
            )

    @property
    def dockerfile_path(self) -> Path:
        return Path(self.context) / self.dockerfile


@dataclass(frozen=True)
class PushTarget:
    """Where a builder pushes: the registry, how to reach it, and where its credentials are."""

    registry: str
    repository: str
    insecure: bool = False
    ca_bundle: str | None = None
    tls_verify: bool = True
    authfile: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"


@dataclass(frozen=True)
class BuildOutput:
    """The pushed manifest, and the staging tag it carries (None when pushed by digest)."""

    digest: str
    staging_tag: str | None = None


class Builder(Protocol):
    """Build ``request`` and push it completely under a staging tag or by digest only.

    The requested tags are moved by the caller once the builder returns, so a tag never
    names a half-pushed image.
    """

    name: str

    def build_and_push(self, request: BuildRequest, target: PushTarget) -> BuildOutput: ...
