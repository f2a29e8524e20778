"""Image references: ``registry/repository:tag`` and ``registry/repository@sha256:...``."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# Grammar of github.com/distribution/reference.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# A registry host (distribution/reference's domain-and-port): ASCII DNS labels separated by '.' (which covers
# localhost and IPv4 addresses), or a bracketed IPv6 address; then an optional port.
_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*"
HOST_RE = re.compile(rf"(?:{_DOMAIN}|\[(?P<ipv6>[0-9A-Fa-f:.]+)\])(?::(?P<port>[0-9]{{1,5}}))?")


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


def _is_host(host: str) -> bool:
    match = HOST_RE.fullmatch(host)
    if match is None or (match["port"] and not 1 <= int(match["port"]) <= 65535):
        return False
    if match["ipv6"]:
        try:
            ipaddress.IPv6Address(match["ipv6"])
        except ValueError:
            return False
    return True


def split_registry(registry: str) -> tuple[str, str]:
    """``host[:port][/path]`` -> (host[:port], path): a registry may keep every repository under a path,
    as Artifact Registry does (``europe-west4-docker.pkg.dev/<project>/<repository>``). The host follows
    distribution/reference's grammar, so that every HTTP client reads the same host out of it.

    :raises ValueError: naming the value and what a registry is.
    """
    text = registry.strip() if isinstance(registry, str) else ""
    host, _, path = text.partition("/")
    if not _is_host(host) or " " in text or (path and not REPOSITORY_RE.match(path)):
        raise ValueError(
            f"invalid registry {registry!r}: expected host[:port], optionally with a path under which the "
            "repositories live, e.g. registry.example.com:5000 or europe-west4-docker.pkg.dev/my-project/ml; "
            "the host is a DNS name of ASCII letters, digits and '-' in labels separated by '.', localhost, "
            "an IPv4 address or an IPv6 address in brackets, and the port 1 to 65535"
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
        if self.registry:
            split_registry(self.registry)
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
    name, at, after = rest.rpartition("@")
    if at and "/" not in after:  # '@' before a '/' is no digest: it is in the host, and refused there
        rest, digest = name, after
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
