"""MLflow tracking from the Airflow side, against a real tracking server (SQLite, artifacts in the test S3)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
import requests
from training_records import history_csv, make_record

from include.devstack.mlflow_server import MLFLOW, MlflowServer
from kubetrain.operators.dedupe import RunRecorder
from kubetrain.s3_layout import RunLocation
from kubetrain.tracking import TrackingSettings, configured

REPO = Path(__file__).resolve().parents[3]
LOG = logging.getLogger("test")


@pytest.fixture(scope="module")
def mlflow(s3_server, tmp_path_factory):
    if not MLFLOW.exists():
        pytest.fail(f"{MLFLOW} is missing: run `make mlflow-env` (make test does)")
    with MlflowServer(
        tmp_path_factory.mktemp("mlflow"),
        s3_server.endpoint,
        s3_server.access_key_id,
        s3_server.secret_access_key,
    ) as server:
        yield server


def api(server, method, endpoint, **kwargs):
    response = requests.request(method, f"{server.url}/api/2.0/mlflow/{endpoint}", timeout=30, **kwargs)
    assert response.ok, f"{method} {endpoint}: {response.status_code} {response.text[:500]}"
    return response.json()


def seed_run(client, record):
    run = RunLocation.from_uri(record["run_uri"])
    client.put_object(
        Bucket=run.bucket,
        Key=run.key("output", "history.csv"),
        Body=history_csv([1.0, 0.6, 0.4], [0.5, 0.7, 0.8]),
    )
    client.put_object(Bucket=run.bucket, Key=run.key("report", "report.html"), Body=b"<html>report</html>")
    record["report_uri"] = f"{run.uri}/report/report.html"


def test_a_promoted_run_is_logged_and_becomes_the_champion(store, client, mlflow, monkeypatch):
    monkeypatch.setenv("KUBETRAIN_MLFLOW_TRACKING_URI", mlflow.url)
    first = make_record(
        run_id="manual__mlflow-1",
        model="tracked",
        promoted=True,
        model_version="v1",
        hyper={"learning_rate": 0.001, "batch_size": 64, "epochs": 3},
    )
    seed_run(client, first)
    recorder = RunRecorder(store, LOG)
    run_id = recorder.track(first)

    found = api(mlflow, "GET", "runs/get", params={"run_id": run_id})["run"]
    params = {p["key"]: p["value"] for p in found["data"]["params"]}
    tags = {t["key"]: t["value"] for t in found["data"]["tags"]}
    assert (
        params["learning_rate"] == "0.001"
        and params["batch_size"] == "64"
        and params["promote"] == "if_better"
    )
    assert tags["kubetrain.dataset_version"] == first["dataset"]["version"]
    assert tags["kubetrain.image_digest"] == "sha256:" + "c" * 64
    assert tags["airflow.dag_run"].endswith("/dags/train_image_classifier/runs/manual__mlflow-1")
    assert tags["kubetrain.run_uri"] == first["run_uri"] and found["info"]["status"] == "FINISHED"
    history = api(
        mlflow, "GET", "metrics/get-history", params={"run_id": run_id, "metric_key": "val_accuracy"}
    )["metrics"]
    assert [(m["step"], round(m["value"], 4)) for m in history] == [(10, 0.475), (20, 0.665), (30, 0.76)]
    inputs = found["inputs"]["dataset_inputs"]
    assert inputs[0]["dataset"]["digest"] == first["dataset"]["version"]
    assert json.loads(inputs[0]["dataset"]["source"])["uri"] == "s3://datasets/digits/"

    # the report is in the run's artifacts (copied inside S3), the model only referenced
    artifact_root = found["info"]["artifact_uri"]
    assert artifact_root.startswith("s3://training/mlflow/")
    key = artifact_root[len("s3://training/") :] + "/report/report.html"
    assert client.get_object(Bucket="training", Key=key)["Body"].read() == b"<html>report</html>"
    champion = api(mlflow, "GET", "registered-models/alias", params={"name": "tracked", "alias": "champion"})[
        "model_version"
    ]
    assert champion["source"] == "s3://training/models/tracked/v1/" and champion["run_id"] == run_id

    # the record in S3 points at the MLflow run
    stored = store.runs.get(RunLocation.from_uri(first["run_uri"]))
    assert stored["mlflow"]["run_id"] == run_id and stored["mlflow"]["url"].startswith(mlflow.url)

    # a retried record step logs into the same run without duplicating the history
    assert (
        recorder.track(
            make_record(run_id="manual__mlflow-1", model="tracked", promoted=True, model_version="v1")
        )
        == run_id
    )
    again = api(
        mlflow, "GET", "metrics/get-history", params={"run_id": run_id, "metric_key": "val_accuracy"}
    )["metrics"]
    assert len(again) == 3

    # the next promotion moves the alias
    second = make_record(run_id="manual__mlflow-2", model="tracked", promoted=True, model_version="v2")
    seed_run(client, second)
    second_run = recorder.track(second)
    champion = api(mlflow, "GET", "registered-models/alias", params={"name": "tracked", "alias": "champion"})[
        "model_version"
    ]
    assert champion["run_id"] == second_run and champion["version"] == "2"


def test_a_failed_run_is_logged_as_failed(store, client, mlflow, monkeypatch):
    monkeypatch.setenv("KUBETRAIN_MLFLOW_TRACKING_URI", mlflow.url)
    failed = make_record(
        run_id="manual__mlflow-failed", model="tracked-failures", status="failed", value=None
    )
    run_id = RunRecorder(store, LOG).track(failed)
    found = api(mlflow, "GET", "runs/get", params={"run_id": run_id})["run"]
    tags = {t["key"]: t["value"] for t in found["data"]["tags"]}
    assert found["info"]["status"] == "FAILED" and tags["kubetrain.failure"] == "train: PodFailed: OOMKilled"


def test_the_connection_configures_tracking_and_a_bad_uri_is_named(monkeypatch):
    monkeypatch.delenv("KUBETRAIN_MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("AIRFLOW_VAR_KUBETRAIN_MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_DEFAULT",
        json.dumps(
            {
                "conn_type": "http",
                "host": "mlflow.example",
                "schema": "https",
                "port": 8443,
                "login": "u",
                "password": "s3cr3t-pass",
            }
        ),
    )
    found = configured()
    assert (
        found.uri == "https://mlflow.example:8443"
        and found.username == "u"
        and "s3cr3t-pass" not in repr(found)
    )
    with pytest.raises(ValueError, match="MLflow tracking URI 'sqlite:///x.db' is not valid"):
        TrackingSettings("sqlite:///x.db")


def test_without_a_tracking_uri_nothing_of_mlflow_is_imported_or_contacted():
    """A record step with no URI and no connection: no MLflow module, no request (asked in a clean process)."""
    env = {k: v for k, v in os.environ.items() if "MLFLOW" not in k}
    code = (
        "import sys, airflow\n"
        "from kubetrain.operators.dedupe import RunRecorder\n"
        "import requests.sessions as s\n"
        "s.Session.request = lambda *a, **k: (_ for _ in ()).throw(AssertionError('contacted'))\n"
        "assert RunRecorder(None, None).track({'model': 'm'}) is None\n"
        "print(sorted(m for m in sys.modules if 'mlflow' in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTHONPATH": f"{REPO}:{REPO / 'plugins'}"},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
