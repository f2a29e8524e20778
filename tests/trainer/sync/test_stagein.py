"""stage-in against a real S3-protocol server: round trips, cache, faults and bad input.

The server is moto's: stage-in's checks need multipart ETags (``<md5>-<parts>``), ``If-Match``
and store checksums, which the dev stack's server lacks (include/devstack/S3.md); that every
request stage-in sends is signed right is tested against the dev stack's server, in
test_signatures.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig
from sync_support import dataset_manifest, put_manifest, run_sync, s3_client, sha256, tree
from sync_support.faultproxy import FaultProxy

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3_server(moto_server):
    return moto_server


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


def _zip_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _targz_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def dataset(s3, tmp_path_factory):
    """A dataset with small files, a multipart object, a zip and a tar.gz; its manifest URI and expected tree."""
    prefix = f"ds-{secrets.token_hex(4)}/"
    rng = secrets.SystemRandom()
    expected: dict[str, str] = {}
    for i in range(40):
        data = os.urandom(rng.randint(1, 60_000))
        s3.put_object(Bucket="datasets", Key=f"{prefix}small/f{i:03d}.bin", Body=data)
        expected[f"small/f{i:03d}.bin"] = hashlib.sha256(data).hexdigest()
    s3.put_object(Bucket="datasets", Key=f"{prefix}empty.txt", Body=b"")
    expected["empty.txt"] = hashlib.sha256(b"").hexdigest()
    # 21 MiB in 5 MiB parts: a multipart ETag ("<md5 of md5s>-5") and ranged GETs
    big = os.urandom(21 * MiB)
    s3.upload_fileobj(
        io.BytesIO(big),
        "datasets",
        f"{prefix}big/blob.bin",
        Config=TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB),
    )
    expected["big/blob.bin"] = hashlib.sha256(big).hexdigest()
    # a 12 MiB single-part object: one MD5 over ranges that arrive out of order
    single = os.urandom(12 * MiB)
    s3.put_object(Bucket="datasets", Key=f"{prefix}big/single.bin", Body=single)
    expected["big/single.bin"] = hashlib.sha256(single).hexdigest()
    zipped = {"images/a.txt": b"alpha\n" * 100, "images/sub/b.txt": b"beta\n"}
    s3.put_object(Bucket="datasets", Key=f"{prefix}archives/pics.zip", Body=_zip_bytes(zipped))
    tarred = {"corpus/x.yml": b"- - hi\n  - hello\n", "corpus/y.yml": os.urandom(3000)}
    s3.put_object(Bucket="datasets", Key=f"{prefix}archives/corpus.tar.gz", Body=_targz_bytes(tarred))
    for name, data in {**zipped, **tarred}.items():
        expected[f"archives/{name}"] = hashlib.sha256(data).hexdigest()
    manifest = dataset_manifest(s3, "datasets", prefix, f"unit-{prefix.strip('/')}")
    assert any(o["etag"].endswith('-5"') for o in manifest["objects"])
    return put_manifest(s3, manifest), expected, manifest


def test_stage_in_round_trip_verifies_and_extracts(s3_server, dataset, tmp_path):
    uri, expected, _ = dataset
    data = tmp_path / "data"
    result = run_sync(
        ["stage-in", "--manifest", uri, "--data-dir", str(data), "--progress-interval", "0.2"],
        s3_server.env(),
    )
    assert result.returncode == 0, result.stderr
    assert tree(data) == expected  # archives extracted and removed, nothing else left behind
    assert "\r" not in result.stderr
    assert "stage-in: done: 45 objects" in result.stderr.splitlines()[-2]
    assert s3_server.secret_access_key not in result.stdout + result.stderr


def test_stage_in_keeps_archives_on_request(s3_server, dataset, tmp_path):
    uri, expected, _ = dataset
    result = run_sync(
        ["stage-in", "--manifest", uri, "--data-dir", str(tmp_path), "--keep-archives"], s3_server.env()
    )
    assert result.returncode == 0, result.stderr
    files = tree(tmp_path)
    assert {"archives/pics.zip", "archives/corpus.tar.gz"} <= set(files)
    assert {k: files[k] for k in expected} == expected


def test_cache_hit_reads_no_object_bytes(s3_server, dataset, tmp_path):
    uri, expected, manifest = dataset
    cache = tmp_path / "cache"
    with FaultProxy(s3_server.endpoint, fail_rate=0.0) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "KUBETRAIN_CACHE_DIR": str(cache)}
        first = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(tmp_path / "one")], env)
        assert first.returncode == 0, first.stderr
        gets_first = len(proxy.object_gets())
        assert gets_first >= len(manifest["objects"])
        assert (cache / manifest["version"] / "index.json").exists()
        proxy.records.clear()
        second = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(tmp_path / "two")], env)
        assert second.returncode == 0, second.stderr
        assert proxy.object_gets() == []
        assert [r.path for r in proxy.records if r.method == "GET"] == [f"/training/{uri.split('/', 3)[3]}"]
    assert "0 bytes read from S3" in second.stderr
    assert tree(tmp_path / "two") == expected


@pytest.mark.parametrize(
    "extra",
    [[], ["--verify", "size"]],
    ids=["hashed", "unhashed"],
)
def test_stage_in_survives_injected_faults(s3_server, dataset, tmp_path, extra):
    uri, expected, _ = dataset
    # each kind of fault once, in turn, on the first object GETs (whatever order the threads
    # send them in), then a share of every request at random
    kinds = ("503", "500", "reset", "reset-body")
    with FaultProxy(s3_server.endpoint, fail_rate=0.1, seed=7, first_gets=kinds) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        result = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(tmp_path), *extra], env)
        faults = {r.fault for r in proxy.records if r.fault}
    assert result.returncode == 0, result.stderr
    assert faults == set(kinds)
    assert tree(tmp_path) == expected


def test_stage_in_finds_a_bucket_outside_the_configured_region(s3_server, dataset, tmp_path):
    """The CRT signs for one region and does not follow S3's wrong-region answer: stage-in asks
    each bucket's region first (a HEAD of the bucket) and signs for it."""
    uri, expected, _ = dataset
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, region="eu-west-2") as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        result = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(tmp_path)], env)
        refused = [(r.method, r.path) for r in proxy.records if r.fault == "region"]
    assert result.returncode == 0, result.stderr
    assert tree(tmp_path) == expected
    # one probe per bucket was signed for us-east-1; every other request for eu-west-2
    assert sorted(refused) == [("HEAD", "/datasets/"), ("HEAD", "/training/")]
    assert "s3://datasets: the bucket is in region eu-west-2, not us-east-1" in result.stderr


