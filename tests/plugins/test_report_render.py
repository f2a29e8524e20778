"""The run report and the sweep leaderboard render from their templates; hostile names stay text."""

from __future__ import annotations

import base64
import re

import pytest

from kubetrain.report.inputs import ReportInputs, compare, parse_history
from kubetrain.report.render import TEMPLATES, environment, render_report
from kubetrain.report.sweep import SweepReportInputs, render_sweep_report

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
# A metric, a model or a trial named by whoever wrote the training code or the DAG's conf.
METRIC = f"val_{HOSTILE}"
HISTORY = f"""epoch,step,loss,{HOSTILE},val_loss,{METRIC},learning_rate,wall_time_s
1,40,1.92,0.41,1.55,0.52,0.001,3.1
2,80,1.10,0.68,0.98,0.71,0.0005,6.0
""".encode()


def run_inputs() -> ReportInputs:
    metrics = {
        "trainer": HOSTILE,
        "task": "classification",
        "monitor": METRIC,
        "monitor_mode": "max",
        "final": {"loss": 1.1, METRIC: 0.71},
        "best": {METRIC: 0.71, "epoch": 2},
        "epochs": 2,
    }
    promoted = {**metrics, "final": {METRIC: 0.5}}
    return ReportInputs(
        run_uri="s3://training/runs/x",
        metrics=metrics,
        history=parse_history(HISTORY),
        params={"hyperparameters": {HOSTILE: f"{HOSTILE} | x"}, "image": HOSTILE},
        comparison=compare(metrics, promoted, f"v-{HOSTILE}"),
        warnings=[f"GPU request on {HOSTILE}"],
        notes=[HOSTILE],
    )


def sweep_inputs() -> SweepReportInputs:
    trials = [
        {
            "trial": f"trial-{HOSTILE}",
            "number": n,
            "status": "success",
            "objective": {"value": value},
            "params": {HOSTILE: choice, "learning_rate": rate},
            "reports": 3,
            "steps": 30,
            "wall_time_s": 9.5,
            "report_url": f'/kubetrain/reports/d/training/{n}/report.html?a=1&b="{HOSTILE}"',
        }
        for n, (value, choice, rate) in enumerate(((0.9, HOSTILE, 0.01), (0.7, "plain", 0.001)))
    ]
    trials.append({"trial": "trial-2", "number": 2, "status": "failed", "error": HOSTILE, "params": {}})
    plan = {
        "uri": f"s3://training/{HOSTILE}",
        "algorithm": "random",
        "seed": 7,
        "max_trials": 3,
        "parallel_trials": 2,
        "objective": {"metric": METRIC, "mode": "max"},
        "early_stopping": {"rule": "off"},
        "dataset": {"version": "3f2a"},
        "image": "localhost:5000/kubetrain/trainer:1",
        "space": {
            HOSTILE: {"choices": [HOSTILE, "plain"]},
            "learning_rate": {"low": 0.0001, "high": 0.1, "log": True},
        },
    }
    return SweepReportInputs(plan=plan, trials=trials, best=trials[0], title=f"Sweep of {HOSTILE}")


def test_the_run_report_escapes_hostile_names():
    files = render_report(run_inputs())
    html = files["report.html"].decode()
    assert "<script" not in html
    assert f"<title>Training report: {ESCAPED}</title>" in html
    assert f"<th>Final val_{ESCAPED}</th><td>0.71</td>" in html  # the metric's name, in the summary
    assert f'<p class="warning">GPU request on {ESCAPED}</p>' in html
    assert f"<th>{ESCAPED}</th><td><code>{ESCAPED} | x</code></td>" in html  # hyperparameters
    assert f"<th>val_{ESCAPED}</th>" in html  # the history's column
    assert f"This model is better than the promoted model: val_{ESCAPED} 0.71" in html
    assert f"(promoted version v-{ESCAPED})." in html
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)">', html)
    assert [alt for _, alt in images] == ["Loss per epoch", f"{ESCAPED} per epoch", "Learning rate per epoch"]
    names = ["loss.png", "_script_alert_1___script_.png", "learning_rate.png"]
    assert [base64.b64decode(data) for data, _ in images] == [files[name] for name in names]

    markdown = files["report.md"].decode()
    assert markdown.startswith(
        f"# Training report: {HOSTILE}\n\n> **GPU request on {HOSTILE}**\n\n<!-- kubetrain:promotion -->\n**This"
    )
    assert f"| {HOSTILE} | `{HOSTILE} \\| x` |" in markdown  # a pipe would split the row
    assert f"![{HOSTILE} per epoch](_script_alert_1___script_.png)" in markdown
    assert markdown.endswith(f"\n\n## Notes\n\n- {HOSTILE}\n")
    assert "\n\n\n" not in markdown


