"""The training checkpoints of a run: what one holds, where it is written, and whether a resume may use it.

What a checkpoint holds (``tf.train.Checkpoint`` under ``tf.train.CheckpointManager``):
the model, the optimizer (slots, iteration count), the loss scale with
``--precision mixed_float16``, Keras' random generators, the global step, the epoch, the number
of batches already consumed in that epoch, and the trainer state as a JSON string
(history so far, the current epoch's running sums, the best epoch, the dataset version,
task data such as class names). The same state is mirrored to
``CHECKPOINT_DIR/trainer_state.json`` after each checkpoint for readers that do not load
TensorFlow.

Checkpoints are named by step (``ckpt-<step>``) and a file once written is never written
again: the checkpoint-sync sidecar uploads them while training runs.

Resume restores the newest checkpoint listed in the ``checkpoint`` index file, which
TensorFlow rewrites atomically only after the checkpoint's data and index files are
complete, so a half-written checkpoint is never chosen. A checkpoint whose files are
damaged or missing is skipped in favour of the one before it. A checkpoint written with
another batch size, for another dataset version, or with another number of batches per
epoch is refused (:meth:`TrainerState.check`): its position in the epoch means nothing for this data.

With several workers only the chief writes CHECKPOINT_DIR; the other workers write their
copies (TensorFlow's multi-worker rule: every worker saves, because a save may reduce
across workers) to a scratch directory that nothing syncs, and restore from CHECKPOINT_DIR,
which every replica's stage-in fills with the chief's checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from kubetrain_contract.json_values import json_safe
from trainer.common.contract import UsageError, write_json_atomic
from trainer.common.runtime import Runtime, to_float

log = logging.getLogger("kubetrain.trainer")

STATE_FILE = "trainer_state.json"
STATE_KIND = "kubetrain/trainer-state"
STATE_FORMAT_VERSION = 1
CHECKPOINT_NAME = "ckpt"

__all__ = [
    "CHECKPOINT_NAME",
    "STATE_FILE",
    "STATE_FORMAT_VERSION",
    "STATE_KIND",
    "CheckpointStore",
    "FlagLearningRate",
    "Restored",
    "TrainerState",
    "epoch_close_pending",
    "training_parts",
]


def training_parts(
    model: keras.Model, optimizer: keras.optimizers.Optimizer, loss_scale: tf.train.Checkpoint | None = None
) -> dict[str, Any]:
    """The objects a training checkpoint holds besides the position and the trainer state.

    Keras keeps the state of its dropout and augmentation generators in variables that
    TensorFlow's object graph does not reach; naming them here checkpoints the random
    streams too, so a resumed run draws the masks it would have drawn.
    """
    rng = {
        f"generator_{i}": v
        for i, v in enumerate(v for v in model.variables if v.path.endswith("seed_generator_state"))
    }
    parts: dict[str, Any] = {"model": model, "optimizer": optimizer, "rng": tf.train.Checkpoint(**rng)}
    if loss_scale is not None:
        parts["loss_scale"] = loss_scale
    return parts


@dataclass(frozen=True)
class TrainerState:
    """The trainer state stored with each checkpoint: this run's fixed facts, written into every
    state document and checked against a checkpoint's before resuming from it.

    Args:
        trainer: the trainer's name.
        checkpoint_dir: CHECKPOINT_DIR, named in the messages.
        global_batch_size: examples per step, all replicas together.
        steps_per_epoch: batches per epoch of this run's data.
        dataset_version: the version of the data in DATA_DIR (None: unknown).
        hyperparameters: this run's settings, compared with the checkpoint's.
        extra: task data stored with each checkpoint (class names, vocabulary).
        check_extra: called with the checkpoint's task data; raises if it does not fit.
    """

    trainer: str
    checkpoint_dir: Path
    global_batch_size: int
    steps_per_epoch: int
    dataset_version: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    check_extra: Callable[[dict[str, Any]], None] | None = None

    def document(
        self,
        *,
        step: int,
        epoch: int,
        batch_in_epoch: int,
        epoch_sums: dict[str, float],
        history: list[dict[str, Any]],
        best: dict[str, Any] | None,
        stopped_early: dict[str, Any] | None,
        wall_time_s: float,
    ) -> dict[str, Any]:
        """The state of the checkpoint of ``step``: where training stands, and this run's facts."""
        return {
            "kind": STATE_KIND,
            "format_version": STATE_FORMAT_VERSION,
            "trainer": self.trainer,
            "checkpoint": f"{CHECKPOINT_NAME}-{step}",
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "steps_per_epoch": self.steps_per_epoch,
            "global_batch_size": self.global_batch_size,
            "dataset_version": self.dataset_version,
            "epoch_sums": epoch_sums,
            "history": history,
            "best": best,
            "stopped_early": stopped_early,
            "wall_time_s": round(wall_time_s, 3),
            "hyperparameters": self.hyperparameters,
            "extra": self.extra,
            "saved_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }

    def changes(self, saved: dict[str, Any]) -> list[str]:
        """``name: saved -> now`` for each setting that differs from the checkpoint's."""
        now = self.hyperparameters
        return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(now) if saved.get(k) != now.get(k)]

    def describe_changes(self) -> str:
        """The changed settings in parentheses, from the state file in CHECKPOINT_DIR ("" when unknown)."""
        try:
            saved = json.loads((self.checkpoint_dir / STATE_FILE).read_text())["hyperparameters"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        changed = self.changes(saved)
        return f" ({'; '.join(changed)})" if changed else ""

    def check(self, state: dict[str, Any], batch_in_epoch: int) -> None:
        """Refuse a checkpoint whose state this trainer cannot read, or whose position in an epoch
        means something else for this run.

        Raises:
            UsageError: naming the checkpoint's value and this run's.
        """
        if state.get("kind") != STATE_KIND or state.get("format_version") != STATE_FORMAT_VERSION:
            raise UsageError(
                f"checkpoint state of kind {state.get('kind')!r} format {state.get('format_version')!r} is not "
                f"understood; expected {STATE_KIND!r} format {STATE_FORMAT_VERSION}"
            )
        hyper = state.get("hyperparameters") or {}
        saved_batch = state.get("global_batch_size", hyper.get("batch_size"))
        if saved_batch is not None and saved_batch != self.global_batch_size:
            raise UsageError(
                f"--batch-size {self.global_batch_size} differs from the checkpoint's {saved_batch} "
                f"in {self.checkpoint_dir}: its step count, epoch position and learning-rate schedule are in "
                f"batches of {saved_batch}. Resume with --batch-size {saved_batch}, or start a new run with an "
                "empty --checkpoint-dir"
            )
        saved_version = state.get("dataset_version")
        if saved_version and self.dataset_version and saved_version != self.dataset_version:
            raise UsageError(
                f"the checkpoint in {self.checkpoint_dir} was trained on dataset version {saved_version!r}, but "
                f"this run's data is version {self.dataset_version!r} (KUBETRAIN_DATASET_VERSION): the split, "
                "the epoch order and the position in the epoch would not carry over. Start a new run with an "
                "empty --checkpoint-dir (a new Airflow run), or stage version "
                f"{saved_version!r} again to finish this one"
            )
        if saved_version != self.dataset_version and not (saved_version and self.dataset_version):
            log.warning(
                "dataset version of the checkpoint %r, of this run %r: cannot tell whether the data changed",
                saved_version,
                self.dataset_version,
            )
        saved_steps = state.get("steps_per_epoch")
        if saved_steps is not None and saved_steps != self.steps_per_epoch:
            raise UsageError(
                f"the checkpoint in {self.checkpoint_dir} was written with {saved_steps} batches per epoch but "
                f"this data gives {self.steps_per_epoch} with --batch-size {self.global_batch_size}: the data "
                "changed since it was written; use an empty --checkpoint-dir to start a new run"
            )
        changed = self.changes(hyper)
        if changed:
            log.info("resuming with changed settings: %s", "; ".join(changed))
        if self.check_extra is not None:
            self.check_extra(state.get("extra", {}))
        if batch_in_epoch > self.steps_per_epoch > 0:
            raise UsageError(
                f"the checkpoint is at batch {batch_in_epoch} of an epoch but this configuration has only "
                f"{self.steps_per_epoch} batches per epoch: the data or --batch-size changed since it was written"
            )


def epoch_close_pending(
    *,
    step: int,
    batch_in_epoch: int,
    steps_per_epoch: int,
    history: list[dict[str, Any]],
    max_steps: int | None,
) -> bool | None:
    """After a restore: whether the checkpoint's epoch still needs closing (None: no), and if so, as partial.

    SIGTERM on the last step of an epoch, or on the step that reaches ``--max-steps``,
    checkpoints before the validation pass and the history row.
    """
    if batch_in_epoch <= 0:
        return None
    if history and history[-1].get("step") == step:
        return None
    if batch_in_epoch >= steps_per_epoch:
        return False
    if max_steps is not None and step >= max_steps:
        return True
    return None


class FlagLearningRate:
    """This run's learning rate over the one a checkpoint restores with the optimizer.

    A checkpoint holds the optimizer's learning-rate variable; putting this run's value back
    after a restore makes a changed ``--learning-rate`` apply on resume, as the log and
    params.json say. A ``LearningRateSchedule`` has no variable: it is computed from the
    restored iteration count with this run's settings, and nothing is put back.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer) -> None:
        self.optimizer = optimizer
        value = optimizer.get_config().get("learning_rate")
        self.value = float(value) if isinstance(value, int | float) else None

    def current(self) -> float:
        """The learning rate the next step uses."""
        return to_float(self.optimizer.learning_rate)

    def reapply(self) -> None:
        """After a restore: this run's learning rate replaces the restored one."""
        if self.value is None:
            return
        restored = self.current()
        self.optimizer.learning_rate = self.value
        # The variable is float32: compare at its precision.
        if not math.isclose(restored, self.value, rel_tol=1e-6):
            log.info(
                "learning rate %.6g from this run's settings replaces the checkpoint's %.6g",
                self.value,
                restored,
            )


@dataclass(frozen=True)
class Restored:
    """A checkpoint read back: its path, position and trainer state (already checked by :class:`TrainerState`)."""

    path: str
    step: int
    epoch: int
    batch_in_epoch: int
    state: dict[str, Any]


class CheckpointStore:
    """Writes the run's training checkpoints, once per step, and finds the one to resume from.

    Args:
        checkpoint_dir: CHECKPOINT_DIR, where the chief writes and every worker restores from.
        runtime: this process's place in the job (the chief writes CHECKPOINT_DIR) and its I/O device.
        parts: the objects to checkpoint besides the position and the state (model, optimizer, ...).
        keep: how many recent checkpoints to keep (``--keep-checkpoints``).
        trainer_state: this run's facts, stored with each checkpoint and checked on resume.
    """

    def __init__(
        self,
        *,
        checkpoint_dir: Path,
        runtime: Runtime,
        parts: dict[str, Any],
        keep: int,
        trainer_state: TrainerState,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.is_chief = runtime.is_chief
        self.trainer_state = trainer_state
        # Where this process writes: CHECKPOINT_DIR on the chief, a scratch directory that
        # nothing syncs on the other workers.
        self.write_dir = checkpoint_dir
        if not self.is_chief:
            cluster = runtime.cluster
            self.write_dir = Path(
                tempfile.mkdtemp(prefix=f"kubetrain-{cluster.task_type}-{cluster.task_index}-checkpoints-")
            )
            weakref.finalize(self, shutil.rmtree, str(self.write_dir), True)
        # Parameter-server mode: all checkpoint I/O goes through the chief (Runtime.io_device).
        self.io = (
            tf.train.CheckpointOptions(experimental_io_device=runtime.io_device)
            if runtime.io_device is not None
            else None
        )
        # The position lives outside the strategy scope: bookkeeping, not replicated state.
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self._batch = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch_in_epoch")
        self._state = tf.Variable("", dtype=tf.string, trainable=False, name="trainer_state")
        self.checkpoint = tf.train.Checkpoint(
            **parts, step=self._step, epoch=self._epoch, batch_in_epoch=self._batch, trainer_state=self._state
        )
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(self.write_dir), max_to_keep=keep, checkpoint_name=CHECKPOINT_NAME
        )
        # The checkpoints to resume from: the chief's, in CHECKPOINT_DIR, on every worker.
        self.restore_manager = (
            self.manager
            if self.is_chief
            else tf.train.CheckpointManager(
                self.checkpoint, str(checkpoint_dir), max_to_keep=keep, checkpoint_name=CHECKPOINT_NAME
            )
        )
        self.last_saved_step: int | None = None
        self.last_saved_path: str | None = None

    def already_saved(self, step: int, reason: str) -> bool:
        """Whether the checkpoint of ``step`` exists already (nothing trained since): a step gets one."""
        if self.last_saved_step != step:
            return False
        log.info(
            "checkpoint %s already written at this step (%s)",
            Path(self.last_saved_path).name if self.last_saved_path else f"{CHECKPOINT_NAME}-{step}",
            reason,
        )
        return True

    def save(self, *, step: int, epoch: int, batch_in_epoch: int, state: dict[str, Any], reason: str) -> str:
        """Write the checkpoint of ``step``, then the state file that mirrors it; returns its path."""
        self._step.assign(step)
        self._epoch.assign(epoch)
        self._batch.assign(batch_in_epoch)
        self._state.assign(json.dumps(json_safe(state)))
        path = self.manager.save(checkpoint_number=step, options=self.io)
        self.last_saved_step = step
        self.last_saved_path = path
        # The JSON mirror is written strictly after the checkpoint it describes.
        write_json_atomic(self.write_dir / STATE_FILE, state)
        log.info(
            "checkpoint %s written (%s; epoch %d, batch %d)%s",
            Path(path).name,
            reason,
            epoch + 1,
            batch_in_epoch,
            "" if self.is_chief else f" to the scratch directory {self.write_dir}",
        )
        return path

    def restore(self, at_step: int | None = None) -> Restored | None:
        """Restore the newest usable checkpoint from CHECKPOINT_DIR (that of ``at_step`` when given).

        Returns:
            The restored checkpoint, or None when there is none.

        Raises:
            UsageError: the checkpoint does not fit this model or this run (:meth:`TrainerState.check`),
                or every listed checkpoint is damaged.
        """
        candidates = list(reversed(self.restore_manager.checkpoints))
        if at_step is not None:
            candidates = [p for p in candidates if p.endswith(f"{CHECKPOINT_NAME}-{at_step}")]
        if not candidates:
            log.info("no checkpoint in %s: starting at step 0", self.checkpoint_dir)
            return None
        for path in candidates:
            try:
                status = self.checkpoint.restore(path, options=self.io)
                status.assert_existing_objects_matched()
            except (tf.errors.NotFoundError, tf.errors.DataLossError, tf.errors.OutOfRangeError) as exc:
                log.warning(
                    "checkpoint %s is unusable (%s): trying the one before it",
                    Path(path).name,
                    exc.message.splitlines()[0] if exc.message else type(exc).__name__,
                )
                continue
            except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as exc:
                raise UsageError(
                    f"checkpoint {path} does not fit this model ({str(exc).splitlines()[0][:300]}); it was "
                    f"written with different hyperparameters{self.trainer_state.describe_changes()}; use an empty "
                    "--checkpoint-dir to start a new run"
                ) from exc
            restored = Restored(
                path=path,
                step=int(self._step.numpy()),
                epoch=int(self._epoch.numpy()),
                batch_in_epoch=int(self._batch.numpy()),
                state=json.loads(self._state.numpy().decode("utf-8")),
            )
            self.trainer_state.check(restored.state, restored.batch_in_epoch)
            self.last_saved_step = restored.step
            self.last_saved_path = path
            return restored
        raise UsageError(f"no usable checkpoint in {self.checkpoint_dir}: every listed one is damaged")

    def holds(self, step: int) -> bool:
        """Whether CHECKPOINT_DIR lists the checkpoint of ``step`` (this process can restore it)."""
        return f"{CHECKPOINT_NAME}-{step}" in {Path(p).name for p in self.restore_manager.checkpoints}

    def last_finite(self) -> str:
        """Where training can go on from after a divergence, for its message."""
        if self.last_saved_path:
            return (
                f"The last finite checkpoint, {Path(self.last_saved_path).name} (step {self.last_saved_step}), "
                f"stays in {self.checkpoint_dir}."
            )
        return f"No checkpoint was written in {self.checkpoint_dir}."

    def rerun_outcome(self) -> str:
        """What a rerun with the same CHECKPOINT_DIR does, for the divergence message."""
        if self.last_saved_path:
            return "a rerun resumes from that checkpoint and is likely to diverge again"
        return "a rerun starts again from step 0 and is likely to diverge again at the same step"
