"""The Training page on a real Airflow API server: two users, and the auth manager decides which runs each sees.

The simple auth manager tells DAGs apart by team (``[core] multi_team``): the DAGs of the bundle
``mlteam`` belong to team mlteam, those of ``research`` to team research. User ``mlviewer``
(viewer of team mlteam) may read only mlteam's DAGs, ``rsviewer`` only research's; ``admin``
reads everything.
Run records of both teams' DAGs are seeded in the test S3 server; only the API server runs
(no scheduler: nothing is executed).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
from datetime import timedelta
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
import requests
from training_records import T0, history_csv, make_record

from include.airflow_ui import AIRFLOW, AirflowUI, copy_metadata_db
from include.devstack.stack import free_port
from kubetrain.s3_layout import S3Layout
from kubetrain.ui.queries import record_ref

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
SEED_DB = Path(os.environ.get("AIRFLOW_HOME", REPO / ".airflow")) / "airflow.db"
DAG_FILE = """
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG

with DAG({dag_id!r}, schedule=None, tags=["test"]):
    EmptyOperator(task_id="train")
"""
USERS = "admin:admin,mlviewer:viewer:mlteam,rsviewer:viewer:research"


@pytest.fixture(scope="module")
def server(s3_server, tmp_path_factory):
    """`airflow api-server` in multi-team mode over two bundles, with the test S3 as aws_default."""
    work = tmp_path_factory.mktemp("auth")
    bundles = []
    for team, dag_id in (("mlteam", "ml_training"), ("research", "research_training")):
        folder = work / "bundles" / team
        folder.mkdir(parents=True)
        (folder / f"{dag_id}.py").write_text(DAG_FILE.format(dag_id=dag_id))
        bundles.append(
            {
                "name": team,
                "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                "kwargs": {"path": str(folder), "refresh_interval": 0},
                "team_name": team,
            }
        )
    aws = {
        "conn_type": "aws",
        "login": s3_server.access_key_id,
        "password": s3_server.secret_access_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.region},
    }
    home = work / "airflow"
    home.mkdir()
    copy_metadata_db(SEED_DB, home / "airflow.db", pause_dags=True)
    ui = AirflowUI(
        home,
        {"AIRFLOW_CONN_AWS_DEFAULT": json.dumps(aws)},
        port=free_port(),
        env={
            "AIRFLOW__CORE__MULTI_TEAM": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": USERS,
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
            "KUBETRAIN_TRAINING_BUCKET": "training",
        },
    )
    env = ui.env()
    for team in ("mlteam", "research"):
        out = subprocess.run(
            [str(AIRFLOW), "teams", "create", team],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    out = subprocess.run(
        [str(AIRFLOW), "dags", "reserialize"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    _ = ui.password  # the admin's; the auth manager generates the others' on start
    with ui.api_server_only():
        passwords = json.loads(ui.passwords_file.read_text())
        tokens = {}
        for user in ("admin", "mlviewer", "rsviewer"):
            answer = requests.post(
                f"{ui.url}/auth/token", json={"username": user, "password": passwords[user]}, timeout=30
            )
            assert answer.status_code in (200, 201), answer.text
            tokens[user] = answer.json()["access_token"]
        yield ui.url, tokens


@pytest.fixture(scope="module")
def records(s3_server, server):
    import boto3
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore

    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
        region_name=s3_server.region,
    )
    aws = {
        "conn_type": "aws",
        "login": s3_server.access_key_id,
        "password": s3_server.secret_access_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.region},
    }
    before = os.environ.get("AIRFLOW_CONN_AWS_DEFAULT")
    os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps(aws)
    try:
        store = RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout())
        seeded = {}
        for index, dag_id in enumerate(("ml_training", "research_training", "ml_training")):
            record = make_record(
                dag_id=dag_id,
                run_id=f"manual__auth-{index}",
                model="shared-model",
                when=T0 + timedelta(minutes=index),
                value=0.5 + index / 10,
            )
            store.runs.write(record)
            run = S3Layout().run(dag_id, record["run_id"])
            client.put_object(
                Bucket="training",
                Key=run.key("output", "history.csv"),
                Body=history_csv([1.0, 0.5], [0.5, 0.8]),
            )
            seeded[index] = record
        # a model only research trains, and shared-model promoted from research's run
        record = make_record(
            dag_id="research_training",
            run_id="manual__auth-secret",
            model="research-only-model",
            when=T0 + timedelta(minutes=5),
            value=0.9,
        )
        store.runs.write(record)
        seeded["research-only"] = record
        research_run = S3Layout().run("research_training", seeded[1]["run_id"])
        store.write_json(
            "training",
            S3Layout().model_latest_key("shared-model"),
            {
                "kind": "kubetrain/model-pointer",
                "format_version": 1,
                "model": "shared-model",
                "version": "v-research",
                "uri": "s3://training/models/shared-model/v-research/",
                "run_uri": research_run.uri,
                "sync_pass": 1,
                "files": ["model.keras"],
                "promoted_at": "2026-01-01T00:00:00Z",
            },
        )
        return seeded
    finally:
        if before:
            os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = before
        else:
            os.environ.pop("AIRFLOW_CONN_AWS_DEFAULT", None)


def get(server, user, path, **kwargs):
    url, tokens = server
    headers = {"Authorization": f"Bearer {tokens[user]}"} if user else {}
    headers.update(kwargs.pop("headers", {}))
    return requests.get(
        f"{url}/kubetrain/training{path}", headers=headers, timeout=60, allow_redirects=False, **kwargs
    )


def run_ids(answer):
    assert answer.status_code == 200, answer.text
    return [r["run_id"] for r in answer.json()["runs"]]


def test_each_user_sees_the_runs_of_the_dags_they_may_read(server, records):
    assert run_ids(get(server, "admin", "/api/runs", params={"model": "shared-model"})) == [
        "manual__auth-2",
        "manual__auth-1",
        "manual__auth-0",
    ]
    assert run_ids(get(server, "mlviewer", "/api/runs", params={"model": "shared-model"})) == [
        "manual__auth-2",
        "manual__auth-0",
    ]
    assert run_ids(get(server, "rsviewer", "/api/runs", params={"model": "shared-model"})) == [
        "manual__auth-1"
    ]
    board = get(server, "rsviewer", "/api/models/shared-model/leaderboard").json()
    assert [e["dag_id"] for e in board["entries"]] == ["research_training"]


def test_other_teams_models_and_their_promoted_runs_stay_hidden(server, records):
    """A viewer sees only models with runs of DAGs they may read, and a promoted pointer only when they may read the
    run it names: another team's model is answered as one that does not exist."""
    # (the session's S3 server holds other tests' records too, of DAGs that belong to no team)
    assert {"research-only-model", "shared-model"} <= set(
        get(server, "admin", "/api/models").json()["models"]
    )
    ml_models = get(server, "mlviewer", "/api/models").json()["models"]
    assert "shared-model" in ml_models and "research-only-model" not in ml_models
    assert {"research-only-model", "shared-model"} <= set(
        get(server, "rsviewer", "/api/models").json()["models"]
    )
    for path in (
        "/api/models/research-only-model/leaderboard",
        "/api/models/research-only-model/promotions",
        "/api/models/no-such-model/leaderboard",
    ):
        answer = get(server, "mlviewer", path)
        assert answer.status_code == 404, answer.text
        assert answer.json()["detail"] in (
            "no model research-only-model that you may read",
            "no model no-such-model that you may read",
        )
    page = get(server, "mlviewer", "/models/research-only-model", headers={"Accept": "text/html"})
    assert page.status_code == 404 and "manual__auth-secret" not in page.text
    # shared-model is promoted from research's run: mlviewer gets no pointer (its run URI names research's DAG)
    board = get(server, "mlviewer", "/api/models/shared-model/leaderboard").json()
    assert board["promoted"] is None and "research_training" not in json.dumps(board)
    assert (
        get(server, "rsviewer", "/api/models/shared-model/leaderboard").json()["promoted"]["version"]
        == "v-research"
    )


