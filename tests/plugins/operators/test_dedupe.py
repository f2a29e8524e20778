"""Train-once fingerprints: a finished training is not repeated for the same data and Params."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import boto3
import pytest
from airflow.providers.common.compat.sdk import AirflowSkipException

from kubetrain.operators.dedupe import RecordTrainingOperator, SkipIfTrainedOperator, fingerprint


def test_fingerprint_ignores_non_training_params_only():
    base = {"epochs": 3, "batch_size": 64, "force": False, "experiment": "a", "promote": "always"}
    same = {**base, "force": True, "experiment": "b", "promote": "never"}
    assert fingerprint("d", "0123456789abcdef", base) == fingerprint("d", "0123456789abcdef", same)
    assert fingerprint("d", "0123456789abcdef", base) != fingerprint("d", "0123456789abcdef", {**base, "epochs": 4})
    assert fingerprint("d", "0123456789abcdef", base) != fingerprint("d", "fedcba9876543210", base)
    assert fingerprint("d", "0123456789abcdef", base) != fingerprint("e", "0123456789abcdef", base)


def test_fingerprint_needs_a_version():
    with pytest.raises(ValueError, match="dataset version '' is empty"):
        fingerprint("d", "", {})


@pytest.fixture()
def aws_conn(s3_server, monkeypatch):
    conn = {
        "conn_type": "aws",
        "login": s3_server.access_key_id,
        "password": s3_server.secret_access_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("KUBETRAIN_TRAINING_BUCKET", "training")
    return boto3.client("s3", **{k: v for k, v in {
        "endpoint_url": s3_server.endpoint,
        "aws_access_key_id": s3_server.access_key_id,
        "aws_secret_access_key": s3_server.secret_access_key,
        "region_name": "us-east-1",
    }.items()})  # fmt: skip


def _context(params: dict, run_id: str = "manual__1"):
    return {"ti": SimpleNamespace(dag_id="train_x", map_index=-1), "params": params, "run_id": run_id}


def test_second_run_with_same_data_and_params_is_skipped(aws_conn):
    version = os.urandom(8).hex()
    params = {"epochs": 3, "force": False}
    check = SkipIfTrainedOperator(task_id="check_new", dataset_version=version)
    first = check.execute(_context(params))
    assert first["marker"].startswith("s3://training/")

    RecordTrainingOperator(task_id="record", dataset_version=version).execute(_context(params))
    bucket, _, key = first["marker"][len("s3://"):].partition("/")
    record = json.loads(aws_conn.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert record["run_id"] == "manual__1" and record["dataset_version"] == version

    with pytest.raises(AirflowSkipException, match=f"already trained on dataset version {version}.*manual__1"):
        check.execute(_context(params, run_id="scheduled__2"))
    # other Params, or force, train again
    assert check.execute(_context({**params, "epochs": 4}, run_id="scheduled__3"))["fingerprint"] != first["fingerprint"]
    assert check.execute(_context({**params, "force": True}, run_id="manual__4"))["fingerprint"] == first["fingerprint"]
