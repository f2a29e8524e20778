"""``python -m trainer.sync probe``, the preflight's S3 checks from a pod, against the dev stack's server."""

from __future__ import annotations

import json
import secrets

from sync_support import run_sync, s3_client
from sync_support.faultproxy import FaultProxy


def _report(result) -> dict:
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("KUBETRAIN_PROBE "), result.stdout + result.stderr
    return json.loads(last.removeprefix("KUBETRAIN_PROBE "))


def test_probe_lists_writes_reads_back_and_deletes(s3_server):
    s3 = s3_client(s3_server)
    key = f"preflight/probe-{secrets.token_hex(3)}.bin"
    with FaultProxy(s3_server.endpoint, fail_rate=0.0) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        result = run_sync(
            ["probe", "--datasets-bucket", "datasets", "--scratch-uri", f"s3://training/{key}"], env
        )
        calls = [(r.method, r.path.split("?")[0], r.status) for r in proxy.records]
    assert result.returncode == 0, result.stderr
    report = _report(result)
    assert all(step["ok"] for step in report.values()), report
    assert report["region"]["buckets"] == {"datasets": s3_server.region, "training": s3_server.region}
    # written, read back (one GET of the CRT, which names a range: 206, as from S3), deleted:
    # nothing is left
    assert [c for c in calls if c[1] == f"/training/{key}"] == [
        ("PUT", f"/training/{key}", 200),
        ("GET", f"/training/{key}", 206),
        ("DELETE", f"/training/{key}", 204),
    ]
    assert s3.list_objects_v2(Bucket="training", Prefix=key).get("KeyCount", 0) == 0
    assert s3_server.secret_access_key not in result.stdout + result.stderr


def test_probe_names_a_bucket_in_another_region(s3_server):
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, region="eu-west-2") as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        result = run_sync(
            ["probe", "--datasets-bucket", "datasets", "--scratch-uri", "s3://training/preflight/r.bin"], env
        )
    report = _report(result)
    assert report["region"] == {
        "ok": True,
        "configured": "us-east-1",
        "buckets": {"datasets": "eu-west-2", "training": "eu-west-2"},
        "detail": "datasets in eu-west-2, training in eu-west-2; pods sign for us-east-1",
    }
    assert report["write"]["ok"], report  # the CRT signed for the bucket's region


def test_probe_reports_each_failure_and_goes_on(s3_server):
    result = run_sync(
        [
            "probe",
            "--datasets-bucket",
            "no-such-datasets",
            "--scratch-uri",
            "s3://no-such-training/preflight/x.bin",
        ],
        s3_server.env(),
    )
    assert result.returncode == 0, result.stderr
    report = _report(result)
    assert not report["list"]["ok"] and "NoSuchBucket" in report["list"]["detail"]
    assert not report["write"]["ok"] and "NoSuchBucket" in report["write"]["detail"]
    assert "probe list: FAILED" in result.stderr
