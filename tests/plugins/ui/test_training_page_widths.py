"""The Training page and the sweep leaderboard on 1280 to 1920 px wide screens, in headless Chromium.

The Training page is served by a real Airflow API server (its UI, its auth manager, the project's
eleven DAGs in its metadata DB) over run records seeded in the test S3 server as the record step
writes them: runs with long run ids and a long failure, a promoted version, and a sweep of five
trials. Each page (runs list, model leaderboard, sweep, compare) is loaded at 1280 and 1920 px,
alone and inside the Airflow UI's frame, and must not be wider than its window, with every row's
links column inside it. The sweep's leaderboard report is rendered from its inputs and measured
the same way.

The runs list offers only the DAGs that train, folds the sweep into one row, and the leaderboard
says "promoted" once. The time from the navigation's "Training" click to the page's heading is
measured and printed (``-s``) beside the page's own load time.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from training_records import T0, history_csv, make_record

from include.airflow_ui import AIRFLOW, AirflowUI, copy_metadata_db
from include.devstack.stack import free_port
from kubetrain.s3_layout import S3Layout
from kubetrain.ui.queries import record_ref

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
SEED_DB = Path(os.environ.get("AIRFLOW_HOME", REPO / ".airflow")) / "airflow.db"
CHROMIUM = Path("/usr/bin/chromium")
WIDTHS = (1280, 1920)
MODEL = "digits-widths"
SWEEP_DAG = "sweep_image_classifier"
SWEEP_RUN = "manual__2026-03-02T09:30:00.123456+00:00"
# run ids as Airflow makes them: long, no spaces
RUN_IDS = [f"scheduled__2026-03-02T08:0{i}:00.{i}08123+00:00" for i in range(3)]
LONG_ERROR = (
    "PodFailed: container 'base' of pod train-image-classifier-scheduled-2026-03-02t08-02-00-208123 "
    "was OOMKilled (exit code 137) after 412 s: its memory limit 2Gi was reached while decoding "
    "s3://datasets/some-team/a-rather-long-dataset-name-with-version/images/part-000017.tar"
)


def _readable_dags(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [row[0] for row in conn.execute("SELECT dag_id FROM dag")]


def _seed(store, client) -> dict:
    layout = S3Layout()
    seeded: dict = {"runs": [], "trials": []}
    for index, run_id in enumerate(RUN_IDS):
        status = "failed" if index == 2 else "success"
        record = make_record(
            dag_id="train_image_classifier",
            run_id=run_id,
            model=MODEL,
            when=T0 + timedelta(minutes=index),
            value=0.9 + index / 100 if status == "success" else None,
            status=status,
            promoted=index == 1,
            model_version="20260302T080100Z-3f1e2d4c" if index == 1 else None,
            hyper={"epochs": 3 + index, "batch_size": 32, "learning_rate": 0.001},
        )
        if status == "failed":
            record["failure"] = {"task": "train", "error": LONG_ERROR}
        record["mlflow"] = {
            "experiment_id": "1",
            "run_id": "a" * 32,
            "url": f"http://mlflow.example/#/runs/{'a' * 32}",
        }
        store.runs.write(record)
        client.put_object(
            Bucket="training",
            Key=layout.run("train_image_classifier", run_id).key("output", "history.csv"),
            Body=history_csv([1.0, 0.6, 0.4], [0.5, 0.7, 0.8 + index / 100]),
        )
        seeded["runs"].append(record)
    for trial, (rate, value, stopped) in enumerate(
        [
            (0.0003, 0.81, False),
            (0.001, 0.9, False),
            (0.003, 0.93, False),
            (0.006, 0.6, True),
            (0.01, 0.5, True),
        ]
    ):
        record = make_record(
            dag_id=SWEEP_DAG,
            run_id=SWEEP_RUN,
            model=MODEL,
            when=T0 + timedelta(minutes=90),
            trial=str(trial),
            value=value,
            hyper={"learning_rate": rate, "batch_size": 32, "epochs": 4},
            sweep={
                "id": f"{SWEEP_DAG}/{SWEEP_RUN}",
                "trial": str(trial),
                "stopped_early": stopped,
                "params": {"learning_rate": rate, "batch_size": 32 * (1 + trial % 2)},
            },
        )
        store.runs.write(record)
        seeded["trials"].append(record)
    store.write_json(
        "training",
        layout.model_latest_key(MODEL),
        {
            "kind": "kubetrain/model-pointer",
            "format_version": 1,
            "model": MODEL,
            "version": "20260302T080100Z-3f1e2d4c",
            "uri": f"s3://training/models/{MODEL}/20260302T080100Z-3f1e2d4c/",
            "run_uri": seeded["runs"][1]["run_uri"],
            "sync_pass": 1,
            "files": ["model.keras"],
            "promoted_at": "2026-03-02T08:12:00Z",
        },
    )
    return seeded


@pytest.fixture(scope="module")
def site(s3_server, tmp_path_factory):
    """`airflow api-server` (the UI and the Training page) on a copy of the project's metadata DB."""
    import boto3
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore

    aws = {
        "conn_type": "aws",
        "login": s3_server.access_key_id,
        "password": s3_server.secret_access_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.region},
    }
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
        region_name=s3_server.region,
    )
    before = os.environ.get("AIRFLOW_CONN_AWS_DEFAULT")
    os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps(aws)
    try:
        seeded = _seed(RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout()), client)
    finally:
        if before:
            os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = before
        else:
            os.environ.pop("AIRFLOW_CONN_AWS_DEFAULT", None)
    home = tmp_path_factory.mktemp("widths") / "airflow"
    home.mkdir()
    copy_metadata_db(SEED_DB, home / "airflow.db", pause_dags=True)
    ui = AirflowUI(
        home,
        {"AIRFLOW_CONN_AWS_DEFAULT": json.dumps(aws)},
        port=free_port(),
        env={"KUBETRAIN_TRAINING_BUCKET": "training"},
    )
    if len(_readable_dags(home / "airflow.db")) < 2:  # a seed DB that never saw the project's DAGs
        out = subprocess.run(
            [str(AIRFLOW), "dags", "reserialize"],
            env=ui.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
    with ui.api_server_only():
        yield {"ui": ui, "dags": _readable_dags(home / "airflow.db"), **seeded}


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (`make setup` does)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded machine renders slowly: assertions wait, as actions do
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"],
            headless=True,
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def signed_in(site, browser):
    """A browser context signed in to the Airflow UI as admin."""
    from playwright.sync_api import expect

    ui = site["ui"]
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(60_000)
    page = context.new_page()
    page.goto(f"{ui.url}/")
    expect(page).to_have_url(re.compile(r"/auth/login"))
    page.get_by_label("Username").fill(ui.username)
    page.get_by_label("Password").fill(ui.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r"^(?!.*auth/login).*$"))
    page.close()
    try:
        yield context
    finally:
        context.close()


