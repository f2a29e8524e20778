"""The best epoch by --monitor: which epoch improves, its weights kept aside and put back for the export
(a tiny Keras model whose weights are set by hand, no training)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import keras
import numpy as np
import pytest

from trainer.common.best_epoch import BEST_DIR, BestEpoch

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def model() -> keras.Model:
    inputs = keras.Input((2,))
    return keras.Model(inputs, keras.layers.Dense(1)(inputs))


def set_weights(net: keras.Model, value: float) -> None:
    net.set_weights([np.full_like(w, value) for w in net.get_weights()])


def tracker(
    root: Path, net: keras.Model, monitor: str = "val_accuracy", restore_best: bool = True
) -> BestEpoch:
    mode = "max" if monitor == "val_accuracy" else "min"
    return BestEpoch(
        model=net, monitor=monitor, mode=mode, restore_best=restore_best, write_dir=root, checkpoint_dir=root
    )


def row(epoch: int, val_accuracy: float, val_loss: float = 1.0) -> dict:
    return {"epoch": epoch, "step": epoch * 10, "val_accuracy": val_accuracy, "val_loss": val_loss}


@pytest.mark.parametrize(
    ("monitor", "best", "value", "improved"),
    [
        ("val_accuracy", None, 0.1, True),
        ("val_accuracy", 0.5, 0.6, True),
        ("val_accuracy", 0.5, 0.5, False),
        ("val_accuracy", 0.5, 0.4, False),
        ("val_loss", 0.5, 0.4, True),
        ("val_loss", 0.5, 0.6, False),
        ("val_loss", None, math.nan, False),
        ("val_loss", None, None, False),
    ],
)
def test_which_value_improves(tmp_path, monitor, best, value, improved):
    t = tracker(tmp_path, model(), monitor)
    if best is not None:
        t.best = {"epoch": 1, "step": 10, "value": best}
    assert t.improved(value) is improved


def test_the_best_epochs_weights_come_back_for_the_export(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    net = model()
    t = tracker(tmp_path, net)
    history = []
    for epoch, (weight, accuracy) in enumerate([(1.0, 0.6), (2.0, 0.8), (3.0, 0.7)], start=1):
        set_weights(net, weight)
        history.append(row(epoch, accuracy))
        assert t.offer(history[-1]) is (epoch != 3)
    assert t.best["epoch"] == 2 and t.is_best(20) and not t.is_best(30)
    assert sorted(p.name for p in (tmp_path / BEST_DIR).glob("*.index")) == ["ckpt-10.index", "ckpt-20.index"]
    assert t.restore_weights(history)
    np.testing.assert_array_equal(net.get_weights()[0], np.full((2, 1), 2.0))
    assert t.exported_row(True, history) == history[1]
    assert "restored the weights of epoch 2 (step 20, val_accuracy 0.8000)" in caplog.text


def test_when_the_last_epoch_is_the_best_nothing_is_read(tmp_path):
    net = model()
    t = tracker(tmp_path, net)
    history = [row(1, 0.5)]
    t.offer(history[0])
    set_weights(net, 7.0)  # whatever the model holds is the best epoch's
    assert t.restore_weights(history)
    np.testing.assert_array_equal(net.get_weights()[0], np.full((2, 1), 7.0))


def test_best_weights_written_by_an_earlier_process_are_not_written_again(tmp_path):
    net = model()
    set_weights(net, 1.0)
    tracker(tmp_path, net).offer(row(1, 0.5))
    index = tmp_path / BEST_DIR / "ckpt-10.index"
    before = index.stat().st_mtime_ns
    set_weights(net, 9.0)
    again = tracker(tmp_path, net)
    again.offer(row(1, 0.5))  # the same epoch closed again after a resume
    assert index.stat().st_mtime_ns == before
    set_weights(net, 5.0)
    assert again.restore_weights([row(1, 0.5), row(2, 0.4)])
    np.testing.assert_array_equal(net.get_weights()[0], np.full((2, 1), 1.0))


def test_without_restore_best_the_last_weights_are_exported(tmp_path):
    net = model()
    t = tracker(tmp_path, net, restore_best=False)
    history = [row(1, 0.9), row(2, 0.1)]
    for r in history:
        t.offer(r)
    assert t.best["epoch"] == 1 and not (tmp_path / BEST_DIR).exists()
    assert not t.restore_weights(history)
    assert t.exported_row(False, history) == history[1]


def test_unreadable_best_weights_leave_the_last_ones(tmp_path, caplog):
    net = model()
    t = tracker(tmp_path, net)
    t.offer(row(1, 0.9))
    t.offer(row(2, 0.1))
    for f in (tmp_path / BEST_DIR).glob("ckpt-10*"):
        f.unlink()
    set_weights(net, 4.0)
    assert not t.restore_weights([row(1, 0.9), row(2, 0.1)])
    np.testing.assert_array_equal(net.get_weights()[0], np.full((2, 1), 4.0))
    assert "cannot be read" in caplog.text and "exporting the last epoch's weights" in caplog.text


def test_a_monitor_mode_other_than_max_or_min_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"mode 'up' is not valid: expected 'max' \(accuracy\) or 'min' \(loss\)"
    ):
        BestEpoch(
            model=model(),
            monitor="val_loss",
            mode="up",
            restore_best=True,
            write_dir=tmp_path,
            checkpoint_dir=tmp_path,
        )
