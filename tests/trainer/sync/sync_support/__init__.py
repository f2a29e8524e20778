"""Helpers for the transfer tool's tests: datasets in S3, manifests, a faulty proxy."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def s3_client(server):
    """A boto3 client for the ``s3_server`` fixture, with the project's buckets present.

    moto keeps buckets per account and derives the account from the access key, so the
    buckets the server created for its own key may be invisible to the fixture's key.
    """
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
        region_name=server.region,
    )
    existing = {b["Name"] for b in client.list_buckets()["Buckets"]}
    for bucket in ("datasets", "training"):
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
    return client


def dataset_manifest(client, bucket: str, prefix: str, dataset: str) -> dict:
    """Build a format-1 dataset manifest of everything under ``bucket/prefix``, as the Airflow side does.

    Written here from the format's description, independently of trainer.sync, so that the
    tests check the tool against the format rather than against itself.
    """
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            rel = item["Key"][len(prefix) :].lstrip("/") or item["Key"].rsplit("/", 1)[-1]
            objects.append(
                {
                    "bucket": bucket,
                    "key": item["Key"],
                    "path": rel,
                    "size": item["Size"],
                    "etag": item["ETag"],
                }
            )
    lines = sorted(f"{o['bucket']}/{o['key']}\t{o['size']}\t{o['etag']}" for o in objects)
    version = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    return {
        "kind": "kubetrain/dataset-manifest",
        "format_version": 1,
        "dataset": dataset,
        "source": f"s3://{bucket}/{prefix}",
        "version": version,
        "created_at": "2026-11-22T04:00:00Z",
        "total_bytes": sum(o["size"] for o in objects),
        "objects": objects,
    }


def put_manifest(client, manifest: dict, bucket: str = "training") -> str:
    """Store a dataset manifest where the Airflow side puts it; its s3:// URI."""
    key = f"manifests/{manifest['dataset']}/{manifest['version']}.json"
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    return f"s3://{bucket}/{key}"


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every regular file below ``root``."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink():
                out[str(p.relative_to(root))] = sha256(p)
    return out


def run_sync(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m trainer.sync ARGS`` from the trainer environment."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.sync", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
