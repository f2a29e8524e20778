"""The "Training report" link: a URL on the Airflow API server, and what the route there will serve."""

from __future__ import annotations

import asyncio
import inspect

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.api import REPORT_CSP, ReportsApp, allowed_report_key
from kubetrain.links import report_url

KEY = "runs/train_digits/manual__2026-11-22T04_00_00_00_00-1a2b3c4d/report/report.html"


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        (
            "https://airflow.example/",
            f"https://airflow.example/kubetrain/reports/train_digits/training/{KEY}",
        ),
        (
            "https://example.org/airflow",
            f"https://example.org/airflow/kubetrain/reports/train_digits/training/{KEY}",
        ),
        ("", f"/kubetrain/reports/train_digits/training/{KEY}"),
    ],
)
def test_report_url_is_on_the_api_server(base, expected):
    assert report_url("train_digits", "training", KEY, base_url=base) == expected


def test_report_url_quotes_what_a_path_cannot_hold():
    url = report_url("train digits", "training", "runs/a+b #1/report/report.html", base_url="")
    assert url == "/kubetrain/reports/train%20digits/training/runs/a%2Bb%20%231/report/report.html"


@pytest.mark.parametrize(
    ("dag_id", "bucket", "key", "allowed"),
    [
        ("train_digits", "training", KEY, True),
        ("train_digits", "training", KEY.replace("/report/report.html", "/trials/3/report/loss.png"), True),
        (
            "train_other",
            "training",
            KEY,
            False,
        ),  # another DAG's run: the viewer's access was checked for train_other
        ("train_digits", "datasets", KEY, False),  # only the training bucket
        ("train_digits", "training", KEY.replace("/report/", "/output/"), False),  # not the report area
        ("train_digits", "training", "runs/train_digits/x/report/../output/model.keras", False),
        ("train_digits", "training", "models/m/latest", False),
        ("train_digits", "training", "runs/train_digits/report/report.html", False),
    ],
)
def test_only_report_files_of_the_dag_are_served(monkeypatch, dag_id, bucket, key, allowed):
    for name in ("KUBETRAIN_TRAINING_BUCKET", "AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    assert allowed_report_key(dag_id, bucket, key) is allowed


def test_report_csp_allows_no_script_and_no_network():
    directives = dict(d.strip().partition(" ")[::2] for d in REPORT_CSP.split(";"))
    assert directives["default-src"] == "'none'" and "sandbox" in directives
    assert "script-src" not in directives  # falls back to default-src 'none'


def test_the_api_server_security_the_route_relies_on():
    """The route authorizes with the API server's own dependency; pin its signature."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    assert list(inspect.signature(requires_access_dag).parameters)[:2] == ["method", "access_entity"]
    assert DagAccessEntity.RUN.name == "RUN"


def test_unauthenticated_request_is_refused(monkeypatch):
    """Without the UI's session cookie or a token, the route answers 401 and reads nothing."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": f"/reports/train_digits/training/{KEY}",
        "raw_path": f"/reports/train_digits/training/{KEY}".encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "server": ("testserver", 80),
        "client": ("t", 1),
    }
    asyncio.run(ReportsApp()(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