def _stage(s3_server, uri: str, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_sync(["stage-in", "--manifest", uri, "--data-dir", str(data), *extra], s3_server.env())


def test_missing_manifest_names_uri(s3_server, tmp_path):
    uri = "s3://training/manifests/nothing/0000000000000000.json"
    result = _stage(s3_server, uri, tmp_path)
    assert result.returncode == 1
    assert f"dataset manifest {uri} does not exist" in result.stderr


def _tampered(s3, manifest: dict, change) -> str:
    doc = json.loads(json.dumps(manifest))
    doc["dataset"] = f"tampered-{secrets.token_hex(3)}"
    change(doc)
    lines = sorted(f"{o['bucket']}/{o['key']}\t{o['size']}\t{o['etag']}" for o in doc["objects"])
    doc["version"] = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    doc["total_bytes"] = sum(o["size"] for o in doc["objects"])
    return put_manifest(s3, doc)


def _small(doc: dict) -> dict:
    return next(o for o in doc["objects"] if o["path"] == "small/f007.bin")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: _small(d).update(key=_small(d)["key"] + ".gone"), "f007.bin.gone does not exist"),
        (lambda d: _small(d).update(size=_small(d)["size"] + 1), "f007.bin"),
        (lambda d: _small(d).update(etag='"0123456789abcdef0123456789abcdef"'), "f007.bin: ETag mismatch"),
        (
            lambda d: next(o for o in d["objects"] if o["path"] == "big/blob.bin").update(
                etag='"0123456789abcdef0123456789abcdef-5"'
            ),
            "big/blob.bin: ETag mismatch",
        ),
    ],
    ids=["missing-object", "size-mismatch", "etag-mismatch", "multipart-etag-mismatch"],
)
def test_bad_objects_are_refused_naming_the_key(s3_server, s3, dataset, tmp_path, change, message):
    _, _, manifest = dataset
    uri = _tampered(s3, manifest, change)
    data = tmp_path / "data"
    data.mkdir()
    (data / "previous.txt").write_text("from an earlier stage-in")
    result = _stage(s3_server, uri, data)
    assert result.returncode == 1, result.stderr
    assert "s3://datasets/" in result.stderr and message in result.stderr
    assert tree(data) == {"previous.txt": sha256(data / "previous.txt")}  # nothing half-done left


