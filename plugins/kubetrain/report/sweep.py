"""A sweep's leaderboard: the trials ranked by the objective, as HTML and Markdown, with two plots.

* ``objective.png``: the objective of every trial by trial number (stopped and failed trials marked);
* ``parallel_coordinates.png``: one axis per hyperparameter and one for the objective, one line
  per trial coloured by its objective (log ranges on a log axis, choices at even positions).

Nothing here touches S3 or Airflow; matplotlib is imported only when plots are drawn.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.report.inputs import Comparison
from kubetrain.report.plots import _figure, _png
from kubetrain.report.render import _STYLE, _fmt, _md


@dataclass
class SweepReportInputs:
    """What the leaderboard shows.

    :param plan: the sweep's plan (space, algorithm, objective, ...).
    :param trials: the trial records, best first.
    :param best: the best trial's record.
    :param comparison: the best trial against the promoted model, if compared.
    :param trial_report_url: a trial's report URL (through the API server), or ``None``.
    """

    plan: Mapping[str, Any]
    trials: Sequence[Mapping[str, Any]]
    best: Mapping[str, Any] | None
    comparison: Comparison | None = None
    title: str | None = None
    trial_report_url: Callable[[Mapping[str, Any]], str | None] = lambda t: t.get("report_url")


def _value(trial: Mapping[str, Any]) -> float | None:
    value = (trial.get("objective") or {}).get("value")
    return (
        float(value)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def _outcome(trial: Mapping[str, Any]) -> str:
    if trial.get("status") != "success":
        return "failed" + (f": {trial['error']}" if trial.get("error") else "")
    if trial.get("stopped_early"):
        step = (trial.get("early_stop") or {}).get("step")
        return f"stopped early at report {step}" if step else "stopped early"
    if trial.get("reused_from"):
        return "finished (reused)"
    return "finished"


def _wall(trial: Mapping[str, Any]) -> str:
    wall = trial.get("wall_time_s")
    return f"{float(wall):.1f}" if isinstance(wall, int | float) else ""


def summary_rows(inputs: SweepReportInputs) -> list[tuple[str, str]]:
    plan = inputs.plan
    objective = plan.get("objective") or {}
    early = plan.get("early_stopping") or {}
    dataset = plan.get("dataset") or {}
    rows = [
        ("Sweep", str(plan.get("uri"))),
        ("Algorithm", f"{plan.get('algorithm')} (seed {plan.get('seed')})"),
        (
            "Trials",
            f"{len(inputs.trials)} of max {plan.get('max_trials')}, {plan.get('parallel_trials')} at a time",
        ),
        ("Objective", f"{objective.get('metric')} ({objective.get('mode')})"),
        (
            "Early stopping",
            "off"
            if early.get("rule") != "median"
            else f"median, after {early.get('start_step')} reports, once {early.get('min_trials')} trials finished",
        ),
        ("Dataset version", _fmt(dataset.get("version"))),
        ("Image", _fmt(plan.get("image"))),
    ]
    if inputs.best is not None:
        rows.append(
            (
                "Best trial",
                f"{inputs.best.get('trial')}: {objective.get('metric')} {_fmt(_value(inputs.best))} "
                f"with {_fmt(inputs.best.get('params'))}",
            )
        )
    counts = {
        "finished": sum(
            1 for t in inputs.trials if t.get("status") == "success" and not t.get("stopped_early")
        ),
        "stopped early": sum(1 for t in inputs.trials if t.get("stopped_early")),
        "failed": sum(1 for t in inputs.trials if t.get("status") != "success"),
    }
    rows.append(("Outcomes", ", ".join(f"{v} {k}" for k, v in counts.items())))
    return rows


def _names(inputs: SweepReportInputs) -> list[str]:
    return list((inputs.plan.get("space") or {}).keys())


def objective_plot(inputs: SweepReportInputs) -> bytes | None:
    """Objective by trial number; stopped trials hollow, the best one starred."""
    points = [(int(t.get("number", 0)), _value(t), t) for t in inputs.trials]
    points = [(n, v, t) for n, v, t in points if v is not None]
    if not points:
        return None
    metric = (inputs.plan.get("objective") or {}).get("metric", "objective")
    figure = _figure(6.4, 3.6)
    axes = figure.subplots()
    done = [(n, v) for n, v, t in points if not t.get("stopped_early")]
    stopped = [(n, v) for n, v, t in points if t.get("stopped_early")]
    if done:
        axes.scatter(*zip(*done, strict=True), label="finished", color="#1f77b4")
    if stopped:
        axes.scatter(
            *zip(*stopped, strict=True), label="stopped early", facecolors="none", edgecolors="#d62728"
        )
    if inputs.best is not None and _value(inputs.best) is not None:
        axes.scatter(
            [int(inputs.best.get("number", 0))],
            [_value(inputs.best)],
            marker="*",
            s=200,
            color="#2ca02c",
            label="best",
            zorder=3,
        )
    axes.set_xlabel("trial")
    axes.set_ylabel(metric)
    axes.set_title(f"{metric} per trial")
    axes.grid(True, alpha=0.3)
    axes.legend()
    return _png(figure)


def _axis(spec: Mapping[str, Any]) -> tuple[Callable[[Any], float | None], list[tuple[float, str]]]:
    """A map from a hyperparameter's values to [0, 1], and tick positions with labels."""
    if "choices" in spec:
        choices = list(spec["choices"])
        labels = [str(c) for c in choices]
        span = max(1, len(choices) - 1)

        def position(value: Any) -> float | None:
            return choices.index(value) / span if value in choices else None

        return position, [(i / span, label) for i, label in enumerate(labels)]
    low, high = float(spec["low"]), float(spec["high"])
    log = bool(spec.get("log")) and low > 0
    lo, hi = (math.log10(low), math.log10(high)) if log else (low, high)
    width = (hi - lo) or 1.0

    def position(value: Any) -> float | None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        v = math.log10(value) if log and value > 0 else float(value)
        return (v - lo) / width

    ticks = [(0.0, _fmt(spec["low"])), (1.0, _fmt(spec["high"]))]
    return position, ticks


