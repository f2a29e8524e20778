"""Dataset snapshot manifests, written when a dataset is staged.

A manifest pins a dataset to the exact objects (key, size, ETag) that were in S3 when it was
staged; the stage-in init container downloads exactly those. The version is derived from the
objects alone, so staging an unchanged dataset yields the same version and the same key.

The format (fields, kind, version rule, reading and writing) is the contract's
:class:`kubetrain_contract.manifests.DatasetManifest`, which the stage-in tool reads too; this
module finds a dataset's objects in S3 and builds, checks and serialises the manifest through it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import check_name, s3_uri, utc_stamp
from kubetrain_contract.manifests import (
    DatasetManifest,
    DatasetObject,
    dataset_version,
    is_safe_relative_path,
)
from kubetrain_contract.s3uri import parse_s3_uri

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore

__all__ = [
    "DatasetManifest",
    "DatasetNotFoundError",
    "ManifestObject",
    "build_manifest",
    "check_manifest",
    "dataset_name_from_uri",
    "dataset_version",
    "dumps",
    "list_source_objects",
]

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip", ".tar")


class DatasetNotFoundError(FileNotFoundError):
    """Nothing to stage at a dataset URI."""


@dataclass(frozen=True)
class ManifestObject(DatasetObject):
    """One object of a dataset snapshot, as found in S3: refused when its path is not safe to stage."""

    def __post_init__(self) -> None:
        if not is_safe_relative_path(self.path):
            raise ValueError(
                f"object s3://{self.bucket}/{self.key} maps to path {self.path!r}, which is not a plain "
                "relative path inside the data directory; rename the object"
            )
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(
                f"object s3://{self.bucket}/{self.key} has size {self.size!r}: expected an integer >= 0"
            )


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
    """Return the manifest document of a snapshot (objects sorted by path, with their version).

    :param dataset: dataset name.
    :param source: normalised source URI.
    :param objects: the snapshot's objects.
    :param created_at: staging time (default now).
    :raises ValueError: no objects, or a dataset name that is not allowed.
    """
    if not objects:
        raise ValueError(f"dataset {dataset!r} at {source} has no objects: a manifest needs at least one")
    manifest = DatasetManifest.of(check_name("dataset", dataset), source, objects, utc_stamp(created_at))
    return manifest.to_dict()


def dumps(manifest: dict[str, Any]) -> bytes:
    """Serialise a manifest the way it is stored, after checking it.

    :param manifest: the manifest document, as :func:`build_manifest` returns it.
    :raises kubetrain_contract.RecordError: (a ``ValueError``) the document is not a valid manifest.
    """
    return (DatasetManifest.from_dict(manifest, "dataset manifest").to_json() + "\n").encode("utf-8")


def check_manifest(manifest: Any) -> dict[str, Any]:
    """Return ``manifest`` when it is a dataset manifest this code can read, else raise ``ValueError``.

    :param manifest: the parsed document.
    :raises kubetrain_contract.RecordError: (a ``ValueError``) naming the bad field or rule: an
        unknown kind or format version, a missing or mistyped field, an unsafe or repeated path,
        or a version or total that does not match the objects.
    """
    DatasetManifest.from_dict(manifest, "dataset manifest")
    return manifest
