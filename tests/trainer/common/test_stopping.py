"""When a run is over: --epochs, --max-steps, --patience and the sweep's stop file."""

from __future__ import annotations

import json
import logging

import pytest

from trainer.common.config import TrainerConfig
from trainer.common.signals import StopRequest
from trainer.common.stopping import Stopping


def stopping(tmp_path, stop: StopRequest | None = None, **settings) -> Stopping:
    dirs = {
        "data_dir": str(tmp_path),
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "output_dir": str(tmp_path / "out"),
    }
    return Stopping(TrainerConfig(**dirs, **settings), stop or StopRequest())


@pytest.mark.parametrize(
    ("settings", "position", "finished"),
    [
        ({"epochs": 3}, (16, 2, 0), False),
        ({"epochs": 3}, (24, 3, 0), True),
        ({"epochs": 3, "max_steps": 20}, (19, 2, 3), False),
        ({"epochs": 3, "max_steps": 20}, (20, 2, 4), True),
    ],
    ids=["epochs-left", "epochs-done", "below-max-steps", "max-steps"],
)
def test_the_run_ends_at_epochs_or_max_steps(tmp_path, settings, position, finished):
    step, epoch, batch = position
    assert stopping(tmp_path, **settings).finished(step=step, epoch=epoch, batch_in_epoch=batch) is finished


def test_the_stop_file_ends_the_run_as_an_early_stop_recorded_once(tmp_path):
    stop_file = tmp_path / "stop"
    s = stopping(tmp_path, StopRequest(stop_file), epochs=10)
    assert not s.finished(step=5, epoch=0, batch_in_epoch=5)
    stop_file.write_text(json.dumps({"reason": "median rule"}))
    assert s.finished(step=6, epoch=0, batch_in_epoch=6)
    assert (
        s.stopped_early["by"] == "stop file"
        and s.stopped_early["epoch"] == 1
        and s.stopped_early["step"] == 6
    )
    assert s.stop_file_seen(step=9, epoch=1, batch_in_epoch=1) and s.stopped_early["step"] == 6


@pytest.mark.parametrize(
    ("patience", "best_epoch", "epoch", "stops"),
    [(0, 1, 9, False), (2, 3, 4, False), (2, 3, 5, True), (2, None, 5, False)],
    ids=["never", "waiting", "exhausted", "no-best"],
)
def test_patience_counts_epochs_since_the_best(tmp_path, caplog, patience, best_epoch, epoch, stops):
    caplog.set_level(logging.INFO)
    s = stopping(tmp_path, patience=patience, epochs=20)
    best = {"epoch": best_epoch, "step": best_epoch * 8} if best_epoch else None
    s.after_epoch({"epoch": epoch, "step": epoch * 8}, best)
    if not stops:
        assert s.stopped_early is None
        return
    assert s.stopped_early == {
        "epoch": epoch,
        "step": epoch * 8,
        "best_epoch": best_epoch,
        "patience": patience,
        "monitor": "val_accuracy",
    }
    assert f"has not improved for {epoch - best_epoch} epoch(s) since epoch {best_epoch}" in caplog.text
    assert s.finished(step=epoch * 8, epoch=epoch, batch_in_epoch=0)
