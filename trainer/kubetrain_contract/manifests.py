"""The two manifests: the dataset manifest (a staged snapshot) and the sync-pass manifest.

* :class:`DatasetManifest` (``kubetrain/dataset-manifest``): written by the Airflow side when a
  dataset is staged, at ``s3://<training bucket>/manifests/<dataset>/<version>.json``; the
  stage-in init container (``python -m trainer.sync stage-in``) downloads exactly its objects.
* :class:`SyncPassRecord` (``kubetrain/sync-pass``): written by the checkpoint-sync sidecar at
  ``<run>/sync/pass-<8-digit pass>.json`` strictly after every file it lists is uploaded; the
  restore, the run's record and the promote step read the newest one.

Reading a manifest checks more than its field types: the rules below (:func:`dataset_version`,
:func:`is_safe_relative_path`) are part of the format, so both sides refuse the same documents.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kubetrain_contract.records import Record, RecordError, spec

#: the areas of a run that the sidecar syncs, as they appear in a pass manifest and under the run's key
AREAS = ("checkpoints", "output")
Area = Literal["checkpoints", "output"]

#: JSON Schema pattern of :func:`is_safe_relative_path`
SAFE_PATH_PATTERN = r"^(?!/)(?!.*(^|/)\.\.?(/|$))(?!.*//)[^\\]+$"
SAFE_PATH_RULE = "expected a/b/c without '..' or '/'"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_safe_relative_path(path: str) -> bool:
    """Whether ``path`` is a plain relative POSIX path that stays inside its directory.

    Refused: the empty path, a leading ``/``, a backslash, and ``.``, ``..`` or empty components.

    :param path: the path, as a manifest lists it.
    """
    parts = path.split("/")
    return (
        bool(path)
        and not path.startswith("/")
        and "\\" not in path
        and not any(p in ("", ".", "..") for p in parts)
    )


def unsafe_path_message(what: str, path: str) -> str:
    """The sentence that refuses an unsafe ``path``; ``what`` names where it was found.

    :param what: what holds the path, as ``objects[3]: path``.
    :param path: the refused path.
    """
    return f"{what} {path!r} is not a safe relative path: {SAFE_PATH_RULE}"


@dataclass(frozen=True)
class DatasetObject:
    """One object of a staged dataset snapshot."""

    bucket: str = spec(minLength=1, description="The bucket the object was staged from.")
    key: str = spec(minLength=1, description="The object's key in that bucket.")
    path: str = spec(
        pattern=SAFE_PATH_PATTERN,
        description="Relative POSIX path below DATA_DIR: no leading '/', no '.', '..' or empty components.",
    )
    size: int = spec(minimum=0, description="The object's size in bytes.")
    etag: str = spec(minLength=1, description="The ETag as S3 returns it, quotes included.")


def dataset_version(objects: Iterable[DatasetObject]) -> str:
    """The version of a snapshot: 16 hex digits of SHA-256 over its sorted object lines.

    An object's line is ``<bucket>/<key>\\t<size>\\t<etag>``; the lines are joined by newlines
    and encoded in UTF-8. The same objects give the same version, whatever their order.

    :param objects: the snapshot's objects.
    """
    lines = sorted(f"{o.bucket}/{o.key}\t{o.size}\t{o.etag}" for o in objects)
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class DatasetManifest(Record):
    """A staged dataset snapshot: written by the Airflow side at
    s3://<training bucket>/manifests/<dataset>/<version>.json, read by `python -m trainer.sync stage-in`."""

    KIND = "kubetrain/dataset-manifest"
    SCHEMA_NAME = "dataset-manifest"
    TITLE = "kubetrain dataset manifest, format version 1"

    dataset: str = spec(minLength=1, description="The dataset's name.")
    source: str = spec(pattern="^s3://[^/]+/", description="The URI the dataset was staged from.")
    version: str = spec(
        pattern="^[0-9a-f]{16}$",
        description='First 16 hex chars of sha256 over "\\n".join(sorted(f"{bucket}/{key}\\t{size}\\t{etag}")) '
        "in UTF-8.",
    )
    created_at: str = spec(format="date-time", description="When the snapshot was staged.")
    total_bytes: int = spec(minimum=0, description="Sum of the objects' sizes.")
    objects: list[DatasetObject] = spec(description="The snapshot's objects; each path appears once.")

    @classmethod
    def of(
        cls, dataset: str, source: str, objects: Iterable[DatasetObject], created_at: str
    ) -> DatasetManifest:
        """The manifest of ``objects``, sorted by path, with their version and total size.

        :param dataset: the dataset's name.
        :param source: the URI it is staged from.
        :param objects: its objects.
        :param created_at: the staging time, as ``2026-01-02T03:04:05Z``.
        """
        ordered = sorted(objects, key=lambda o: o.path)
        return cls(
            dataset=dataset,
            source=source,
            version=dataset_version(ordered),
            created_at=created_at,
            total_bytes=sum(o.size for o in ordered),
            objects=ordered,
        )

    @classmethod
    def from_dict(cls, doc: Any, where: str | None = None) -> DatasetManifest:
        """The manifest ``doc`` holds, checked: safe and distinct paths, and a version and total that
        match the objects; :class:`RecordError` names what is wrong."""
        where = where or cls.KIND
        manifest = super().from_dict(doc, where)
        seen: set[str] = set()
        for i, obj in enumerate(manifest.objects):
            here = f"{where}: objects[{i}]"
            if not is_safe_relative_path(obj.path):
                raise RecordError(unsafe_path_message(f"{here}: path", obj.path))
            if obj.path in seen:
                raise RecordError(f"{here}: path {obj.path!r} appears twice")
            seen.add(obj.path)
        expected = dataset_version(manifest.objects)
        if manifest.version != expected:
            raise RecordError(
                f"{where}: version {manifest.version!r} does not match its objects "
                f"(they hash to {expected!r}); the manifest was edited or written by a different rule"
            )
        total = sum(o.size for o in manifest.objects)
        if manifest.total_bytes != total:
            raise RecordError(
                f"{where}: total_bytes {manifest.total_bytes} differs from the sum of object sizes {total}"
            )
        return manifest