def parallel_coordinates_plot(inputs: SweepReportInputs) -> bytes | None:
    """One axis per hyperparameter plus the objective; one line per trial, coloured by its objective."""
    names = _names(inputs)
    trials = [t for t in inputs.trials if _value(t) is not None and isinstance(t.get("params"), Mapping)]
    if not names or not trials:
        return None
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    space = inputs.plan.get("space") or {}
    objective = inputs.plan.get("objective") or {}
    values = [_value(t) for t in trials]
    vmin, vmax = min(values), max(values)
    norm = Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1e-9)
    axes_maps = [_axis(space.get(n) or {}) for n in names]
    figure = _figure(max(6.4, 1.6 * (len(names) + 1)), 4.2)
    axes = figure.subplots()
    cmap = colormaps["viridis" if objective.get("mode") != "min" else "viridis_r"]
    xs = list(range(len(names) + 1))
    for trial, value in sorted(zip(trials, values, strict=True), key=lambda p: p[1]):
        ys = [position(trial["params"].get(n)) for n, (position, _) in zip(names, axes_maps, strict=True)]
        ys.append(norm(value))
        style = "--" if trial.get("stopped_early") else "-"
        axes.plot(
            xs,
            [y if y is not None else float("nan") for y in ys],
            style,
            color=cmap(norm(value)),
            alpha=0.8,
            linewidth=2.5
            if inputs.best is not None and trial.get("number") == inputs.best.get("number")
            else 1.2,
        )
    for x, (_, ticks) in enumerate(axes_maps):
        axes.axvline(x, color="#888", linewidth=0.8)
        for y, label in ticks:
            axes.annotate(label, (x, y), textcoords="offset points", xytext=(3, 0), fontsize=7, va="center")
    axes.axvline(len(names), color="#888", linewidth=0.8)
    for y, label in ((0.0, _fmt(vmin)), (1.0, _fmt(vmax))):
        axes.annotate(
            label, (len(names), y), textcoords="offset points", xytext=(3, 0), fontsize=7, va="center"
        )
    axes.set_xticks(xs, labels=[*names, objective.get("metric", "objective")])
    axes.set_yticks([])
    axes.set_ylim(-0.05, 1.05)
    axes.set_title("Hyperparameters against the objective (dashed: stopped early)")
    figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes, label=objective.get("metric", "objective"))
    return _png(figure)


