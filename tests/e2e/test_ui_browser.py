"""The Airflow UI against the dev stack, driven in headless Chromium as a newcomer would use it.

Log in with the generated password, open train_image_classifier, trigger it from the trigger
form with one Param changed (epochs), follow the run to success, and follow the report
task's "Training report" link to the HTML report, served by the Airflow API server from S3. Screenshots of each
step are kept in the test's tmp dir.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

import pytest

from kubetrain.s3_layout import S3Layout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
DAG_ID = "train_image_classifier"


@pytest.fixture(scope="module")
def ui(airflow_ui, devstack, tmp_path_factory):
    """The session's Airflow (`make airflow`), with a small digits dataset uploaded."""
    import boto3

    stack_env = devstack.env()
    work = tmp_path_factory.mktemp("ui")
    archive = work / "digits.zip"
    # Unreadable files from a fresh seed make this upload a dataset version no other test trained.
    subprocess.run(
        [str(TRAINER_PYTHON), "-m", "include.sample_data.digits", "--out", str(archive), "--size", "16",
         "--per-class", "24", "--corrupt", "2", "--seed", str(secrets.randbelow(2**31))],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    s3 = boto3.client(
        "s3",
        endpoint_url=stack_env["KUBETRAIN_S3_ENDPOINT"],
        aws_access_key_id=stack_env["KUBETRAIN_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=stack_env["KUBETRAIN_S3_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    s3.upload_file(str(archive), "datasets", "digits/digits.zip")
    yield airflow_ui


@pytest.fixture
def page(tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (`make setup` does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        context.set_default_timeout(30_000)
        try:
            yield context.new_page()
        finally:
            context.close()


def anonymous_status(url: str) -> int:
    """The HTTP status a request without the UI's session cookie gets."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def shot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)


def test_trigger_from_the_form_and_follow_the_report_link(ui, page, tmp_path):
    from playwright.sync_api import expect

    runs_before = {r["dag_run_id"] for r in ui.runs(DAG_ID)}

    # Log in: an unauthenticated visit lands on the SimpleAuthManager's sign-in page.
    page.goto(f"{ui.url}/dags/{DAG_ID}")
    expect(page).to_have_url(re.compile(r"/auth/login"))
    page.get_by_label("Username").fill(ui.username)
    page.get_by_label("Password").fill(ui.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/dags/{DAG_ID}")
    expect(page.get_by_text("stage_dataset").first).to_be_visible()
    shot(page, tmp_path, "1-dag")

    # The trigger form: its Params sections, the unpause box ticked, epochs changed.
    page.get_by_role("button", name="Trigger").first.click()
    form = page.get_by_role("dialog")
    expect(form.get_by_text(f"Trigger Dag - {DAG_ID}")).to_be_visible()
    expect(form.get_by_role("checkbox", name=f"Unpause {DAG_ID} on trigger")).to_be_checked()
    form.get_by_role("button", name="Training").click()
    epochs_field = form.locator("input[name='element_epochs']")
    expect(epochs_field).to_have_value(re.compile(r"^[0-9]+$"))
    epochs = 3 if epochs_field.input_value() == "2" else 2  # anything but the DAG's default
    epochs_field.fill(str(epochs))
    shot(page, tmp_path, "2-trigger-form")
    submit = form.get_by_role("button", name="Trigger", exact=True)
    try:
        expect(submit).to_be_enabled(timeout=5_000)
    except AssertionError:
        # The form takes an empty text field for a missing value, which only a "null"-typed Param allows.
        empty = form.locator("input[name^='element_']").evaluate_all(
            "els => els.filter(e => e.type === 'text' && e.value === '').map(e => e.name.slice('element_'.length))"
        )
        pytest.fail(
            "the trigger form refuses the DAG's default Params (its Trigger button stays disabled); "
            f"Params left empty: {empty}; screenshot: {tmp_path / '2-trigger-form.png'}"
        )
    submit.click()

    def new_run():
        runs = [r for r in ui.runs(DAG_ID) if r["dag_run_id"] not in runs_before]
        return runs[0] if runs else None

    deadline = time.monotonic() + 30
    while (run := new_run()) is None:
        assert time.monotonic() < deadline, "submitting the trigger form created no run"
        time.sleep(1)
    run_id = run["dag_run_id"]
    assert run["run_type"] == "manual"
    assert run["conf"]["epochs"] == epochs, run["conf"]

    final = ui.wait_run(DAG_ID, run_id, timeout=420)
    states = {k: v["state"] for k, v in ui.task_instances(DAG_ID, run_id).items()}
    errors = {k: ui.task_errors(DAG_ID, run_id, k) for k, state in states.items() if state == "failed"}
    assert final["state"] == "success", f"run {run_id} ended {final['state']}: {states}; errors: {errors}"
    assert ui.api("GET", f"/dags/{DAG_ID}")["is_paused"] is False, "the form's unpause box did not unpause the DAG"

    # The run as the UI shows it; from there the report task, its Details tab and the extra link.
    run_path = f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}"
    page.goto(ui.url + run_path)
    expect(page.get_by_text(run_id).first).to_be_visible()
    shot(page, tmp_path, "3-run")
    page.locator(f"a[href$='/runs/{run_id}/tasks/report']").first.click()
    page.wait_for_url("**/tasks/report")
    page.get_by_role("link", name="Details", exact=True).click()
    link = page.get_by_role("link", name="Training report")
    expect(link).to_be_visible()
    shot(page, tmp_path, "4-report-task")
    href = link.get_attribute("href")

    report = ui.api("GET", f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/report/xcomEntries/return_value")
    value = report["value"]
    run_location = S3Layout.from_environment().run(DAG_ID, run_id)
    report_key = run_location.key("report", "report.html")
    assert value["report_uri"] == f"s3://{run_location.bucket}/{report_key}"
    assert href == value["report_url"]
    parsed = urlparse(href)
    assert (parsed.scheme, parsed.netloc) == (urlparse(ui.url).scheme, urlparse(ui.url).netloc), href
    assert unquote(parsed.path) == f"/kubetrain/reports/{DAG_ID}/{run_location.bucket}/{report_key}", href
    assert value["epochs"] == epochs  # what the trainer ran, as metrics.json reports it

    # The link opens the report itself through the Airflow API server, with the viewer's login:
    # the browser needs neither S3 credentials nor a readable bucket.
    response = page.request.get(href)
    assert response.ok, f"the Training report link {href} answered {response.status} to the browser"
    assert response.headers["content-type"].startswith("text/html"), response.headers
    assert "default-src 'none'" in response.headers["content-security-policy"]
    assert run_location.uri in response.text()
    status = anonymous_status(href)
    assert status in (401, 403), f"the report was served to a request without an Airflow login ({status})"
    if link.get_attribute("target") == "_blank":
        with page.context.expect_page() as opened:
            link.click()
        report_page = opened.value
    else:
        link.click()
        report_page = page
    report_page.wait_for_load_state()
    assert report_page.url == href
    expect(report_page.locator("img").first).to_be_visible()
    report_page.screenshot(path=str(tmp_path / "5-report.png"), full_page=True)
