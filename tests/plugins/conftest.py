"""Fixtures shared by the operator tests that talk to the test S3 server."""

from __future__ import annotations

import json
import time

import boto3
import pytest
from botocore.exceptions import ClientError


def s3_client(server):
    """A boto3 client for the test server, once its buckets exist (it answers before creating them)."""
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
        region_name=server.region,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            for bucket in ("datasets", "training"):
                client.head_bucket(Bucket=bucket)
            return client
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def client(s3_server, monkeypatch):
    """A boto3 client of the test server; Airflow's ``aws_default`` connection points at it too."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_DEFAULT",
        json.dumps(
            {
                "conn_type": "aws",
                "login": s3_server.access_key_id,
                "password": s3_server.secret_access_key,
                "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.region},
            }
        ),
    )
    for name in (
        "KUBETRAIN_TRAINING_BUCKET",
        "AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET",
        "KUBETRAIN_S3_PUBLIC_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    return s3_client(s3_server)


@pytest.fixture
def store(client):
    """The RunStore of the operators, on the test server (through Airflow's ``aws_default``)."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout

    return RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout())
