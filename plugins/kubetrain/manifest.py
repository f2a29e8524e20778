"""Dataset snapshot manifests (format version 1), written when a dataset is staged.

A manifest pins a dataset to the exact objects (key, size, ETag) that were in S3 when it was
staged; the stage-in init container downloads exactly those. The version is derived from the
objects alone, so staging an unchanged dataset yields the same version and the same key.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import check_name, parse_s3_uri, s3_uri, utc_stamp

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore

KIND = "kubetrain/dataset-manifest"
FORMAT_VERSION = 1
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip", ".tar")


class DatasetNotFoundError(FileNotFoundError):
    """Nothing to stage at a dataset URI."""


@dataclass(frozen=True)
class ManifestObject:
    """One object of a dataset snapshot."""

    bucket: str
    key: str
    path: str
    size: int
    etag: str

    def __post_init__(self) -> None:
        parts = self.path.split("/")
        if not self.path or self.path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(
                f"object s3://{self.bucket}/{self.key} maps to path {self.path!r}, which is not a plain "
                "relative path inside the data directory; rename the object"
            )
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(
                f"object s3://{self.bucket}/{self.key} has size {self.size!r}: expected an integer >= 0"
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "key": self.key,
            "path": self.path,
            "size": self.size,
            "etag": self.etag,
        }


def dataset_version(objects: Iterable[ManifestObject]) -> str:
    """The version of a snapshot: 16 hex digits of SHA-256 over its sorted object lines."""
    lines = sorted(f"{o.bucket}/{o.key}\t{o.size}\t{o.etag}" for o in objects)
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]


def dataset_name_from_uri(uri: str) -> str:
    """Derive a dataset name from its URI: the last prefix segment or the archive's base name.

    ``s3://datasets/digits/`` and ``s3://datasets/archives/digits.zip`` both give ``digits``.
    """
    _, key = parse_s3_uri(uri)
    name = posixpath.basename(key.rstrip("/"))
    for suffix in ARCHIVE_SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    name = name.lower().replace(" ", "-")
    try:
        return check_name("dataset", name)
    except ValueError as exc:
        raise ValueError(
            f"cannot derive a dataset name from {uri!r} ({exc}); pass dataset= explicitly"
        ) from exc


def quoted_etag(etag: str) -> str:
    """An ETag in the quoted form S3 returns (``"<hex>"``); some servers list it unquoted."""
    return f'"{str(etag).strip(chr(34))}"'


def list_source_objects(store: RunStore, uri: str) -> tuple[str, list[ManifestObject]]:
    """Resolve a dataset URI to its objects.

    ``s3://bucket/prefix/`` lists every object below the prefix (paths relative to it);
    ``s3://bucket/key`` is that single object when it exists (path: its base name), else the
    prefix ``key/``.

    :param store: the S3 store (:class:`kubetrain.run_store.RunStore`).
    :param uri: the dataset URI.
    :return: the normalised source URI and the objects sorted by path.
    :raises DatasetNotFoundError: when nothing is there, naming the URI.
    """
    bucket, key = parse_s3_uri(uri)
    if key and not key.endswith("/"):
        head = store.head(bucket, key)
        if head is not None:
            obj = ManifestObject(
                bucket, key, posixpath.basename(key), int(head["ContentLength"]), quoted_etag(head["ETag"])
            )
            return s3_uri(bucket, key), [obj]
        key += "/"
    objects = []
    for item in store.list(bucket, key):
        if item["Key"].endswith("/"):
            continue  # "folder" placeholder objects made by consoles carry no data
        objects.append(
            ManifestObject(
                bucket, item["Key"], item["Key"][len(key) :], int(item["Size"]), quoted_etag(item["ETag"])
            )
        )
    if not objects:
        raise DatasetNotFoundError(
            f"nothing to stage at {uri}: no object with that key and no objects under s3://{bucket}/{key}"
        )
    paths = [o.path for o in objects]
    clashes = sorted({p for p in paths if any(q.startswith(p + "/") for q in paths)})
    if clashes:
        raise ValueError(
            f"dataset {uri} has objects that are both a file and a directory: {', '.join(clashes[:5])}"
        )
    return s3_uri(bucket, key), sorted(objects, key=lambda o: o.path)


def build_manifest(
    dataset: str, source: str, objects: list[ManifestObject], created_at: datetime | None = None
) -> dict[str, Any]:
    """Return the manifest document of a snapshot.

    :param dataset: dataset name.
    :param source: normalised source URI.
    :param objects: the snapshot's objects.
    :param created_at: staging time (default now).
    """
    if not objects:
        raise ValueError(f"dataset {dataset!r} at {source} has no objects: a manifest needs at least one")
    objects = sorted(objects, key=lambda o: o.path)
    return {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "dataset": check_name("dataset", dataset),
        "source": source,
        "version": dataset_version(objects),
        "created_at": utc_stamp(created_at),
        "total_bytes": sum(o.size for o in objects),
        "objects": [o.as_dict() for o in objects],
    }


def dumps(manifest: dict[str, Any]) -> bytes:
    """Serialise a manifest the way it is stored."""
    return (json.dumps(manifest, indent=2) + "\n").encode("utf-8")


def check_manifest(manifest: Any) -> dict[str, Any]:
    """Return ``manifest`` when it is a dataset manifest this code can read, else raise ``ValueError``."""
    if not isinstance(manifest, dict):
        raise ValueError(f"dataset manifest must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("kind") != KIND:
        raise ValueError(f"unknown manifest kind {manifest.get('kind')!r}: expected {KIND!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"unknown dataset manifest format_version {manifest.get('format_version')!r}: this version reads {FORMAT_VERSION}"
        )
    for field in ("dataset", "source", "version", "created_at", "total_bytes", "objects"):
        if field not in manifest:
            raise ValueError(f"dataset manifest lacks the field {field!r}")
    return manifest