def test_the_nav_click_shows_the_page_soon(site, signed_in):
    """The time from the navigation's click to the page's heading, the first time after the API server
    started (what a user meets first) and again, beside the page's own load time."""
    from playwright.sync_api import expect

    ui = site["ui"]
    # the API server warms the page as it starts (kubetrain.api.ReportsApp.warm_up_on_start), without
    # a request: its log says so, with the seconds it took
    log = ui.log_path("api-server")
    deadline = time.monotonic() + 300
    while "The Training page is warmed up for its first visit" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    page = signed_in.new_page()
    figures: dict[str, list[float]] = {"nav click": [], "alone": []}
    for _ in range(3):
        page.goto(f"{ui.url}/")
        link = page.get_by_role("link", name="Training").first
        expect(link).to_be_visible()
        started = time.monotonic()
        link.click()
        frame = page.frame_locator("iframe[title='Training']")
        expect(frame.get_by_role("heading", name="Training runs")).to_be_visible()
        figures["nav click"].append(time.monotonic() - started)
        started = time.monotonic()
        page.goto(f"{ui.url}/kubetrain/training/")
        expect(page.get_by_role("heading", name="Training runs")).to_be_visible()
        figures["alone"].append(time.monotonic() - started)
    page.close()
    print(
        "Training page, seconds to its heading:", {k: [round(v, 2) for v in vs] for k, vs in figures.items()}
    )


# Measured in the document that shows the page: its width against its window, and the right edge of
# every links cell (the column the frame used to cut) against the window's width.
MEASURE = """() => {
    const links = [...document.querySelectorAll('td.links')].map(td => td.getBoundingClientRect().right);
    return {scroll: document.documentElement.scrollWidth, view: window.innerWidth,
            links: links.length, right: Math.max(0, ...links)};
}"""


def _fits(sizes: dict) -> bool:
    return sizes["scroll"] <= sizes["view"] and sizes["right"] <= sizes["view"]


def _pages(site) -> dict[str, str]:
    from kubetrain.ui.queries import sweep_time

    runs, trials = site["runs"], site["trials"]
    return {
        "runs": "/",
        "model": f"/models/{MODEL}",
        "sweep": f"/sweeps/{SWEEP_DAG}/{SWEEP_RUN}?model={MODEL}&t={sweep_time(trials[0])}",
        "compare": "/compare?"
        + "&".join(f"run={record_ref(r)}" for r in (runs[0], runs[1], trials[2], trials[3])),
    }


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_fits_the_window_with_its_links_column(site, signed_in, width):
    from playwright.sync_api import expect

    page = signed_in.new_page()
    page.set_viewport_size({"width": width, "height": 900})
    base = f"{site['ui'].url}/kubetrain/training"
    found = {}
    for name, path in _pages(site).items():
        page.goto(base + path)
        expect(page.locator("main h1")).to_be_visible()
        found[name] = page.evaluate(MEASURE)
    page.close()
    assert all(found[name]["links"] for name in found), found
    assert [name for name, sizes in found.items() if not _fits(sizes)] == [], found