def test_a_run_of_another_teams_dag_cannot_be_opened(server, records):
    research, ml = record_ref(records[1]), record_ref(records[0])
    assert get(server, "rsviewer", "/api/compare", params={"run": [research, ml]}).status_code == 404
    assert (
        get(server, "mlviewer", "/api/compare", params={"run": [ml, record_ref(records[2])]}).status_code
        == 200
    )
    assert get(server, "mlviewer", f"/files/{research}").status_code == 404
    assert get(server, "rsviewer", f"/files/{research}").status_code == 200


def test_the_html_page_follows_the_same_rule(server, records):
    page = get(server, "mlviewer", "/", headers={"Accept": "text/html"})
    assert page.status_code == 200 and "manual__auth-0" in page.text and "manual__auth-1" not in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    compare = get(
        server, "mlviewer", "/compare", params={"run": [record_ref(records[0]), record_ref(records[2])]}
    )
    assert compare.status_code == 200 and "<svg" in compare.text


def test_without_a_login_nothing_is_served(server, records):
    assert get(server, None, "/api/runs").status_code == 401
    page = get(server, None, "/models/shared-model", headers={"Accept": "text/html"})
    assert page.status_code == 303
    target = urllib.parse.urlsplit(page.headers["location"])
    assert target.path == "/auth/login"
    assert urllib.parse.parse_qs(target.query)["next"] == ["/kubetrain/training/models/shared-model"]
    assert get(server, None, "/static/training.js").status_code == 200  # the page's script holds no data


@pytest.mark.parametrize(
    ("user", "dag_id", "status"),
    [
        ("mlviewer", "ml_training", 200),  # its own team's DAG
        ("admin", "ml_training", 200),
        ("mlviewer", "research_training", 404),  # another team's DAG: the auth manager refuses
        ("mlviewer", "ghost_training", 404),  # no DAG of that id in Airflow: as a missing report
        ("admin", "ghost_training", 404),  # not even for an admin: a deleted DAG's or another deployment's
    ],
    ids=["own-team", "admin", "other-team", "unknown-dag-viewer", "unknown-dag-admin"],
)
def test_a_report_is_served_only_for_a_dag_that_exists_and_the_user_may_read(
    s3_server, server, records, user, dag_id, status
):
    import boto3

    key = f"runs/{dag_id}/manual__auth-report/report/report.html"
    body = f"<html>report of {dag_id}</html>".encode()
    boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
        region_name=s3_server.region,
    ).put_object(Bucket="training", Key=key, Body=body)
    url, tokens = server
    answer = requests.get(
        f"{url}/kubetrain/reports/{dag_id}/training/{key}",
        headers={"Authorization": f"Bearer {tokens[user]}"},
        timeout=60,
    )
    assert answer.status_code == status, answer.text
    if status == 200:
        assert answer.content == body
    else:
        assert body not in answer.content
    if status == 404:  # answered as a missing report: nothing tells the DAG ids apart
        assert answer.json()["detail"] == f"no report at s3://training/{key}"


def test_the_training_page_is_in_the_navigation(server):
    url, tokens = server
    plugins = requests.get(
        f"{url}/api/v2/plugins", headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30
    ).json()
    (kubetrain,) = [p for p in plugins["plugins"] if p["name"] == "kubetrain"]
    (view,) = kubetrain["external_views"]
    assert view["name"] == "Training" and view["url_route"] == "training" and view["destination"] == "nav"
    assert view["href"] == "kubetrain/training/"
