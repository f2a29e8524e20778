"""The Training page in the Airflow UI, and the same runs in MLflow, after two real training runs.

The session's `make airflow` Airflow (api-server, scheduler, DAG processor, triggerer) on the
dev stack, shared with the other browser tests, with an MLflow tracking server beside it (SQLite,
artifacts in the stack's S3) named in the Variable kubetrain_mlflow_tracking_uri. Two runs of train_image_classifier train a fresh model name on a
small digits dataset at once: A (2 epochs, promote=always) and B (3 epochs, promote=never).

Then, in headless Chromium: the "Training" entry of the Airflow navigation opens the page,
both runs are listed with their metric, A and B are compared (curves on one chart, the
differing epochs highlighted), the leaderboard marks A's version as promoted and its link
opens the DAG run in Airflow. Through MLflow's REST API: both runs with their params, the
per-epoch metric history with steps, and the champion alias on A's version, whose source is
the promoted S3 prefix. Screenshots are kept in the test's tmp dir (KUBETRAIN_DOCS_SCREENSHOT=1
also copies the comparison to docs/training-compare.png).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
import requests

from include.devstack.mlflow_server import MLFLOW, MlflowServer
from include.devstack.stack import s3_client
from kubetrain.s3_layout import S3Layout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DAG_ID = "train_image_classifier"
MODEL = f"digits-page-{secrets.token_hex(3)}"
TRACKING_VARIABLE = "kubetrain_mlflow_tracking_uri"


@pytest.fixture(scope="module")
def stack(devstack, tmp_path_factory):
    """The dev stack's variables, a fresh digits dataset and an MLflow server on the stack's S3."""

    if not MLFLOW.exists():
        pytest.fail(f"{MLFLOW} is missing: run `make mlflow-env` (make test does)")
    env = devstack.env()
    work = tmp_path_factory.mktemp("training-page")
    archive = work / "digits.zip"
    subprocess.run(
        [
            str(TRAINER_PYTHON),
            "-m",
            "include.sample_data.digits",
            "--out",
            str(archive),
            "--size",
            "16",
            "--per-class",
            "20",
            "--seed",
            str(secrets.randbelow(2**31)),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    s3 = s3_client(env)
    dataset = f"digits-{MODEL}"
    s3.upload_file(str(archive), "datasets", f"{dataset}/digits.zip")
    with MlflowServer(
        work / "mlflow",
        env["KUBETRAIN_S3_ENDPOINT"],
        env["KUBETRAIN_S3_ACCESS_KEY_ID"],
        env["KUBETRAIN_S3_SECRET_ACCESS_KEY"],
    ) as mlflow:
        yield {
            "env": env,
            "s3": s3,
            "work": work,
            "mlflow": mlflow,
            "dataset_uri": f"s3://datasets/{dataset}/",
        }


@pytest.fixture(scope="module")
def runs(stack, ui):
    """The session's Airflow (`make airflow`) logging to MLflow; runs A and B trained, both finished."""
    airflow = ui
    # the setting's Variable: the running Airflow logs to this MLflow server from the next task on
    airflow.api("POST", "/variables", {"key": TRACKING_VARIABLE, "value": stack["mlflow"].url})
    try:
        airflow.set_paused(DAG_ID, False)
        common = {
            "dataset_uri": stack["dataset_uri"],
            "model_name": MODEL,
            "image_size": 16,
            "batch_size": 32,
        }
        run_a = airflow.trigger(DAG_ID, {**common, "epochs": 2, "promote": "always"})
        run_b = airflow.trigger(DAG_ID, {**common, "epochs": 3, "promote": "never"})
        for run_id in (run_a, run_b):
            final = airflow.wait_run(DAG_ID, run_id, timeout=600)
            states = {k: v["state"] for k, v in airflow.task_instances(DAG_ID, run_id).items()}
            errors = {k: airflow.task_errors(DAG_ID, run_id, k) for k, s in states.items() if s == "failed"}
            assert final["state"] == "success", (
                f"run {run_id} ended {final['state']}: {states}; errors: {errors}"
            )
        layout = S3Layout()

        def record(run_id):
            key = layout.run_record_key(layout.run(DAG_ID, run_id))
            return json.loads(stack["s3"].get_object(Bucket="training", Key=key)["Body"].read())

        yield {"airflow": airflow, "a": record(run_a), "b": record(run_b)}
    finally:
        # the next browser test finds the DAG paused and runs untracked, as the session started them
        airflow.set_paused(DAG_ID, True)
        airflow.api("DELETE", f"/variables/{TRACKING_VARIABLE}")


