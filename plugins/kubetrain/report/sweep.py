"""A sweep's leaderboard: the trials ranked by the objective, as HTML and Markdown, with two plots.

* ``objective.png``: the objective of every trial by trial number (stopped and failed trials marked);
* ``parallel_coordinates.png``: one axis per hyperparameter and one for the objective, one line
  per trial coloured by its objective (log ranges on a log axis, choices at even positions).

Nothing here touches S3 or Airflow; matplotlib is imported only when plots are drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.report.inputs import Comparison
from kubetrain.report.plots import _figure, _png
from kubetrain.report.render import Plots, comparison_line, figures, format_value, render_page, report_files
from kubetrain_contract.trial import SweepCompute


@dataclass
class SweepReportInputs:
    """What the leaderboard shows.

    :param plan: the sweep's plan (space, algorithm, objective, ...).
    :param trials: the trial records, best first.
    :param best: the best trial's record.
    :param comparison: the best trial against the promoted model, if compared.
    :param trial_report_url: a trial's report URL (through the API server), or ``None``.
    :param compute: the trainers' compute and what every trial run to its budget would have cost.
    """

    plan: Mapping[str, Any]
    trials: Sequence[Mapping[str, Any]]
    best: Mapping[str, Any] | None
    comparison: Comparison | None = None
    title: str | None = None
    trial_report_url: Callable[[Mapping[str, Any]], str | None] = lambda t: t.get("report_url")
    compute: SweepCompute | None = None


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
        decision = trial.get("early_stop") or {}
        step, rung = decision.get("step"), decision.get("rung")
        if rung:
            rank, of = decision.get("rank"), decision.get("rung_trials")
            ranked = f", rank {rank} of {of}" if rank and of else ""
            return f"stopped early at rung {rung} (report {step}{ranked})"
        return f"stopped early at report {step}" if step else "stopped early"
    if trial.get("reused_from"):
        return "finished (reused)"
    return "finished"


def _wall(trial: Mapping[str, Any]) -> str:
    wall = trial.get("wall_time_s")
    return f"{float(wall):.1f}" if isinstance(wall, int | float) else ""


def _hours(trial: Mapping[str, Any]) -> str:
    hours = trial.get("accelerator_hours")
    return f"{float(hours):.4f}" if isinstance(hours, int | float) and not isinstance(hours, bool) else ""


def _unit(inputs: SweepReportInputs) -> str:
    """The column of the trials' accelerator-hours: GPU-hours, or CPU-hours where no trial asked for a GPU."""
    gpu = (inputs.compute.accelerator if inputs.compute else None) == "gpu" or any(
        t.get("accelerator") == "gpu" for t in inputs.trials
    )
    return "GPU-hours" if gpu else "CPU-hours"


def _early_stopping(early: Mapping[str, Any]) -> str:
    """The early-stopping settings in words."""
    rule = early.get("rule")
    if rule == "median":
        return (
            f"median, after {early.get('start_step')} reports, once {early.get('min_trials')} trials finished"
        )
    if rule in (None, "", "off"):
        return "off"
    settings = ", ".join(f"{k} {v}" for k, v in early.items() if k != "rule" and v is not None)
    return f"{rule}, {settings}" if settings else str(rule)


