"""The two manifest formats the transfer tool reads and writes (format version 1 each).

Both are documented in ``trainer/sync/README.md`` and described as JSON Schemas in
``trainer/sync/schemas/``. A reader refuses a ``kind`` or ``format_version`` it does not
know, naming it, instead of guessing at a newer layout.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from trainer.sync.s3 import SyncError

DATASET_KIND = "kubetrain/dataset-manifest"
PASS_KIND = "kubetrain/sync-pass"
FORMAT_VERSION = 1
AREAS = ("checkpoints", "output")
PASS_NAME = re.compile(r"pass-(\d{8})\.json$")


def pass_key(run_key: str, number: int) -> str:
    """Key of pass manifest ``number`` below a run prefix."""
    return f"{run_key.rstrip('/')}/sync/pass-{number:08d}.json"


def check_relative_path(path: str, what: str) -> str:
    """Return ``path`` if it is a plain relative POSIX path that stays inside its directory.

    Raises:
        SyncError: ``path`` is empty, absolute, or has ``..``/empty components.
    """
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise SyncError(f"{what} {path!r} is not a safe relative path: expected a/b/c without '..' or '/'")
    return path


def dataset_version(objects: list[DatasetObject]) -> str:
    """The version string of a set of objects: 16 hex chars of a sha256 over their identities."""
    lines = sorted(f"{o.bucket}/{o.key}\t{o.size}\t{o.etag}" for o in objects)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _require(doc: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise SyncError(f"{where}: field {name!r} is {value!r}, expected {expected}")
    return value


def _check_header(doc: Any, kind: str, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise SyncError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("kind") != kind:
        raise SyncError(f"{where}: unknown kind {doc.get('kind')!r}, expected {kind!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise SyncError(
            f"{where}: unknown format_version {doc.get('format_version')!r} of {kind}; "
            f"this tool reads format_version {FORMAT_VERSION}"
        )
    return doc


def loads(data: bytes, where: str) -> Any:
    """Parse JSON, naming ``where`` in the error."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SyncError(f"{where}: not valid JSON ({exc})") from exc


@dataclass(frozen=True)
class DatasetObject:
    """One object of a staged dataset snapshot."""

    bucket: str
    key: str
    path: str
    size: int
    etag: str


@dataclass(frozen=True)
class DatasetManifest:
    """A staged dataset snapshot (``kubetrain/dataset-manifest``, format version 1)."""

    dataset: str
    source: str
    version: str
    created_at: str
    total_bytes: int
    objects: list[DatasetObject]

    @classmethod
    def from_json(cls, doc: Any, where: str) -> DatasetManifest:
        """Check and load a parsed manifest; ``where`` (its URI) names it in errors.

        Raises:
            SyncError: a wrong kind or version, a missing field, an unsafe path, a
                duplicated path, or a version or total that does not match the objects.
        """
        doc = _check_header(doc, DATASET_KIND, where)
        objects = []
        seen: set[str] = set()
        for i, item in enumerate(_require(doc, "objects", list, where)):
            here = f"{where}: objects[{i}]"
            if not isinstance(item, dict):
                raise SyncError(f"{here}: expected an object, got {item!r}")
            obj = DatasetObject(
                bucket=_require(item, "bucket", str, here),
                key=_require(item, "key", str, here),
                path=check_relative_path(_require(item, "path", str, here), f"{here}: path"),
                size=_require(item, "size", int, here),
                etag=_require(item, "etag", str, here),
            )
            if obj.size < 0:
                raise SyncError(f"{here}: size {obj.size} is negative")
            if obj.path in seen:
                raise SyncError(f"{here}: path {obj.path!r} appears twice")
            seen.add(obj.path)
            objects.append(obj)
        manifest = cls(
            dataset=_require(doc, "dataset", str, where),
            source=_require(doc, "source", str, where),
            version=_require(doc, "version", str, where),
            created_at=_require(doc, "created_at", str, where),
            total_bytes=_require(doc, "total_bytes", int, where),
            objects=objects,
        )
        expected = dataset_version(objects)
        if manifest.version != expected:
            raise SyncError(
                f"{where}: version {manifest.version!r} does not match its objects "
                f"(they hash to {expected!r}); the manifest was edited or written by a different rule"
            )
        if manifest.total_bytes != sum(o.size for o in objects):
            raise SyncError(
                f"{where}: total_bytes {manifest.total_bytes} differs from the sum of object sizes "
                f"{sum(o.size for o in objects)}"
            )
        return manifest

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict."""
        return {
            "kind": DATASET_KIND,
            "format_version": FORMAT_VERSION,
            "dataset": self.dataset,
            "source": self.source,
            "version": self.version,
            "created_at": self.created_at,
            "total_bytes": self.total_bytes,
            "objects": [
                {"bucket": o.bucket, "key": o.key, "path": o.path, "size": o.size, "etag": o.etag}
                for o in self.objects
            ],
        }


@dataclass(frozen=True)
class PassFile:
    """One file committed by a sync pass."""

    area: str
    path: str
    key: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area,
            "path": self.path,
            "key": self.key,
            "size": self.size,
            "sha256": self.sha256,
        }


@dataclass
class PassManifest:
    """A checkpoint-sync pass (``kubetrain/sync-pass``, format version 1)."""

    number: int
    final: bool
    complete: bool
    started_at: str
    finished_at: str
    pod: str
    files: list[PassFile] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    timed_out: bool = False  # the final pass ran out of its grace period (then complete is false)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> PassManifest:
        """Check and load a parsed pass manifest.

        Raises:
            SyncError: a wrong kind or version, a missing field or an unsafe path.
        """
        doc = _check_header(doc, PASS_KIND, where)
        files = []
        for i, item in enumerate(_require(doc, "files", list, where)):
            here = f"{where}: files[{i}]"
            if not isinstance(item, dict):
                raise SyncError(f"{here}: expected an object, got {item!r}")
            area = _require(item, "area", str, here)
            if area not in AREAS:
                raise SyncError(f"{here}: area {area!r} is not one of {', '.join(AREAS)}")
            sha = _require(item, "sha256", str, here)
            if not re.fullmatch(r"[0-9a-f]{64}", sha):
                raise SyncError(f"{here}: sha256 {sha!r} is not 64 lowercase hex digits")
            files.append(
                PassFile(
                    area=area,
                    path=check_relative_path(_require(item, "path", str, here), f"{here}: path"),
                    key=_require(item, "key", str, here),
                    size=_require(item, "size", int, here),
                    sha256=sha,
                )
            )
        errors = _require(doc, "errors", list, where)
        return cls(
            number=_require(doc, "pass", int, where),
            final=_require(doc, "final", bool, where),
            complete=_require(doc, "complete", bool, where),
            started_at=_require(doc, "started_at", str, where),
            finished_at=_require(doc, "finished_at", str, where),
            pod=_require(doc, "pod", str, where),
            files=files,
            errors=[e for e in errors if isinstance(e, dict)],
            timed_out=_require(doc, "timed_out", bool, where) if "timed_out" in doc else False,
        )

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict."""
        return {
            "kind": PASS_KIND,
            "format_version": FORMAT_VERSION,
            "pass": self.number,
            "final": self.final,
            "complete": self.complete,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "pod": self.pod,
            "files": [f.to_json() for f in self.files],
            "errors": list(self.errors),
            "timed_out": self.timed_out,
        }
