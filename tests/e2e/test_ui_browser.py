"""The Airflow UI against the dev stack, driven in headless Chromium as a newcomer would use it.

Log in with the generated password, open train_image_classifier, see the trigger form open on
the Training and Model Params, have a dataset URI that is not s3://... refused in words, trigger
it with one Param changed (epochs), follow the run to success, and follow the report task's
"Training report" link to the HTML report, served by the Airflow API server from S3, which
says that the GPU request was served on CPU. Then unpause and trigger from the form five times
back to back: every run starts. Screenshots of each step are kept in the test's tmp dir.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from urllib.parse import quote, unquote, urlparse

import pytest
from ui_support import DAG_ID, log_in, shot

from kubetrain.s3_layout import S3Layout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def anonymous_status(url: str) -> int:
    """The HTTP status a request without the UI's session cookie gets."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


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

    # The trigger form, in the order people use it: the Training and Model Params open under
    # "Run Parameters", then Data, Resources, Cluster and Promotion folded.
    page.get_by_role("button", name="Trigger").first.click()
    form = page.get_by_role("dialog")
    expect(form.get_by_text(f"Trigger Dag - {DAG_ID}")).to_be_visible()
    expect(form.get_by_role("checkbox", name=f"Unpause {DAG_ID} on trigger")).to_be_checked()
    groups = [
        t.strip()
        for t in form.locator("[data-scope='accordion'][data-part='item-trigger']").all_inner_texts()
    ]
    assert groups[:5] == ["Run Parameters", "Data", "Resources", "Cluster", "Promotion"], groups
    epochs_field = form.locator("input[name='element_epochs']")
    expect(epochs_field).to_be_visible()  # open without a click
    expect(
        form.locator("input[name='element_architecture']").or_(form.get_by_text("Architecture")).first
    ).to_be_visible()
    dataset_field = form.locator("input[name='element_dataset_uri']")
    expect(dataset_field).to_be_hidden()  # folded
    shot(page, tmp_path, "2-trigger-form")

    # A dataset URI that is not s3://bucket/... is refused in words, not with a regular expression.
    form.get_by_role("button", name="Data").click()
    expect(dataset_field).to_be_visible()
    dataset_field.fill("datasets/digits/")
    form.get_by_role("button", name="Trigger", exact=True).click()
    refusal = form.get_by_text(
        re.compile(r"'datasets/digits/' is not a 'S3 URI: s3://<bucket>/<prefix>/")
    ).first
    expect(refusal).to_be_visible()
    assert "^s3://" not in refusal.inner_text()
    shot(page, tmp_path, "3-refused-dataset")
    assert [r for r in ui.runs(DAG_ID) if r["dag_run_id"] not in runs_before] == []
    # Airflow 3.3's form unpauses the DAG before it submits the run (TriggerDAGForm's onSubmit
    # does not wait for the answer), so even a refused submit unpauses it; kubetrain cannot
    # change that. docs/extending.md says so.
    assert ui.api("GET", f"/dags/{DAG_ID}")["is_paused"] is False
    ui.set_paused(DAG_ID, True)

    # The form keeps the refusal until it is closed: open it again, change epochs, submit.
    page.keyboard.press("Escape")
    expect(form).to_be_hidden()
    page.reload()
    page.get_by_role("button", name="Trigger").first.click()
    form = page.get_by_role("dialog")
    expect(form.get_by_role("checkbox", name=f"Unpause {DAG_ID} on trigger")).to_be_checked()
    epochs_field = form.locator("input[name='element_epochs']")
    expect(epochs_field).to_have_value(re.compile(r"^[0-9]+$"))
    epochs = 3 if epochs_field.input_value() == "2" else 2  # anything but the DAG's default
    epochs_field.fill(str(epochs))
    submit = form.get_by_role("button", name="Trigger", exact=True)
    try:
        expect(submit).to_be_enabled()
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
    assert ui.api("GET", f"/dags/{DAG_ID}")["is_paused"] is False, (
        "the form's unpause box did not unpause the DAG"
    )

    # The report task's documentation (its task page's "Documentation") is its operator's docstring.
    page.goto(f"{ui.url}/dags/{DAG_ID}/tasks/report")
    page.get_by_role("button", name="Documentation").click()
    docs = page.get_by_role("dialog")
    expect(docs.get_by_text("Task Documentation")).to_be_visible()
    expect(docs.get_by_text(re.compile(r"Render a training run's report into"))).to_be_visible()
    expect(docs.get_by_text("Arguments", exact=True)).to_be_visible()
    shot(page, tmp_path, "5-report-task-docs")
    page.keyboard.press("Escape")
    expect(docs).to_be_hidden()

    # The run as the UI shows it; from there the report task, its Details tab and the extra link.
    run_path = f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}"
    page.goto(ui.url + run_path)
    expect(page.get_by_text(run_id).first).to_be_visible()
    shot(page, tmp_path, "4-run")
    page.locator(f"a[href$='/runs/{run_id}/tasks/report']").first.click()
    page.wait_for_url("**/tasks/report")
    page.get_by_role("link", name="Details", exact=True).click()
    link = page.get_by_role("link", name="Training report")
    expect(link).to_be_visible()
    shot(page, tmp_path, "6-report-task")
    href = link.get_attribute("href")

    report = ui.api(
        "GET",
        f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/report/xcomEntries/return_value",
    )
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
    # The dev stack has no GPU node: the run's GPU request was served on CPU, and the report
    # says so in one line at the top, as the train task's log does.
    expect(report_page.locator("p.warning", has_text="GPU request served on CPU")).to_be_visible()
    notes = ui.api(
        "GET", f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train/xcomEntries/notes"
    )
    assert len(notes["value"]) == 1 and notes["value"][0].startswith("GPU request served on CPU"), notes
    train_try = ui.task_instances(DAG_ID, run_id)["train"]["try_number"]
    train_log = ui.api(
        "GET",
        f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train/logs/{train_try}?full_content=true",
    )
    assert [e for e in train_log["content"] if isinstance(e, dict) and e.get("event") == notes["value"][0]], (
        "the GPU line is not in the train task's log"
    )
    report_page.screenshot(path=str(tmp_path / "7-report.png"), full_page=True)


