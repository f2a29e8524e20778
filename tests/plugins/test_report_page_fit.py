"""Small things a reader of a report and of the Training page meets first.

* A run with no promoted model to compare with says so in a sentence that reads right.
* The report's summary table stays within the page, a long image reference by digest included
  (measured in Chromium, the browser the UI tests use).
* A promotion reason that the Runs page cuts to two lines carries its full text as a tooltip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.report.inputs import ReportInputs, compare, parse_history
from kubetrain.report.render import render_report
from kubetrain.ui.app import templates

CHROMIUM = Path("/usr/bin/chromium")
IMAGE = (
    "registry.example.com:5000/some-team/kubetrain/trainer@sha256:" + "9efdd109550212ae3cd978e7f074fbd2" * 2
)
METRICS = {
    "trainer": "image_classifier",
    "task": "classification",
    "monitor": "val_accuracy",
    "monitor_mode": "max",
    "final": {"loss": 0.49, "val_accuracy": 0.94},
    "best": {"val_accuracy": 0.94, "epoch": 4},
    "epochs": 4,
}


def report(promoted: dict | None) -> dict[str, bytes]:
    return render_report(
        ReportInputs(
            run_uri="s3://training/runs/train_image_classifier/manual__2026-11-26T19_38_54.007834_00_00-f8cfc903",
            metrics=METRICS,
            history=parse_history(b"epoch,loss,val_accuracy\n1,1.7,0.16\n2,0.99,0.9\n"),
            params={"image": IMAGE, "dataset_version": "04d598435446b7e2", "hyperparameters": {"epochs": 4}},
            comparison=compare(METRICS, promoted, "v1" if promoted else None),
        )
    )


def test_a_first_model_is_not_called_better_than_a_promoted_one_that_does_not_exist():
    files = report(None)
    html, markdown = files["report.html"].decode(), files["report.md"].decode()
    assert (
        '<p class="neutral">No model was promoted before: there is none to compare this model with.</p>'
        in html
    )
    assert "**No model was promoted before: there is none to compare this model with.**" in markdown
    assert "the promoted model: no model is promoted yet" not in html + markdown
    # with a promoted model, the verdict names it as before
    compared = report({**METRICS, "final": {"val_accuracy": 0.9}})["report.html"].decode()
    assert "This model is better than the promoted model: val_accuracy 0.94" in compared


def test_the_summary_table_fits_the_page_with_a_long_image_reference(tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (`make setup` does)")
    from playwright.sync_api import sync_playwright

    html = report(None)["report.html"].decode()
    assert IMAGE in html
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"], headless=True
        )
        try:
            for width in (1280, 700):
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.set_content(html)
                sizes = page.evaluate(
                    """() => {
                        const table = document.querySelector('table.summary');
                        return {page: document.documentElement.scrollWidth, view: window.innerWidth,
                                table: table.getBoundingClientRect().right};
                    }"""
                )
                assert sizes["page"] <= sizes["view"] and sizes["table"] <= sizes["view"], (width, sizes)
                page.close()
        finally:
            browser.close()


def test_a_cut_promotion_reason_has_its_full_text_as_a_tooltip():
    reason = (
        "not promoted: promote=if_better and val_accuracy 0.941504 was not better than the promoted 0.941504 "
        "(max), lost to version 20261126T172104Z-e03ce3a4 on dataset version 04d598435446b7e2"
    )
    macros = templates().get_template("macros.html").module
    cut = str(macros.promotion({"promotion": {"promoted": False, "reason": reason}}))
    assert 'class="muted clamp"' in cut and f'title="{reason}"' in cut
    promoted = str(macros.promotion({"promotion": {"promoted": True, "version": "v2", "reason": reason}}))
    assert f'title="{reason}"' in promoted and "promoted v2" in promoted
