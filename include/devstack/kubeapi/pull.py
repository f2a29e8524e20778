"""Image pulls from the dev stack's own registry, checked as a kubelet's container runtime checks them.

An image whose registry is the stack's (``--registry 127.0.0.1:PORT``) must be in it: its manifest
is resolved with ``HEAD /v2/<repo>/manifests/<tag or digest>`` and the media types a kubelet's
runtime accepts, and a missing one fails with containerd's words (``...: not found``), whatever
the image map says. A present one gives its digest (the container's ``imageID``) and, when asked,
the ``User`` of its image config (for runAsNonRoot). Images of other registries are not looked up:
no image is pulled from the internet, they run through the image map.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass

import aiohttp

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[:2]
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


class PullError(Exception):
    """The image cannot be pulled; the message is the runtime's, as the kubelet reports it."""


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @property
    def ref(self) -> str:
        return self.digest or self.tag or "latest"


@dataclass(frozen=True)
class Pulled:
    image_id: str  # registry/repository@sha256:...
    user: str | None  # the image config's User ("" is root); None when not read


def parse(image: str) -> Reference:
    """Split an image reference as the distribution reference grammar does (docker.io for a bare name)."""
    rest, _, digest = image.partition("@")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
    else:
        registry, path = "docker.io", rest
    name, tag = path, None
    if ":" in path.rsplit("/", 1)[-1]:
        name, _, tag = path.rpartition(":")
    return Reference(registry, name, tag or (None if digest else "latest"), digest or None)


def same_registry(a: str, b: str) -> bool:
    def norm(host: str) -> str:
        return host.replace("localhost:", "127.0.0.1:", 1) if host.startswith("localhost:") else host

    return norm(a) == norm(b)


async def pull(registry: str, image: str, *, want_user: bool) -> Pulled | None:
    """Resolve ``image`` in the stack's ``registry``; None when the image lives elsewhere."""
    ref = parse(image)
    if not same_registry(ref.registry, registry):
        return None
    base = f"http://{registry}/v2/{ref.repository}"
    url = f"{base}/manifests/{ref.ref}"
    prefix = f'failed to pull and unpack image "{image}": failed to resolve reference "{image}"'
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            accept = {"Accept": ", ".join(MANIFEST_TYPES)}
            async with session.head(url, headers=accept) as resp:
                if resp.status == 404:
                    raise PullError(f"rpc error: code = NotFound desc = {prefix}: {image}: not found")
                if resp.status in (401, 403):
                    raise PullError(f"rpc error: code = Unknown desc = {prefix}: pull access denied, repository does "
                                    "not exist or may require authorization: authorization failed")  # fmt: skip
                if resp.status != 200:
                    raise PullError(f"rpc error: code = Unknown desc = {prefix}: unexpected status from HEAD request "
                                    f"to {url}: {resp.status} {resp.reason}")  # fmt: skip
                digest = resp.headers.get("Docker-Content-Digest", "")
            user = await _config_user(session, base, ref.ref, accept) if want_user else None
    except aiohttp.ClientError as exc:
        raise PullError(f"rpc error: code = Unknown desc = {prefix}: failed to do request: Head \"{url}\": {exc}") from None
    image_id = f"{ref.registry}/{ref.repository}@{digest}" if digest else image
    return Pulled(image_id, user)


async def _config_user(session: aiohttp.ClientSession, base: str, ref: str, accept: dict) -> str:
    async with session.get(f"{base}/manifests/{ref}", headers=accept) as resp:
        resp.raise_for_status()
        manifest = json.loads(await resp.read())
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        entries = manifest.get("manifests") or []
        chosen = next((m for m in entries if (m.get("platform") or {}).get("architecture") == ARCH
                       and (m.get("platform") or {}).get("os", "linux") == "linux"), None)  # fmt: skip
        if chosen is None:
            raise aiohttp.ClientError(f"no manifest for linux/{ARCH} in the image index")
        async with session.get(f"{base}/manifests/{chosen['digest']}", headers=accept) as resp:
            resp.raise_for_status()
            manifest = json.loads(await resp.read())
    async with session.get(f"{base}/blobs/{manifest['config']['digest']}") as resp:
        resp.raise_for_status()
        config = json.loads(await resp.read())
    return str((config.get("config") or {}).get("User") or "")


def non_root_problem(pod: dict, container: dict, image_user: str) -> str | None:
    """The kubelet's runAsNonRoot verification (verifyRunAsNonRoot); None when the container may start."""
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = container.get("securityContext") or {}
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if not non_root:
        return None
    meta = pod["metadata"]
    who = f'(pod: "{meta["name"]}_{meta["namespace"]}({meta.get("uid", "")})", container: {container["name"]})'
    run_as = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if run_as is not None:
        return f"container's runAsUser breaks non-root policy {who}" if int(run_as) == 0 else None
    user = image_user.split(":", 1)[0]
    if user == "":
        user = "0"
    if not user.isdigit():
        return f"container has runAsNonRoot and image has non-numeric user ({user}), cannot verify user is non-root {who}"
    if int(user) == 0:
        return f"container has runAsNonRoot and image will run as root {who}"
    return None
