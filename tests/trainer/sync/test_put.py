"""The CRT's plain requests (``S3.put_bytes``, the multipart calls, listings): metadata, a damaged body, a hung store."""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time

import pytest
from sync_support import s3_client
from sync_support.faultproxy import FaultProxy

from trainer.sync.errors import S3RequestError, SyncError
from trainer.sync.s3 import S3


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def test_a_put_lands_with_its_metadata_and_a_damaged_body_is_refused(s3_server, s3, monkeypatch):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    client = S3()
    key = f"runs/unit_put/{secrets.token_hex(5)}/ckpt-1.index"
    data = b"checkpoint index bytes"
    headers = client.put_bytes("training", key, data, content_md5=_md5(data), metadata={"sha256": "ab12"})
    assert headers["etag"].strip('"') == hashlib.md5(data).hexdigest()
    got = s3.get_object(Bucket="training", Key=key)
    assert got["Body"].read() == data
    assert {k.lower(): v for k, v in got["Metadata"].items()} == {"sha256": "ab12"}  # rclone capitalises
    # the body the store receives is not the one whose MD5 was sent: refused, the object kept
    with pytest.raises(S3RequestError) as refused:
        client.put_bytes("training", key, b"damaged", content_md5=_md5(data), metadata={})
    assert refused.value.status == 400, refused.value
    assert s3.get_object(Bucket="training", Key=key)["Body"].read() == data


def test_a_put_that_gets_no_answer_is_given_up_after_the_read_timeout(s3_server, monkeypatch):
    release = threading.Event()
    with FaultProxy(
        s3_server.endpoint, fail_rate=0.0, stall=lambda method, _path: release if method == "PUT" else None
    ) as proxy:
        for name, value in {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}.items():
            monkeypatch.setenv(name, value)
        client = S3(read_timeout=1.0)
        began = time.monotonic()
        try:
            with pytest.raises(SyncError, match="no answer to PutObject within 1s"):
                client.put_bytes("training", "runs/unit_put/hung", b"x", content_md5=_md5(b"x"), metadata={})
        finally:
            release.set()
        assert proxy.stalled.is_set()
        assert time.monotonic() - began < 10