def summary_rows(inputs: SweepReportInputs) -> list[tuple[str, str]]:
    """The headline facts of a sweep as (label, value) pairs, shared by HTML and Markdown."""
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
        ("Early stopping", _early_stopping(early)),
        ("Dataset version", format_value(dataset.get("version"))),
        ("Image", format_value(plan.get("image"))),
    ]
    if inputs.best is not None:
        rows.append(
            (
                "Best trial",
                f"{inputs.best.get('trial')}: {objective.get('metric')} {format_value(_value(inputs.best))} "
                f"with {format_value(inputs.best.get('params'))}",
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
    if inputs.compute is not None and inputs.compute.line:
        rows.append(("Compute", inputs.compute.line))
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

        def choice_position(value: Any) -> float | None:
            return choices.index(value) / span if value in choices else None

        return choice_position, [(i / span, label) for i, label in enumerate(labels)]
    low, high = float(spec["low"]), float(spec["high"])
    log = bool(spec.get("log")) and low > 0
    lo, hi = (math.log10(low), math.log10(high)) if log else (low, high)
    width = (hi - lo) or 1.0

    def range_position(value: Any) -> float | None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        v = math.log10(value) if log and value > 0 else float(value)
        return (v - lo) / width

    ticks = [(0.0, format_value(spec["low"])), (1.0, format_value(spec["high"]))]
    if log:
        # the powers of ten between the ends, at their log positions: what tells a log axis from a linear one
        decades = range(math.floor(lo) + 1, math.ceil(hi))
        ticks[1:1] = [((d - lo) / width, format_value(10.0**d)) for d in decades]
    return range_position, ticks


def log_scaled(spec: Mapping[str, Any]) -> bool:
    """Whether a hyperparameter was searched on a log scale (a range with ``log``, ``low`` > 0)."""
    try:
        return bool(spec.get("log")) and "choices" not in spec and float(spec["low"]) > 0
    except (KeyError, TypeError, ValueError):
        return False


def parallel_coordinates_plot(inputs: SweepReportInputs) -> bytes | None:
    """One axis per hyperparameter plus the objective; one line per trial, coloured by its objective."""
    figure = parallel_coordinates_figure(inputs)
    return _png(figure) if figure is not None else None


def parallel_coordinates_figure(inputs: SweepReportInputs) -> Any:
    """The parallel-coordinates plot as a matplotlib figure (``None`` without trials that have values);
    a log-searched hyperparameter's axis is logarithmic, ticked at its powers of ten."""
    names = _names(inputs)
    scored = [
        (t, value)
        for t in inputs.trials
        if (value := _value(t)) is not None and isinstance(t.get("params"), Mapping)
    ]
    if not names or not scored:
        return None
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    space = inputs.plan.get("space") or {}
    objective = inputs.plan.get("objective") or {}
    values = [value for _, value in scored]
    vmin, vmax = min(values), max(values)
    norm = Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1e-9)
    axes_maps = [_axis(space.get(n) or {}) for n in names]
    figure = _figure(max(6.4, 1.6 * (len(names) + 1)), 4.2)
    axes = figure.subplots()
    cmap = colormaps["viridis" if objective.get("mode") != "min" else "viridis_r"]
    xs = list(range(len(names) + 1))
    for trial, value in sorted(scored, key=lambda p: p[1]):
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
    for y, label in ((0.0, format_value(vmin)), (1.0, format_value(vmax))):
        axes.annotate(
            label, (len(names), y), textcoords="offset points", xytext=(3, 0), fontsize=7, va="center"
        )
    labels = [f"{n}\n(log scale)" if log_scaled(space.get(n) or {}) else n for n in names]
    axes.set_xticks(xs, labels=[*labels, objective.get("metric", "objective")])
    axes.set_yticks([])
    axes.set_ylim(-0.05, 1.05)
    # two short lines: the axes are narrower than the figure (the colour bar takes its share), and
    # constrained layout makes room for a title's lines, not for a line matplotlib wraps when drawing
    axes.set_title("Hyperparameters against the objective\n(dashed: stopped early)")
    figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes, label=objective.get("metric", "objective"))
    return figure


def page_values(inputs: SweepReportInputs, plots: Plots) -> dict[str, Any]:
    """What the leaderboard's templates show.

    :param inputs: the sweep's plan and trials.
    :param plots: the plots by file name, each as (caption, PNG bytes).
    """
    names = _names(inputs)
    metric = (inputs.plan.get("objective") or {}).get("metric", "objective")
    trials = []
    for rank, trial in enumerate(inputs.trials, start=1):
        params = trial.get("params") or {}
        cells = [
            str(rank),
            str(trial.get("trial")),
            *(format_value(params.get(n)) for n in names),
            format_value(_value(trial)),
            format_value(trial.get("reports")),
            format_value(trial.get("steps")),
            _outcome(trial),
            _wall(trial),
            _hours(trial),
        ]
        trials.append({"cells": cells, "url": inputs.trial_report_url(trial)})
    return {
        "title": inputs.title or "Sweep leaderboard",
        "warnings": [],
        "comparison": comparison_line(inputs.comparison, "The best trial", version=False),
        "summary": summary_rows(inputs),
        "header": [
            "rank",
            "trial",
            *names,
            metric,
            "reports",
            "steps",
            "outcome",
            "trainer wall (s)",
            _unit(inputs),
            "report",
        ],
        "trials": trials,
        # the outcome's column (0-based), after rank, trial, the hyperparameters, the objective, reports, steps
        "outcome_column": len(names) + 5,
        "plots": figures(plots),
    }


def render_html(inputs: SweepReportInputs, plots: Plots) -> str:
    """The leaderboard as one HTML file, plots inlined as base64 PNG data URIs."""
    return render_page("sweep.html", page_values(inputs, plots))


def render_markdown(inputs: SweepReportInputs, plots: Plots) -> str:
    """The leaderboard in Markdown; plots are referenced as the PNG files next to it."""
    return render_page("sweep.md", page_values(inputs, plots))


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
    return report_files("sweep", plots, page_values(inputs, plots))
