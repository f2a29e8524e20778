"""The training loop on a tiny real problem (one CPU device): epoch boundaries, resume, the NaN
guard, the best epoch, early stopping, K steps per call, TensorBoard."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import trainer_loop_support as tiny

from trainer.common.contract import Preempted, TrainingDiverged, UsageError

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

ROW_KEYS = ("epoch", "step", "loss", "accuracy", "val_loss", "val_accuracy")


def rows(history):
    return [{k: row[k] for k in ROW_KEYS} for row in history]


def assert_same_rows(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        for k in ROW_KEYS:
            assert x[k] == pytest.approx(y[k], abs=1e-6), (k, x, y)


def test_sigterm_on_an_epochs_last_step_resumes_to_the_uninterrupted_result(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    # A periodic checkpoint falls on each epoch's last step (8 batches, every 8 steps).
    reference = tiny.make_loop(tmp_path / "ref", checkpoint_every_steps=tiny.STEPS_PER_EPOCH)
    expected = reference.run()

    first = tiny.make_loop(
        tmp_path / "run",
        stop=tiny.StopAtStep(tiny.STEPS_PER_EPOCH),
        checkpoint_every_steps=tiny.STEPS_PER_EPOCH,
    )
    with pytest.raises(Preempted):
        first.run()
    assert first.last_saved_step == tiny.STEPS_PER_EPOCH

    resumed = tiny.make_loop(tmp_path / "run", checkpoint_every_steps=tiny.STEPS_PER_EPOCH)
    result = resumed.run(history_path=tmp_path / "history.csv")
    assert result.resumed_from_step == tiny.STEPS_PER_EPOCH
    assert_same_rows(rows(result.history), rows(expected.history))
    for got, want in zip(tiny.weights(resumed), tiny.weights(reference), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    with open(tmp_path / "history.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [8, 16]


def test_a_periodic_checkpoint_on_an_epochs_last_step_holds_the_closed_epoch(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    loop = tiny.make_loop(tmp_path, checkpoint_every_steps=4)
    loop.run()
    state = tiny.checkpoint_state(tmp_path / "ckpt" / "ckpt-8")
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 0)
    assert [row["step"] for row in state["history"]] == [8]
    assert "checkpoint ckpt-8 written (end of epoch" in caplog.text
    assert "checkpoint ckpt-4 written (every 4 steps" in caplog.text


def test_a_finished_run_retried_keeps_every_history_row_when_max_steps_is_a_checkpoint_multiple(tmp_path):
    first = tiny.make_loop(tmp_path, epochs=3, max_steps=12, checkpoint_every_steps=4)
    done = first.run(history_path=tmp_path / "out.csv")
    assert [(r["epoch"], r["step"], bool(r.get("partial"))) for r in done.history] == [
        (1, 8, False),
        (2, 12, True),
    ]
    again = tiny.make_loop(tmp_path, epochs=3, max_steps=12, checkpoint_every_steps=4)
    retried = again.run(history_path=tmp_path / "again.csv")
    assert retried.steps == 12
    assert_same_rows(rows(retried.history), rows(done.history))
    assert (tmp_path / "again.csv").read_text() == (tmp_path / "out.csv").read_text()


def test_a_nan_loss_stops_the_run_by_name_and_keeps_the_last_finite_checkpoint(tmp_path):
    def nan_in_sixth_batch(epoch: int, batch: int, x: np.ndarray) -> np.ndarray:
        if (epoch, batch) == (0, 5):
            x[3, 0] = np.nan
        return x

    loop = tiny.make_loop(tmp_path, poison=nan_in_sixth_batch, checkpoint_every_steps=4)
    # (oneDNN's ReLU turns the NaN into 0 on the way forward; the gradient keeps it.)
    with pytest.raises(
        TrainingDiverged,
        match=r"training diverged at step 6 .*(loss|gradient) was NaN or infinite.*"
        r"The last finite checkpoint, ckpt-4 \(step 4\)",
    ) as info:
        loop.run()
    assert "a rerun resumes from that checkpoint and is likely to diverge again" in str(info.value)
    ckpt = tmp_path / "ckpt"
    assert tf.train.latest_checkpoint(str(ckpt)).endswith("ckpt-4")
    assert sorted(p.name for p in ckpt.glob("ckpt-*.index")) == ["ckpt-4.index"]
    reader = tf.train.load_checkpoint(str(ckpt / "ckpt-4"))
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert np.isfinite(value).all(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 4


def test_a_nan_loss_before_any_checkpoint_says_that_a_rerun_starts_again(tmp_path):
    def nan_in_sixth_batch(epoch: int, batch: int, x: np.ndarray) -> np.ndarray:
        if (epoch, batch) == (0, 5):
            x[3, 0] = np.nan
        return x

    loop = tiny.make_loop(tmp_path, poison=nan_in_sixth_batch, checkpoint_every_steps=0)
    with pytest.raises(TrainingDiverged) as info:
        loop.run()
    message = str(info.value)
    assert "training diverged at step 6" in message and "No checkpoint was written in" in message
    assert "a rerun starts again from step 0" in message and "resumes from that checkpoint" not in message
    assert "Lower the learning rate" in message  # TrainerConfig has no learning-rate flag to name
    assert not list((tmp_path / "ckpt").glob("ckpt-*"))


def test_a_changed_learning_rate_is_used_on_resume(tmp_path, caplog):
    import keras

    caplog.set_level(logging.INFO)
    tiny.make_loop(tmp_path, max_steps=4, optimizer=lambda: keras.optimizers.Adam(0.01)).run()
    assert tiny.checkpoint_state(tmp_path / "ckpt" / "ckpt-4")["step"] == 4
    resumed = tiny.make_loop(tmp_path, max_steps=6, optimizer=lambda: keras.optimizers.Adam(0.002))
    resumed.restore()
    # The checkpoint holds the optimizer's learning-rate variable (0.01); this run's 0.002 wins.
    assert float(resumed.optimizer.learning_rate) == pytest.approx(0.002, rel=1e-6)
    assert "learning rate 0.002 from this run's settings replaces the checkpoint's 0.01" in caplog.text
    result = resumed.run()
    assert result.steps == 6 and result.history[-1]["learning_rate"] == pytest.approx(0.002, rel=1e-6)
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt" / "ckpt-6"))
    saved = [
        reader.get_tensor(n)
        for n in reader.get_variable_to_shape_map()
        if n.startswith("optimizer/") and "learning_rate" in n
    ]
    assert saved and float(saved[0]) == pytest.approx(0.002, rel=1e-6)


def test_the_dialogue_warmup_schedule_uses_this_runs_settings_on_resume(tmp_path):
    import keras

    from trainer.dialogue.model import WarmupSchedule

    def adam(scale: float):  # as the dialogue trainer builds it
        return lambda: keras.optimizers.Adam(
            WarmupSchedule(16, 30, scale), beta_1=0.9, beta_2=0.98, epsilon=1e-9
        )

    tiny.make_loop(tmp_path, max_steps=4, optimizer=adam(1.0)).run()
    resumed = tiny.make_loop(tmp_path, max_steps=6, optimizer=adam(3.0))
    resumed.restore()
    # The schedule is no variable: the restored step count (4) with this run's --learning-rate-scale.
    assert int(resumed.optimizer.iterations) == 4
    assert float(resumed.optimizer.learning_rate) == pytest.approx(
        float(WarmupSchedule(16, 30, 3.0)(4)), rel=1e-6
    )
    result = resumed.run()
    assert result.history[-1]["learning_rate"] == pytest.approx(
        float(WarmupSchedule(16, 30, 3.0)(6)), rel=1e-6
    )
    assert result.history[-1]["learning_rate"] > 2.9 * float(WarmupSchedule(16, 30, 1.0)(6))


def test_the_run_ends_with_the_best_epochs_weights(tmp_path):
    loop = tiny.make_loop(tmp_path, data=tiny.examples(flip_validation=True), epochs=4)
    result = loop.run()
    accuracies = [row["val_accuracy"] for row in result.history]
    best = max(range(len(accuracies)), key=accuracies.__getitem__)
    assert best != len(accuracies) - 1, accuracies  # the data makes an early epoch the best
    _, val_accuracy = loop.evaluate()  # the model as the trainer exports it
    assert val_accuracy == pytest.approx(accuracies[best], abs=1e-9)
    assert result.best["epoch"] == best + 1 and result.restored_best
    assert result.exported["val_accuracy"] == pytest.approx(accuracies[best])


def test_patience_stops_early_and_a_retry_does_not_train_again(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    flipped = tiny.examples(flip_validation=True)
    loop = tiny.make_loop(tmp_path, data=flipped, epochs=20, patience=2)
    result = loop.run()
    best = result.best["epoch"]
    assert len(result.history) == best + 2 < 20
    assert result.stopped_early == {
        "epoch": best + 2,
        "step": (best + 2) * tiny.STEPS_PER_EPOCH,
        "best_epoch": best,
        "patience": 2,
        "monitor": "val_accuracy",
    }
    assert f"has not improved for 2 epoch(s) since epoch {best}" in caplog.text
    again = tiny.make_loop(tmp_path, data=flipped, epochs=20, patience=2).run()
    assert again.steps == result.steps and len(again.history) == len(result.history)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch": 16}, "--batch-size 16 differs from the checkpoint's 8"),
        (
            {"loop_args": {"dataset_version": "v2"}},
            "trained on dataset version 'v1', but this run's data is version 'v2'",
        ),
    ],
    ids=["batch-size", "dataset-version"],
)
def test_resume_refuses_another_batch_size_or_dataset_version(tmp_path, change, message):
    first = tiny.make_loop(tmp_path, stop=tiny.StopAtStep(3), loop_args={"dataset_version": "v1"})
    with pytest.raises(Preempted):
        first.run()
    assert first.last_saved_step == 3
    with pytest.raises(UsageError, match=message):
        tiny.make_loop(tmp_path, **{"loop_args": {"dataset_version": "v1"}, **change}).run()


def test_k_steps_per_call_train_exactly_as_single_steps_and_wait_for_the_device_rarely(tmp_path):
    single = tiny.make_loop(tmp_path / "one", epochs=3, log_every_steps=1000)
    expected = single.run()
    multi = tiny.make_loop(
        tmp_path / "four", epochs=3, log_every_steps=1000, steps_per_execution=4, checkpoint_every_steps=8
    )
    reads = []
    read = multi.runner.read
    multi.runner.read = lambda: reads.append(1) or read()
    result = multi.run()
    assert_same_rows(rows(result.history), rows(expected.history))
    for got, want in zip(tiny.weights(multi), tiny.weights(single), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # 24 steps: one read after the first call (the first log line) and one per epoch end.
    assert len(reads) == 4
    throughput = result.throughput
    assert throughput["examples_per_s"] > 0 and throughput["input_wait_s"] >= 0
    assert throughput["compute_s"] > 0 and 0 <= throughput["input_wait_fraction"] < 1


def test_jit_compiled_steps_train_like_the_plain_ones(tmp_path):
    plain = tiny.make_loop(tmp_path / "plain", log_every_steps=1000).run()
    jit = tiny.make_loop(
        tmp_path / "jit", log_every_steps=1000, jit_compile=True, steps_per_execution=8
    ).run()
    for a, b in zip(plain.history, jit.history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["val_accuracy"] == pytest.approx(b["val_accuracy"], abs=1e-9)


def test_tensorboard_event_files_hold_step_and_epoch_scalars(tmp_path):
    tiny.make_loop(tmp_path, log_every_steps=4).run()
    scalars: dict[str, dict[str, list[int]]] = {}
    for split in ("train", "validation"):
        files = list((tmp_path / "out" / "tensorboard" / split).glob("events.out.tfevents.*"))
        assert len(files) == 1, split
        for record in tf.data.TFRecordDataset(str(files[0])):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                number = float(tf.make_ndarray(value.tensor))
                assert math.isfinite(number)
                scalars.setdefault(split, {}).setdefault(value.tag, []).append(event.step)
    assert scalars["train"]["loss"] == [1, 4, 8, 12, 16]
    assert scalars["train"]["epoch_loss"] == [8, 16]
    assert scalars["validation"]["epoch_accuracy"] == [8, 16]
    assert {"learning_rate", "gradient_global_norm", "examples_per_s", "input_wait_fraction"} <= set(
        scalars["train"]
    )


def test_the_best_weights_survive_a_restart(tmp_path):
    flipped = tiny.examples(flip_validation=True)
    first = tiny.make_loop(
        tmp_path, data=flipped, epochs=4, stop=tiny.StopAtStep(27), checkpoint_every_steps=8
    )
    with pytest.raises(Preempted):
        first.run()
    best = first.best
    assert best is not None and best["epoch"] < 3
    resumed = tiny.make_loop(tmp_path, data=flipped, epochs=4, checkpoint_every_steps=8)
    result = resumed.run()
    assert result.best["step"] == best["step"] and result.restored_best
    assert resumed.evaluate()[1] == pytest.approx(best["value"], abs=1e-9)
    assert (Path(tmp_path) / "ckpt" / "best" / f"ckpt-{best['step']}.index").exists()
