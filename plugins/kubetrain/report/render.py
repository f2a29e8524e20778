"""Render a run report: a self-contained HTML page (plots inlined) and a Markdown summary.

The markup lives in templates beside the Training page's (``ui/templates/report/``): ``page.html``
and ``page.md`` hold what every report shows (title, warnings, comparison, summary), ``run.*`` and
``sweep.*`` the rest. The code here computes the values they show.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kubetrain.report.inputs import Comparison, ReportInputs
from kubetrain.report.plots import all_plots
from kubetrain.report.plots import warm_up as warm_up_plots

if TYPE_CHECKING:
    from jinja2 import Environment
    from markupsafe import Markup

MAX_SAMPLES = 20
TEMPLATES = Path(__file__).resolve().parent.parent / "ui" / "templates"

Plots = Mapping[str, tuple[str, bytes]]


def format_value(value: Any) -> str:
    """A value as a report shows it: floats to 6 significant digits, objects as JSON, ``None`` empty."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def markdown_cell(value: Any) -> str:
    """A value for a Markdown table cell: no pipes or line breaks, which would break the row."""
    return format_value(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


# A link the pages may follow: http(s) with a host, or a path of this origin ("/kubetrain/..."), never
# "//host" or "/\\host", which browsers read as another host.
_WEB_LINK = re.compile(r"(?i)(https?://[^/?#]|/(?![/\\]))")


def web_link(url: Any) -> str | None:
    """``url`` if a page may make it an ``href``, else ``None``.

    Run records are documents in S3: their ``report_url``, ``mlflow.url`` (and a sweep's trials'
    ``report_url``) are rendered as links, so only an ``http://`` or ``https://`` URL with a host, or
    a path on the page's own origin (one leading '/'), passes. Anything else (``javascript:``,
    ``data:``, ``vbscript:``, ``//host/``) fails, and so does any whitespace, control character or
    backslash, which browsers drop or read as '/' before they look at the scheme (``" javascript:"``,
    ``"java\\tscript:"``, ``"/\\host"``).
    """
    if not isinstance(url, str) or not url:
        return None
    if any(c <= " " or c in "\x7f\\" for c in url):
        return None
    return url if _WEB_LINK.match(url) else None


def link(url: Any, text: str, **attributes: str) -> Markup:
    """The Jinja filter ``link``: ``<a href=url ...>text</a>`` for a :func:`web_link`, else ``text`` as plain text.

    ``{{ run.report_url | link("report", title=run.report_uri) }}``; the attributes (``title``,
    ``target``, ``rel``) are escaped like the text; a refused URL is shown only in the title.
    """
    from markupsafe import Markup, escape

    href = web_link(url)
    if href is None:
        return Markup('<span class="muted" title="not a web link: {}">{}</span>').format(url, text)
    extra = Markup("").join(Markup(' {}="{}"').format(name, value) for name, value in attributes.items())
    return Markup('<a href="{}"{}>{}</a>').format(href, extra, escape(text))


def register_filters(env: Environment) -> Environment:
    """Add the filters every kubetrain template may use (``link``, ``href``) to ``env``.

    Both environments over ``ui/templates`` (the Training page's, :func:`kubetrain.ui.app.templates`,
    and the reports', :func:`environment`) call it, so that a template links a stored URL only
    through :func:`web_link`.
    """
    env.filters["link"] = link
    env.filters["href"] = lambda url: web_link(url) or ""
    return env


@cache
def environment() -> Environment:
    """The reports' Jinja environment, over the Training page's template folder and set up as its own.

    HTML templates autoescape every value (a metric named ``<script>`` stays text); Markdown ones
    do not, as Markdown has no escaping of its own: their table cells go through the ``md`` filter.
    """
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = format_value
    env.filters["md"] = markdown_cell
    return register_filters(env)


class Figure(NamedTuple):
    """A plot as the templates show it: the PNG's file name, its caption, its bytes in base64."""

    name: str
    caption: str
    base64: str


def figures(plots: Plots) -> list[Figure]:
    """The plots in their order, each with its PNG in base64 for a data URI."""
    return [
        Figure(name, caption, base64.b64encode(png).decode("ascii")) for name, (caption, png) in plots.items()
    ]


def comparison_line(comparison: Comparison | None, subject: str, *, version: bool) -> dict[str, str] | None:
    """The verdict against the promoted model, as a sentence and its CSS class, or ``None``.

    :param comparison: the comparison, or ``None`` when there was none.
    :param subject: what was compared, e.g. ``"This model"``.
    :param version: whether the sentence names the promoted version.
    """
    if comparison is None:
        return None
    if comparison.nothing_promoted:
        return {
            "css": "neutral",
            "text": f"No model was promoted before: there is none to compare {subject[:1].lower()}{subject[1:]} with",
        }
    verdict = "better than" if comparison.better else "not better than"
    text = f"{subject} is {verdict} the promoted model: {comparison.reason}"
    if version and comparison.promoted_version:
        text += f" (promoted version {comparison.promoted_version})"
    return {"css": "better" if comparison.better else "worse", "text": text}


#: the comments around a run report's promotion block, which the promote task replaces with its outcome
PROMOTION_START = "<!-- kubetrain:promotion -->"
PROMOTION_END = "<!-- /kubetrain:promotion -->"


def promotion_outcome(
    *,
    promoted: bool,
    rule: str,
    model: str,
    monitor: str | None,
    mode: str | None,
    value: float | None,
    other_version: str | None,
    other_value: float | None,
    model_uri: str | None = None,
    version: str | None = None,
) -> dict[str, str]:
    """What the promote task decided, as a sentence with both figures and its CSS class.

    :param promoted: whether this run's model was promoted.
    :param rule: the ``promote`` setting (``if_better``, ``always``, ``never``).
    :param model: the model's name.
    :param monitor: the compared metric; ``mode``: ``max`` or ``min``; ``value``: this run's.
    :param other_version: the version promoted before this decision (``None``: there was none);
        ``other_value``: its ``monitor``.
    :param model_uri: where the promoted model now is; ``version``: its version (when promoted).
    """
    better = {"max": "higher", "min": "lower"}.get(mode or "", "")
    this = (
        f"this run's {monitor} {format_value(value)}"
        if monitor and value is not None
        else f"this run has no {monitor or 'monitored metric'}"
    )
    if other_version is None:
        figures = f"{this}; no version of {model} was promoted before"
    elif other_value is None:
        figures = f"{this}; the version promoted before, {other_version}, has no {monitor}"
    else:
        figures = (
            f"{this} against {format_value(other_value)} of version {other_version}, promoted before"
            + (f" ({better} is better)" if better else "")
        )
    if promoted:
        text = f"Promoted as {model_uri} (model {model}, version {version}; promote={rule}): {figures}"
        return {"css": "better", "text": text}
    why = {
        "never": "promote=never",
        "if_better": "promote=if_better, and it is not better than the promoted model",
    }.get(rule, f"promote={rule}")
    return {"css": "worse", "text": f"Not promoted ({why}): {figures}"}


def promotion_block(kind: str, values: Mapping[str, Any]) -> str:
    """The promotion block of a run report, markers included: ``kind`` ``"html"`` or ``"md"``.

    :param values: ``comparison`` (the report's verdict), ``promote_rule`` (a decision is pending) and
        ``promotion`` (the decision: :func:`promotion_outcome`), each possibly ``None``.
    """
    return environment().get_template(f"report/promotion.{kind}").render(values)


def with_promotion(document: str, kind: str, outcome: Mapping[str, str]) -> str:
    """A rendered run report with its promotion block replaced by ``outcome``.

    :param document: ``report.html`` (``kind="html"``) or ``report.md`` (``kind="md"``) as rendered.
    :param outcome: from :func:`promotion_outcome`.
    :raises ValueError: the document has no promotion block (a report from before there was one).
    """
    start, end = document.find(PROMOTION_START), document.find(PROMOTION_END)
    if start < 0 or end < start:
        raise ValueError(f"the report.{kind} has no promotion block ({PROMOTION_START} ... {PROMOTION_END})")
    block = promotion_block(kind, {"comparison": None, "promote_rule": None, "promotion": outcome})
    return document[:start] + block.rstrip("\n") + document[end + len(PROMOTION_END) :]


def render_page(template: str, values: Mapping[str, Any]) -> str:
    """Render ``ui/templates/report/<template>`` with ``values``.

    :param template: the template's name in the report folder, e.g. ``"run.html"``.
    :param values: what it shows: ``title``, ``warnings``, ``comparison``, ``summary`` and its own.
    """
    return environment().get_template(f"report/{template}").render(values)


def warm_up() -> None:
    """Load what rendering a report takes (the templates compiled, matplotlib and its font),
    so that a process which renders one later, such as a sweep trial's task at its pod's end,
    does not pay for it then."""
    env = environment()
    for name in env.list_templates(filter_func=lambda name: name.startswith("report/")):
        env.get_template(name)  # the pages' own and what they extend and import
    warm_up_plots()


def report_files(kind: str, plots: Plots, values: Mapping[str, Any]) -> dict[str, bytes]:
    """Every file of a report by name: ``report.html``, ``report.md`` and the PNG plots.

    :param kind: the report's templates, ``"run"`` or ``"sweep"``.
    :param plots: the plots by file name, each as (caption, PNG bytes).
    :param values: what the templates show.
    """
    files = {name: png for name, (_, png) in plots.items()}
    files["report.html"] = render_page(f"{kind}.html", values).encode("utf-8")
    files["report.md"] = render_page(f"{kind}.md", values).encode("utf-8")
    return files


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 20 s``, ``2 h 05 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def disruption_rows(disruptions: Any) -> list[tuple[str, str]]:
    """The summary rows of a run the cluster queued or interrupted (a RunDisruptions, or None)."""
    if disruptions is None:
        return []
    rows = [("Time queued", duration(disruptions.queued_s))]
    if disruptions.preemptions:
        lost = "not known" if disruptions.steps_lost is None else str(disruptions.steps_lost)
        resumed = ", ".join(
            "?" if i.resume_step is None else str(i.resume_step) for i in disruptions.interruptions
        )
        rows.append(
            (
                "Preemptions",
                f"{disruptions.preemptions} (no retry used; resumed at step {resumed}; steps lost: {lost})",
            )
        )
    return rows


def summary_rows(inputs: ReportInputs) -> list[tuple[str, str]]:
    """The headline facts of a run as (label, value) pairs, shared by HTML and Markdown."""
    m = inputs.metrics
    rows = [("Run", inputs.run_uri)]
    if inputs.run_date:
        rows.append(("Run date", inputs.run_date))
    rows += [
        ("Trainer", trainer_cell(inputs)),
        ("Task", format_value(m.get("task")) or 'not stated (metrics.json has no "task")'),
    ]
    monitor = m["monitor"]
    rows.append(("Monitor", f"{monitor} ({m['monitor_mode']})"))
    for name, value in sorted(m["final"].items()):
        rows.append((f"Final {name}", format_value(value)))
    best = m.get("best")
    if isinstance(best, dict) and best:
        epoch = best.get("epoch")
        rows.append(
            (
                f"Best {monitor}",
                f"{format_value(best.get(monitor))}" + (f" at epoch {epoch}" if epoch is not None else ""),
            )
        )
    facts = dict(m)
    if "epochs" not in facts and inputs.epochs is not None:
        facts["epochs"] = inputs.epochs  # from history.csv
    for key, label in (
        ("epochs", "Epochs"),
        ("steps", "Steps"),
        ("resumed_from_step", "Resumed from step"),
        ("wall_time_s", "Wall time (s)"),
        ("examples_per_s", "Examples per second"),
        ("devices", "Devices"),
        ("workers", "Workers"),
        ("strategy", "Distribution"),
        ("precision", "Precision"),
        ("steps_per_execution", "Steps per call"),
        ("jit_compile", "XLA"),
        ("unigram_val_loss", "Unigram baseline val_loss"),
        ("warmup_steps", "Warm-up steps"),
        ("skipped_files", "Skipped input files"),
    ):
        if key in facts:
            value = facts[key]
            rows.append(
                (label, ", ".join(map(str, value)) if isinstance(value, list) else format_value(value))
            )
    rows.extend(disruption_rows(inputs.disruptions))
    # params.json (kubetrain's trainers) first, else what the platform knows (a container of the user's own)
    params = inputs.params or {}
    if inputs.dataset_uri:
        rows.append(("Dataset", dataset_cell(inputs)))
    known = {"dataset_version": inputs.dataset_version, "image": inputs.image}
    for key, label in (("dataset_version", "Dataset version"), ("image", "Image")):
        if value := params.get(key) or known.get(key):
            rows.append((label, format_value(value)))
    if code := code_version_cell(inputs):
        rows.append(("Code version", code))
    user_set = inputs.user_set or {}
    others = sorted(set(user_set) - set(hyperparameters_of(inputs)))
    if others:
        rows.append(
            (
                "Set for this run",
                ", ".join(f"{name}={format_value(user_set[name][0])}" for name in others),
            )
        )
    return rows


#: the OCI label that holds the source revision an image was built from
REVISION_LABEL = "org.opencontainers.image.revision"


def code_version_cell(inputs: ReportInputs) -> str:
    """The Code version row: the git revision the image carries, else the digest (or params.json's
    code_version), saying why there is no revision; empty when nothing is known."""
    if inputs.revision:
        return f"{inputs.revision} (git revision, the image's {REVISION_LABEL} label)"
    digest = (inputs.params or {}).get("code_version")
    if not digest and inputs.image and "@" in inputs.image:
        digest = inputs.image.rsplit("@", 1)[1]
    if not digest:
        return ""
    if inputs.revision_note:
        return f"{format_value(digest)} (the image's digest: {inputs.revision_note})"
    return format_value(digest)


def size_text(size: float) -> str:
    """``1.80 MB (1,803,432 bytes)``: decimal units, as S3 consoles count."""
    number = float(size)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(number) < 1000 or unit == "TB":
            break
        number /= 1000
    exact = f"{int(size):,} bytes"
    return exact if unit == "bytes" else f"{number:.3g} {unit} ({exact})"


def dataset_cell(inputs: ReportInputs) -> str:
    """The Dataset row: its URI, its size and its number of objects, as staged."""
    facts = []
    if inputs.dataset_objects is not None:
        facts.append(f"{inputs.dataset_objects} object{'' if inputs.dataset_objects == 1 else 's'}")
    if inputs.dataset_bytes is not None:
        facts.append(size_text(inputs.dataset_bytes))
    return f"{inputs.dataset_uri}: {', '.join(facts)}" if facts else str(inputs.dataset_uri)


def hyperparameters_of(inputs: ReportInputs) -> dict[str, Any]:
    """params.json's ``hyperparameters`` (the values the trainer ran with), or ``{}``."""
    hyper = (inputs.params or {}).get("hyperparameters")
    return hyper if isinstance(hyper, dict) else {}


def hyperparameter_tables(inputs: ReportInputs) -> dict[str, Any]:
    """The hyperparameters as the templates show them: ``set`` (name, value, default) for those this run
    set to another value than the DAG's default, ``defaults`` (name, value) for the rest, and ``marked``,
    whether the run's settings were known (when not, every one is in ``defaults``, unmarked)."""
    hyper = hyperparameters_of(inputs)
    user_set = inputs.user_set
    if user_set is None:
        return {"marked": False, "set": [], "defaults": sorted(hyper.items())}
    return {
        "marked": True,
        "set": [
            (name, value, user_set[name][1]) for name, value in sorted(hyper.items()) if name in user_set
        ],
        "defaults": [(name, value) for name, value in sorted(hyper.items()) if name not in user_set],
    }


def trainer_cell(inputs: ReportInputs) -> str:
    """The Trainer row: metrics.json's ``trainer``, else the image's repository and the command it ran."""
    if inputs.metrics.get("trainer"):
        return format_value(inputs.metrics["trainer"])
    if inputs.trainer is None and not inputs.command:
        return ""
    command = " ".join(inputs.command) if inputs.command else "its own ENTRYPOINT and CMD"
    return f"{inputs.trainer or 'the training image'} (command: {command})"


def page_values(inputs: ReportInputs, plots: Plots) -> dict[str, Any]:
    """What the run report's templates show.

    :param inputs: the run's report inputs.
    :param plots: the plots by file name, each as (caption, PNG bytes).
    """
    history = inputs.history
    return {
        "title": inputs.title or f"Training report: {inputs.metrics.get('trainer') or 'run'}",
        "warnings": inputs.warnings,
        "comparison": comparison_line(inputs.comparison, "This model", version=True),
        "promote_rule": inputs.promote_rule,
        "promotion": None,
        "airflow_url": inputs.airflow_url,
        "summary": summary_rows(inputs),
        "hyperparameters": hyperparameter_tables(inputs),
        "plots": figures(plots),
        "history": (
            {
                "columns": history.columns,
                "cells": [[row.get(c) for c in history.columns] for row in history.rows],
            }
            if history is not None and history.rows
            else None
        ),
        "samples": [
            [sample.get(key) for key in ("step", "input", "reply", "reference")]
            for sample in (inputs.samples or [])[-MAX_SAMPLES:]
        ]
        # the exported model's replies to held-out questions (metrics.json's val_samples)
        + [
            ["exported", *(sample.get(key) for key in ("input", "reply", "reference"))]
            for sample in (inputs.metrics.get("val_samples") or [])[:MAX_SAMPLES]
            if isinstance(sample, dict)
        ],
        "notes": inputs.notes,
    }


def render_html(inputs: ReportInputs, plots: Plots) -> str:
    """A single HTML file with every plot inlined as a base64 PNG data URI."""
    return render_page("run.html", page_values(inputs, plots))


def render_markdown(inputs: ReportInputs, plots: Plots) -> str:
    """A Markdown summary; plots are referenced as the PNG files next to it."""
    return render_page("run.md", page_values(inputs, plots))


def render_report(inputs: ReportInputs) -> dict[str, bytes]:
    """Every report file by name: ``report.html``, ``report.md`` and the PNG plots."""
    plots = all_plots(inputs.history, inputs.confusion)
    return report_files("run", plots, page_values(inputs, plots))