@pytest.mark.parametrize("width", WIDTHS)
def test_the_pages_fit_the_airflow_ui_frame(site, signed_in, width):
    """Inside the Airflow UI the page has less than the window (the navigation takes its share)."""
    from playwright.sync_api import expect

    page = signed_in.new_page()
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{site['ui'].url}/")
    page.get_by_role("link", name="Training").first.click()
    page.wait_for_url("**/plugin/training**")
    frame_locator = page.frame_locator("iframe[title='Training']")
    expect(frame_locator.get_by_role("heading", name="Training runs")).to_be_visible()
    # the iframe's own document (the UI also puts the frame's path in its own URL: not that one)
    frame = page.locator("iframe[title='Training']").element_handle().content_frame()
    assert frame is not None and frame != page.main_frame
    found = {}
    for name, path in _pages(site).items():
        frame.goto(f"{site['ui'].url}/kubetrain/training{path}")
        expect(frame.locator("main h1")).to_be_visible()
        found[name] = frame.evaluate(MEASURE)
    outer = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    page.close()
    assert outer[0] <= outer[1], outer
    assert all(sizes["view"] < width for sizes in found.values()), found  # measured inside the frame
    assert [name for name, sizes in found.items() if not _fits(sizes)] == [], found


def test_the_runs_list_offers_training_dags_and_folds_the_sweep(site, signed_in):
    from playwright.sync_api import expect

    assert {"build_trainer_image", "kubetrain_preflight"} <= set(site["dags"])  # the UI knows them
    page = signed_in.new_page()
    page.goto(f"{site['ui'].url}/kubetrain/training/?model={MODEL}")
    options = page.locator("select[name=dag_id] option").all_inner_texts()
    # the DAGs with run records: this test's, and those other tests of the session recorded in the same store
    assert options[0] == "all" and {SWEEP_DAG, "train_image_classifier"} <= set(options[1:]), options
    assert options[1:] == sorted(options[1:]), options
    not_training = {"build_trainer_image", "kubetrain_preflight", "kubetrain_run_index", "watch_datasets"}
    assert not_training & set(options) == set(), options
    rows = page.locator("table.runs tbody tr")
    expect(rows).to_have_count(len(RUN_IDS) + 1)  # the three runs and one row for the five trials
    sweep = page.locator("table.runs tbody tr.sweep-row")
    expect(sweep).to_have_count(1)
    expect(sweep).to_contain_text("5 trials")
    expect(sweep).to_contain_text("val_accuracy 0.93")  # the best trial's objective
    sweep.get_by_role("link", name=re.compile(r"^5 trials")).click()
    expect(page.locator("main h1")).to_have_text(f"Sweep {SWEEP_RUN}")
    expect(page.locator("table.sweep tbody tr")).to_have_count(5)
    page.close()


def test_the_leaderboard_says_promoted_once(site, signed_in):
    page = signed_in.new_page()
    page.goto(f"{site['ui'].url}/kubetrain/training/models/{MODEL}")
    cell = page.locator("table.leaderboard tr.is-promoted td.reason").inner_text()
    page.close()
    assert cell.lower().count("promoted") == 1, cell
    assert "20260302T080100Z-3f1e2d4c" in cell, cell


