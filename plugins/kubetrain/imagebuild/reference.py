"""Image references: ``registry/repository:tag`` and ``registry/repository@sha256:...``."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Grammar of github.com/distribution/reference.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def check_tag(tag: str) -> str:
    """Return ``tag`` when it is a valid tag, else raise ``ValueError`` saying what a tag may be."""
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise ValueError(
            f"invalid image tag {tag!r}: expected 1 to 128 characters of letters, digits, '_', '.' and '-', "
            "not starting with '.' or '-'"
        )
    return tag


def check_repository(repository: str) -> str:
    """Return ``repository`` when it is a valid repository path, else raise ``ValueError``."""
    if not isinstance(repository, str) or len(repository) > 255 or not REPOSITORY_RE.match(repository):
        raise ValueError(
            f"invalid repository name {repository!r}: expected lowercase path components such as "
            "'kubetrain/trainer' (letters, digits and single '.', '_', '__' or '-' separators)"
        )
    return repository


def split_registry(registry: str) -> tuple[str, str]:
    """``host[:port][/path]`` -> (host[:port], path): a registry may keep every repository under a path,
    as Artifact Registry does (``europe-west4-docker.pkg.dev/<project>/<repository>``).

    :raises ValueError: naming the value and what a registry is.
    """
    text = registry.strip() if isinstance(registry, str) else ""
    host, _, path = text.partition("/")
    if not host or " " in text or (path and not REPOSITORY_RE.match(path)):
        raise ValueError(
            f"invalid registry {registry!r}: expected host[:port], optionally with a path under which the "
            "repositories live, e.g. registry.example.com:5000 or europe-west4-docker.pkg.dev/my-project/ml"
        )
    return host, path


def check_digest(digest: str) -> str:
    """Return ``digest`` when it is a sha256 digest, else raise ``ValueError``."""
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise ValueError(f"invalid digest {digest!r}: expected 'sha256:' and 64 lowercase hex digits")
    return digest


def _looks_like_host(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost"


@dataclass(frozen=True)
class ImageReference:
    """A parsed image reference; ``registry`` is ``host[:port]`` or empty when the reference had none."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        check_repository(self.repository)
        if self.tag is not None:
            check_tag(self.tag)
        if self.digest is not None:
            check_digest(self.digest)

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest when there is one, else the tag (``latest`` by default)."""
        return self.digest or self.tag or "latest"

    def with_registry(self, registry: str) -> ImageReference:
        return ImageReference(registry, self.repository, self.tag, self.digest)

    def __str__(self) -> str:
        name = f"{self.registry}/{self.repository}" if self.registry else self.repository
        if self.tag:
            name += f":{self.tag}"
        if self.digest:
            name += f"@{self.digest}"
        return name


def parse_reference(text: str, default_registry: str = "") -> ImageReference:
    """Parse ``[registry/]repository[:tag][@digest]``.

    :param text: the reference.
    :param default_registry: the registry assumed when ``text`` names none.
    :raises ValueError: naming the reference and what part of it is wrong.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"invalid image reference {text!r}: expected [registry/]repository[:tag][@sha256:...]"
        )
    rest = text.strip()
    for scheme in ("docker://", "https://", "http://"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
    first, _, remainder = rest.partition("/")
    if remainder and _looks_like_host(first):
        registry, repository = first, remainder
    else:
        registry, repository = default_registry, rest
    try:
        return ImageReference(registry, repository, tag, digest)
    except ValueError as exc:
        raise ValueError(f"invalid image reference {text!r}: {exc}") from None
