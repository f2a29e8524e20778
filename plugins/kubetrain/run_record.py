"""Run records (format version 1): one small JSON document per finished training run, and its index.

The pipeline's record step writes, through :class:`~kubetrain.run_store.RunStore`, the record
of every finished run (a single pod, one trial of a sweep, a distributed job): what ran (DAG,
run, trial, model, dataset version, image digest, code version, Params and hyperparameters),
how it went (final and best metrics, epochs, steps, wall time, the step it resumed from) and
what became of it (promoted or not, and why). A run that fails in training, report or
promotion leaves a record too, with ``status: failed`` and the failing task's error.

The record lives beside the run's files (``runs/<dag>/<run>/run-record.json``) and is copied
into key-ordered indexes, so that pages list runs with one ListObjectsV2 request and read only
the records they show:

* ``index/<model>/<entry>.json`` and ``index/_all/<entry>.json``: newest first. The entry name
  is ``<inverted run time>~<model>~<dag>~<run>~<trial>~<dataset version>~<status>``, so the
  filters (DAG, dataset version, status) are answered from the keys alone;
* ``leaderboard/<model>/<metric>/<entry>.json``: best first for the metric's mode, the value
  encoded so that key order is value order (``<sortable value>~<inverted run time>~<dag>~<run>~<trial>``).

``~`` never occurs in a model name or an S3-safe segment, so entry names split unambiguously.
The schema is ``schemas/run-record.v1.json``; promotions (``promotions/<model>/``) follow
``schemas/promotion.v1.json``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from kubetrain.s3_layout import RunLocation, S3Layout, check_name, safe_segment, utc_stamp
from kubetrain_contract.reports import finite_number

KIND = "kubetrain/run-record"
PROMOTION_KIND = "kubetrain/promotion"
FORMAT_VERSION = 1
STATUSES = ("success", "failed")
PROMOTE_RULES = ("if_better", "always", "never")
SCHEMAS = Path(__file__).parent / "schemas"
SEPARATOR = "~"
# Inverted times count down from here (milliseconds): keys of newer runs sort first until year 2286.
_TIME_CEILING = 10**13 - 1
_MAX_ERROR_CHARS = 2000


# -- times and sortable values ----------------------------------------------------------------


def inverted_time(when: datetime) -> str:
    """13 digits that sort newest first: ``9999999999999`` minus the UTC epoch milliseconds."""
    millis = int(round(when.astimezone(UTC).timestamp() * 1000))
    if not 0 <= millis <= _TIME_CEILING:
        raise ValueError(f"time {when!r} is outside what a run index can hold (1970 to 2286)")
    return f"{_TIME_CEILING - millis:013d}"


def time_of_inverted(text: str) -> datetime:
    """The time that :func:`inverted_time` turned into ``text``."""
    if len(text) != 13 or not text.isdigit():
        raise ValueError(f"{text!r} is not an inverted time: expected 13 digits")
    return datetime.fromtimestamp((_TIME_CEILING - int(text)) / 1000, tz=UTC)


def sortable_value(value: float, mode: str) -> str:
    """16 hex digits whose string order is best-first for ``mode`` (``max``: largest first).

    IEEE 754 doubles compare like their bits once negative numbers have all bits flipped and
    positive ones only the sign bit; ``max`` sorts the negated value.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"monitor mode {mode!r} is not valid: expected 'max' or 'min'")
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"metric value {value!r} cannot be ranked: expected a finite number")
    key = -float(value) if mode == "max" else float(value)
    if key == 0:
        key = 0.0  # -0.0 and 0.0 rank together
    (bits,) = struct.unpack(">Q", struct.pack(">d", key))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | (1 << 63)
    return f"{bits:016x}"


def value_of_sortable(text: str, mode: str) -> float:
    """The value that :func:`sortable_value` encoded as ``text``."""
    bits = int(text, 16)
    bits = bits & ~(1 << 63) if bits >> 63 else bits ^ 0xFFFFFFFFFFFFFFFF
    (key,) = struct.unpack(">d", struct.pack(">Q", bits))
    return -key if mode == "max" else key


# -- index entries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexEntry:
    """What the name of a run index object says about the run, without reading it."""

    key: str
    run_time: datetime
    model: str
    dag: str  # S3-safe segment of the DAG id
    run: str  # S3-safe segment of the run id
    trial: str  # S3-safe segment of the trial, "" for none
    dataset_version: str
    status: str

    @classmethod
    def parse(cls, key: str) -> IndexEntry:
        name = key.rsplit("/", 1)[-1]
        if not name.endswith(".json"):
            raise ValueError(f"run index key {key!r} does not end in .json")
        parts = name[: -len(".json")].split(SEPARATOR)
        if len(parts) != 7:
            raise ValueError(
                f"run index key {key!r} has {len(parts)} fields: expected 7 separated by {SEPARATOR!r}"
            )
        stamp, model, dag, run, trial, version, status = parts
        return cls(key, time_of_inverted(stamp), model, dag, run, trial, version, status)