def _sweep_report_inputs(names: int = 3):
    """A finished asha sweep of 12 trials (stopped and failed ones among them) over the first ``names``
    of five hyperparameters, two of them searched on a log scale."""
    from kubetrain.report.sweep import SweepReportInputs

    space = {
        "learning_rate": {"low": 1e-5, "high": 1.0, "log": True, "type": "float"},
        "batch_size": {"choices": [16, 32, 64, 128]},
        "dropout": {"low": 0.0, "high": 0.5, "type": "float"},
        "weight_decay": {"low": 1e-6, "high": 1e-2, "log": True, "type": "float"},
        "label_smoothing": {"low": 0.0, "high": 0.2, "type": "float"},
    }
    trials = []
    for n in range(12):
        stopped = n % 3 == 2
        trials.append(
            {
                "trial": str(n),
                "number": n,
                "status": "success" if n != 11 else "failed",
                "error": "PodFailed: OOMKilled (exit code 137)" if n == 11 else None,
                "objective": {"value": 0.5 + n / 30} if n != 11 else {},
                "params": {
                    "learning_rate": 10 ** -(1 + n % 5) * 1.2345678,
                    "batch_size": [16, 32, 64, 128][n % 4],
                    "dropout": round(0.04 * n, 6),
                    "weight_decay": 10 ** -(2 + n % 4) * 3.3333333,
                    "label_smoothing": 0.0123456 * n,
                },
                "reports": 9 if not stopped else 3,
                "steps": 4500 if not stopped else 1500,
                "stopped_early": stopped,
                "early_stop": {"step": 3, "rung": 1, "rank": 3, "rung_trials": 4} if stopped else None,
                "wall_time_s": 1234.56,
                "accelerator_hours": 0.3429,
                "accelerator": "gpu",
                "report_url": f"/kubetrain/reports/sweep/training/runs/sweep/r/trials/{n}/report/report.html",
            }
        )
    plan = {
        "uri": "s3://training/runs/sweep_image_classifier/manual__2026-11-29T04:14:28.123456+00:00",
        "algorithm": "tpe",
        "seed": 7,
        "max_trials": 12,
        "parallel_trials": 4,
        "objective": {"metric": "val_accuracy", "mode": "max"},
        "early_stopping": {"rule": "asha", "min_resource": 1, "reduction_factor": 3, "grace": 1},
        "dataset": {"version": "04d598435446b7e2"},
        "image": "registry.example.com:5000/some-team/kubetrain/trainer@sha256:" + "9e" * 32,
        "space": dict(list(space.items())[:names]),
    }
    return SweepReportInputs(plan=plan, trials=trials, best=trials[10])


@pytest.mark.parametrize("width", WIDTHS)
def test_the_sweep_leaderboard_fits_the_screen_and_its_outcomes_read_in_two_lines(browser, width):
    from kubetrain.report.sweep import render_sweep_report

    html = render_sweep_report(_sweep_report_inputs())["report.html"].decode()
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.set_content(html)
    sizes = page.evaluate(
        """() => {
            const table = [...document.querySelectorAll('table')].find(t =>
                [...t.rows[0].cells].some(c => c.textContent === 'outcome'));
            const outcome = [...table.rows[0].cells].findIndex(c => c.textContent === 'outcome');
            const lines = [...table.rows].slice(1).map(row => {
                const cell = row.cells[outcome];
                const style = getComputedStyle(cell);
                const inner = cell.clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom);
                return Math.round(inner / parseFloat(style.lineHeight === 'normal' ? 1.2 * parseFloat(style.fontSize) : style.lineHeight));
            });
            const links = [...table.querySelectorAll('a')].map(a => a.getBoundingClientRect().right);
            return {scroll: document.documentElement.scrollWidth, view: window.innerWidth,
                    table: table.getBoundingClientRect().right, lines: Math.max(...lines),
                    right: Math.max(...links)};
        }"""
    )
    page.close()
    assert sizes["scroll"] <= sizes["view"] and sizes["table"] <= sizes["view"], sizes
    assert sizes["right"] <= sizes["view"], sizes  # the report links of the last column are on screen
    assert sizes["lines"] <= 2, sizes

    # a space of many hyperparameters: the table scrolls in its box, the page keeps the screen's width
    wide = render_sweep_report(_sweep_report_inputs(names=5))["report.html"].decode()
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.set_content(wide)
    scroll = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    page.close()
    assert scroll[0] <= scroll[1], scroll


def test_a_log_searched_hyperparameter_gets_a_log_axis_and_the_title_stays_in_the_figure():
    from kubetrain.report.sweep import _axis, parallel_coordinates_figure

    position, ticks = _axis({"low": 1e-5, "high": 1.0, "log": True})
    # equal ratios at equal distances: 1e-3 halfway between 1e-5 and 1e-1, a decade a fifth of the axis
    assert position(1e-3) == pytest.approx(0.4) and position(1e-1) == pytest.approx(0.8)
    assert [label for _, label in ticks] == ["1e-05", "0.0001", "0.001", "0.01", "0.1", "1"]
    assert [y for y, _ in ticks] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    linear, linear_ticks = _axis({"low": 0.0, "high": 0.5})
    assert linear(0.25) == pytest.approx(0.5) and len(linear_ticks) == 2

    figure = parallel_coordinates_figure(_sweep_report_inputs(names=5))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
    labels = [t.get_text() for t in axes.get_xticklabels()]
    assert labels == [
        "learning_rate\n(log scale)",
        "batch_size",
        "dropout",
        "weight_decay\n(log scale)",
        "label_smoothing",
        "val_accuracy",
    ]
    title = axes.title.get_window_extent(renderer)
    frame = figure.bbox
    assert frame.x0 <= title.x0 and title.x1 <= frame.x1 and frame.y0 <= title.y0 and title.y1 <= frame.y1, (
        title,
        frame,
    )