@dataclass(frozen=True)
class SyncPassFile:
    """One file a sync pass lists."""

    area: Area = spec(description="The run's area the file belongs to.")
    path: str = spec(pattern=SAFE_PATH_PATTERN, description="The file's path below its area's directory.")
    key: str = spec(minLength=1, description="Full S3 key: <run key>/<area>/<path>.")
    size: int = spec(minimum=0, description="The file's size in bytes.")
    sha256: str = spec(pattern="^[0-9a-f]{64}$", description="SHA-256 of the file's bytes, lowercase hex.")


@dataclass(frozen=True)
class SyncPassError:
    """A file a sync pass could not upload."""

    area: Area = spec(description="The run's area the file belongs to.")
    path: str = spec(description="The file's path below its area's directory.")
    error: str = spec(description="Why it was not uploaded.")


@dataclass(frozen=True)
class SyncPassRecord(Record):
    """Written by `python -m trainer.sync checkpoint-sync` at <run>/sync/pass-<8-digit pass>.json strictly
    after every file it lists is uploaded. Readers trust the newest manifest and verify size and sha256."""

    KIND = "kubetrain/sync-pass"
    SCHEMA_NAME = "sync-pass"
    TITLE = "kubetrain checkpoint-sync pass manifest, format version 1"

    number: int = spec(
        json_name="pass",
        minimum=1,
        description="Equals the number in the object's name; continues across pods of a run.",
    )
    final: bool = spec(description="True for the pass run on SIGTERM.")
    complete: bool = spec(description="False when any file could not be uploaded; errors says which.")
    started_at: str = spec(format="date-time", description="When the pass began.")
    finished_at: str = spec(format="date-time", description="When the pass finished its uploads.")
    pod: str = spec(description="The pod whose sidecar ran the pass.")
    files: list[SyncPassFile] = spec(
        description="The whole current set of files, not only those uploaded by this pass."
    )
    errors: list[SyncPassError] = spec(description="The files this pass could not upload.")
    timed_out: bool = spec(
        False,
        description="True when the final pass ran out of its grace period before every file was uploaded "
        "(complete is then false). Optional: absent means false.",
    )

    @classmethod
    def from_dict(cls, doc: Any, where: str | None = None) -> SyncPassRecord:
        """The pass ``doc`` holds, checked: safe paths and SHA-256 digests of 64 lowercase hex digits;
        :class:`RecordError` names what is wrong."""
        where = where or cls.KIND
        record = super().from_dict(doc, where)
        for i, f in enumerate(record.files):
            here = f"{where}: files[{i}]"
            if not is_safe_relative_path(f.path):
                raise RecordError(unsafe_path_message(f"{here}: path", f.path))
            if not SHA256_HEX.fullmatch(f.sha256):
                raise RecordError(f"{here}: sha256 {f.sha256!r} is not 64 lowercase hex digits")
        return record