def test_a_server_that_ignores_if_match_cannot_serve_another_version(s3_server, s3, dataset, tmp_path):
    # the server serves whatever it holds; the ETag of its response gives the other version away
    _, _, manifest = dataset
    uri = _tampered(s3, manifest, lambda d: _small(d).update(etag='"0123456789abcdef0123456789abcdef"'))
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, drop_headers=("if-match",)) as proxy:
        result = run_sync(
            ["stage-in", "--manifest", uri, "--data-dir", str(tmp_path)],
            {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint},
        )
    assert result.returncode == 1
    assert "small/f007.bin: ETag mismatch: the server sent ETag" in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def plain_s3(s3_server):
    """A client that asks the store to keep no checksum, as older SDKs and tools upload."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
        region_name=s3_server.region,
        config=Config(request_checksum_calculation="when_required"),
    )


def _one_object_dataset(s3, client, size: int) -> tuple[str, str]:
    prefix = f"one-{secrets.token_hex(4)}/"
    key = f"{prefix}blob.bin"
    client.put_object(Bucket="datasets", Key=key, Body=os.urandom(size))
    return put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"unit-{prefix.strip('/')}")), key


@pytest.mark.parametrize(
    ("store_checksum", "size", "extra", "message"),
    [
        (True, 100_000, [], "crc32 mismatch: the content gives"),
        # a ranged object: the engine checks it against the checksum of stage-in's HEAD
        (True, 12 * MiB, [], "crc32 mismatch: the content does not give the store's checksum"),
        (False, 100_000, [], "ETag mismatch: content hashes to"),
        (False, 12 * MiB, ["--verify", "md5"], "ETag mismatch: content hashes to"),
    ],
    ids=["store-crc32-whole", "store-crc32-ranged", "md5-whole", "md5-ranged"],
)
def test_corrupted_bytes_are_refused(s3_server, s3, plain_s3, tmp_path, store_checksum, size, extra, message):
    uri, key = _one_object_dataset(s3, s3 if store_checksum else plain_s3, size)
    data = tmp_path / "data"
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, corrupt=key) as proxy:
        result = run_sync(
            ["stage-in", "--manifest", uri, "--data-dir", str(data), *extra],
            {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint},
        )
        corrupted = sum(1 for r in proxy.records if r.fault == "corrupt")
    assert corrupted >= 1
    assert result.returncode == 1, result.stderr
    assert f"s3://datasets/{key}: {message}" in result.stderr
    assert not data.exists() or os.listdir(data) == []


def test_many_small_objects_are_md5_checked_together_and_one_corrupted_is_refused(
    s3_server, s3, plain_s3, tmp_path
):
    """Objects without a store checksum are hashed in batches (trainer/sync/md5many.py): more of
    them than a batch, of every length around MD5's block, each checked against its own ETag."""
    from trainer.sync.transfer import MD5_BATCH

    prefix = f"many-{secrets.token_hex(4)}/"
    bodies = {f"{prefix}{i:03d}.bin": os.urandom(i * 37 % 300 + i) for i in range(MD5_BATCH + 9)}
    for key, body in bodies.items():
        plain_s3.put_object(Bucket="datasets", Key=key, Body=body)
    uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"unit-{prefix.strip('/')}"))
    result = _stage(s3_server, uri, tmp_path / "data")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if "stage-in: verified " in x)
    assert f"{len(bodies)} objects by size+md5(etag)" in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()} == {
        k.rsplit("/", 1)[1]: v for k, v in bodies.items()
    }
    bad = f"{prefix}{MD5_BATCH - 3:03d}.bin"  # neither a batch's first nor its last
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, corrupt=bad) as proxy:
        refused = run_sync(
            ["stage-in", "--manifest", uri, "--data-dir", str(tmp_path / "bad")],
            {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint},
        )
    assert refused.returncode == 1, refused.stderr
    assert f"s3://datasets/{bad}: ETag mismatch: content hashes to" in refused.stderr
    assert not (tmp_path / "bad").exists() or list((tmp_path / "bad").rglob("*.bin")) == []


