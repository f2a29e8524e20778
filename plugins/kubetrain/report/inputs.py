"""Parse and check the files a trainer leaves in OUTPUT_DIR (metrics.json, history.csv, ...)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubetrain.imagebuild.reference import parse_reference
from kubetrain_contract.reports import HISTORY_CSV, finite_number
from kubetrain_contract.run_layout import CONFUSION_MATRIX_JSON, METRICS_JSON, PARAMS_JSON, SAMPLES_JSON

MONITOR_MODES = ("max", "min")


def parse_json(name: str, data: bytes) -> Any:
    """Decode a JSON file, naming it in the error."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc


def parse_metrics(data: bytes) -> dict[str, Any]:
    """Parse metrics.json and check the fields the report and the comparison rely on."""
    metrics = parse_json(METRICS_JSON, data)
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics.json must hold a JSON object, got {type(metrics).__name__}")
    monitor = metrics.get("monitor")
    if not isinstance(monitor, str) or not monitor:
        raise ValueError(
            f"metrics.json has monitor={monitor!r}: expected the name of a metric, e.g. 'val_accuracy'"
        )
    mode = metrics.get("monitor_mode")
    if mode not in MONITOR_MODES:
        raise ValueError(f"metrics.json has monitor_mode={mode!r}: expected 'max' or 'min'")
    final = metrics.get("final")
    if not isinstance(final, dict):
        raise ValueError(f"metrics.json has final={final!r}: expected an object of final metric values")
    return metrics


@dataclass(frozen=True)
class History:
    """history.csv: one row per epoch; values are floats or ``None`` where empty."""

    columns: list[str]
    rows: list[dict[str, float | None]]

    @property
    def metric(self) -> str | None:
        """The task metric (the column after ``loss``: ``accuracy``, ...), if any."""
        extra = [c for c in self.columns if c not in _FIXED_COLUMNS and not c.startswith("val_")]
        return extra[0] if extra else None

    def series(self, column: str) -> tuple[list[float], list[float]]:
        """``(epochs, values)`` of a column, skipping empty cells."""
        xs, ys = [], []
        for index, row in enumerate(self.rows):
            value = row.get(column)
            if value is not None:
                epoch = row.get("epoch")
                xs.append(epoch if epoch is not None else float(index + 1))
                ys.append(value)
        return xs, ys


_FIXED_COLUMNS = ("epoch", "step", "loss", "val_loss", "learning_rate", "wall_time_s")


def parse_history(data: bytes) -> History:
    """Parse history.csv (``epoch,step,loss,<metric>,val_loss,val_<metric>,learning_rate,wall_time_s``)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"history.csv is not UTF-8 text: {exc}") from exc
    reader = csv.DictReader(io.StringIO(text))
    columns = [c.strip() for c in reader.fieldnames or []]
    if "epoch" not in columns or "loss" not in columns:
        raise ValueError(
            f"history.csv has columns {columns}: expected at least 'epoch' and 'loss' in the header row"
        )
    rows = []
    for raw in reader:
        rows.append({(k or "").strip(): finite_number(v) for k, v in raw.items() if k})
    return History(columns=columns, rows=rows)


def parse_confusion(data: bytes) -> dict[str, Any]:
    """Parse confusion_matrix.json: ``{"classes": [...], "matrix": [[...]]}`` with a square matrix."""
    doc = parse_json(CONFUSION_MATRIX_JSON, data)
    classes = doc.get("classes") if isinstance(doc, dict) else None
    matrix = doc.get("matrix") if isinstance(doc, dict) else None
    if not isinstance(classes, list) or not isinstance(matrix, list):
        raise ValueError(
            "confusion_matrix.json must be an object with 'classes' (list) and 'matrix' (list of rows)"
        )
    if len(matrix) != len(classes) or any(not isinstance(r, list) or len(r) != len(classes) for r in matrix):
        raise ValueError(
            f"confusion_matrix.json: the matrix must be {len(classes)}x{len(classes)} for {len(classes)} classes"
        )
    return {
        "classes": [str(c) for c in classes],
        "matrix": [[finite_number(v) or 0 for v in r] for r in matrix],
    }


def parse_samples(data: bytes) -> list[dict[str, Any]]:
    """Parse samples.json: a list of ``{"step", "input", "reply", "reference"}``."""
    doc = parse_json(SAMPLES_JSON, data)
    if not isinstance(doc, list) or not all(isinstance(s, dict) for s in doc):
        raise ValueError("samples.json must hold a list of objects with step, input, reply and reference")
    return doc


@dataclass(frozen=True)
class Comparison:
    """The new model against the promoted one, on the run's monitor."""

    monitor: str
    mode: str
    value: float | None
    promoted_version: str | None
    promoted_value: float | None
    better: bool
    reason: str
    # no model is promoted at all (then the new one counts as better: there is nothing to beat)
    nothing_promoted: bool = False


