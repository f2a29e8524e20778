"""Training checkpoints: the trainer state, what a resume refuses, writing once per step, restoring the
newest usable one, and this run's learning rate on resume (a tiny Keras model, no training)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.common.checkpoints import (
    STATE_FILE,
    CheckpointStore,
    FlagLearningRate,
    TrainerState,
    epoch_close_pending,
    training_parts,
)
from trainer.common.cluster import ClusterInfo
from trainer.common.contract import UsageError
from trainer.common.runtime import Runtime

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def runtime(chief: bool = True) -> Runtime:
    cluster = ClusterInfo(None)
    if not chief:
        config = {"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 0}}
        cluster = ClusterInfo(config, "worker", 0)
    return Runtime(
        strategy=tf.distribute.get_strategy(),
        devices=["/physical_device:CPU:0"],
        replicas=1,
        mixed_precision=False,
        cluster=cluster,
    )


def trainer_state(root: Path, **changes) -> TrainerState:
    values = {
        "trainer": "tiny",
        "checkpoint_dir": root,
        "global_batch_size": 8,
        "steps_per_epoch": 10,
        "dataset_version": "v1",
        "hyperparameters": {"batch_size": 8, "learning_rate": 0.01},
        "extra": {"classes": ["a", "b"]},
        **changes,
    }
    return TrainerState(**values)


def document(state: TrainerState, step: int = 12, epoch: int = 1, batch: int = 2) -> dict:
    return state.document(
        step=step,
        epoch=epoch,
        batch_in_epoch=batch,
        epoch_sums={"loss_sum": 1.0, "examples": 16.0, "correct": 9.0, "count": 16.0},
        history=[{"epoch": 1, "step": 10}],
        best={"epoch": 1, "step": 10, "value": 0.5},
        stopped_early=None,
        wall_time_s=3.14159,
    )


def test_the_state_document_records_the_position_and_this_runs_facts(tmp_path):
    doc = document(trainer_state(tmp_path))
    assert doc["kind"] == "kubetrain/trainer-state" and doc["format_version"] == 1
    assert (doc["checkpoint"], doc["step"], doc["epoch"], doc["batch_in_epoch"]) == ("ckpt-12", 12, 1, 2)
    assert (doc["global_batch_size"], doc["steps_per_epoch"], doc["dataset_version"]) == (8, 10, "v1")
    assert doc["wall_time_s"] == 3.142 and doc["extra"] == {"classes": ["a", "b"]}
    assert doc["saved_at"].endswith("Z")


@pytest.mark.parametrize(
    ("saved", "now", "batch", "message"),
    [
        ({"kind": "other"}, {}, 2, "checkpoint state of kind 'other' format 1 is not understood"),
        ({"global_batch_size": 16}, {}, 2, "--batch-size 8 differs from the checkpoint's 16"),
        (
            {},
            {"dataset_version": "v2"},
            2,
            "trained on dataset version 'v1', but this run's data is version 'v2'",
        ),
        ({"steps_per_epoch": 12}, {}, 2, "written with 12 batches per epoch but this data gives 10"),
        ({}, {}, 11, "at batch 11 of an epoch but this configuration has only 10 batches per epoch"),
    ],
    ids=["kind", "batch-size", "dataset-version", "steps-per-epoch", "batch-position"],
)
def test_a_resume_refuses_a_checkpoint_that_does_not_fit_by_name(tmp_path, saved, now, batch, message):
    state = {**document(trainer_state(tmp_path)), **saved}
    with pytest.raises(UsageError, match=message):
        trainer_state(tmp_path, **now).check(state, batch)


def test_a_resume_logs_changed_settings_and_asks_the_trainer_about_its_task_data(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    state = document(trainer_state(tmp_path))
    seen = []
    trainer_state(
        tmp_path, hyperparameters={"batch_size": 8, "learning_rate": 0.002}, check_extra=seen.append
    ).check(state, 2)
    assert "resuming with changed settings: learning_rate: 0.01 -> 0.002" in caplog.text
    assert seen == [{"classes": ["a", "b"]}]
    with pytest.raises(ValueError, match="classes changed"):

        def refuse(extra):
            raise ValueError("classes changed")

        trainer_state(tmp_path, check_extra=refuse).check(state, 2)


def test_an_unknown_dataset_version_is_a_warning_not_a_refusal(tmp_path, caplog):
    state = document(trainer_state(tmp_path, dataset_version=None))
    trainer_state(tmp_path).check(state, 2)
    assert "cannot tell whether the data changed" in caplog.text


@pytest.mark.parametrize(
    ("step", "batch", "history_step", "max_steps", "pending"),
    [
        (16, 0, 16, None, None),  # between epochs
        (13, 5, 8, None, None),  # mid-epoch: training goes on
        (16, 8, 16, None, None),  # the epoch was closed before the checkpoint
        (16, 8, 8, None, False),  # SIGTERM on the epoch's last step: close it
        (12, 4, 8, 12, True),  # SIGTERM on the --max-steps step: close it as partial
    ],
    ids=["between", "mid-epoch", "closed", "last-step", "max-steps"],
)
def test_which_restored_epoch_still_needs_closing(step, batch, history_step, max_steps, pending):
    history = [{"epoch": 1, "step": history_step}]
    got = epoch_close_pending(
        step=step, batch_in_epoch=batch, steps_per_epoch=8, history=history, max_steps=max_steps
    )
    assert got is pending


def model() -> keras.Model:
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def store(root: Path, net: keras.Model, chief: bool = True, **state_changes) -> CheckpointStore:
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(net.trainable_variables)
    return CheckpointStore(
        checkpoint_dir=root,
        runtime=runtime(chief),
        parts=training_parts(net, optimizer),
        keep=3,
        trainer_state=trainer_state(root, **state_changes),
    )


def save(s: CheckpointStore, step: int, batch: int = 2) -> str:
    return s.save(
        step=step,
        epoch=1,
        batch_in_epoch=batch,
        state=document(s.trainer_state, step, 1, batch),
        reason="test",
    )


def test_a_checkpoint_restores_the_weights_the_position_and_the_state(tmp_path):
    keras.utils.set_random_seed(1)
    net = model()
    s = store(tmp_path, net)
    path = save(s, 12)
    assert Path(path).name == "ckpt-12" and s.last_saved_step == 12
    assert json.loads((tmp_path / STATE_FILE).read_text())["step"] == 12  # the mirror

    keras.utils.set_random_seed(2)
    other = model()
    assert not np.allclose(other.get_weights()[0], net.get_weights()[0])
    restored = store(tmp_path, other).restore()
    assert (restored.step, restored.epoch, restored.batch_in_epoch) == (12, 1, 2)
    assert restored.state["history"] == [{"epoch": 1, "step": 10}]
    np.testing.assert_array_equal(other.get_weights()[0], net.get_weights()[0])


def test_a_step_gets_one_checkpoint(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    s = store(tmp_path, model())
    save(s, 4)
    assert s.already_saved(4, "SIGTERM") and not s.already_saved(5, "SIGTERM")
    assert "checkpoint ckpt-4 already written at this step (SIGTERM)" in caplog.text


def test_no_checkpoint_means_a_start_at_step_0(tmp_path):
    s = store(tmp_path, model())
    assert s.restore() is None
    assert s.last_finite() == f"No checkpoint was written in {tmp_path}."
    assert "starts again from step 0" in s.rerun_outcome()


def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before(tmp_path, caplog):
    s = store(tmp_path, model())
    save(s, 4)
    save(s, 8)
    (tmp_path / "ckpt-8.index").unlink()  # listed in the index file, but its files are gone
    fresh = store(tmp_path, model())
    restored = fresh.restore()
    assert restored.step == 4 and fresh.last_saved_step == 4
    assert "checkpoint ckpt-8 is unusable" in caplog.text
    assert fresh.last_finite() == f"The last finite checkpoint, ckpt-4 (step 4), stays in {tmp_path}."
    assert "resumes from that checkpoint" in fresh.rerun_outcome()


def test_a_named_step_is_restored_and_holds_says_which_are_listed(tmp_path):
    s = store(tmp_path, model())
    save(s, 4)
    save(s, 8)
    assert s.holds(4) and s.holds(8) and not s.holds(6)
    assert store(tmp_path, model()).restore(at_step=4).step == 4
    assert store(tmp_path, model()).restore(at_step=6) is None


def test_a_checkpoint_of_another_model_is_refused_with_the_changed_settings(tmp_path):
    s = store(tmp_path, model())
    save(s, 4)
    inputs = keras.Input((3,))
    wider = keras.Model(inputs, keras.layers.Dense(5)(inputs))
    other = store(tmp_path, wider, hyperparameters={"batch_size": 8, "learning_rate": 0.01, "hidden": 5})
    with pytest.raises(UsageError, match=r"does not fit this model .*\(hidden: None -> 5\)"):
        other.restore()


def test_a_worker_writes_to_a_scratch_directory_and_restores_the_chiefs(tmp_path):
    chief = store(tmp_path, model())
    save(chief, 4)
    worker = store(tmp_path, model(), chief=False)
    assert worker.write_dir != tmp_path and worker.write_dir.is_dir()
    assert worker.restore().step == 4
    save(worker, 8)
    assert (worker.write_dir / "ckpt-8.index").exists() and not (tmp_path / "ckpt-8.index").exists()


def test_this_runs_learning_rate_replaces_the_restored_one(caplog):
    caplog.set_level(logging.INFO)
    optimizer = keras.optimizers.Adam(0.002)
    optimizer.build(model().trainable_variables)
    flag = FlagLearningRate(optimizer)
    optimizer.learning_rate.assign(0.01)  # what a restore puts there
    flag.reapply()
    assert flag.current() == pytest.approx(0.002, rel=1e-6)
    assert "learning rate 0.002 from this run's settings replaces the checkpoint's 0.01" in caplog.text


def test_a_schedule_is_left_to_the_restored_iteration_count():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = keras.optimizers.SGD(schedule)
    optimizer.build(model().trainable_variables)
    flag = FlagLearningRate(optimizer)
    assert flag.value is None
    optimizer.iterations.assign(2)
    flag.reapply()
    assert flag.current() == pytest.approx(0.025)