@pytest.mark.parametrize("algorithm", ["CRC32C", "CRC64NVME", "SHA1", "SHA256"])
def test_a_large_object_is_checked_against_any_store_checksum(s3_server, s3, tmp_path, algorithm):
    """Each full-object checksum S3 keeps, checked by the engine across a ranged download."""
    prefix = f"large-{secrets.token_hex(4)}/"
    key = f"{prefix}blob.bin"
    body = os.urandom(12 * MiB + 1234)
    s3.put_object(Bucket="datasets", Key=key, Body=body, ChecksumAlgorithm=algorithm)
    uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"unit-{prefix.strip('/')}"))
    result = _stage(s3_server, uri, tmp_path / "data")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data" / "blob.bin").read_bytes() == body
    line = next(x for x in result.stderr.splitlines() if "stage-in: verified " in x)
    assert f"1 objects by size+etag+{algorithm.lower()}(store)" in line
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, corrupt=key) as proxy:
        bad = run_sync(
            ["stage-in", "--manifest", uri, "--data-dir", str(tmp_path / "bad")],
            {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint},
        )
    assert bad.returncode == 1
    assert f"s3://datasets/{key}: {algorithm.lower()} mismatch: the content does not give" in bad.stderr
    assert not (tmp_path / "bad").exists() or os.listdir(tmp_path / "bad") == []


def test_a_download_the_engine_did_not_check_is_refused():
    """Where the engine was given a checksum and reports it made no check, nothing passes silently.

    No server makes the engine skip its check on demand: its completion is called as it would be.
    """
    from kubetrain_contract.s3uri import S3Uri
    from trainer.sync.errors import SyncError
    from trainer.sync.s3_crt import CrtHandle

    handle = CrtHandle(S3Uri("datasets", "blob.bin"), None, None, expected_checksum=("crc32", "LC6FYw=="))
    handle.done(error=None, status_code=200, did_validate_checksum=False)
    with pytest.raises(
        SyncError,
        match=r"s3://datasets/blob.bin: the engine did not check the content's crc32 against the store's "
        r"checksum LC6FYw==",
    ):
        handle.wait()
    checked = CrtHandle(S3Uri("datasets", "blob.bin"), None, None, expected_checksum=("crc32", "LC6FYw=="))
    checked.done(error=None, status_code=200, did_validate_checksum=True)
    checked.wait()