def _env(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_a_listing_pages_and_names_every_key_as_botocore_does(s3_server, s3, monkeypatch):
    """Through the CRT (keys in the environment) and through botocore: the same objects, across pages."""
    _env(monkeypatch, s3_server.env())
    prefix = f"runs/unit_list/{secrets.token_hex(5)}/"
    names = ["a.json", "b c.json", "plus+sign.json", "pct%41.json", "ü/nested.json", "zz.json"]
    for name in names:
        s3.put_object(Bucket="training", Key=prefix + name, Body=name.encode())
    expected = {
        prefix + n: (s3.head_object(Bucket="training", Key=prefix + n)["ETag"], len(n.encode()))
        for n in names
    }
    on_crt = S3(small_calls_on_crt=True)
    assert on_crt.small_calls_on_crt
    for client in (on_crt, S3()):
        listed = list(client.list_objects("training", prefix, page_size=2))
        assert {i["Key"]: (i["ETag"], i["Size"]) for i in listed} == expected
        assert len(listed) == len(names)  # every key once across the three pages
    assert list(on_crt.list_objects("training", prefix + "none/")) == []


def test_a_multipart_upload_through_the_crt_lands_and_an_aborted_one_leaves_nothing(
    s3_server, s3, monkeypatch
):
    _env(monkeypatch, s3_server.env())
    client = S3(small_calls_on_crt=True)
    key = f"runs/unit_put/{secrets.token_hex(5)}/big.data"
    parts = [secrets.token_bytes(5 * 1024 * 1024), b"tail"]
    upload_id = client.create_multipart_upload("training", key, {"sha256": "cd34"})
    etags = [client.upload_part("training", key, upload_id, n, d) for n, d in enumerate(parts, start=1)]
    assert [e.strip('"') for e in etags] == [hashlib.md5(d).hexdigest() for d in parts]
    client.complete_multipart_upload("training", key, upload_id, etags)
    got = s3.get_object(Bucket="training", Key=key)
    assert got["Body"].read() == b"".join(parts)
    assert {k.lower(): v for k, v in got["Metadata"].items()} == {"sha256": "cd34"}

    other = key + ".aborted"
    upload_id = client.create_multipart_upload("training", other, {})
    client.upload_part("training", other, upload_id, 1, b"never joined")
    client.abort_multipart_upload("training", other, upload_id)
    with pytest.raises(S3RequestError) as gone:  # the upload no longer takes parts
        client.upload_part("training", other, upload_id, 2, b"late")
    assert gone.value.status == 404, gone.value
    assert "Contents" not in s3.list_objects_v2(Bucket="training", Prefix=other)


def test_a_listing_that_gets_no_answer_is_sent_again(s3_server, monkeypatch):
    """The CRT has no read timeout: a read held without an answer is cancelled and sent again."""
    release, held = threading.Event(), []

    def stall(method: str, path: str):
        if method == "GET" and "list-type=2" in path and not held:
            held.append(path)
            return release
        return None

    with FaultProxy(s3_server.endpoint, fail_rate=0.0, stall=stall) as proxy:
        _env(monkeypatch, {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
        client = S3(read_timeout=1.0, small_calls_on_crt=True)
        try:
            listed = list(client.list_objects("training", "runs/unit_list/"))
        finally:
            release.set()
        assert proxy.stalled.is_set() and len(held) == 1
        assert [r.path for r in proxy.records if "list-type=2" in r.path and r.status == 200]
        assert all(i["Key"].startswith("runs/unit_list/") for i in listed)


def test_every_part_is_sent_with_its_crc32c(s3_server, s3, monkeypatch):
    """A part goes with its CRC32C (``x-amz-checksum-crc32c``, a signed header), which AWS S3 checks.

    No server that installs here checks it (neither the dev stack's nor moto: a part sent with
    another part's CRC32C is stored; include/devstack/S3.md), so the test reads the requests as sent.
    """
    from awscrt.checksums import crc32c

    with FaultProxy(s3_server.endpoint, fail_rate=0.0) as proxy:
        _env(monkeypatch, {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
        client = S3(small_calls_on_crt=True)
        key = f"runs/unit_put/{secrets.token_hex(5)}/ckpt 1+b/big.data"  # signed as sent: a space and a plus
        parts = [secrets.token_bytes(5 * 1024 * 1024), b"tail"]
        crcs = [crc32c(d) for d in parts]
        upload_id = client.create_multipart_upload("training", key, {}, part_checksums=True)
        etags = [
            client.upload_part("training", key, upload_id, n, d, crc32c=c)
            for n, (d, c) in enumerate(zip(parts, crcs, strict=True), start=1)
        ]
        client.complete_multipart_upload("training", key, upload_id, etags, crc32cs=crcs)
    create = next(r for r in proxy.records if r.method == "POST" and r.path.endswith("?uploads"))
    assert create.headers.get("x-amz-checksum-algorithm") == "CRC32C"
    sent = [r for r in proxy.records if r.method == "PUT" and "uploadId=" in r.path and r.status == 200]
    assert [r.headers.get("x-amz-checksum-crc32c") for r in sent] == [
        base64.b64encode(c.to_bytes(4, "big")).decode() for c in crcs
    ]
    assert all("x-amz-checksum-crc32c" in r.headers["authorization"] for r in sent)
    # the body is not hashed to sign it: the checksum covers it
    assert {r.headers.get("x-amz-content-sha256") for r in sent} == {"UNSIGNED-PAYLOAD"}
    assert s3.get_object(Bucket="training", Key=key)["Body"].read() == b"".join(parts)


def test_without_part_checksums_every_part_is_signed_with_its_sha256(s3_server, s3, monkeypatch):
    """Where the store takes no part checksums, a part's signature covers its SHA-256
    (``x-amz-content-sha256``), which AWS S3 checks: read from the requests as sent, as above."""
    with FaultProxy(s3_server.endpoint, fail_rate=0.0) as proxy:
        _env(monkeypatch, {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
        client = S3(small_calls_on_crt=True)
        key = f"runs/unit_put/{secrets.token_hex(5)}/ckpt 1+b/big.data"  # signed as sent: a space and a plus
        parts = [secrets.token_bytes(5 * 1024 * 1024), b"tail"]
        upload_id = client.create_multipart_upload("training", key, {})
        etags = [client.upload_part("training", key, upload_id, n, d) for n, d in enumerate(parts, start=1)]
        client.complete_multipart_upload("training", key, upload_id, etags)
    sent = [r for r in proxy.records if r.method == "PUT" and "uploadId=" in r.path and r.status == 200]
    assert [r.headers.get("x-amz-content-sha256") for r in sent] == [
        hashlib.sha256(d).hexdigest() for d in parts
    ]
    assert all("x-amz-content-sha256" in r.headers["authorization"] for r in sent)
    assert s3.get_object(Bucket="training", Key=key)["Body"].read() == b"".join(parts)


def test_a_sent_part_is_freed_when_its_call_returns_not_when_the_collector_runs(s3_server, monkeypatch):
    """Each request's body is let go as its call returns: the sidecar's memory is bounded by its workers' parts
    in flight, not by the size of what it uploads (a request kept alive by a reference cycle until the
    collector ran held every part sent: 985 MB of RSS for 900 MB of checkpoints)."""
    import gc
    import io

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    client = S3()
    key = f"runs/unit_put/{secrets.token_hex(5)}/big.data-00000-of-00001"
    parts = [secrets.token_bytes(5 * 1024 * 1024) for _ in range(3)]

    gc.collect()
    gc.disable()  # what a burst of uploads between two collections looks like
    try:
        upload_id = client.create_multipart_upload("training", key, {})
        etags = [client.upload_part("training", key, upload_id, n, d) for n, d in enumerate(parts, start=1)]
        client.complete_multipart_upload("training", key, upload_id, etags)
        # What sends a part is a stream over its bytes; one still open holds them. The CRT lets its own
        # references go later, on its event-loop thread (once in CI, a request was still alive a minute
        # after its call returned), so the stream is closed as the call returns: asserted at once, with
        # the collector off.
        holding = [
            o
            for o in gc.get_objects()
            if isinstance(o, io.BytesIO) and not o.closed and any(o.getvalue() == p for p in parts)
        ]
        assert holding == [], f"{len(holding)} part(s) still held after their calls returned"
    finally:
        gc.enable()