def test_the_form_unpauses_and_triggers_five_times_in_a_row_and_every_run_starts(ui, page, tmp_path):
    """The trigger form sends its unpause (PATCH /dags/<id>) together with the trigger. With four
    components writing one SQLite file, the unpause could wait on the file's lock and fail after 5 s
    (500), leaving the DAG paused and the run queued with no hint; on Postgres every one answers, and
    every run leaves "queued". Each run is failed once it runs, so that the next may start
    (max_active_runs=1) and no training takes place: seconds, not minutes."""
    from playwright.sync_api import expect

    runs_before = {r["dag_run_id"] for r in ui.runs(DAG_ID)}
    log_in(page, ui, f"/dags/{DAG_ID}")
    answers = []
    for attempt in range(5):
        ui.set_paused(DAG_ID, True)
        # the DAG's own page each time: the UI moves to the new run's page after a trigger, and that
        # page polls the running run's task instances, which is what the machine was busiest with
        page.goto(f"{ui.url}/dags/{DAG_ID}")
        page.get_by_role("button", name="Trigger").first.click()
        form = page.get_by_role("dialog")
        # the form renders once the DAG's details and Params have arrived: with the suite and two
        # CPU hogs beside it, an attempt took about a minute and the form once more than 30 s
        expect(form).to_be_visible(timeout=120_000)
        expect(form.get_by_role("checkbox", name=f"Unpause {DAG_ID} on trigger")).to_be_checked()
        submit = form.get_by_role("button", name="Trigger", exact=True)
        expect(submit).to_be_enabled()
        started = time.monotonic()
        with (
            page.expect_response(
                lambda r: r.request.method == "PATCH" and f"/dags/{DAG_ID}" in r.url
            ) as unpause,
            page.expect_response(
                lambda r: r.request.method == "POST" and r.url.endswith("/dagRuns")
            ) as trigger,
        ):
            submit.click()
        answers.append((unpause.value.status, trigger.value.status, round(time.monotonic() - started, 1)))
        assert unpause.value.ok and trigger.value.ok, (
            f"attempt {attempt + 1}: unpause, trigger, seconds: {answers}"
        )
        page.keyboard.press("Escape")
    shot(page, tmp_path, "five-triggers")
    assert ui.api("GET", f"/dags/{DAG_ID}")["is_paused"] is False

    new = [r["dag_run_id"] for r in ui.runs(DAG_ID) if r["dag_run_id"] not in runs_before]
    assert len(new) == 5, f"5 submits made {len(new)} runs: {new}; answers {answers}"
    started_runs: dict[str, str] = {}
    deadline = time.monotonic() + 180
    try:
        while len(started_runs) < len(new):
            for run in ui.runs(DAG_ID):
                run_id = run["dag_run_id"]
                if run_id in new and run_id not in started_runs and run["state"] != "queued":
                    started_runs[run_id] = run["state"]
                    if run["state"] == "running":
                        ui.set_run_state(DAG_ID, run_id, "failed")
            assert time.monotonic() < deadline, (
                f"runs still queued after 180 s: {sorted(set(new) - set(started_runs))}; started: {started_runs}"
            )
            time.sleep(1)
    finally:
        ui.set_paused(DAG_ID, True)
    assert set(started_runs.values()) <= {"running", "failed", "success"}, started_runs