def test_stage_in_says_how_each_object_was_verified(s3_server, s3, plain_s3, tmp_path):
    prefix = f"how-{secrets.token_hex(4)}/"
    s3.put_object(Bucket="datasets", Key=f"{prefix}with-crc32.bin", Body=os.urandom(5000))
    plain_s3.put_object(Bucket="datasets", Key=f"{prefix}small.bin", Body=os.urandom(5000))
    plain_s3.put_object(Bucket="datasets", Key=f"{prefix}large.bin", Body=os.urandom(9 * MiB))
    uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"unit-{prefix.strip('/')}"))
    result = _stage(s3_server, uri, tmp_path / "data", "--md5-max-size", str(MiB))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if "stage-in: verified " in x)
    assert "size+etag+crc32(store)" in line
    assert "size+md5(etag)" in line
    assert "size+etag (no store checksum; no MD5 above 1,048,576 bytes)" in line
    every = _stage(s3_server, uri, tmp_path / "again", "--verify", "md5")
    assert every.returncode == 0, every.stderr
    line = next(x for x in every.stderr.splitlines() if "stage-in: verified " in x)
    assert "3 objects by size+md5(etag)" in line


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(kind="someone/else"), "unknown kind 'someone/else'"),
        (lambda d: d.update(format_version=2), "unknown format_version 2"),
        (lambda d: d["objects"][0].update(path="../escape"), "'../escape' is not a safe relative path"),
        (lambda d: d.update(version="ffffffffffffffff"), "does not match its objects"),
    ],
    ids=["kind", "format-version", "unsafe-path", "version"],
)
def test_bad_manifests_are_refused(s3_server, s3, dataset, tmp_path, change, message):
    _, _, manifest = dataset
    doc = json.loads(json.dumps(manifest))
    change(doc)
    key = f"manifests/bad/{secrets.token_hex(4)}.json"
    s3.put_object(Bucket="training", Key=key, Body=json.dumps(doc).encode())
    result = _stage(s3_server, f"s3://training/{key}", tmp_path)
    assert result.returncode == 1
    assert f"s3://training/{key}" in result.stderr and message in result.stderr


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def test_full_target_directory_is_a_clear_error(s3_server, s3, dataset, tmp_path):
    uri, _, _ = dataset
    # 1.5 MB of text in a zip of about 0.8 MB: passes the up-front space check, then fills the disk
    prefix = f"fill-{secrets.token_hex(4)}/"
    s3.put_object(
        Bucket="datasets",
        Key=f"{prefix}text.zip",
        Body=_zip_bytes({"t.txt": os.urandom(750_000).hex().encode()}),
    )
    filling = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"fill-{prefix.strip('/')}"))
    data = tmp_path / "tiny"
    data.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(data)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        result = _stage(s3_server, uri, data)
        assert result.returncode == 1
        assert f"DATA_DIR {data} has" in result.stderr and "the dataset needs" in result.stderr
        assert os.listdir(data) == []
        result = _stage(s3_server, filling, data)
        assert result.returncode == 1
        assert "text.zip: no space left on device" in result.stderr
        assert os.listdir(data) == []
    finally:
        subprocess.run(["umount", str(data)], check=True)


def test_read_only_target_directory_is_a_clear_error(s3_server, dataset, tmp_path):
    uri, _, _ = dataset
    data = tmp_path / "ro"
    data.mkdir()
    if not _mount("--bind", str(data), str(data)):
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        assert _mount("-o", "remount,bind,ro", str(data))
        result = _stage(s3_server, uri, data)
        assert result.returncode == 1
        assert (
            f"cannot write to DATA_DIR {data}" in result.stderr and "Read-only file system" in result.stderr
        )
    finally:
        subprocess.run(["umount", str(data)], check=True)


def test_publishing_replaces_what_an_earlier_stage_in_left_whatever_its_kind(tmp_path):
    from trainer.sync.stagein import _publish

    data, objects = tmp_path / "data", tmp_path / "staging" / "objects"
    for path, text in {
        "file.txt": "new file",  # replaces a file
        "was_dir": "a file where a directory was",
        "was_file/inner.txt": "a directory where a file was",
        "full_dir/new.txt": "a directory where a directory with other files was",
        "link/x.txt": "a directory where a symbolic link to a directory was",
    }.items():
        (objects / path).parent.mkdir(parents=True, exist_ok=True)
        (objects / path).write_text(text)
    (data / "was_dir").mkdir(parents=True)
    (data / "was_dir" / "old.txt").write_text("old")
    (data / "file.txt").write_text("old file")
    (data / "was_file").write_text("old")
    (data / "full_dir").mkdir()
    (data / "full_dir" / "old.txt").write_text("old")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "kept.txt").write_text("not DATA_DIR's")
    (data / "link").symlink_to(tmp_path / "elsewhere")
    (data / "untouched.txt").write_text("not in the new snapshot")

    _publish(objects, data)

    assert os.listdir(objects) == []
    assert {str(p.relative_to(data)): p.read_text() for p in sorted(data.rglob("*")) if p.is_file()} == {
        "file.txt": "new file",
        "full_dir/new.txt": "a directory where a directory with other files was",
        "link/x.txt": "a directory where a symbolic link to a directory was",
        "untouched.txt": "not in the new snapshot",
        "was_dir": "a file where a directory was",
        "was_file/inner.txt": "a directory where a file was",
    }
    assert not (data / "link").is_symlink()
    assert (tmp_path / "elsewhere" / "kept.txt").read_text() == "not DATA_DIR's"  # a link is not followed