def compare(
    metrics: dict[str, Any],
    promoted: dict[str, Any] | None,
    promoted_version: str | None,
    *,
    on: str = "final",
) -> Comparison:
    """Whether ``metrics`` beats the promoted model's metrics (strictly) on ``metrics["monitor"]``.

    :param metrics: the new run's metrics.json.
    :param promoted: the promoted model's metrics.json, or ``None`` when nothing is promoted.
    :param promoted_version: its version, for the record.
    :param on: ``"final"`` (the exported model's last values) or ``"best"`` (the best epoch).
    """
    if on not in ("final", "best"):
        raise ValueError(f"compare_on={on!r} is not valid: expected 'final' or 'best'")
    monitor, mode = metrics["monitor"], metrics["monitor_mode"]

    def value_of(doc: dict[str, Any]) -> float | None:
        section = doc.get(on)
        if not isinstance(section, dict):
            section = {}
        return finite_number(section.get(monitor))

    value = value_of(metrics)
    if value is None:
        return Comparison(
            monitor, mode, None, promoted_version, None, False, f"this run has no {on} {monitor}"
        )
    if promoted is None:
        return Comparison(
            monitor, mode, value, None, None, True, "no model is promoted yet", nothing_promoted=True
        )
    old = value_of(promoted)
    if old is None:
        return Comparison(
            monitor,
            mode,
            value,
            promoted_version,
            None,
            True,
            f"the promoted model has no {on} {monitor} to compare with",
        )
    better = value > old if mode == "max" else value < old
    relation = "better than" if better else "not better than"
    return Comparison(
        monitor,
        mode,
        value,
        promoted_version,
        old,
        better,
        f"{monitor} {value:.6g} is {relation} the promoted {old:.6g} ({mode})",
    )


@dataclass
class ReportInputs:
    """Everything a report shows."""

    run_uri: str
    metrics: dict[str, Any]
    history: History | None = None
    params: dict[str, Any] | None = None
    confusion: dict[str, Any] | None = None
    samples: list[dict[str, Any]] | None = None
    comparison: Comparison | None = None
    title: str | None = None
    notes: list[str] = field(default_factory=list)
    # Facts about how the run ran that a reader must see first (e.g. a GPU request served on CPU).
    warnings: list[str] = field(default_factory=list)
    # Preemptions, evictions and time queued (kubetrain_contract.run.RunDisruptions), if any.
    disruptions: Any = None
    # What the platform knows of the run, for a container that records none of it in params.json
    # (an image of the user's own): the image by digest, the dataset version, the training command.
    image: str | None = None
    dataset_version: str | None = None
    command: list[str] | None = None
    # The run as Airflow knows it: when it ran (text, UTC) and its page in the Airflow UI.
    run_date: str | None = None
    airflow_url: str | None = None
    # The dataset as the stage task found it: its URI, bytes and objects.
    dataset_uri: str | None = None
    dataset_bytes: int | None = None
    dataset_objects: int | None = None
    # The source revision the image carries (label org.opencontainers.image.revision), or, when there is
    # none, why not (the Code version row then shows the digest and says so).
    revision: str | None = None
    revision_note: str | None = None
    # The Params this run set to other values than the DAG's defaults, each as (value, default);
    # ``None``: not known (no hyperparameter is marked).
    user_set: dict[str, tuple[Any, Any]] | None = None
    # The promote task's rule when one decides after this report (the page says the decision is pending).
    promote_rule: str | None = None

    @property
    def epochs(self) -> int | None:
        """The epochs trained: metrics.json's ``epochs``, else the last epoch of history.csv (``None``: unknown)."""
        return epochs_of(self.metrics, self.history)

    @property
    def trainer(self) -> str | None:
        """metrics.json's ``trainer``, else the image's repository (a container of the user's own)."""
        return self.metrics.get("trainer") or image_repository(self.image)


