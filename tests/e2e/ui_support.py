"""The Airflow UI of the end-to-end tests: Airflow as `make airflow` starts it, and headless Chromium.

``airflow_ui`` starts Airflow (API server, scheduler, DAG processor, triggerer) in a private
home against the dev stack (its metadata DB a database of the stack's Postgres), with a small digits dataset uploaded; tests/e2e/conftest.py makes
it the session's ``ui`` fixture, so that every browser and live-log test shares one Airflow.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from include.airflow_ui import AirflowUI
from include.devstack.stack import free_port, s3_client

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DAG_ID = "train_image_classifier"


@contextlib.contextmanager
def airflow_ui(
    stack_env: dict[str, str], work: Path, dags: tuple[str, ...] = (DAG_ID,)
) -> Iterator[AirflowUI]:
    """Airflow as `make airflow` starts it, in a private home, with a small digits dataset uploaded."""

    archive = work / "digits.zip"
    # Unreadable files from a fresh seed make this upload a dataset version no other test trained.
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
            "24",
            "--corrupt",
            "2",
            "--seed",
            str(secrets.randbelow(2**31)),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    s3 = s3_client(stack_env)
    s3.upload_file(str(archive), "datasets", "digits/digits.zip")
    with AirflowUI(
        work / "airflow",
        stack_env,
        port=free_port(),
        paused_at_creation=True,
        env={
            "KUBETRAIN_IMAGE_CLASSIFIER_CRON": "",
            "KUBETRAIN_IMAGE_BUILD_CRON": "",
            "KUBETRAIN_RETRY_DELAY_SECONDS": "5",
        },
    ) as airflow:
        airflow.wait_dags(dags)
        yield airflow


@contextlib.contextmanager
def chromium_page(profile: Path):
    """A headless Chromium page (Debian's chromium, driven by Playwright)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (`make setup` does)")
    from playwright.sync_api import expect, sync_playwright

    # a loaded machine renders the UI slowly: every action and every assertion waits for its
    # condition up to 30 s (Playwright's assertions have a default of their own, 5 s)
    expect.set_options(timeout=30_000)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
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


def log_in(page, ui: AirflowUI, path: str) -> None:
    """Open ``path``; an unauthenticated visit lands on the SimpleAuthManager's sign-in page first."""
    from playwright.sync_api import expect

    page.goto(f"{ui.url}{path}")
    if "/auth/login" not in page.url:
        expect(page).to_have_url(re.compile(r"/auth/login"))
    page.get_by_label("Username").fill(ui.username)
    page.get_by_label("Password").fill(ui.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**{path}")


def shot(page, folder: Path, name: str) -> Path:
    """A full-page screenshot ``<folder>/<name>.png``, kept as the test's artifact."""
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
