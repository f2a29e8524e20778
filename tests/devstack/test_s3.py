"""The dev stack's S3 server keeps what users put in it and refuses what AWS S3 refuses."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from include.devstack.stack import Stack


def _client(endpoint: str, key_id: str, secret: str, **config):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(retries={"total_max_attempts": 1}, **config),
    )


def _stack_client(state: dict, **config):
    s3 = state["s3"]
    return _client(s3["endpoint"], s3["access_key_id"], s3["secret_access_key"], **config)


def _status(exc: pytest.ExceptionInfo) -> int:
    return exc.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_objects_and_keys_outlive_a_stack_restart(tmp_path):
    stack = Stack(tmp_path / "stack")
    state = stack.up()
    try:
        data = os.urandom(300_000)
        _stack_client(state).put_object(Bucket="datasets", Key="digits/v1/digits.zip", Body=data)
        before = {k: state["s3"][k] for k in ("access_key_id", "secret_access_key")}
    finally:
        stack.down()
    assert (tmp_path / "stack" / "s3" / "datasets" / "digits" / "v1" / "digits.zip").read_bytes() == data
    state = stack.up()
    try:
        assert {k: state["s3"][k] for k in before} == before  # the same key pair: old shells still work
        client = _stack_client(state)
        assert client.get_object(Bucket="datasets", Key="digits/v1/digits.zip")["Body"].read() == data
        listed = client.list_objects_v2(Bucket="datasets", Prefix="digits/")["Contents"]
        assert [(o["Key"], o["Size"]) for o in listed] == [("digits/v1/digits.zip", len(data))]
        assert (
            json.loads((tmp_path / "stack" / "s3-keys.json").read_text())["access_key_id"]
            == before["access_key_id"]
        )
        assert oct((tmp_path / "stack" / "s3-keys.json").stat().st_mode & 0o777) == "0o600"
    finally:
        stack.down()


def test_only_requests_signed_with_the_stack_key_pair_are_served(s3_server):
    good = _client(s3_server.endpoint, s3_server.access_key_id, s3_server.secret_access_key)
    good.put_object(Bucket="training", Key="runs/x/report/index.html", Body=b"<html>report</html>")

    for key_id, secret in (
        (s3_server.access_key_id, "0" * 40),
        ("kt0000000000000000", s3_server.secret_access_key),
    ):
        with pytest.raises(ClientError) as exc:
            _client(s3_server.endpoint, key_id, secret).get_object(
                Bucket="training", Key="runs/x/report/index.html"
            )
        assert _status(exc) == 403

    # an x-amz-* header that is not part of the signature
    late = _client(s3_server.endpoint, s3_server.access_key_id, s3_server.secret_access_key)
    late.meta.events.register_last(
        "before-send.s3.GetObject",
        lambda request, **_: request.headers.__setitem__("x-amz-expected-bucket-owner", "123456789012"),
    )
    with pytest.raises(ClientError) as exc:
        late.get_object(Bucket="training", Key="runs/x/report/index.html")
    assert _status(exc) == 403

    # no bucket policy makes a report public: an anonymous GET is refused ...
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(f"{s3_server.endpoint}/training/runs/x/report/index.html", timeout=30)
    assert http.value.code in (400, 403)
    # ... and a presigned URL (SigV4) opens it, until it is tampered with
    url = _client(
        s3_server.endpoint, s3_server.access_key_id, s3_server.secret_access_key, signature_version="s3v4"
    ).generate_presigned_url(
        "get_object", Params={"Bucket": "training", "Key": "runs/x/report/index.html"}, ExpiresIn=300
    )
    assert urllib.request.urlopen(url, timeout=30).read() == b"<html>report</html>"
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(url.replace("report/index.html", "report/other.html"), timeout=30)
    assert http.value.code == 403


def test_a_range_is_answered_as_aws_s3_answers_it(s3_server, tmp_path):
    """206 with no whole-object checksum, so boto3's ranged downloads of a checksummed object work."""
    client = _client(s3_server.endpoint, s3_server.access_key_id, s3_server.secret_access_key)
    data = os.urandom(20_000_000)
    # boto3's default: a CRC32 the store keeps and sends back with the whole object
    client.put_object(Bucket="training", Key="models/m 1+x/model.bin", Body=data)

    whole = client.get_object(Bucket="training", Key="models/m 1+x/model.bin", ChecksumMode="ENABLED")
    assert whole["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert whole["ChecksumCRC32"]
    assert whole["Body"].read() == data  # botocore validated it against the CRC32

    part = client.get_object(
        Bucket="training", Key="models/m 1+x/model.bin", Range="bytes=100-199", ChecksumMode="ENABLED"
    )
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["ContentRange"] == f"bytes 100-199/{len(data)}"
    assert not [h for h in part["ResponseMetadata"]["HTTPHeaders"] if h.startswith("x-amz-checksum-")]
    assert part["Body"].read() == data[100:200]

    # over 8 MiB: s3transfer's ranged GETs, each of which botocore validates when a checksum comes
    client.download_file("training", "models/m 1+x/model.bin", str(tmp_path / "model.bin"))
    assert (tmp_path / "model.bin").read_bytes() == data


def test_a_presigned_url_valid_for_more_than_a_week_is_refused(s3_server):
    client = _client(
        s3_server.endpoint, s3_server.access_key_id, s3_server.secret_access_key, signature_version="s3v4"
    )
    client.put_object(Bucket="training", Key="runs/x/report/week.html", Body=b"<html>report</html>")
    params = {"Bucket": "training", "Key": "runs/x/report/week.html"}
    week = client.generate_presigned_url("get_object", Params=params, ExpiresIn=604800)
    assert urllib.request.urlopen(week, timeout=30).read() == b"<html>report</html>"
    longer = client.generate_presigned_url("get_object", Params=params, ExpiresIn=604801)
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(longer, timeout=30)
    assert http.value.code == 400
    assert b"<Code>AuthorizationQueryParametersError</Code>" in http.value.read()