@dataclass(frozen=True)
class LeaderboardEntry:
    """What the name of a leaderboard object says: the value, and which run."""

    key: str
    value: float
    run_time: datetime
    dag: str
    run: str
    trial: str

    @classmethod
    def parse(cls, key: str, mode: str) -> LeaderboardEntry:
        name = key.rsplit("/", 1)[-1]
        parts = name[: -len(".json")].split(SEPARATOR) if name.endswith(".json") else []
        if len(parts) != 5:
            raise ValueError(f"leaderboard key {key!r} is not <value>~<time>~<dag>~<run>~<trial>.json")
        value, stamp, dag, run, trial = parts
        return cls(key, value_of_sortable(value, mode), time_of_inverted(stamp), dag, run, trial)


def run_time_of(record: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(record["run_time"].replace("Z", "+00:00"))


def _segments(record: dict[str, Any]) -> tuple[str, str, str]:
    trial = record.get("trial")
    return (
        safe_segment(record["dag_id"]),
        safe_segment(record["run_id"]),
        safe_segment(str(trial)) if trial not in (None, "") else "",
    )


def index_name(record: dict[str, Any]) -> str:
    """The run's entry name in the run indexes (the same under ``index/<model>/`` and ``index/_all/``)."""
    dag, run, trial = _segments(record)
    version = (record.get("dataset") or {}).get("version") or ""
    fields = (inverted_time(run_time_of(record)), record["model"], dag, run, trial, version, record["status"])
    return SEPARATOR.join(fields) + ".json"


def index_run_prefix(record: dict[str, Any]) -> str:
    """The part of :func:`index_name` that names the run (every status and version of it share it)."""
    return SEPARATOR.join(index_name(record).split(SEPARATOR)[:5]) + SEPARATOR


def leaderboard_name(record: dict[str, Any]) -> str | None:
    """The run's leaderboard entry name, or ``None`` when it has no value to rank (failed, no metric)."""
    metrics = record.get("metrics") or {}
    value, mode = metrics.get("value"), metrics.get("monitor_mode")
    if record.get("status") != "success" or not metrics.get("monitor") or mode not in ("max", "min"):
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return None
    dag, run, trial = _segments(record)
    fields = (sortable_value(value, mode), inverted_time(run_time_of(record)), dag, run, trial)
    return SEPARATOR.join(fields) + ".json"


def record_keys(layout: S3Layout, record: dict[str, Any]) -> list[str]:
    """Every key a record is written under: the run's own, the two indexes, the leaderboard."""
    run = RunLocation.from_uri(record["run_uri"])
    name = index_name(record)
    keys = [
        layout.run_record_key(run),
        layout.run_index_prefix(record["model"]) + name,
        layout.run_index_prefix(None) + name,
    ]
    board = leaderboard_name(record)
    if board is not None:
        keys.append(layout.leaderboard_prefix(record["model"], record["metrics"]["monitor"]) + board)
    return keys


def promotion_name(event: dict[str, Any], written: datetime | None = None) -> str:
    """Entry name of a promotion in ``promotions/<model>/``: newest first.

    Ordered by ``written``, the time the entry is written (milliseconds), when given: ``promoted_at``
    has whole seconds, so two promotions within one second would otherwise sort by version.
    """
    when = written or datetime.fromisoformat(event["promoted_at"].replace("Z", "+00:00"))
    return f"{inverted_time(when)}{SEPARATOR}{safe_segment(event['version'])}.json"


# -- schema --------------------------------------------------------------------------------------


@cache
def schema(name: str = "run-record") -> dict[str, Any]:
    """The JSON schema ``schemas/<name>.v1.json``."""
    return json.loads((SCHEMAS / f"{name}.v{FORMAT_VERSION}.json").read_text())


def check_document(document: Any, name: str = "run-record") -> dict[str, Any]:
    """Return ``document`` when it is valid against its schema, else raise ``ValueError`` naming the field."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema(name), format_checker=jsonschema.FormatChecker())
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "(the document)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"{name} field {where}: {first.message}{more}")
    return document


# -- why a run was or was not promoted -------------------------------------------------------------


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def promotion_reason(
    *,
    rule: str | None,
    promoted: bool,
    monitor: str | None = None,
    mode: str | None = None,
    value: float | None = None,
    other_version: str | None = None,
    other_value: float | None = None,
) -> str:
    """One sentence that says why a run was (not) promoted.

    :param rule: the run's ``promote`` Param (``if_better``, ``always``, ``never``).
    :param promoted: whether it was.
    :param monitor: the compared metric; ``mode``: ``max`` or ``min``; ``value``: this run's.
    :param other_version: the version promoted before (compared with); ``other_value``: its value.
    """
    this = f"{monitor} {_fmt(value)}" if monitor and value is not None else None
    other = f"version {other_version}" if other_version else None
    if rule == "never":
        return "not promoted: promote=never"
    if rule == "always":
        replaced = f", replacing {other}" if promoted and other else ""
        return f"promoted: promote=always{replaced}" if promoted else "not promoted (promote=always)"
    if rule != "if_better":
        return "promoted" if promoted else "not promoted"
    if other_version is None:
        if promoted:
            return "promoted: promote=if_better and no version was promoted before"
        if this is None:
            return f"not promoted: promote=if_better and this run has no {monitor or 'metric'} to compare"
        return f"not promoted: promote=if_better and {this} was not better than the promoted model"
    if this is None:
        return f"not promoted: promote=if_better and this run has no {monitor or 'metric'} to compare with {other}"
    if other_value is None:
        return (
            f"promoted: promote=if_better, {other} has no {monitor} to compare with"
            if promoted
            else f"not promoted: promote=if_better, {other} has no {monitor}"
        )
    sign = (">" if mode == "max" else "<") if promoted else ("<=" if mode == "max" else ">=")
    if promoted:
        return f"promoted: promote=if_better, {this} {sign} {_fmt(other_value)} of {other}"
    return f"not promoted: promote=if_better, lost to {other} ({monitor} {_fmt(other_value)}; this run {_fmt(value)})"


# -- building a record -------------------------------------------------------------------------------


def _integer(value: Any) -> int | None:
    number = finite_number(value)
    return int(number) if number is not None and number == int(number) and number >= 0 else None


def _numbers(section: Any) -> dict[str, float | int | None]:
    """A metrics section with every value a number or null (integers such as an epoch stay integers)."""
    if not isinstance(section, dict):
        return {}
    return {
        str(k): v if isinstance(v, int) and not isinstance(v, bool) else finite_number(v)
        for k, v in section.items()
    }


def json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: NaN and infinities become null, objects text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


def build_record(
    *,
    dag_id: str,
    run_id: str,
    run: RunLocation,
    run_time: datetime,
    model: str,
    status: str = "success",
    trial: str | None = None,
    params: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    run_params: dict[str, Any] | None = None,
    dataset_uri: str | None = None,
    dataset_version: str | None = None,
    dataset_manifest: str | None = None,
    image: str | None = None,
    fingerprint: str | None = None,
    promote_rule: str | None = None,
    promotion: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None,
    resumed_from_step: int | None = None,
    resumed_from_source: str | None = None,
    failure: dict[str, str] | None = None,
    sweep: dict[str, Any] | None = None,
    distributed: dict[str, Any] | None = None,
    compare_on: str = "final",
) -> dict[str, Any]:
    """The run record of a finished run, checked against the schema.

    :param params: the DAG run's Params (what the user chose).
    :param metrics: the run's ``output/metrics.json`` (``None`` when the container wrote none).
    :param run_params: the run's ``output/params.json`` (hyperparameters, code version), if any.
    :param image: the training image by digest (``<repository>@sha256:...``).
    :param promote_rule: the ``promote`` Param; ``promotion``: the promote task's result.
    :param report: the report task's result (report URI and URL, the comparison with the promoted model).
    :param resumed_from_step: the step the last pod resumed from (0: it started fresh).
    :param failure: ``{"task", "error"}`` of a failed run.
    :param sweep: a sweep trial's fields (``id``, ``trial``, ``stopped_early``, ...).
    :param distributed: a distributed run's fields (``backend``, ``workers``, ``ps_replicas``).
    :param compare_on: which section of metrics.json holds the ranked value (``final`` or ``best``).
    """
    if status not in STATUSES:
        raise ValueError(f"run status {status!r} is not valid: expected one of {', '.join(STATUSES)}")
    if promote_rule is not None and promote_rule not in PROMOTE_RULES:
        raise ValueError(f"promote={promote_rule!r} is not valid: expected one of {', '.join(PROMOTE_RULES)}")
    check_name("model", model)
    metrics = metrics if isinstance(metrics, dict) else {}
    run_params = run_params if isinstance(run_params, dict) else {}
    promotion = dict(promotion or {})
    report = dict(report or {})
    monitor = metrics.get("monitor") if isinstance(metrics.get("monitor"), str) else report.get("monitor")
    mode = (
        metrics.get("monitor_mode")
        if metrics.get("monitor_mode") in ("max", "min")
        else report.get("monitor_mode")
    )
    section = metrics.get(compare_on) if isinstance(metrics.get(compare_on), dict) else {}
    value = finite_number(section.get(monitor)) if monitor else None
    if value is None:
        value = finite_number(report.get("value"))
    digest = image.rsplit("@", 1)[1] if isinstance(image, str) and "@sha256:" in image else None
    code_version = run_params.get("code_version")
    if not code_version and image:
        from kubetrain.pod_spec import code_version_of

        code_version = code_version_of(image)
    promoted = bool(promotion.get("promoted"))
    other_version = promotion.get("previous_version") or report.get("promoted_version")
    other_value = finite_number(report.get("promoted_metric"))
    if failure is not None:
        reason = f"not promoted: the run failed in {failure.get('task')}"
    else:
        reason = promotion.get("reason") or promotion_reason(
            rule=promote_rule,
            promoted=promoted,
            monitor=monitor,
            mode=mode,
            value=value,
            other_version=other_version,
            other_value=other_value,
        )
    if resumed_from_step is None and _integer(metrics.get("resumed_from_step")) is not None:
        resumed_from_step, resumed_from_source = _integer(metrics.get("resumed_from_step")), "metrics.json"
    record = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "dag_id": dag_id,
        "run_id": run_id,
        "trial": str(trial) if trial not in (None, "") else None,
        "run_uri": run.uri,
        "run_time": utc_stamp(run_time),
        "recorded_at": utc_stamp(),
        "status": status,
        "failure": (
            {"task": str(failure.get("task")), "error": str(failure.get("error") or "")[:_MAX_ERROR_CHARS]}
            if failure is not None
            else None
        ),
        "model": model,
        "trainer": metrics.get("trainer") or run_params.get("trainer") or report.get("trainer"),
        "dataset": {
            "uri": dataset_uri or None,
            "version": dataset_version or run_params.get("dataset_version") or None,
            "manifest_uri": dataset_manifest or None,
        },
        "image": {"reference": image or run_params.get("image") or None, "digest": digest},
        "code_version": code_version or None,
        "fingerprint": fingerprint or None,
        "params": json_safe(dict(params or {})),
        "hyperparameters": json_safe(run_params.get("hyperparameters") or {}),
        "metrics": {
            "monitor": monitor or None,
            "monitor_mode": mode if mode in ("max", "min") else None,
            "compare_on": compare_on,
            "value": value,
            "final": _numbers(metrics.get("final") or report.get("final")),
            "best": _numbers(metrics.get("best") or report.get("best")),
        },
        "epochs": _integer(metrics.get("epochs")),
        "steps": _integer(metrics.get("steps")),
        "wall_time_s": finite_number(metrics.get("wall_time_s")),
        "examples_per_s": finite_number(metrics.get("examples_per_s")),
        "resumed_from_step": resumed_from_step,
        "resumed_from_source": resumed_from_source if resumed_from_step is not None else None,
        "promotion": {
            "rule": promote_rule,
            "promoted": promoted,
            "version": promotion.get("model_version") if promoted else None,
            "model_uri": promotion.get("model_uri") if promoted else None,
            "reason": reason,
            "compared_with": ({"version": other_version, "value": other_value} if other_version else None),
        },
        "report_uri": report.get("report_uri") or None,
        "report_url": report.get("report_url") or None,
        "sweep": json_safe(sweep) if sweep else None,
        "distributed": json_safe(distributed) if distributed else None,
        "mlflow": None,
    }
    return check_document(record)


def promotion_event(
    *,
    model: str,
    version: str,
    model_uri: str,
    dag_id: str,
    run_id: str,
    trial: str | None,
    run_uri: str,
    rule: str,
    reason: str,
    monitor: str | None,
    value: float | None,
    previous_version: str | None,
    previous_value: float | None,
    promoted_at: str | None = None,
) -> dict[str, Any]:
    """One entry of a model's promotion history, checked against ``schemas/promotion.v1.json``."""
    event = {
        "kind": PROMOTION_KIND,
        "format_version": FORMAT_VERSION,
        "model": check_name("model", model),
        "version": version,
        "model_uri": model_uri,
        "promoted_at": promoted_at or utc_stamp(),
        "dag_id": dag_id,
        "run_id": run_id,
        "trial": str(trial) if trial not in (None, "") else None,
        "run_uri": run_uri,
        "rule": rule,
        "reason": reason,
        "metric": {"name": monitor, "value": finite_number(value)},
        "previous": {"version": previous_version, "value": finite_number(previous_value)}
        if previous_version
        else None,
    }
    return check_document(event, "promotion")
