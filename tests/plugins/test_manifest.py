"""Dataset manifests built from real objects in the S3 test server."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from airflow.providers.amazon.aws.hooks.s3 import S3Hook  # noqa: F401  (also puts plugins/ on sys.path)

from kubetrain.manifest import (
    DatasetNotFoundError,
    ManifestObject,
    build_manifest,
    check_manifest,
    dataset_name_from_uri,
    dumps,
    list_source_objects,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "trainer" / "kubetrain_contract" / "schemas" / "dataset-manifest.v1.json"
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"


@pytest.fixture
def dataset(client):
    """A small dataset under a unique prefix: two files, one of them nested."""
    name = f"ds-{uuid.uuid4().hex[:8]}"
    client.put_object(Bucket="datasets", Key=f"{name}/train.csv", Body=b"x,y\n1,2\n3,4\n")
    client.put_object(Bucket="datasets", Key=f"{name}/images/0/a.png", Body=b"\x89PNG fake but bytes")
    return name


def expected_version(objects: list[tuple[str, int, str]]) -> str:
    lines = sorted(f"datasets/{key}\t{size}\t{etag}" for key, size, etag in objects)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def test_manifest_of_a_prefix(store, client, dataset):
    source, objects = list_source_objects(store, f"s3://datasets/{dataset}/")
    manifest = build_manifest(dataset, source, objects)

    heads = {
        k: client.head_object(Bucket="datasets", Key=k)
        for k in (f"{dataset}/train.csv", f"{dataset}/images/0/a.png")
    }
    assert manifest["kind"] == "kubetrain/dataset-manifest"
    assert manifest["format_version"] == 1
    assert manifest["source"] == f"s3://datasets/{dataset}/"
    assert [o["path"] for o in manifest["objects"]] == [
        "images/0/a.png",
        "train.csv",
    ]
    for obj in manifest["objects"]:
        head = heads[obj["key"]]
        assert obj["bucket"] == "datasets"
        assert obj["size"] == head["ContentLength"]
        assert obj["etag"] == head["ETag"] and obj["etag"].startswith('"')
    assert manifest["total_bytes"] == sum(h["ContentLength"] for h in heads.values())
    assert manifest["version"] == expected_version(
        [(k, h["ContentLength"], h["ETag"]) for k, h in heads.items()]
    )
    assert manifest["created_at"].endswith("Z")


def test_prefix_without_trailing_slash_is_the_same_dataset(store, client, dataset):
    with_slash = build_manifest(dataset, *list_source_objects(store, f"s3://datasets/{dataset}/"))
    without = build_manifest(dataset, *list_source_objects(store, f"s3://datasets/{dataset}"))
    assert without["version"] == with_slash["version"]
    assert without["source"] == with_slash["source"]


def test_version_is_stable_and_follows_content(store, client, dataset):
    uri = f"s3://datasets/{dataset}/"
    first = build_manifest(dataset, *list_source_objects(store, uri))
    again = build_manifest(dataset, *list_source_objects(store, uri))
    assert again["version"] == first["version"]

    client.put_object(
        Bucket="datasets", Key=f"{dataset}/train.csv", Body=b"x,y\n1,2\n3,5\n"
    )  # same size, new bytes
    changed = build_manifest(dataset, *list_source_objects(store, uri))
    assert changed["version"] != first["version"]

    client.put_object(Bucket="datasets", Key=f"{dataset}/extra.txt", Body=b"more")
    grown = build_manifest(dataset, *list_source_objects(store, uri))
    assert grown["version"] not in (first["version"], changed["version"])
    assert len(grown["objects"]) == 3


def test_single_archive(store, client):
    key = f"archives/digits-{uuid.uuid4().hex[:6]}.tar.gz"
    client.put_object(Bucket="datasets", Key=key, Body=b"\x1f\x8b not really gzip")
    source, objects = list_source_objects(store, f"s3://datasets/{key}")
    assert source == f"s3://datasets/{key}"
    assert [(o.key, o.path) for o in objects] == [(key, key.rsplit("/", 1)[1])]
    assert dataset_name_from_uri(f"s3://datasets/{key}") == key.rsplit("/", 1)[1].removesuffix(".tar.gz")


def test_missing_dataset_names_the_uri(store, client):
    uri = f"s3://datasets/nothing-{uuid.uuid4().hex[:8]}/"
    with pytest.raises(DatasetNotFoundError, match=f"nothing to stage at {uri}"):
        list_source_objects(store, uri)


def test_paths_that_leave_the_data_directory_are_refused():
    with pytest.raises(ValueError, match=r"maps to path '\.\./etc/passwd'"):
        ManifestObject("datasets", "d/../etc/passwd", "../etc/passwd", 1, '"e"')
    with pytest.raises(ValueError, match="size -1"):
        ManifestObject("datasets", "d/a", "a", -1, '"e"')


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kind": "kubetrain/other"},
            "unknown kind 'kubetrain/other', expected 'kubetrain/dataset-manifest'",
        ),
        ({"format_version": 2}, "unknown format_version 2 of kubetrain/dataset-manifest"),
        ({"version": "0" * 16}, "version '0000000000000000' does not match its objects"),
        ({"total_bytes": 2}, "total_bytes 2 differs from the sum of object sizes 1"),
        ({"objects": "a"}, "field 'objects' is 'a', expected a list of an object (DatasetObject)"),
    ],
    ids=["kind", "format-version", "version", "total", "objects"],
)
def test_reader_refuses_unknown_kind_and_version_and_a_foreign_manifest(change, message):
    manifest = build_manifest(
        "digits", "s3://datasets/digits/", [ManifestObject("datasets", "digits/a", "a", 1, '"e"')]
    )
    assert check_manifest(manifest) is manifest
    with pytest.raises(ValueError, match=re.escape(message)):
        check_manifest({**manifest, **change})
    with pytest.raises(ValueError, match=re.escape(message)):
        dumps({**manifest, **change})


def test_manifest_matches_the_contract_schema(store, client, dataset):
    import jsonschema

    manifest = build_manifest(dataset, *list_source_objects(store, f"s3://datasets/{dataset}/"))
    jsonschema.validate(json.loads(dumps(manifest)), json.loads(SCHEMA.read_text()))


def test_pod_side_reader_accepts_the_manifest(store, client, dataset):
    """The stage-in tool (trainer environment) loads what the Airflow side writes, version included."""
    if not TRAINER_PYTHON.exists():
        pytest.skip("trainer/.venv is not installed")
    manifest = build_manifest(dataset, *list_source_objects(store, f"s3://datasets/{dataset}/"))
    script = (
        "import json, sys\n"
        "from trainer.sync.manifest import read_dataset_manifest\n"
        "m = read_dataset_manifest(sys.stdin.buffer.read(), 'test')\n"
        "print(json.dumps([m.version, m.total_bytes, [o.path for o in m.objects]]))\n"
    )
    done = subprocess.run(
        [str(TRAINER_PYTHON), "-c", script], input=dumps(manifest), cwd=REPO, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == [
        manifest["version"],
        manifest["total_bytes"],
        ["images/0/a.png", "train.csv"],
    ]


def test_folder_markers_are_not_dataset_files(moto_server, monkeypatch):
    """The S3 console's "create folder" leaves a ``name/`` object; it is no file of the dataset.

    The dev stack's server cannot store such keys (include/devstack/S3.md), so this runs on moto.
    """
    import boto3

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout

    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_MOTO",
        json.dumps(
            {
                "conn_type": "aws",
                "login": moto_server.access_key_id,
                "password": moto_server.secret_access_key,
                "extra": {"endpoint_url": moto_server.endpoint, "region_name": moto_server.region},
            }
        ),
    )
    s3 = boto3.client(
        "s3",
        **{
            k: v
            for k, v in {
                "endpoint_url": moto_server.endpoint,
                "aws_access_key_id": moto_server.access_key_id,
                "aws_secret_access_key": moto_server.secret_access_key,
                "region_name": moto_server.region,
            }.items()
        },
    )
    s3.create_bucket(Bucket="markers")
    for key, body in (
        ("ds/", b""),
        ("ds/images/", b""),
        ("ds/images/a.png", b"png bytes"),
        ("ds/train.csv", b"x\n"),
    ):
        s3.put_object(Bucket="markers", Key=key, Body=body)
    store = RunStore(S3Hook(aws_conn_id="aws_moto"), S3Layout())
    _, objects = list_source_objects(store, "s3://markers/ds/")
    assert sorted(o.key for o in objects) == ["ds/images/a.png", "ds/train.csv"]
