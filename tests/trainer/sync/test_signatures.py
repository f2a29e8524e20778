"""Every S3 call of the pod side, against a server that verifies SigV4 signatures.

The dev stack's server refuses a request whose signature does not match, and one that sends
an ``x-amz-*`` header left out of its signature, as AWS S3 does. A recording proxy in front
of it shows which requests were sent (ranged GETs with ``If-Match``, ``x-amz-checksum-mode``,
multipart uploads, listings) and that every one of them was accepted.
"""

from __future__ import annotations

import io
import os
import secrets
import urllib.error
import urllib.request

import pytest
from boto3.s3.transfer import TransferConfig
from sync_support import dataset_manifest, put_manifest, run_sync, s3_client, tree
from sync_support.faultproxy import FaultProxy
from test_checkpoint import _Lines, _sidecar

from trainer.sync.errors import S3RequestError
from trainer.sync.s3 import S3

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


def _signed(record) -> set[str]:
    auth = record.headers.get("authorization", "")
    assert auth.startswith("AWS4-HMAC-SHA256 "), (record.method, record.path, auth)
    return set(auth.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";"))


def _check_all_signed_and_accepted(records) -> None:
    assert records
    for r in records:
        assert 200 <= r.status < 300, (r.method, r.path, r.status)
        sent = {h for h in r.headers if h.startswith("x-amz-") or h in ("range", "if-match", "host")}
        assert sent <= _signed(r), (r.method, r.path, sent - _signed(r))


def test_the_server_refuses_what_aws_refuses(s3_server, s3):
    s3.put_object(Bucket="training", Key="sig/probe.txt", Body=b"probe")
    # an x-amz header added after signing (as the hand-written signer once added x-amz-checksum-mode)
    late = _plain(s3_server)
    late.meta.events.register_last(
        "before-send.s3.GetObject",
        lambda request, **_: request.headers.__setitem__("x-amz-expected-bucket-owner", "123456789012"),
    )
    with pytest.raises(late.exceptions.ClientError) as exc:
        late.get_object(Bucket="training", Key="sig/probe.txt")
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    # a wrong secret
    wrong = type(s3_server)(s3_server.endpoint, s3_server.access_key_id, "0" * 40)
    with pytest.raises(late.exceptions.ClientError) as exc:
        _plain(wrong).get_object(Bucket="training", Key="sig/probe.txt")
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    # no signature at all
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(f"{s3_server.endpoint}/training/sig/probe.txt", timeout=30)
    assert http.value.code in (400, 403)


def _plain(server):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
        region_name=server.region,
    )


def test_every_pod_side_call_is_signed_right(s3_server, s3, tmp_path, monkeypatch):
    prefix = f"sig-{secrets.token_hex(4)}/"
    for i in range(5):
        s3.put_object(Bucket="datasets", Key=f"{prefix}small/f{i}.bin", Body=os.urandom(1000 * (i + 1)))
    s3.put_object(Bucket="datasets", Key=f"{prefix}empty.txt", Body=b"")
    big = os.urandom(20 * MiB)  # several ranged GETs
    s3.upload_fileobj(
        io.BytesIO(big), "datasets", f"{prefix}big.bin", Config=TransferConfig(multipart_threshold=5 * MiB)
    )
    uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"sig-{prefix.strip('/')}"))
    run = f"s3://training/runs/unit_sig/{secrets.token_hex(5)}"

    with FaultProxy(s3_server.endpoint, fail_rate=0.0) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        # stage-in: manifest, HEADs with checksum mode, whole and ranged GETs with If-Match
        for extra in ([], ["--verify", "md5"]):
            data = tmp_path / f"data{len(extra)}"
            result = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(data), *extra], env)
            assert result.returncode == 0, result.stderr
            assert len(tree(data)) == 7

        # checkpoint-sync: listing, single PUTs with metadata, a multipart upload, manifests
        ck, out = tmp_path / "ck", tmp_path / "out"
        ck.mkdir()
        out.mkdir()
        (ck / "ckpt-1.index").write_bytes(b"index")
        (ck / "big.data").write_bytes(os.urandom(18 * MiB))  # above the single-PUT limit
        (out / "metrics.json").write_text("{}")
        proc = _sidecar(env, run, ck, out, "--interval", "0.3", "--quiet", "0")
        lines = _Lines(proc)
        try:
            lines.wait("pass 1 committed")
            proc.terminate()
            proc.wait(60)
        finally:
            proc.kill()
        assert proc.returncode == 0, lines.text()

        # restore: listing, pass manifests, HEADs, GETs checked by sha256; and stage-in's resume
        restored = tmp_path / "restored"
        result = run_sync(
            [
                "restore",
                "--run-uri",
                run,
                "--checkpoint-dir",
                str(restored),
                "--output-dir",
                str(tmp_path / "o"),
                "--area",
                "checkpoints",
                "--area",
                "output",
            ],
            env,
        )
        assert result.returncode == 0, result.stderr
        assert tree(restored) == tree(ck)

        # the calls of the S3 class itself, in this process
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        client = S3()
        assert (
            client.get_bytes("datasets", f"{prefix}small/f0.bin")
            == s3.get_object(Bucket="datasets", Key=f"{prefix}small/f0.bin")["Body"].read()
        )
        etag = client.head("datasets", f"{prefix}big.bin", checksum_mode=True)["etag"]
        try:
            client.head("datasets", f"{prefix}big.bin", part_number=1)
        except S3RequestError as exc:  # a server without part HEADs may refuse it, never for its signature
            assert exc.status not in (401, 403), exc
        got = bytearray()
        handle = client.get_object(
            "datasets",
            f"{prefix}big.bin",
            if_match=etag,
            checksum_mode=True,
            on_body=lambda c, o: got.extend(c),
        )
        handle.wait()
        assert bytes(got) == big

    methods = {(r.method, "uploadId" in r.path, "list-type=2" in r.path) for r in proxy.records}
    assert {("GET", False, False), ("HEAD", False, False), ("PUT", False, False)} <= methods
    assert ("PUT", True, False) in methods and ("POST", True, False) in methods  # multipart upload
    assert ("GET", False, True) in methods  # ListObjectsV2
    gets = [r for r in proxy.records if r.method == "GET"]
    assert any("range" in r.headers and "if-match" in r.headers for r in gets)
    assert any("x-amz-checksum-mode" in r.headers for r in gets)
    _check_all_signed_and_accepted(proxy.records)


def test_credentials_from_botocore_s_chain_reach_the_crt(s3_server, s3, tmp_path):
    """Without keys in the environment (workload identity, a credentials file), stage-in takes
    botocore's credential chain and hands it to the CRT."""
    s3.put_object(Bucket="datasets", Key="sig-chain/a.bin", Body=b"chain" * 1000)
    uri = put_manifest(s3, dataset_manifest(s3, "datasets", "sig-chain/", "sig-chain"))
    shared = tmp_path / "credentials"
    shared.write_text(
        f"[default]\naws_access_key_id = {s3_server.access_key_id}\n"
        f"aws_secret_access_key = {s3_server.secret_access_key}\n"
    )
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_DEFAULT_REGION": s3_server.region,
        "AWS_SHARED_CREDENTIALS_FILE": str(shared),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    import subprocess
    import sys

    from sync_support import REPO

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.sync",
            "stage-in",
            "--manifest",
            uri,
            "--data-dir",
            str(tmp_path / "d"),
        ],
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "d" / "a.bin").read_bytes() == b"chain" * 1000
