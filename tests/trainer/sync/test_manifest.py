"""The transfer tool's manifest readers: documents the older code wrote still read; bad ones are refused.

The format is the contract's (kubetrain_contract.manifests); the tool reads it with a SyncError
that names the document, the field or rule, and the bad value.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubetrain_contract.manifests import DatasetManifest, DatasetObject, SyncPassFile, SyncPassRecord
from trainer.sync.errors import SyncError
from trainer.sync.manifest import read_dataset_manifest, read_pass

WHERE = "s3://training/runs/d/r/sync/pass-00000003.json"
SHA = "ab" * 32


def old_pass() -> dict[str, Any]:
    """A pass manifest as the sidecar wrote it before the contract (no timed_out field yet)."""
    return {
        "kind": "kubetrain/sync-pass",
        "format_version": 1,
        "pass": 3,
        "final": True,
        "complete": False,
        "started_at": "2026-11-22T04:10:00.000000Z",
        "finished_at": "2026-11-22T04:10:01.500000Z",
        "pod": "train-0",
        "files": [
            {
                "area": "checkpoints",
                "path": "ckpt-3.index",
                "key": "runs/d/r/checkpoints/ckpt-3.index",
                "size": 12,
                "sha256": SHA,
            }
        ],
        "errors": [{"area": "output", "path": "model.keras", "error": "boom"}],
    }


def dataset_doc() -> dict[str, Any]:
    objects = [
        DatasetObject("datasets", "digits/b.csv", "b.csv", 3, '"e1"'),
        DatasetObject("datasets", "digits/a/x.png", "a/x.png", 5, '"e2"'),
    ]
    return DatasetManifest.of("digits", "s3://datasets/digits/", objects, "2026-11-22T04:00:00Z").to_dict()


def test_a_pass_written_before_timed_out_existed_reads_with_its_fields() -> None:
    record = read_pass(json.dumps(old_pass()).encode(), WHERE)
    assert (record.number, record.final, record.complete, record.timed_out) == (3, True, False, False)
    assert record.files == [
        SyncPassFile("checkpoints", "ckpt-3.index", "runs/d/r/checkpoints/ckpt-3.index", 12, SHA)
    ]
    assert [(e.area, e.path, e.error) for e in record.errors] == [("output", "model.keras", "boom")]


def test_a_pass_is_written_with_the_same_fields_in_the_same_order() -> None:
    record = read_pass(json.dumps(old_pass()).encode(), WHERE)
    assert list(json.loads(record.to_json())) == [*old_pass(), "timed_out"]
    assert read_pass(record.to_json(indent=1).encode(), WHERE) == record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(kind="someone/else"), "unknown kind 'someone/else'"),
        (lambda d: d.update(format_version=2), "unknown format_version 2"),
        (lambda d: d.pop("pod"), "field 'pod' is missing, expected a string"),
        (lambda d: d.update({"pass": 0}), "field 'pass' is 0, expected at least 1"),
        (lambda d: d["files"][0].update(area="logs"), "field 'files[0].area' is 'logs', expected one of"),
        (lambda d: d["files"][0].update(path="../x"), "files[0]: path '../x' is not a safe relative path"),
        (lambda d: d["files"][0].update(sha256="AB" * 32), "is not 64 lowercase hex digits"),
        (lambda d: d["files"][0].update(size=-1), "field 'files[0].size' is -1, expected at least 0"),
    ],
    ids=["kind", "format-version", "missing", "pass", "area", "unsafe-path", "sha256", "size"],
)
def test_a_bad_pass_is_a_sync_error_naming_the_document(change, message) -> None:
    doc = old_pass()
    change(doc)
    with pytest.raises(SyncError) as caught:
        read_pass(json.dumps(doc).encode(), WHERE)
    assert str(caught.value).startswith(f"{WHERE}: ") and message in str(caught.value)


def test_a_torn_pass_is_a_sync_error() -> None:
    with pytest.raises(SyncError, match="not valid JSON"):
        read_pass(b'{"kind": "kubetrain/sy', WHERE)


def test_a_dataset_manifest_reads_back_sorted_by_path() -> None:
    doc = dataset_doc()
    manifest = read_dataset_manifest(json.dumps(doc).encode(), "s3://training/manifests/digits/v.json")
    assert [o.path for o in manifest.objects] == ["a/x.png", "b.csv"]
    assert manifest.total_bytes == 8 and manifest.to_dict() == doc


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["objects"][0].update(path="a//x.png"),
            "objects[0]: path 'a//x.png' is not a safe relative path",
        ),
        (lambda d: d["objects"][1].update(path="a/x.png"), "objects[1]: path 'a/x.png' appears twice"),
        (lambda d: d.update(total_bytes=9), "total_bytes 9 differs from the sum of object sizes 8"),
        (lambda d: d["objects"][0].update(etag='"other"'), "does not match its objects"),
    ],
    ids=["unsafe-path", "duplicate", "total", "version"],
)
def test_a_bad_dataset_manifest_is_a_sync_error(change, message) -> None:
    doc = dataset_doc()
    change(doc)
    with pytest.raises(SyncError) as caught:
        read_dataset_manifest(json.dumps(doc).encode(), "s3://training/manifests/digits/v.json")
    assert str(caught.value).startswith("s3://training/manifests/digits/v.json: ")
    assert message in str(caught.value)


def test_the_schema_files_describe_what_the_old_hand_written_ones_did() -> None:
    dataset = DatasetManifest.json_schema()
    obj = dataset["properties"]["objects"]["items"]
    assert dataset["properties"]["version"]["pattern"] == "^[0-9a-f]{16}$"
    assert (
        obj["properties"]["size"]["minimum"] == 0
        and "quotes included" in obj["properties"]["etag"]["description"]
    )
    sync = SyncPassRecord.json_schema()
    assert sync["properties"]["pass"]["minimum"] == 1 and "timed_out" not in sync["required"]
    assert sync["properties"]["files"]["items"]["properties"]["area"]["enum"] == ["checkpoints", "output"]
