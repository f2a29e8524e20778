"""The image map: which local runtime runs a container image (include/devstack/images.json)."""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFAULT_IMAGE_MAP = REPO / "include" / "devstack" / "images.json"
SYSTEM_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]


class ImageMapError(ValueError):
    """The image map file is missing or malformed."""


@dataclass(frozen=True)
class Runtime:
    """What a mapped image runs with."""

    image: str
    runtime: str
    path: tuple[str, ...]
    env: dict[str, str]
    working_dir: str
    command: tuple[str, ...]  # the image's ENTRYPOINT
    args: tuple[str, ...]  # its CMD
    user: str = "0"  # its USER ("uid[:gid]" or a name); root when the map gives none

    @property
    def image_id(self) -> str:
        return f"kubetrain-local://{self.runtime}"


def short_form(image: str) -> str:
    """``docker.io/library/alpine:3`` -> ``alpine:3`` (the familiar name Docker shows)."""
    out = image
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if out.startswith(prefix):
            out = out[len(prefix) :]
            break
    if out.startswith("library/"):
        out = out[len("library/") :]
    return out


class ImageMap:
    """Loaded from a JSON file on every lookup, so an edited map applies to the next pull retry."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise ImageMapError(f"image map {self.path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ImageMapError(f"image map {self.path} is not valid JSON: {exc}") from None
        if not isinstance(data.get("runtimes"), dict) or not isinstance(data.get("images"), list):
            raise ImageMapError(f'image map {self.path} needs a "runtimes" object and an "images" list')
        for i, entry in enumerate(data["images"]):
            if (
                not isinstance(entry, dict)
                or "pattern" not in entry
                or entry.get("runtime") not in data["runtimes"]
            ):
                raise ImageMapError(
                    f'image map {self.path}: images[{i}] must have a "pattern" and a "runtime" that is one of '
                    f"{sorted(data['runtimes'])}, got {entry!r}"
                )
        return data

    def resolve(self, image: str) -> Runtime | None:
        data = self.load()
        candidates = [image, short_form(image)]
        for entry in data["images"]:
            if any(fnmatch.fnmatchcase(c, entry["pattern"]) for c in candidates):
                rt = data["runtimes"][entry["runtime"]]
                repo = str(REPO)

                def sub(value: str, repo: str = repo) -> str:
                    return value.replace("{repo}", repo)

                path = tuple(sub(p) for p in rt.get("path", [])) + tuple(SYSTEM_PATH)
                env = {k: sub(v) for k, v in {**rt.get("env", {}), **entry.get("env", {})}.items()}
                return Runtime(
                    image=image,
                    runtime=entry["runtime"],
                    path=path,
                    env=env,
                    working_dir=sub(entry.get("workingDir", rt.get("workingDir", "/"))),
                    command=tuple(entry.get("command", rt.get("command", []))),
                    args=tuple(entry.get("args", rt.get("args", []))),
                    user=str(entry.get("user", rt.get("user", "0"))),
                )
        return None


def default_image_map() -> Path:
    return Path(os.environ.get("KUBETRAIN_IMAGE_MAP", DEFAULT_IMAGE_MAP))
