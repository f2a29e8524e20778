"""The pod contract for your own training script: reports, atomic outputs, the stop file and preemption.

Standard library only: ``pip install kubetrain-contract`` in your image (docs/extending.md, "The kit"),
then::

    from kubetrain_contract import kit

    guard = kit.PreemptionGuard()              # SIGTERM becomes a flag, not an exit
    for epoch in range(start, epochs):
        for step in ...:
            train_one_step()
            if guard.requested or kit.should_stop():
                save_checkpoint()                  # in kit.checkpoint_dir()
                raise SystemExit(kit.EXIT_PREEMPTED if guard.requested else kit.EXIT_STOPPED)
        kit.report(epoch=epoch + 1, step=global_step, loss=loss, val_accuracy=acc)
    kit.write_metrics(monitor="val_accuracy", mode="max", final={...})

What it writes is what the checkpoint-sync sidecar's stopping rules and the run's report read
(:mod:`kubetrain_contract.reports`, :mod:`kubetrain_contract.run_layout`): one JSON object a line in
OUTPUT_DIR/metrics.jsonl, and metrics.json and history.csv replaced whole, never seen half-written
(the sidecar uploads files as they change and skips ``.tmp`` names).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kubetrain_contract.exit_codes import (
    EXIT_DATAERR,
    EXIT_DIVERGED,
    EXIT_NOINPUT,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
)
from kubetrain_contract.json_values import json_safe
from kubetrain_contract.pod import CHECKPOINT_DIR, DATA_DIR, OUTPUT_DIR, STOP_FILE, Env
from kubetrain_contract.reports import HISTORY_CSV, METRICS_JSONL
from kubetrain_contract.run_layout import METRICS_JSON

__all__ = [
    "EXIT_DATAERR",
    "EXIT_DIVERGED",
    "EXIT_NOINPUT",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_STOPPED",
    "EXIT_USAGE",
    "PreemptionGuard",
    "checkpoint_dir",
    "data_dir",
    "output_dir",
    "report",
    "should_stop",
    "stop_file",
    "write_history",
    "write_json",
    "write_metrics",
]


def data_dir() -> Path:
    """The staged dataset: ``$DATA_DIR``, else the pod's /data."""
    return Path(os.environ.get(Env.DATA_DIR) or DATA_DIR)


def checkpoint_dir() -> Path:
    """Where checkpoints go (synced to S3 as they are written, restored before a retry starts)."""
    return Path(os.environ.get(Env.CHECKPOINT_DIR) or CHECKPOINT_DIR)


def output_dir() -> Path:
    """Where the model, metrics.json, history.csv and metrics.jsonl go."""
    return Path(os.environ.get(Env.OUTPUT_DIR) or OUTPUT_DIR)


def stop_file() -> Path:
    """The file whose appearance asks the script to stop (a sweep's early-stopping rule writes it)."""
    return Path(os.environ.get(Env.STOP_FILE) or STOP_FILE)


def should_stop() -> bool:
    """Whether the stop file has appeared: save, write the outputs, exit with :data:`EXIT_STOPPED`."""
    return stop_file().exists()


def _finite(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values as JSON takes them: numbers as floats or ints, NaN and infinities as null."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric name {key!r} is not valid: expected a non-empty string")
        if hasattr(value, "item") and callable(value.item):  # numpy and tensor scalars
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        out[key] = json_safe(value)
    return out


def report(**metrics: Any) -> dict[str, Any]:
    """Append one report to OUTPUT_DIR/metrics.jsonl: ``report(epoch=3, step=300, val_accuracy=0.91)``.

    The line is written with a single ``write`` on a file opened for appending, so a reader sees whole
    lines and at most a torn last one, which the readers drop. ``epoch`` and ``step``, when given, must be
    integers >= 0: a stopping rule counts a metric's reports (an epoch's line with ``val_accuracy`` is one).
    Returns the object written.
    """
    for name in ("epoch", "step"):
        value = metrics.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"report {name}={value!r} is not valid: expected an integer >= 0")
    if not metrics:
        raise ValueError("report() needs at least one metric, e.g. report(epoch=1, val_loss=0.4)")
    row = {**_finite(metrics), "time": round(time.time(), 3)}
    line = (json.dumps(row, allow_nan=False) + "\n").encode()
    path = output_dir() / METRICS_JSONL
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):  # a full disk: finish the line, or fail loudly
            os.write(fd, line[written:])
    finally:
        os.close(fd)
    return row


def _write_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a ``.tmp`` file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(name: str, obj: Any) -> Path:
    """Write OUTPUT_DIR/``name`` as JSON, atomically (NaN and infinities become null)."""
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n"
    return _write_atomic(output_dir() / name, text.encode())


def check_monitor_mode(mode: str) -> str:
    """``mode`` when it says which way the monitored metric is better: ``max`` (larger, accuracy) or ``min``
    (smaller, loss); else a ValueError naming it."""
    if mode not in ("max", "min"):
        raise ValueError(f"mode {mode!r} is not valid: expected 'max' (accuracy) or 'min' (loss)")
    return mode


def write_metrics(
    *,
    monitor: str,
    mode: str,
    final: Mapping[str, Any],
    best: Mapping[str, Any] | None = None,
    trainer: str = "custom",
    **extra: Any,
) -> Path:
    """Write OUTPUT_DIR/metrics.json, what the report and the promotion read: the monitored metric, whether
    larger is better (``max``) or smaller (``min``), the final epoch's metrics and, when the model kept is
    another epoch's, that epoch's (``best``, with its ``epoch``)."""
    if monitor not in final and not (best and monitor in best):
        raise ValueError(f"monitor {monitor!r} is in neither final nor best: the report compares runs by it")
    document = {
        "trainer": trainer,
        "monitor": monitor,
        "monitor_mode": check_monitor_mode(mode),
        "final": _finite(final),
        **extra,
    }
    if best is not None:
        document["best"] = _finite(best)
    return write_json(METRICS_JSON, document)


def write_history(rows: Sequence[Mapping[str, Any]] | Iterable[Mapping[str, Any]]) -> Path:
    """Write OUTPUT_DIR/history.csv, one row an epoch (the columns of every row, ``epoch`` first)."""
    rows = [_finite(r) for r in rows]
    columns = list(dict.fromkeys(["epoch", *(k for r in rows for k in r)]))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", restval="")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return _write_atomic(output_dir() / HISTORY_CSV, buf.getvalue().encode())


class PreemptionGuard:
    """SIGTERM as a flag: the kubelet's notice that the pod goes (preemption, eviction, deletion).

    Without it Python dies at once (exit 143) and the work since the last checkpoint is lost. With it,
    the script checks :attr:`requested` at a safe point (after an optimizer step), saves a checkpoint and
    exits with :data:`EXIT_PREEMPTED`, which the operator takes for an interruption and resumes from. The
    pod's grace period (the sidecar uploads the checkpoint within it) bounds how long that may take.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.requested = False
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested, self.signal = True, signum

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
