"""Render a run report: a self-contained HTML page (plots inlined) and a Markdown summary."""

from __future__ import annotations

import base64
import html
import json
from typing import Any

from kubetrain.report.inputs import ReportInputs
from kubetrain.report.plots import all_plots

MAX_SAMPLES = 20

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5rem 0; } td, th { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } code { font-size: 0.9em; } figure { margin: 1rem 0; } img { max-width: 100%; }
.better { color: #1a7f37; font-weight: bold; } .worse { color: #9a6700; font-weight: bold; }
.warning { background: #fff8c5; border: 1px solid #d4a72c; padding: 0.4rem 0.6rem; }
"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def summary_rows(inputs: ReportInputs) -> list[tuple[str, str]]:
    """The headline facts of a run as (label, value) pairs, shared by HTML and Markdown."""
    m = inputs.metrics
    rows = [("Run", inputs.run_uri), ("Trainer", _fmt(m.get("trainer"))), ("Task", _fmt(m.get("task")))]
    monitor = m["monitor"]
    rows.append(("Monitor", f"{monitor} ({m['monitor_mode']})"))
    for name, value in sorted(m["final"].items()):
        rows.append((f"Final {name}", _fmt(value)))
    best = m.get("best")
    if isinstance(best, dict) and best:
        epoch = best.get("epoch")
        rows.append(
            (
                f"Best {monitor}",
                f"{_fmt(best.get(monitor))}" + (f" at epoch {epoch}" if epoch is not None else ""),
            )
        )
    for key, label in (
        ("epochs", "Epochs"),
        ("steps", "Steps"),
        ("resumed_from_step", "Resumed from step"),
        ("wall_time_s", "Wall time (s)"),
        ("examples_per_s", "Examples per second"),
        ("devices", "Devices"),
        ("workers", "Workers"),
        ("strategy", "Distribution"),
        ("skipped_files", "Skipped input files"),
    ):
        if key in m:
            value = m[key]
            rows.append((label, ", ".join(map(str, value)) if isinstance(value, list) else _fmt(value)))
    params = inputs.params or {}
    for key, label in (
        ("dataset_version", "Dataset version"),
        ("image", "Image"),
        ("code_version", "Code version"),
    ):
        if params.get(key):
            rows.append((label, _fmt(params[key])))
    return rows


def _comparison_text(inputs: ReportInputs) -> str | None:
    c = inputs.comparison
    if c is None:
        return None
    verdict = "better than the promoted model" if c.better else "not better than the promoted model"
    return f"{verdict}: {c.reason}" + (
        f" (promoted version {c.promoted_version})" if c.promoted_version else ""
    )


def render_html(inputs: ReportInputs, plots: dict[str, tuple[str, bytes]]) -> str:
    """A single HTML file with every plot inlined as a base64 PNG data URI."""
    e = html.escape
    title = inputs.title or f"Training report: {inputs.metrics.get('trainer') or 'run'}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    parts += [f'<p class="warning">{e(w)}</p>' for w in inputs.warnings]
    comparison = _comparison_text(inputs)
    if comparison:
        css = "better" if inputs.comparison and inputs.comparison.better else "worse"
        parts.append(f'<p class="{css}">This model is {e(comparison)}.</p>')
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary_rows(inputs)]
    parts.append("</table>")
    hyper = (inputs.params or {}).get("hyperparameters")
    if isinstance(hyper, dict) and hyper:
        parts.append("<h2>Hyperparameters</h2><table>")
        parts += [
            f"<tr><th>{e(str(k))}</th><td><code>{e(_fmt(v))}</code></td></tr>"
            for k, v in sorted(hyper.items())
        ]
        parts.append("</table>")
    if plots:
        parts.append("<h2>Curves</h2>")
        for name, (caption, png) in plots.items():
            data = base64.b64encode(png).decode("ascii")
            parts.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{e(caption)}">'
                f"<figcaption>{e(caption)} <code>{e(name)}</code></figcaption></figure>"
            )
    if inputs.history is not None and inputs.history.rows:
        columns = inputs.history.columns
        parts.append("<h2>History</h2><table><tr>" + "".join(f"<th>{e(c)}</th>" for c in columns) + "</tr>")
        for row in inputs.history.rows:
            parts.append("<tr>" + "".join(f"<td>{e(_fmt(row.get(c)))}</td>" for c in columns) + "</tr>")
        parts.append("</table>")
    if inputs.samples:
        parts.append(
            "<h2>Sample replies</h2><table><tr><th>Step</th><th>Input</th><th>Reply</th><th>Reference</th></tr>"
        )
        for sample in inputs.samples[-MAX_SAMPLES:]:
            cells = (sample.get("step"), sample.get("input"), sample.get("reply"), sample.get("reference"))
            parts.append("<tr>" + "".join(f"<td>{e(_fmt(c))}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    if inputs.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in inputs.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _md(value: Any) -> str:
    # Table cells: no pipes or line breaks, which would break the row.
    return _fmt(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def render_markdown(inputs: ReportInputs, plots: dict[str, tuple[str, bytes]]) -> str:
    """A Markdown summary; plots are referenced as the PNG files next to it."""
    title = inputs.title or f"Training report: {inputs.metrics.get('trainer') or 'run'}"
    lines = [f"# {_md(title)}", ""]
    for warning in inputs.warnings:
        lines += [f"> **{_md(warning)}**", ""]
    comparison = _comparison_text(inputs)
    if comparison:
        lines += [f"**This model is {_md(comparison)}.**", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {_md(k)} | {_md(v)} |" for k, v in summary_rows(inputs)]
    hyper = (inputs.params or {}).get("hyperparameters")
    if isinstance(hyper, dict) and hyper:
        lines += ["", "## Hyperparameters", "", "| name | value |", "|---|---|"]
        lines += [f"| {_md(k)} | `{_md(v)}` |" for k, v in sorted(hyper.items())]
    if plots:
        lines += ["", "## Curves", ""]
        lines += [f"![{_md(caption)}]({name})" for name, (caption, _) in plots.items()]
    if inputs.samples:
        lines += ["", "## Sample replies", "", "| step | input | reply | reference |", "|---|---|---|---|"]
        for s in inputs.samples[-MAX_SAMPLES:]:
            lines.append(
                f"| {_md(s.get('step'))} | {_md(s.get('input'))} | {_md(s.get('reply'))} | {_md(s.get('reference'))} |"
            )
    if inputs.notes:
        lines += ["", "## Notes", ""] + [f"- {_md(n)}" for n in inputs.notes]
    return "\n".join(lines) + "\n"


def render_report(inputs: ReportInputs) -> dict[str, bytes]:
    """Every report file by name: ``report.html``, ``report.md`` and the PNG plots."""
    plots = all_plots(inputs.history, inputs.confusion)
    files = {name: png for name, (_, png) in plots.items()}
    files["report.html"] = render_html(inputs, plots).encode("utf-8")
    files["report.md"] = render_markdown(inputs, plots).encode("utf-8")
    return files
