"""The comparison chart: loss and metric curves of several runs on shared axes, as inline SVG.

Drawn on the server with matplotlib (already the report's plotting library), so the page
needs no chart script and nothing is fetched by the browser: the SVG is part of the HTML.
Each run keeps one color on both panels; training is a solid line, validation dashed.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubetrain.report.inputs import History

# matplotlib's tab10, the first five: one per compared run
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def _metric_of(histories: list[History | None]) -> str | None:
    for history in histories:
        if history is not None and history.metric:
            return history.metric
    return None


def curves_svg(labels: list[str], histories: list[History | None]) -> str | None:
    """An SVG document (without XML prolog) with a loss panel and a metric panel, or ``None`` when no run has a history."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not any(h is not None and h.rows for h in histories):
        return None
    metric = _metric_of(histories)
    panels = [("loss", "loss")] + ([(metric, metric)] if metric else [])
    figure = Figure(figsize=(5.2 * len(panels), 3.8), dpi=100, layout="constrained")
    FigureCanvasSVG(figure)
    axes_list = figure.subplots(1, len(panels), squeeze=False)[0]
    for axes, (column, title) in zip(axes_list, panels, strict=True):
        for index, (label, history) in enumerate(zip(labels, histories, strict=True)):
            if history is None:
                continue
            color = COLORS[index % len(COLORS)]
            for name, style, suffix in ((column, "-", "training"), (f"val_{column}", "--", "validation")):
                if name not in history.columns:
                    continue
                xs, ys = history.series(name)
                if xs:
                    axes.plot(xs, ys, style, color=color, marker="o", markersize=3, label=f"{label} {suffix}")
        axes.set_title(title)
        axes.set_xlabel("epoch")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(True, alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=COLORS[i % len(COLORS)], marker="o", markersize=3, label=label)
        for i, (label, history) in enumerate(zip(labels, histories, strict=True))
        if history is not None
    ]
    handles += [
        Line2D([], [], color="#555555", linestyle="-", label="training"),
        Line2D([], [], color="#555555", linestyle="--", label="validation"),
    ]
    figure.legend(
        handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small", frameon=False
    )
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    svg = buffer.getvalue()
    svg = re.sub(r"^<\?xml[^>]*>\s*", "", svg)
    svg = re.sub(r"^<!DOCTYPE[^>]*>\s*", "", svg)
    return svg