@pytest.fixture
def page(tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (`make setup` does)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)  # as ui_support.chromium_page: assertions wait like actions
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1500, "height": 1000},
        )
        context.set_default_timeout(30_000)
        try:
            yield context.new_page()
        finally:
            context.close()


def test_the_runs_records_say_what_ran_and_what_was_promoted(runs):
    a, b = runs["a"], runs["b"]
    assert a["status"] == b["status"] == "success" and a["model"] == MODEL
    assert (a["epochs"], b["epochs"]) == (2, 3) and a["resumed_from_step"] == 0
    assert a["image"]["digest"].startswith("sha256:") and a["dataset"]["version"] == b["dataset"]["version"]
    assert a["promotion"]["promoted"] is True and a["promotion"]["reason"].startswith(
        "promoted: promote=always"
    )
    assert b["promotion"] == {**b["promotion"], "promoted": False, "reason": "not promoted: promote=never"}
    assert a["metrics"]["monitor"] == "val_accuracy" and isinstance(a["metrics"]["value"], float)
    assert a["report_url"].endswith("/report/report.html") and a["mlflow"]["run_id"]


def test_the_training_page_lists_compares_and_ranks_the_runs(runs, page, tmp_path):
    from playwright.sync_api import expect

    airflow, a, b = runs["airflow"], runs["a"], runs["b"]
    page.goto(f"{airflow.url}/")
    expect(page).to_have_url(re.compile(r"/auth/login"))
    page.get_by_label("Username").fill(airflow.username)
    page.get_by_label("Password").fill(airflow.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r"^(?!.*auth/login).*$"))

    # The navigation's "Training" entry opens the page inside the Airflow UI.
    page.get_by_role("link", name="Training").first.click()
    page.wait_for_url("**/plugin/training**")
    frame = page.frame_locator("iframe[title='Training']")
    expect(frame.get_by_role("heading", name="Training runs")).to_be_visible(timeout=30_000)
    frame.locator("select[name=model]").select_option(MODEL)
    frame.get_by_role("button", name="Filter").click()
    rows = frame.locator("table.runs tbody tr")
    expect(rows).to_have_count(2)
    for record in (a, b):
        row = frame.locator(f"tr[data-ref='{record_ref(record)}']")
        expect(row).to_contain_text(record["run_id"])
        expect(row).to_contain_text(f"val_accuracy {record['metrics']['value']:.4g}")
    expect(frame.locator(f"tr[data-ref='{record_ref(b)}']")).to_contain_text("not promoted: promote=never")
    page.screenshot(path=str(tmp_path / "1-training-runs.png"), full_page=True)

    # Two runs side by side: one chart, the params that differ highlighted.
    frame.locator(f"tr[data-ref='{record_ref(a)}'] input[name=run]").check()
    frame.locator(f"tr[data-ref='{record_ref(b)}'] input[name=run]").check()
    frame.get_by_role("button", name="Compare selected").click()
    # the API server's first chart imports matplotlib: give it time on a loaded machine
    expect(frame.get_by_role("heading", name="2 runs compared")).to_be_visible(timeout=90_000)
    expect(frame.locator("figure.chart svg")).to_be_visible()
    epochs = frame.locator("table.params tr", has=frame.locator("th", has_text=re.compile(r"^epochs")))
    expect(epochs.first).to_have_class(re.compile(r"\bdiffers\b"))
    page.screenshot(path=str(tmp_path / "2-compare.png"), full_page=True)
    if os.environ.get("KUBETRAIN_DOCS_SCREENSHOT"):
        shutil.copy(tmp_path / "2-compare.png", REPO / "docs" / "training-compare.png")

    # The model's leaderboard marks A's version; its link opens the DAG run in Airflow, around the page.
    frame.get_by_role("link", name=MODEL).first.click()
    expect(frame.get_by_role("heading", name=f"Model {MODEL}")).to_be_visible(timeout=30_000)
    promoted_row = frame.locator("table.leaderboard tr.is-promoted")
    expect(promoted_row).to_have_count(1)
    expect(promoted_row).to_contain_text(a["run_id"])
    expect(frame.locator("table.promotions")).to_contain_text("promote=always")
    # docs/training-page.png is the leaderboard of `make demo`'s run in `make airflow`, not this one
    page.screenshot(path=str(tmp_path / "3-leaderboard.png"), full_page=True)
    promoted_row.get_by_role("link", name="Airflow run").click()
    page.wait_for_url(f"**/dags/{DAG_ID}/runs/{quote(a['run_id'], safe='')}**")
    expect(page.get_by_text(a["run_id"]).first).to_be_visible()


