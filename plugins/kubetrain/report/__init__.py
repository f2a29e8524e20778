"""Training reports: read a run's metrics, plot them, and render HTML and Markdown from the
templates in ``ui/templates/report/``.

Nothing here touches S3 or Airflow; the ReportOperator feeds in the files' bytes and uploads
what :func:`render_report` returns. matplotlib is imported only when plots are drawn.
"""

from __future__ import annotations

from kubetrain.report.inputs import Comparison, History, ReportInputs, compare, parse_history, parse_metrics
from kubetrain.report.render import render_report

__all__ = [
    "Comparison",
    "History",
    "ReportInputs",
    "compare",
    "parse_history",
    "parse_metrics",
    "render_report",
]
