"""The two manifests as the transfer tool reads and writes them.

Their format (fields, ``kind``, ``format_version``, reading and writing) is the contract's:
:class:`kubetrain_contract.manifests.DatasetManifest` and
:class:`kubetrain_contract.manifests.SyncPassRecord`, whose JSON Schemas are generated into
``kubetrain_contract/schemas/``; where a pass manifest lives is
:func:`kubetrain_contract.run_layout.pass_key`. This module reads either kind with a
:class:`SyncError` that names the document, as the rest of the tool reports its errors. A reader
refuses a ``kind`` or ``format_version`` it does not know, naming it, instead of guessing at a
newer layout.
"""

from __future__ import annotations

from kubetrain_contract.manifests import (
    AREAS,
    DatasetManifest,
    DatasetObject,
    SyncPassError,
    SyncPassFile,
    SyncPassRecord,
    dataset_version,
)
from kubetrain_contract.records import RecordError
from trainer.sync.errors import SyncError

#: the names the tool's modules use for the pass records
PassManifest = SyncPassRecord
PassFile = SyncPassFile

__all__ = [
    "AREAS",
    "DatasetManifest",
    "DatasetObject",
    "PassFile",
    "PassManifest",
    "SyncPassError",
    "dataset_version",
    "read_dataset_manifest",
    "read_pass",
]


def read_dataset_manifest(data: bytes, where: str) -> DatasetManifest:
    """Check and load a dataset manifest; ``where`` (its URI) names it in errors.

    Raises:
        SyncError: not JSON, a wrong kind or version, a missing field, an unsafe path, a
            duplicated path, or a version or total that does not match the objects.
    """
    try:
        return DatasetManifest.from_json(data, where)
    except RecordError as exc:
        raise SyncError(str(exc)) from exc


def read_pass(data: bytes, where: str) -> SyncPassRecord:
    """Check and load a pass manifest; ``where`` (its URI) names it in errors.

    Raises:
        SyncError: not JSON, a wrong kind or version, a missing field, an unknown area, an
            unsafe path or a malformed sha256.
    """
    try:
        return SyncPassRecord.from_json(data, where)
    except RecordError as exc:
        raise SyncError(str(exc)) from exc