def record_ref(record: dict) -> str:
    from kubetrain.ui.queries import record_ref as ref

    return ref(record)


def test_mlflow_has_both_runs_their_history_and_the_champion(runs, stack):
    mlflow = stack["mlflow"].url
    a, b = runs["a"], runs["b"]

    def api(endpoint, **params):
        answer = requests.get(f"{mlflow}/api/2.0/mlflow/{endpoint}", params=params, timeout=30)
        assert answer.ok, f"{endpoint}: {answer.status_code} {answer.text[:300]}"
        return answer.json()

    experiment = api("experiments/get-by-name", experiment_name=MODEL)["experiment"]
    found = requests.post(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        json={"experiment_ids": [experiment["experiment_id"]]},
        timeout=30,
    ).json()["runs"]
    by_run = {next(t["value"] for t in r["data"]["tags"] if t["key"] == "kubetrain.run_id"): r for r in found}
    assert set(by_run) == {a["run_id"], b["run_id"]}
    for record, epochs in ((a, 2), (b, 3)):
        run = by_run[record["run_id"]]
        assert run["info"]["run_id"] == record["mlflow"]["run_id"] and run["info"]["status"] == "FINISHED"
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert params["epochs"] == str(epochs) and params["batch_size"] == "32"
        assert tags["kubetrain.dataset_version"] == record["dataset"]["version"]
        assert tags["kubetrain.image_digest"] == record["image"]["digest"]
        assert tags["airflow.dag_run"].endswith(f"/dags/{DAG_ID}/runs/{quote(record['run_id'], safe='')}")
        history = api("metrics/get-history", run_id=run["info"]["run_id"], metric_key="val_accuracy")[
            "metrics"
        ]
        assert len(history) == epochs
        steps = [m["step"] for m in history]
        assert steps == sorted(steps) and len(set(steps)) == epochs and steps[-1] == record["steps"]
        assert history[-1]["value"] == pytest.approx(record["metrics"]["final"]["val_accuracy"], rel=1e-4)
    champion = api("registered-models/alias", name=MODEL, alias="champion")["model_version"]
    assert champion["run_id"] == a["mlflow"]["run_id"]
    assert champion["source"] == a["promotion"]["model_uri"]
    pointer = json.loads(
        stack["s3"].get_object(Bucket="training", Key=f"models/{MODEL}/latest")["Body"].read()
    )
    assert pointer["uri"] == champion["source"] and pointer["version"] == a["promotion"]["version"]
    report = requests.get(
        f"{mlflow}/get-artifact",
        params={"path": "report/report.html", "run_uuid": a["mlflow"]["run_id"]},
        timeout=30,
    )
    assert report.ok and a["run_uri"] in report.text
