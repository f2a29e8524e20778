"""metrics.json, history.csv and the trainer's last log line describe the exported model."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from trainer.common.config import TrainerConfig
from trainer.common.metrics_doc import (
    LoopResult,
    describe_exported,
    history_header,
    metrics_document,
    write_history,
)


def row(epoch: int, val_loss: float, val_accuracy: float, **more) -> dict:
    return {
        "epoch": epoch,
        "step": epoch * 8,
        "loss": 1.0 / epoch,
        "accuracy": 0.5 + epoch / 100,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "learning_rate": 0.01,
        "wall_time_s": 1.5 * epoch,
        **more,
    }


HISTORY = [row(1, 0.70, 0.60), row(2, 0.40, 0.90), row(3, 0.55, 0.75)]


def best_of(history, epoch: int) -> dict:
    r = history[epoch - 1]
    return {
        "epoch": epoch,
        "step": r["step"],
        "value": r["val_accuracy"],
        "monitor": "val_accuracy",
        "row": r,
    }


def result(**changes) -> LoopResult:
    values = {
        "history": HISTORY,
        "steps": 24,
        "resumed_from_step": 8,
        "wall_time_s": 12.5,
        "examples_per_s": 100.0,
        "best": best_of(HISTORY, 2),
        "exported": HISTORY[1],
        "restored_best": True,
        "throughput": {"step_time_s": 0.01, "input_wait_s": 0.5, "compute_s": 2.0, "startup_s": 3.0},
        **changes,
    }
    return LoopResult(**values)


@pytest.fixture(scope="module")
def runtime():
    import tensorflow as tf

    from trainer.common.runtime import Runtime

    return Runtime(
        strategy=tf.distribute.get_strategy(),
        devices=["/physical_device:CPU:0"],
        replicas=1,
        mixed_precision=False,
    )


def test_final_is_the_exported_epoch_and_last_is_the_last_one(runtime):
    doc = metrics_document(
        trainer="t", task="classification", metric="accuracy", result=result(), runtime=runtime
    )
    assert doc["final"] == {"loss": 0.5, "accuracy": 0.52, "val_loss": 0.40, "val_accuracy": 0.90}
    assert doc["last"]["val_loss"] == 0.55 and doc["last"]["val_accuracy"] == 0.75
    assert doc["exported"] == {"epoch": 2, "step": 16, "restored_best": True}
    assert doc["best"] == {"val_accuracy": 0.90, "epoch": 2, "step": 16}
    assert (doc["epochs"], doc["steps"], doc["resumed_from_step"]) == (3, 24, 8)
    assert (doc["step_time_s"], doc["input_wait_s"], doc["compute_s"], doc["startup_s"]) == (
        0.01,
        0.5,
        2.0,
        3.0,
    )
    assert doc["input_wait_fraction"] is None  # not in the throughput given
    assert (doc["strategy"], doc["workers"], doc["parameter_servers"], doc["replicas"]) == (
        "mirrored",
        1,
        0,
        1,
    )


def test_without_an_exported_row_final_is_the_last_epoch(runtime):
    doc = metrics_document(
        trainer="t",
        task="c",
        metric="accuracy",
        result=result(exported=None, restored_best=False),
        runtime=runtime,
    )
    assert doc["final"]["val_loss"] == 0.55 and doc["exported"]["epoch"] == 3


def test_runtime_facts_replace_the_flag_values_and_task_facts_come_last(runtime, tmp_path):
    config = TrainerConfig(
        data_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "ckpt"),
        output_dir=str(tmp_path / "out"),
        steps_per_execution=8,
        jit_compile=True,
    )
    doc = metrics_document(
        trainer="t",
        task="c",
        metric="accuracy",
        result=result(),
        runtime=runtime,
        config=config,
        runtime_facts={"precision": "mixed_float16", "jit_compile": False},
        classes=["a", "b"],
    )
    assert doc["steps_per_execution"] == 8  # from the flags: the runtime did not resolve it otherwise
    assert doc["jit_compile"] is False and doc["precision"] == "mixed_float16"
    assert doc["classes"] == ["a", "b"]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {},
            "exported epoch 2 (step 16, the best by val_accuracy): val_accuracy 0.9000 val_loss 0.4000",
        ),
        (
            {"monitor": "val_loss", "monitor_mode": "min"},
            "exported epoch 2 (step 16, the best by val_loss): val_loss 0.4000 val_accuracy 0.9000",
        ),
        (
            {"exported": HISTORY[2], "restored_best": False},
            "exported epoch 3 (step 24, the last): val_accuracy 0.7500 val_loss 0.5500",
        ),
        ({"history": [], "exported": None, "best": None, "restored_best": False}, "no epoch was closed"),
        (
            {"exported": row(1, math.nan, 0.5), "restored_best": False},
            "exported epoch 1 (step 8, the last): val_accuracy 0.5000 val_loss nan",
        ),
    ],
    ids=["best-by-accuracy", "best-by-loss", "last", "no-epoch", "nan"],
)
def test_the_last_log_line_gives_the_exported_epochs_figures_not_the_last_ones(changes, expected):
    assert describe_exported(result(**changes)) == expected


def test_history_csv_has_one_row_per_epoch_and_leaves_nan_empty(tmp_path):
    history = [*HISTORY[:2], row(3, math.nan, 0.123456789)]
    write_history(tmp_path / "history.csv", "accuracy", history)
    with open(tmp_path / "history.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == history_header("accuracy")
        rows = list(reader)
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert rows[2]["val_loss"] == "" and rows[2]["val_accuracy"] == "0.123457"


def test_peak_rss_is_the_processs_own_high_water_mark_in_bytes():
    """metrics.json's ``peak_rss_bytes``, read in a fresh process that touched 300 MiB and freed them: above
    300 MiB, and not the memory of the process that started it (this test's, with TensorFlow loaded, more
    than the child's own: ``ru_maxrss`` would report that)."""
    import resource
    import subprocess
    import sys

    script = (
        "from trainer.common.metrics_doc import peak_rss_bytes\n"
        "block = b'x' * (300 * 1024 * 1024)\n"
        "del block\n"
        "print(peak_rss_bytes())\n"
    )
    ballast = b"y" * (700 * 1024 * 1024)  # so that this process is certainly the larger one
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del ballast
    peak = int(out.stdout)
    assert 300 * 1024 * 1024 <= peak < 600 * 1024 * 1024 < own, (peak, own)
