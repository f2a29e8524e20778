"""What a finished training loop reports: history.csv, metrics.json and the trainer's last log line.

``final`` in metrics.json, like the last log line, describes the model in OUTPUT_DIR: with
``--restore-best`` (the default) the best epoch's, which need not be the last one.
Standard library only: readers of the outputs do not load TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.common.contract import write_csv_atomic

if TYPE_CHECKING:
    from trainer.common.config import TrainerConfig
    from trainer.common.runtime import Runtime

__all__ = ["LoopResult", "describe_exported", "history_header", "metrics_document", "write_history"]


@dataclass
class LoopResult:
    """What a finished loop reports for metrics.json."""

    history: list[dict[str, Any]]
    steps: int
    resumed_from_step: int
    wall_time_s: float
    examples_per_s: float
    extra_state: dict[str, Any] = field(default_factory=dict)
    monitor: str = "val_accuracy"
    monitor_mode: str = "max"
    best: dict[str, Any] | None = None  # epoch, step and value of the best epoch
    exported: dict[str, Any] | None = None  # the history row whose weights the model holds now
    restored_best: bool = False
    stopped_early: dict[str, Any] | None = None
    throughput: dict[str, Any] = field(default_factory=dict)


def history_header(metric: str) -> list[str]:
    """The history.csv columns for a metric name."""
    return ["epoch", "step", "loss", metric, "val_loss", f"val_{metric}", "learning_rate", "wall_time_s"]


def write_history(path: Path, metric: str, history: list[dict[str, Any]]) -> None:
    """history.csv: one row per epoch, numbers to 6 significant digits, NaN as an empty cell."""
    header = history_header(metric)
    write_csv_atomic(path, header, ([_csv_value(row[h]) for h in header] for row in history))


def peak_rss_bytes() -> int | None:
    """The trainer process's peak resident memory so far (what a pod's memory limit must hold, page cache
    and other containers apart): the kernel's high-water mark of this process's memory, ``VmHWM``.

    Not ``getrusage``'s ``ru_maxrss``, which keeps the mark of the image an ``exec`` replaced: a trainer
    started from a large process (a test's, a notebook's) would report that process's memory.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def metrics_document(
    *,
    trainer: str,
    task: str,
    metric: str,
    result: LoopResult,
    runtime: Runtime,
    skipped_files: int = 0,
    config: TrainerConfig | None = None,
    runtime_facts: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """metrics.json: the exported model's metrics (``final``), the best and last epochs, steps,
    time, throughput split into input wait and compute, and devices.

    Args:
        runtime_facts: what the runtime resolved at start-up (e.g. ``precision``,
            ``steps_per_execution``, ``jit_compile`` as actually used); they replace the
            flag values of the same name taken from ``config``.
        extra: task facts (class names, example counts), added last.
    """
    monitor = result.monitor
    keys = ("loss", metric, "val_loss", f"val_{metric}")
    last = result.history[-1] if result.history else {}
    exported = result.exported or last
    best = result.best or {}
    doc = {
        "trainer": trainer,
        "task": task,
        "monitor": monitor,
        "monitor_mode": result.monitor_mode,
        # "final" describes the model in OUTPUT_DIR: the best epoch's with --restore-best.
        "final": {k: exported.get(k) for k in keys},
        "best": {monitor: best.get("value"), "epoch": best.get("epoch"), "step": best.get("step")},
        "last": {k: last.get(k) for k in keys},
        "exported": {
            "epoch": exported.get("epoch"),
            "step": exported.get("step"),
            "restored_best": result.restored_best,
        },
        "stopped_early": result.stopped_early,
        "epochs": len(result.history),
        "steps": result.steps,
        "resumed_from_step": result.resumed_from_step,
        "wall_time_s": result.wall_time_s,
        "examples_per_s": result.examples_per_s,
        "step_time_s": result.throughput.get("step_time_s"),
        "input_wait_s": result.throughput.get("input_wait_s"),
        "compute_s": result.throughput.get("compute_s"),
        "input_wait_fraction": result.throughput.get("input_wait_fraction"),
        "startup_s": result.throughput.get("startup_s"),
        "peak_rss_bytes": peak_rss_bytes(),
        "devices": runtime.devices,
        "replicas": runtime.replicas,
        "strategy": runtime.mode,
        "workers": runtime.workers,
        "parameter_servers": runtime.cluster.parameter_servers,
        "mixed_precision": runtime.mixed_precision,
        "deterministic": runtime.deterministic,
        "skipped_files": skipped_files,
    }
    if config is not None:
        doc["steps_per_execution"] = config.steps_per_execution
        doc["jit_compile"] = config.jit_compile
    doc.update(runtime_facts or {})
    doc.update(extra)
    return doc


def describe_exported(result: LoopResult, metric: str = "accuracy") -> str:
    """The exported model in words, for the trainer's last log line.

    Gives the epoch whose weights the model holds (the best one with ``--restore-best``,
    not necessarily the last) and that epoch's validation figures, the monitored one first.
    """
    row = result.exported or (result.history[-1] if result.history else None)
    if row is None:
        return "no epoch was closed"
    which = f"the best by {result.monitor}" if result.restored_best else "the last"
    names = [result.monitor, *(k for k in ("val_loss", f"val_{metric}") if k != result.monitor)]
    figures = " ".join(f"{k} {_figure(row.get(k))}" for k in names)
    return f"exported epoch {row.get('epoch')} (step {row.get('step')}, {which}): {figures}"


def _figure(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "n/a"


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value