def _comparison_text(inputs: SweepReportInputs) -> str | None:
    c = inputs.comparison
    if c is None:
        return None
    verdict = "better than the promoted model" if c.better else "not better than the promoted model"
    return f"The best trial is {verdict}: {c.reason}"


def render_html(inputs: SweepReportInputs, plots: dict[str, tuple[str, bytes]]) -> str:
    e = html.escape
    title = inputs.title or "Sweep leaderboard"
    names = _names(inputs)
    metric = (inputs.plan.get("objective") or {}).get("metric", "objective")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    if (text := _comparison_text(inputs)) is not None:
        css = "better" if inputs.comparison and inputs.comparison.better else "worse"
        parts.append(f'<p class="{css}">{e(text)}.</p>')
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary_rows(inputs)]
    parts.append("</table><h2>Trials</h2><table><tr><th>rank</th><th>trial</th>")
    parts += [f"<th>{e(n)}</th>" for n in names]
    parts.append(
        f"<th>{e(metric)}</th><th>reports</th><th>steps</th><th>outcome</th><th>trainer wall (s)</th><th>report</th></tr>"
    )
    for rank, trial in enumerate(inputs.trials, start=1):
        params = trial.get("params") or {}
        url = inputs.trial_report_url(trial)
        link = f'<a href="{e(url)}">report</a>' if url else ""
        cells = [
            str(rank),
            str(trial.get("trial")),
            *(_fmt(params.get(n)) for n in names),
            _fmt(_value(trial)),
            _fmt(trial.get("reports")),
            _fmt(trial.get("steps")),
            _outcome(trial),
            _wall(trial),
        ]
        parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + f"<td>{link}</td></tr>")
    parts.append("</table>")
    if plots:
        parts.append("<h2>Plots</h2>")
        for name, (caption, png) in plots.items():
            data = base64.b64encode(png).decode("ascii")
            parts.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{e(caption)}">'
                f"<figcaption>{e(caption)} <code>{e(name)}</code></figcaption></figure>"
            )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_markdown(inputs: SweepReportInputs, plots: dict[str, tuple[str, bytes]]) -> str:
    title = inputs.title or "Sweep leaderboard"
    names = _names(inputs)
    metric = (inputs.plan.get("objective") or {}).get("metric", "objective")
    lines = [f"# {_md(title)}", ""]
    if (text := _comparison_text(inputs)) is not None:
        lines += [f"**{_md(text)}.**", ""]
    lines += ["| | |", "|---|---|"] + [f"| {_md(k)} | {_md(v)} |" for k, v in summary_rows(inputs)]
    header = ["rank", "trial", *names, metric, "reports", "steps", "outcome", "trainer wall (s)", "report"]
    lines += [
        "",
        "## Trials",
        "",
        "| " + " | ".join(_md(h) for h in header) + " |",
        "|" + "---|" * len(header),
    ]
    for rank, trial in enumerate(inputs.trials, start=1):
        params = trial.get("params") or {}
        url = inputs.trial_report_url(trial)
        cells = [
            str(rank),
            str(trial.get("trial")),
            *(_fmt(params.get(n)) for n in names),
            _fmt(_value(trial)),
            _fmt(trial.get("reports")),
            _fmt(trial.get("steps")),
            _outcome(trial),
            _wall(trial),
        ]
        lines.append("| " + " | ".join(_md(c) for c in cells) + f" | {f'[report]({url})' if url else ''} |")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{_md(caption)}]({name})" for name, (caption, _) in plots.items()]
    return "\n".join(lines) + "\n"


def render_sweep_report(inputs: SweepReportInputs) -> dict[str, bytes]:
    """Every leaderboard file by name: ``report.html``, ``report.md`` and the PNG plots."""
    plots: dict[str, tuple[str, bytes]] = {}
    metric = (inputs.plan.get("objective") or {}).get("metric", "objective")
    if png := objective_plot(inputs):
        plots["objective.png"] = (f"{metric} per trial", png)
    if png := parallel_coordinates_plot(inputs):
        plots["parallel_coordinates.png"] = (
            "Parallel coordinates: hyperparameters against the objective",
            png,
        )
    files = {name: png for name, (_, png) in plots.items()}
    files["report.html"] = render_html(inputs, plots).encode("utf-8")
    files["report.md"] = render_markdown(inputs, plots).encode("utf-8")
    return files
