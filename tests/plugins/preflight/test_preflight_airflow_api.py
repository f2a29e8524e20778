"""The preflight's pool line reads Airflow's REST API, never the ORM.

Against a real `airflow api-server` (simple auth manager, a copy of the migrated metadata DB): the pool is
read with a user's password or a token, a missing pool FAILs with the command that creates it, and an API
that refuses or does not answer is WARN naming the URL and what to set. The CLI, run where ``AIRFLOW_HOME`` is
an empty folder, creates no ``airflow.db``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from include.airflow_ui import AIRFLOW, AirflowUI, copy_metadata_db
from include.devstack.stack import free_port
from kubetrain.preflight import Preflight
from kubetrain.settings import Deployment

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
SEED_DB = Path(os.environ.get("AIRFLOW_HOME", REPO / ".airflow")) / "airflow.db"
POOL = "kubetrain-preflight-gpu"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """`airflow api-server` alone, with pool ``POOL`` of 3 slots created through Airflow's CLI; yields the
    server's URL, the admin's password and a JWT."""
    home = tmp_path_factory.mktemp("preflight-api") / "airflow"
    home.mkdir()
    copy_metadata_db(SEED_DB, home / "airflow.db", pause_dags=True)
    ui = AirflowUI(home, {}, port=free_port())
    env = ui.env()
    out = subprocess.run(
        [str(AIRFLOW), "pools", "set", POOL, "3", "GPU training pods"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    password = ui.password
    with ui.api_server_only():
        answer = requests.post(
            f"{ui.url}/auth/token", json={"username": "admin", "password": password}, timeout=30
        )
        assert answer.status_code in (200, 201), answer.text
        yield ui.url, password, answer.json()["access_token"]


def connection(monkeypatch, **fields) -> None:
    """Define the ``airflow_api`` connection (type http) in the environment."""
    monkeypatch.setenv("AIRFLOW_CONN_AIRFLOW_API", json.dumps({"conn_type": "http", **fields}))


def pool_line(pool: str = POOL, **kwargs):
    return Preflight(Deployment(), pool=pool, **kwargs).airflow_checks.check_pool()


def test_the_pool_is_read_with_a_users_password(api, monkeypatch):
    url, password, _ = api
    port = int(url.rsplit(":", 1)[1])
    connection(monkeypatch, host="127.0.0.1", port=port, login="admin", password=password)
    check = pool_line()
    assert (check.status, check.detail) == ("PASS", f"Airflow pool {POOL!r} has 3 slot(s) (API {url})")


def test_the_pool_is_read_with_a_token(api, monkeypatch):
    url, _, token = api
    connection(monkeypatch, host=url, extra={"token": token})
    assert pool_line().status == "PASS"


def test_a_missing_pool_fails_with_the_command_that_creates_it(api, monkeypatch):
    url, _, token = api
    connection(monkeypatch, host=url, extra={"token": token})
    check = pool_line("gpu-missing")
    assert check.status == "FAIL"
    assert check.detail.startswith("Airflow pool 'gpu-missing' does not exist")
    assert check.fix == "airflow pools set gpu-missing <number of GPUs> 'GPU training pods'"


def test_a_url_that_is_not_the_api_servers_warns_rather_than_failing(api, monkeypatch):
    url, _, token = api
    connection(monkeypatch, host=f"{url}/airflow", extra={"token": token})
    check = pool_line()
    assert check.status == "WARN"
    assert f"the Airflow API at {url}/airflow (connection 'airflow_api') answered" in check.detail, check
    assert "is it the API server's URL?" in check.detail


def test_a_refused_password_warns_naming_the_url_and_the_connection(api, monkeypatch):
    url, _, _ = api
    connection(monkeypatch, host=url, login="admin", password="not-the-password")
    check = pool_line()
    assert check.status == "WARN"
    assert f"the Airflow API at {url} (connection 'airflow_api') refused user 'admin'" in check.detail
    assert "define connection airflow_api" in check.detail
    assert f"check with `airflow pools get {POOL}`" in check.detail


def test_no_credentials_warn_naming_what_to_set(api, monkeypatch):
    url, _, _ = api
    monkeypatch.delenv("AIRFLOW_CONN_AIRFLOW_API", raising=False)
    check = pool_line(airflow_api_url=url)
    assert check.status == "WARN"
    assert (
        f"the Airflow API at {url} (no credentials: connection 'airflow_api' is not defined) "
        "refused the request at GET /api/v2/pools (401)" in check.detail
    )
    assert "define connection airflow_api (type http" in check.detail


def test_an_api_that_does_not_answer_warns_naming_the_url(monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    connection(monkeypatch, host=closed, login="admin", password="x")
    check = pool_line()
    assert check.status == "WARN"
    assert (
        f"the Airflow API at {closed} (connection 'airflow_api') does not answer: ConnectionError"
        in check.detail
    )
    assert "ORM" not in check.detail


def test_without_an_api_the_line_says_how_to_check_by_hand(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_AIRFLOW_API", raising=False)
    check = Preflight(Deployment()).airflow_checks.check_pool()
    assert check.status == "INFO"
    assert check.detail.startswith("pool 'gpu' not checked: no Airflow API configured")
    assert check.detail.endswith("check with `airflow pools get gpu`")


def cli(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m kubetrain.preflight`` with ``AIRFLOW_HOME`` at ``home`` and no cluster."""
    keep = ("PATH", "LANG", "TMPDIR")
    return subprocess.run(
        [sys.executable, "-m", "kubetrain.preflight", "--pod-timeout", "5", *args],
        cwd=home,
        env={
            **{k: os.environ[k] for k in keep if k in os.environ},
            "HOME": str(home),
            "AIRFLOW_HOME": str(home / "airflow"),
            "KUBECONFIG": str(home / "no-kubeconfig"),
            "KUBETRAIN_REGISTRY": f"127.0.0.1:{free_port()}",
            "PYTHONPATH": os.pathsep.join([str(REPO / "plugins"), str(REPO)]),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def pool_output(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stdout.splitlines() if line.split()[1:2] == ["gpu-pool:"]]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


def test_the_cli_creates_no_metadata_database(tmp_path):
    proc = cli(tmp_path)
    assert not (tmp_path / "airflow" / "airflow.db").exists()
    assert list(tmp_path.rglob("*.db")) == []
    line = pool_output(proc)
    assert line.startswith("INFO  gpu-pool: pool 'gpu' not checked: no Airflow API configured"), line
    assert "slot_pool" not in proc.stdout and "ORM" not in proc.stdout


def test_the_cli_asks_airflows_base_url_and_names_the_connection_to_set(api, tmp_path):
    url, _, _ = api
    proc = cli(tmp_path, AIRFLOW__API__BASE_URL=url)
    line = pool_output(proc)
    assert line.startswith(
        f"WARN  gpu-pool: pool 'gpu' not checked: the Airflow API at {url} (no credentials"
    ), line
    assert "define connection airflow_api (type http" in line
    assert list(tmp_path.rglob("*.db")) == []


def test_the_cli_reads_the_pool_from_the_api_server(api, tmp_path):
    url, password, _ = api
    proc = cli(
        tmp_path,
        "--pool",
        POOL,
        "--airflow-api-url",
        url,
        AIRFLOW_CONN_AIRFLOW_API=json.dumps({"conn_type": "http", "login": "admin", "password": password}),
    )
    assert pool_output(proc) == f"PASS  gpu-pool: Airflow pool {POOL!r} has 3 slot(s) (API {url})"
    assert list(tmp_path.rglob("*.db")) == []
