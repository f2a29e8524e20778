"""The sidecar's single PUTs through the CRT (``S3.put_bytes``): metadata, a damaged body, a hung store."""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time

import pytest
from sync_support import s3_client
from sync_support.faultproxy import FaultProxy

from trainer.sync.s3 import S3, S3RequestError, SyncError


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
            with pytest.raises(SyncError, match="no answer to the upload within 1s"):
                client.put_bytes("training", "runs/unit_put/hung", b"x", content_md5=_md5(b"x"), metadata={})
        finally:
            release.set()
        assert proxy.stalled.is_set()
        assert time.monotonic() - began < 10