def test_the_sweep_report_escapes_hostile_names():
    files = render_sweep_report(sweep_inputs())
    assert sorted(files) == ["objective.png", "parallel_coordinates.png", "report.html", "report.md"]
    html = files["report.html"].decode()
    assert "<script" not in html
    assert f"<h1>Sweep of {ESCAPED}</h1>" in html
    assert (
        f"<tr><th>rank</th><th>trial</th><th>{ESCAPED}</th><th>learning_rate</th><th>val_{ESCAPED}</th>"
        in html
    )
    assert f"<td>trial-{ESCAPED}</td>" in html and f"<td>failed: {ESCAPED}</td>" in html
    # the link stays inside its attribute: quotes and ampersands escaped
    assert (
        f'<a href="/kubetrain/reports/d/training/0/report.html?a=1&amp;b=&#34;{ESCAPED}&#34;">report</a>'
        in html
    )
    assert html.count("data:image/png;base64,") == 2

    markdown = files["report.md"].decode()
    header = f"| rank | trial | {HOSTILE} | learning_rate | val_{HOSTILE} | reports | steps | outcome |"
    columns = "trainer wall (s) | CPU-hours | report |"
    assert f"\n\n## Trials\n\n{header} {columns}\n|{'---|' * 11}\n| 1 | trial-" in markdown
    # no hours, no report: empty cells
    assert f"| 3 | trial-2 |  |  |  |  |  | failed: {HOSTILE} |  |  |  |\n" in markdown
    assert markdown.endswith(
        f"\n\n## Plots\n\n![val_{HOSTILE} per trial](objective.png)\n"
        "![Parallel coordinates: hyperparameters against the objective](parallel_coordinates.png)\n"
    )
    assert "\n\n\n" not in markdown


@pytest.mark.parametrize(("name", "escaped"), [("page.html", True), ("page.md", False)])
def test_html_templates_autoescape_and_markdown_ones_do_not(name, escaped):
    values = {"title": HOSTILE, "warnings": [], "comparison": None, "summary": []}
    page = environment().get_template(f"report/{name}").render(values)
    assert (ESCAPED in page) is escaped and (HOSTILE in page) is not escaped
    assert (TEMPLATES / "report" / name).is_file()


def test_after_the_warm_up_a_report_renders_without_loading_anything_more():
    """A sweep trial's task warms the renderer while its pod runs (TrialPodCallbacks.on_pod_starting):
    rendering a report afterwards, in the same process, imports no module and opens no template."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "sys.path[:0] = ['tests/plugins', 'plugins', 'trainer']\n"
        "from test_report_render import run_inputs\n"
        "from kubetrain.report.render import environment, render_report, warm_up\n"
        "assert 'matplotlib' not in sys.modules\n"
        "inputs = run_inputs()\n"
        "warm_up()\n"
        "modules, templates = set(sys.modules), len(environment().cache)\n"
        "files = render_report(inputs)\n"
        "assert files['report.html'] and any(name.endswith('.png') for name in files), sorted(files)\n"
        "print(sorted(set(sys.modules) - modules), len(environment().cache) - templates)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "0"], proc.stdout


def test_a_dialogue_report_gives_the_baseline_what_ran_and_the_exported_models_replies():
    metrics = {
        "trainer": "dialogue",
        "monitor": "val_loss",
        "monitor_mode": "min",
        "final": {"val_loss": 0.61},
        "unigram_val_loss": 4.4,
        "warmup_steps": 23,
        "precision": "float32",
        "steps_per_execution": 1,
        "jit_compile": False,
        "val_samples": [{"input": "hello", "reply": "hi there", "reference": "hi"}],
    }
    html = render_report(ReportInputs(run_uri="s3://training/runs/d", metrics=metrics))[
        "report.html"
    ].decode()
    for row in (
        "<th>Unigram baseline val_loss</th><td>4.4</td>",
        "<th>Warm-up steps</th><td>23</td>",
        "<th>Precision</th><td>float32</td>",
        "<th>Steps per call</th><td>1</td>",
    ):
        assert row in html
    assert "<td>exported</td><td>hello</td><td>hi there</td><td>hi</td>" in html
