"""Plots of a training run as PNG bytes (matplotlib's object API with the Agg canvas, no pyplot)."""

from __future__ import annotations

import io
import re
from typing import Any

from kubetrain.report.inputs import History


def _figure(width: float = 6.4, height: float = 4.0):
    # Figure + Agg canvas instead of pyplot: no global state, safe in threads and workers.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def warm_up() -> None:
    """Draw one small plot with text to PNG, so that matplotlib's modules, its font cache and the
    font are loaded before a report is rendered in this process (about 0.4 s of a first render)."""
    figure = _figure(1.0, 1.0)
    axes = figure.add_subplot()
    axes.plot([0, 1], [0, 1])
    axes.set_title("warm-up")
    _epoch_axis(axes)
    _png(figure)


def _epoch_axis(axes) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.set_xlabel("epoch")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def curve_plot(history: History, column: str, title: str, ylabel: str) -> bytes | None:
    """Training and validation curves of ``column`` (and ``val_<column>``) per epoch, or ``None``."""
    lines = [
        (c, label)
        for c, label in ((column, "training"), (f"val_{column}", "validation"))
        if c in history.columns
    ]
    series = [(history.series(c), label) for c, label in lines]
    series = [(xy, label) for xy, label in series if xy[0]]
    if not series:
        return None
    figure = _figure()
    axes = figure.subplots()
    for (xs, ys), label in series:
        axes.plot(xs, ys, marker="o", markersize=3, label=label)
    axes.set_title(title)
    _epoch_axis(axes)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend()
    return _png(figure)


def learning_rate_plot(history: History) -> bytes | None:
    xs, ys = history.series("learning_rate")
    if len(set(ys)) < 2:
        return None  # a constant rate says nothing a table does not
    figure = _figure(6.4, 3.0)
    axes = figure.subplots()
    axes.plot(xs, ys, marker="o", markersize=3)
    axes.set_title("Learning rate")
    _epoch_axis(axes)
    axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    return _png(figure)


def confusion_plot(confusion: dict[str, Any]) -> bytes:
    """A confusion-matrix heat map with counts in the cells (true class down, predicted across)."""
    classes, matrix = confusion["classes"], confusion["matrix"]
    size = max(4.0, min(12.0, 0.5 * len(classes) + 2))
    figure = _figure(size, size)
    axes = figure.subplots()
    image = axes.imshow(matrix, cmap="Blues")
    figure.colorbar(image, ax=axes, shrink=0.8)
    ticks = range(len(classes))
    axes.set_xticks(ticks, labels=classes, rotation=45 if len(classes) > 8 else 0)
    axes.set_yticks(ticks, labels=classes)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title("Confusion matrix (validation)")
    if len(classes) <= 20:
        peak = max((max(row) for row in matrix), default=0) or 1
        for i, row in enumerate(matrix):
            for j, value in enumerate(row):
                colour = "white" if value > peak / 2 else "black"
                axes.text(j, i, f"{value:g}", ha="center", va="center", color=colour, fontsize=8)
    return _png(figure)


def all_plots(history: History | None, confusion: dict[str, Any] | None) -> dict[str, tuple[str, bytes]]:
    """File name -> (caption, PNG bytes) of every plot the inputs allow, in display order."""
    plots: dict[str, tuple[str, bytes]] = {}
    if history is not None:
        if png := curve_plot(history, "loss", "Loss", "loss"):
            plots["loss.png"] = ("Loss per epoch", png)
        metric = history.metric
        if metric and (png := curve_plot(history, metric, metric.replace("_", " ").capitalize(), metric)):
            plots[f"{re.sub(r'[^A-Za-z0-9_.-]', '_', metric)}.png"] = (f"{metric} per epoch", png)
        if png := learning_rate_plot(history):
            plots["learning_rate.png"] = ("Learning rate per epoch", png)
    if confusion is not None:
        plots["confusion_matrix.png"] = ("Confusion matrix", confusion_plot(confusion))
    return plots