def user_set_params(conf: Any, defaults: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The Params a DAG run set to another value than their default, as ``{name: (value, default)}``.

    The trigger form sends every Param in the run's conf, the defaults included, so a Param counts as
    set by the user only where its value differs from the default. A conf key that is no Param is
    left out (it is not a setting of the run).

    :param conf: the DAG run's conf (``dag_run.conf``); anything else than a mapping counts as empty.
    :param defaults: each Param's default value by name.
    """
    if not isinstance(conf, Mapping):
        return {}
    return {
        str(name): (value, defaults[name])
        for name, value in conf.items()
        if name in defaults and not same_value(value, defaults[name])
    }


def same_value(a: Any, b: Any) -> bool:
    """Whether a conf value equals a default as the form means it: ``1`` is ``1.0``, ``None`` is ``""``."""
    if a in (None, "") and b in (None, ""):
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def epochs_of(metrics: dict[str, Any], history: History | None) -> int | None:
    """The epochs a run trained: metrics.json's ``epochs``, else the last (highest) epoch of history.csv.

    :param metrics: the run's metrics.json.
    :param history: its history.csv, if any.
    """
    stated = finite_number(metrics.get("epochs"))
    if stated is not None:
        return int(stated) if stated == int(stated) and stated >= 0 else None
    if history is None or not history.rows:
        return None
    epochs = [e for e in (row.get("epoch") for row in history.rows) if e is not None]
    last = max(epochs) if epochs else float(len(history.rows))
    return int(last) if last == int(last) and last >= 0 else None


def image_repository(image: str | None) -> str | None:
    """An image reference without its registry, tag or digest (``examples/keras-model``), or ``None``
    (no image, or one that is no reference).

    :param image: e.g. ``localhost:5000/examples/keras-model@sha256:...``.
    """
    if not image:
        return None
    try:
        return parse_reference(image).repository
    except ValueError:
        return None


#: the output files :func:`load_run_inputs` reads
REPORT_FILES = (METRICS_JSON, HISTORY_CSV, PARAMS_JSON, CONFUSION_MATRIX_JSON, SAMPLES_JSON)


def load_run_inputs(
    read: Callable[[str], bytes | None], run_uri: str, *, title: str | None = None
) -> ReportInputs | None:
    """A run's report inputs from its output files, or ``None`` when it wrote no metrics.json.

    :param read: ``read(name) -> bytes | None``: a file of the run's output area, ``None`` when missing.
    :param run_uri: the run, for the report.
    :param title: report title.
    """
    raw_metrics = read(METRICS_JSON)
    if raw_metrics is None:
        return None
    inputs = ReportInputs(run_uri=run_uri, metrics=parse_metrics(raw_metrics), title=title)
    if (raw := read(HISTORY_CSV)) is not None:
        inputs.history = parse_history(raw)
    else:
        inputs.notes.append("history.csv is missing: no curves")
    if (raw := read(PARAMS_JSON)) is not None:
        params = parse_json(PARAMS_JSON, raw)
        inputs.params = params if isinstance(params, dict) else None
    if (raw := read(CONFUSION_MATRIX_JSON)) is not None:
        inputs.confusion = parse_confusion(raw)
    if (raw := read(SAMPLES_JSON)) is not None:
        inputs.samples = parse_samples(raw)
    return inputs
