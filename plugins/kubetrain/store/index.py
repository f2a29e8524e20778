"""The names of run records in the run indexes and leaderboards, and of promotions in a model's history.

Key order is the pages' order, so the names carry what the pages sort and filter on:

* ``index/<model>/<entry>.json`` and ``index/_all/<entry>.json``: newest first. The entry name
  is ``<inverted run time>~<model>~<dag>~<run>~<trial>~<dataset version>~<status>``, so the
  filters (DAG, dataset version, status) are answered from the keys alone;
* ``leaderboard/<model>/<metric>/<entry>.json``: best first for the metric's mode, the value
  encoded so that key order is value order (``<sortable value>~<inverted run time>~<dag>~<run>~<trial>``);
* ``promotions/<model>/<inverted time>~<version>.json``: newest first.

``~`` never occurs in a model name or an S3-safe segment, so entry names split unambiguously.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubetrain.s3_layout import RunLocation, S3Layout, safe_segment
from kubetrain_contract.run import RunRecord

SEPARATOR = "~"
# Inverted times count down from here (milliseconds): keys of newer runs sort first until year 2286.
_TIME_CEILING = 10**13 - 1


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


def run_time_of(record: Mapping[str, Any]) -> datetime:
    """The ``run_time`` of a record's document."""
    return datetime.fromisoformat(record["run_time"].replace("Z", "+00:00"))


def _segments(record: RunRecord) -> tuple[str, str, str]:
    trial = record.trial
    return safe_segment(record.dag_id), safe_segment(record.run_id), safe_segment(trial) if trial else ""


def index_name(record: RunRecord) -> str:
    """The run's entry name in the run indexes (the same under ``index/<model>/`` and ``index/_all/``)."""
    dag, run, trial = _segments(record)
    when = inverted_time(run_time_of({"run_time": record.run_time}))
    fields = (when, record.model, dag, run, trial, record.dataset.version or "", record.status)
    return SEPARATOR.join(fields) + ".json"


def leaderboard_name(record: RunRecord) -> str | None:
    """The run's leaderboard entry name, or ``None`` when it has no value to rank (failed, no metric)."""
    metrics = record.metrics
    value, mode = metrics.value, metrics.monitor_mode
    if record.status != "success" or not metrics.monitor or mode is None:
        return None
    if value is None or not math.isfinite(value):
        return None
    dag, run, trial = _segments(record)
    when = inverted_time(run_time_of({"run_time": record.run_time}))
    return SEPARATOR.join((sortable_value(value, mode), when, dag, run, trial)) + ".json"


def record_keys(layout: S3Layout, record: RunRecord) -> list[str]:
    """Every key a record is written under: the run's own, the two indexes, the leaderboard."""
    run = RunLocation.from_uri(record.run_uri)
    name = index_name(record)
    keys = [
        layout.run_record_key(run),
        layout.run_index_prefix(record.model) + name,
        layout.run_index_prefix(None) + name,
    ]
    board = leaderboard_name(record)
    if board is not None and record.metrics.monitor:
        keys.append(layout.leaderboard_prefix(record.model, record.metrics.monitor) + board)
    return keys


def promotion_name(version: str, written: datetime) -> str:
    """Entry name of a promotion in ``promotions/<model>/``: newest first.

    Ordered by ``written``, the time the entry is written (milliseconds): ``promoted_at`` has
    whole seconds, so two promotions within one second would otherwise sort by version.

    :param version: the promoted version; ``written``: when the entry is written.
    """
    return f"{inverted_time(written)}{SEPARATOR}{safe_segment(version)}.json"
