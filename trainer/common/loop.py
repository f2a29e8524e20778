"""The custom training loop shared by the trainers, with checkpoints and resume.

What a checkpoint holds (``tf.train.Checkpoint`` under ``tf.train.CheckpointManager``):
the model, the optimizer (slots, iteration count), the loss scale with
``--mixed-precision``, Keras' random generators, the global step, the epoch, the number
of batches already consumed in that epoch, and the trainer state as a JSON string
(history so far, the current epoch's running sums, the best epoch, the dataset version,
task data such as class names). The same state is mirrored to
``CHECKPOINT_DIR/trainer_state.json`` after each checkpoint for readers that do not load
TensorFlow. ``CHECKPOINT_DIR/best/`` holds the model weights of the best epoch so far.

Checkpoints are named by step (``ckpt-<step>``) and a file once written is never written
again: the checkpoint-sync sidecar uploads them while training runs. A step therefore
gets at most one checkpoint, taken after everything that happens at that step: when a
periodic save falls on the last step of an epoch (or on ``--max-steps``), the save waits
for the epoch to be closed (validation, history row) and is the end-of-epoch checkpoint.
Only SIGTERM on such a step saves before the close, because the grace period may not
cover a validation pass; resuming from that checkpoint closes the epoch first.

Resume restores the newest checkpoint listed in the ``checkpoint`` index file, which
TensorFlow rewrites atomically only after the checkpoint's data and index files are
complete, so a half-written checkpoint is never chosen. A checkpoint whose files are
damaged or missing is skipped in favour of the one before it. A checkpoint written with
another batch size, for another dataset version, or with another number of batches per
epoch is refused: its position in the epoch means nothing for this data.

Several workers (``--strategy multi_worker``) train in lock step. Only the chief writes
CHECKPOINT_DIR and OUTPUT_DIR; the other workers write their checkpoint copies (TensorFlow's
multi-worker rule: every worker saves, because a save may reduce across workers) to a
scratch directory that nothing syncs, and restore from CHECKPOINT_DIR, which every replica's
stage-in fills with the chief's checkpoints. The workers agree at every point where the host
waits for the device: SIGTERM on any worker stops all of them at the same step, each with
its checkpoint, and a resume that finds the workers at different steps stops before the first
step. Each worker reads its share of every global batch (data sharding), so a step sees the
same examples as on one pod.

The input pipeline skips the batches already consumed in the current epoch: each epoch's
order depends only on (seed, epoch), so the resumed epoch sees exactly the remaining
batches, and augmentation draws from stateless generators keyed by position.

Steps run ``--steps-per-execution`` at a time on the device (``trainer.common.steps``);
the host waits for them only at a log line, a checkpoint, a step hook, SIGTERM and the
end of an epoch. Those points are also where the NaN guard looks: a non-finite loss (or
a non-finite gradient without loss scaling, or weights that stopped being finite) stops
the run with ``TrainingDiverged`` before anything after it is saved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer.common.config import MONITORS, TrainerConfig, flag_name
from trainer.common.contract import (
    Preempted,
    TrainingDiverged,
    UsageError,
    json_safe,
    write_csv_atomic,
    write_json_atomic,
)
from trainer.common.runtime import Runtime, to_float
from trainer.common.signals import StopRequest
from trainer.common.steps import SUM_KEYS, ComputeFn, Counters, StepRunner
from trainer.common.summaries import Summaries

log = logging.getLogger("kubetrain.trainer")

STATE_FILE = "trainer_state.json"
STATE_KIND = "kubetrain/trainer-state"
STATE_FORMAT_VERSION = 1
CHECKPOINT_NAME = "ckpt"
BEST_DIR = "best"

# train_dataset_fn(epoch, skip_batches) -> batched dataset for that epoch, minus the
# first skip_batches batches.
DatasetFn = Callable[[int, int], tf.data.Dataset]

__all__ = [
    "SUM_KEYS",
    "ComputeFn",
    "DatasetFn",
    "LoopResult",
    "TrainingLoop",
    "history_header",
    "metrics_document",
]


def history_header(metric: str) -> list[str]:
    """The history.csv columns for a metric name."""
    return ["epoch", "step", "loss", metric, "val_loss", f"val_{metric}", "learning_rate", "wall_time_s"]


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


@dataclass
class _Timing:
    """Wall time of the training steps, split into the first stretch (tracing, compilation,
    first input fill) and the steady state, and input wait versus compute."""

    startup_s: float | None = None
    steady_s: float = 0.0
    steady_steps: int = 0
    steady_examples: float = 0.0
    steady_input_wait_s: float = 0.0
    all_s: float = 0.0
    all_steps: int = 0
    all_examples: float = 0.0
    all_input_wait_s: float = 0.0
    input_timed: bool = True

    def add(self, seconds: float, steps: int, examples: float, input_wait_s: float) -> None:
        self.all_s += seconds
        self.all_steps += steps
        self.all_examples += examples
        self.all_input_wait_s += input_wait_s
        if self.startup_s is None:
            self.startup_s = seconds
            return
        self.steady_s += seconds
        self.steady_steps += steps
        self.steady_examples += examples
        self.steady_input_wait_s += input_wait_s

    def report(self) -> dict[str, Any]:
        # A run of one stretch has no steady state: its figures include the start-up.
        steady = self.steady_steps > 0
        seconds = self.steady_s if steady else self.all_s
        steps = self.steady_steps if steady else self.all_steps
        examples = self.steady_examples if steady else self.all_examples
        wait = self.steady_input_wait_s if steady else self.all_input_wait_s
        timed = self.input_timed
        return {
            "examples_per_s": round(examples / seconds, 2) if seconds > 0 else 0.0,
            "step_time_s": round(seconds / steps, 6) if steps else None,
            # Not measured under --deterministic: TensorFlow then refuses its timestamp op.
            "input_wait_s": round(wait, 3) if timed else None,
            "compute_s": round(max(0.0, seconds - wait), 3) if timed else None,
            "input_wait_fraction": round(wait / seconds, 4) if timed and seconds > 0 else None,
            "startup_s": round(self.startup_s, 3) if self.startup_s is not None else None,
            "timed_steps": steps,
            "steady_state": steady,
        }


def _next_multiple(step: int, every: int | None) -> float:
    return (step // every + 1) * every if every else math.inf


class TrainingLoop:
    """Runs epochs of distributed training steps with checkpoints, resume and SIGTERM handling.

    Args:
        trainer: trainer name, recorded in the state file.
        config: the trainer's configuration.
        runtime: devices and strategy from ``runtime.configure``.
        model: the Keras model, built under ``runtime.strategy.scope()``.
        optimizer: its optimizer, built under the same scope. Its clipping settings
            (``global_clipnorm``, ``clipnorm``, ``clipvalue``) apply to the all-replica gradient.
        compute_fn: per-replica loss and metric sums for one batch.
        train_dataset_fn: the training batches of an epoch, minus a number already consumed.
        val_dataset: the validation batches.
        steps_per_epoch: batches per epoch (training drops the last partial batch).
        global_batch_size: examples per step, all replicas together.
        stop: the SIGTERM flag.
        metric: name of the metric (``accuracy``).
        extra_state: task data stored with each checkpoint (e.g. class names).
        check_resume: called with the restored task data; raises if it does not fit.
        on_step: called with the global step at every multiple of ``on_step_every``.
        on_step_every: the cadence of ``on_step`` (the step function stops there).
        dataset_version: the version of the data in DATA_DIR; a checkpoint of another one is refused.
    """

    def __init__(
        self,
        *,
        trainer: str,
        config: TrainerConfig,
        runtime: Runtime,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        compute_fn: ComputeFn,
        train_dataset_fn: DatasetFn,
        val_dataset: tf.data.Dataset,
        steps_per_epoch: int,
        global_batch_size: int,
        stop: StopRequest,
        metric: str = "accuracy",
        extra_state: dict[str, Any] | None = None,
        check_resume: Callable[[dict[str, Any]], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        on_step_every: int | None = None,
        dataset_version: str | None = None,
    ) -> None:
        self.trainer = trainer
        self.config = config
        self.runtime = runtime
        self.model = model
        self.optimizer = optimizer
        self.compute_fn = compute_fn
        self.train_dataset_fn = train_dataset_fn
        self.val_dataset = val_dataset
        self.steps_per_epoch = steps_per_epoch
        self.global_batch_size = global_batch_size
        self.stop = stop
        self.metric = metric
        self.monitor = config.monitor
        self.monitor_mode = MONITORS[config.monitor]
        self.extra_state = dict(extra_state or {})
        self.check_resume = check_resume
        self.on_step = on_step
        self.on_step_every = (on_step_every or 1) if on_step is not None else None
        self.dataset_version = dataset_version
        self.checkpoint_dir = Path(config.checkpoint_dir)
        self.is_chief = runtime.is_chief
        # Where this process writes checkpoints: CHECKPOINT_DIR on the chief, a scratch
        # directory that nothing syncs on the other workers (it restores from CHECKPOINT_DIR).
        self.write_dir = self.checkpoint_dir
        if not self.is_chief:
            self.write_dir = Path(
                tempfile.mkdtemp(
                    prefix=f"kubetrain-{runtime.cluster.task_type}-{runtime.cluster.task_index}-checkpoints-"
                )
            )
            weakref.finalize(self, shutil.rmtree, str(self.write_dir), True)
        self.summaries = Summaries(config.output_dir, enabled=config.tensorboard and self.is_chief)

        self.step = 0
        self.epoch = 0  # epochs completed; the one in progress has this 0-based index
        self.batch_in_epoch = 0
        self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.stopped_early: dict[str, Any] | None = None
        self.wall_before = 0.0  # training wall time spent by earlier processes of this run
        self.resumed_from_step = 0
        self.last_saved_step: int | None = None
        self.last_saved_path: str | None = None
        self._started = time.monotonic()
        self._timing = _Timing()
        self._window_s = 0.0
        self._window_wait_s = 0.0
        self._next_log = 0
        self._segment_started: float | None = None
        self._learning_rate_at_log: float | None = None

        # Counters live outside the strategy scope: they are bookkeeping, not replicated state.
        self._step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self._batch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch_in_epoch")
        self._state_var = tf.Variable("", dtype=tf.string, trainable=False, name="trainer_state")
        with runtime.strategy.scope():
            # Slot variables must exist before restoring, or their saved values are dropped.
            optimizer.build(model.trainable_variables)
        # The learning rate this run's flags built the optimizer with. A checkpoint holds the
        # optimizer's learning-rate variable too; restore() puts this value back over it, so
        # that a changed --learning-rate is used on resume, as the log and params.json say.
        # None for a LearningRateSchedule: no variable, it is computed from the restored
        # iteration count with this run's settings.
        self._flag_learning_rate = _constant_learning_rate(optimizer)
        self.runner = StepRunner(
            strategy=runtime.strategy,
            model=model,
            optimizer=optimizer,
            compute_fn=compute_fn,
            global_batch_size=global_batch_size,
            mixed_precision=runtime.mixed_precision,
            jit_compile=config.jit_compile,
            time_input=not runtime.deterministic,
            coordinator=runtime.coordinator,
        )
        self._timing.input_timed = self.runner.time_input
        # Keras keeps the state of its dropout and augmentation generators in variables
        # that TensorFlow's object graph does not reach; naming them here checkpoints the
        # random streams too, so a resumed run draws the masks it would have drawn.
        rng = {
            f"generator_{i}": v
            for i, v in enumerate(v for v in model.variables if v.path.endswith("seed_generator_state"))
        }
        parts: dict[str, Any] = dict(
            model=model,
            optimizer=optimizer,
            rng=tf.train.Checkpoint(**rng),
            step=self._step_var,
            epoch=self._epoch_var,
            batch_in_epoch=self._batch_var,
            trainer_state=self._state_var,
        )
        if self.runner.loss_scale is not None:
            parts["loss_scale"] = self.runner.loss_scale.checkpoint()
        self.checkpoint = tf.train.Checkpoint(**parts)
        # Parameter-server mode: all checkpoint I/O goes through the chief (Runtime.io_device).
        self._io = (
            tf.train.CheckpointOptions(experimental_io_device=runtime.io_device)
            if runtime.io_device is not None
            else None
        )
        self.manager = tf.train.CheckpointManager(
            self.checkpoint,
            str(self.write_dir),
            max_to_keep=config.keep_checkpoints,
            checkpoint_name=CHECKPOINT_NAME,
        )
        # The checkpoints to resume from: the chief's, in CHECKPOINT_DIR, on every worker.
        self.restore_manager = (
            self.manager
            if self.is_chief
            else tf.train.CheckpointManager(
                self.checkpoint,
                str(self.checkpoint_dir),
                max_to_keep=config.keep_checkpoints,
                checkpoint_name=CHECKPOINT_NAME,
            )
        )
        self._best_checkpoint = tf.train.Checkpoint(model=model)
        # Two: the best recorded in the newest training checkpoint survives a newer best
        # written just before a crash.
        self._best_manager = tf.train.CheckpointManager(
            self._best_checkpoint,
            str(self.write_dir / BEST_DIR),
            max_to_keep=2,
            checkpoint_name=CHECKPOINT_NAME,
        )

    # -- evaluation ----------------------------------------------------------------------

    def evaluate(self) -> tuple[float, float]:
        """Loss and metric over the validation split."""
        totals = self.runner.evaluate(self.val_dataset)
        return _ratio(totals["loss_sum"], totals["examples"]), _ratio(totals["correct"], totals["count"])

    # -- state -------------------------------------------------------------------------

    def wall_time(self) -> float:
        """Training wall time of the whole run, earlier processes included."""
        return self.wall_before + (time.monotonic() - self._started)

    def state(self) -> dict[str, Any]:
        """The trainer state stored with each checkpoint."""
        return {
            "kind": STATE_KIND,
            "format_version": STATE_FORMAT_VERSION,
            "trainer": self.trainer,
            "checkpoint": f"{CHECKPOINT_NAME}-{self.step}",
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "steps_per_epoch": self.steps_per_epoch,
            "global_batch_size": self.global_batch_size,
            "dataset_version": self.dataset_version,
            "epoch_sums": self.sums,
            "history": self.history,
            "best": self.best,
            "stopped_early": self.stopped_early,
            "wall_time_s": round(self.wall_time(), 3),
            "hyperparameters": self.config.hyperparameters(),
            "extra": self.extra_state,
            "saved_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }

    def save(self, reason: str) -> str | None:
        """Write the checkpoint of the current step, then the state file; once per step.

        Raises:
            TrainingDiverged: a weight is no longer finite; nothing is written.
        """
        if self.last_saved_step == self.step:
            # nothing trained since that checkpoint: it already holds this step
            log.info(
                "checkpoint %s already written at this step (%s)",
                Path(self.last_saved_path).name if self.last_saved_path else f"ckpt-{self.step}",
                reason,
            )
            return None
        broken = self.runner.variables_finite()
        if broken:
            raise TrainingDiverged(
                f"training diverged by step {self.step}: {len(broken)} variable(s) hold NaN or infinite values "
                f"({', '.join(broken[:5])}{' ...' if len(broken) > 5 else ''}); not checkpointed. "
                f"{self._last_finite_checkpoint()}"
            )
        state = self.state()
        self._step_var.assign(self.step)
        self._epoch_var.assign(self.epoch)
        self._batch_var.assign(self.batch_in_epoch)
        self._state_var.assign(json.dumps(json_safe(state)))
        path = self.manager.save(checkpoint_number=self.step, options=self._io)
        self.last_saved_step = self.step
        self.last_saved_path = path
        # The JSON mirror is written strictly after the checkpoint it describes.
        write_json_atomic(self.write_dir / STATE_FILE, state)
        log.info(
            "checkpoint %s written (%s; epoch %d, batch %d)%s",
            Path(path).name,
            reason,
            self.epoch + 1,
            self.batch_in_epoch,
            "" if self.is_chief else f" to the scratch directory {self.write_dir}",
        )
        return path

    def _last_finite_checkpoint(self) -> str:
        if self.last_saved_path:
            return (
                f"The last finite checkpoint, {Path(self.last_saved_path).name} (step {self.last_saved_step}), "
                f"stays in {self.checkpoint_dir}."
            )
        return f"No checkpoint was written in {self.checkpoint_dir}."

    def _rerun_outcome(self) -> str:
        """What a rerun with the same CHECKPOINT_DIR does, for the divergence message."""
        if self.last_saved_path:
            return "a rerun resumes from that checkpoint and is likely to diverge again"
        return "a rerun starts again from step 0 and is likely to diverge again at the same step"

    def _learning_rate_flag(self) -> str:
        """The flag that sets this trainer's learning rate."""
        names = {f.name for f in dataclasses.fields(self.config)}
        return next(
            (flag_name(n) for n in ("learning_rate", "learning_rate_scale") if n in names),
            "the learning rate",
        )

    def restore(self, at_step: int | None = None) -> bool:
        """Restore the newest usable checkpoint from CHECKPOINT_DIR (that of ``at_step`` when given); False when
        there is none."""
        candidates = list(reversed(self.restore_manager.checkpoints))
        if at_step is not None:
            candidates = [p for p in candidates if p.endswith(f"{CHECKPOINT_NAME}-{at_step}")]
        if not candidates:
            log.info("no checkpoint in %s: starting at step 0", self.checkpoint_dir)
            return False
        for path in candidates:
            try:
                status = self.checkpoint.restore(path, options=self._io)
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
                    f"written with different hyperparameters{self._describe_changes()}; use an empty "
                    "--checkpoint-dir to start a new run"
                ) from exc
            self._load_state(json.loads(self._state_var.numpy().decode("utf-8")))
            self.last_saved_step = self.step
            self.last_saved_path = path
            self._use_flag_learning_rate()
            log.info(
                "resumed from %s: step %d, epoch %d, batch %d of %d in that epoch; learning rate %.6g",
                Path(path).name,
                self.step,
                self.epoch + 1,
                self.batch_in_epoch,
                self.steps_per_epoch,
                self._learning_rate(),
            )
            return True
        raise UsageError(f"no usable checkpoint in {self.checkpoint_dir}: every listed one is damaged")

    def _use_flag_learning_rate(self) -> None:
        """After a restore: this run's learning rate replaces the one restored with the optimizer."""
        if self._flag_learning_rate is None:
            return
        restored = self._learning_rate()
        self.optimizer.learning_rate = self._flag_learning_rate
        # The variable is float32: compare at its precision.
        if not math.isclose(restored, self._flag_learning_rate, rel_tol=1e-6):
            log.info(
                "learning rate %.6g from this run's settings replaces the checkpoint's %.6g",
                self._flag_learning_rate,
                restored,
            )

    def _changes(self, saved: dict[str, Any]) -> list[str]:
        now = self.config.hyperparameters()
        return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(now) if saved.get(k) != now.get(k)]

    def _describe_changes(self) -> str:
        try:
            saved = json.loads((self.checkpoint_dir / STATE_FILE).read_text())["hyperparameters"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        changed = self._changes(saved)
        return f" ({'; '.join(changed)})" if changed else ""

    def _check_fits(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose position in an epoch means something else for this run."""
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
        changed = self._changes(hyper)
        if changed:
            log.info("resuming with changed settings: %s", "; ".join(changed))

    def _load_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != STATE_KIND or state.get("format_version") != STATE_FORMAT_VERSION:
            raise UsageError(
                f"checkpoint state of kind {state.get('kind')!r} format {state.get('format_version')!r} is not "
                f"understood; expected {STATE_KIND!r} format {STATE_FORMAT_VERSION}"
            )
        self._check_fits(state)
        if self.check_resume is not None:
            self.check_resume(state.get("extra", {}))
        self.step = int(self._step_var.numpy())
        self.epoch = int(self._epoch_var.numpy())
        self.batch_in_epoch = int(self._batch_var.numpy())
        self.sums = {k: float(state["epoch_sums"].get(k, 0.0)) for k in SUM_KEYS}
        self.history = list(state.get("history", []))
        self.best = state.get("best")
        self.stopped_early = state.get("stopped_early")
        self.wall_before = float(state.get("wall_time_s", 0.0))
        self._started = time.monotonic()
        self.resumed_from_step = self.step
        if self.batch_in_epoch > self.steps_per_epoch > 0:
            raise UsageError(
                f"the checkpoint is at batch {self.batch_in_epoch} of an epoch but this configuration has only "
                f"{self.steps_per_epoch} batches per epoch: the data or --batch-size changed since it was written"
            )

    def _close_pending(self) -> bool | None:
        """After a restore: whether the checkpoint's epoch still needs closing (None: no), and if so, as partial.

        SIGTERM on the last step of an epoch, or on the step that reaches ``--max-steps``,
        checkpoints before the validation pass and the history row.
        """
        if self.batch_in_epoch <= 0:
            return None
        if self.history and self.history[-1].get("step") == self.step:
            return None
        if self.batch_in_epoch >= self.steps_per_epoch:
            return False
        if self._max_reached():
            return True
        return None

    # -- the loop ----------------------------------------------------------------------

    def _eta(self) -> str:
        """Training time left at the step time so far (evaluation and checkpoints not counted)."""
        t = self._timing
        seconds, steps = (t.steady_s, t.steady_steps) if t.steady_steps else (t.all_s, t.all_steps)
        total = self.config.epochs * self.steps_per_epoch
        if self.config.max_steps is not None:
            total = min(total, self.config.max_steps)
        left = max(0, total - self.step) * (seconds / steps if steps else 0.0)
        if left >= 3600:
            return f"{int(left // 3600)}h{int(left % 3600 // 60):02d}m"
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def _max_reached(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def _finished(self) -> bool:
        return (
            self.epoch >= self.config.epochs
            or self._max_reached()
            or self.stopped_early is not None
            or self._stop_file_seen()
        )

    def _stop_file_seen(self) -> bool:
        """Whether the sweep's sidecar asked this run to stop (``KUBETRAIN_STOP_FILE``): early stopping."""
        request = self.stop.stop_file_request()
        if request is not None and self.stopped_early is None:
            self.stopped_early = {
                "epoch": self.epoch + (1 if self.batch_in_epoch else 0),
                "step": self.step,
                "by": "stop file",
                "monitor": self.monitor,
                "request": request,
            }
            log.info("early stopping requested through the stop file at step %d", self.step)
        return request is not None

    def _learning_rate(self) -> float:
        return to_float(self.optimizer.learning_rate)

    def _improved(self, value: float) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best is None or self.best.get("value") is None:
            return True
        return value > self.best["value"] if self.monitor_mode == "max" else value < self.best["value"]

    def _close_epoch(self, partial: bool) -> None:
        val_loss, val_metric = self.evaluate()
        row = {
            "epoch": self.epoch + 1,
            "step": self.step,
            "loss": _ratio(self.sums["loss_sum"], self.sums["examples"]),
            self.metric: _ratio(self.sums["correct"], self.sums["count"]),
            "val_loss": val_loss,
            f"val_{self.metric}": val_metric,
            "learning_rate": self._learning_rate(),
            "wall_time_s": round(self.wall_time(), 3),
        }
        if partial:
            row["partial"] = True
        self.history.append(row)
        value = row.get(self.monitor)
        if self._improved(value):
            self._save_best(row)
        if not partial:
            self.epoch += 1
            self.batch_in_epoch = 0
            self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        log.info(
            "epoch %d%s: loss %.4f %s %.4f val_loss %.4f val_%s %.4f%s",
            row["epoch"],
            " (partial, --max-steps reached)" if partial else "",
            row["loss"],
            self.metric,
            row[self.metric],
            val_loss,
            self.metric,
            val_metric,
            f" (best {self.monitor} so far)" if self.best and self.best["step"] == self.step else "",
        )
        self.summaries.scalars("train", self.step, {f"epoch_{k}": row[k] for k in ("loss", self.metric)})
        self.summaries.scalars(
            "validation", self.step, {"epoch_loss": val_loss, f"epoch_{self.metric}": val_metric}
        )
        self.summaries.flush()
        if not partial and self.config.patience and self.best is not None:
            waited = row["epoch"] - self.best["epoch"]
            if waited >= self.config.patience:
                self.stopped_early = {
                    "epoch": row["epoch"],
                    "step": self.step,
                    "best_epoch": self.best["epoch"],
                    "patience": self.config.patience,
                    "monitor": self.monitor,
                }
                log.info(
                    "early stopping: %s has not improved for %d epoch(s) since epoch %d (--patience %d)",
                    self.monitor,
                    waited,
                    self.best["epoch"],
                    self.config.patience,
                )

    def _save_best(self, row: dict[str, Any]) -> None:
        """Keep the weights of the best epoch so far in CHECKPOINT_DIR/best/ckpt-<step>."""
        self.best = {
            "epoch": row["epoch"],
            "step": self.step,
            "value": row[self.monitor],
            "monitor": self.monitor,
            "row": dict(row),
        }
        if not self.config.restore_best:
            return
        # Closing the epoch of a restored SIGTERM checkpoint again must not rewrite a file
        # the sidecar may already have uploaded: the same step's weights are the same.
        if any(
            (d / BEST_DIR / f"{CHECKPOINT_NAME}-{self.step}.index").exists()
            for d in (self.write_dir, self.checkpoint_dir)
        ):
            return
        self._best_manager.save(checkpoint_number=self.step, options=self._io)

    def restore_best_weights(self) -> bool:
        """Load the best epoch's weights into the model; False (and the last weights kept) when unavailable."""
        if self.best is None or not self.config.restore_best:
            return False
        if self.history and self.history[-1].get("step") == self.best["step"]:
            return True  # the model already holds them
        name = f"{CHECKPOINT_NAME}-{self.best['step']}"
        # Written by this process, or by an earlier one of the run (restored into CHECKPOINT_DIR).
        path = next(
            (
                d / BEST_DIR / name
                for d in (self.write_dir, self.checkpoint_dir)
                if (d / BEST_DIR / f"{name}.index").exists()
            ),
            self.write_dir / BEST_DIR / name,
        )
        try:
            self._best_checkpoint.restore(str(path), options=self._io).assert_existing_objects_matched()
        except (tf.errors.NotFoundError, tf.errors.DataLossError, AssertionError, ValueError) as exc:
            log.warning(
                "the best epoch's weights (%s) cannot be read (%s): exporting the last epoch's weights",
                path,
                str(exc).splitlines()[0][:200],
            )
            return False
        log.info(
            "restored the weights of epoch %d (step %d, %s %.4f), the best by %s",
            self.best["epoch"],
            self.best["step"],
            self.monitor,
            self.best["value"],
            self.monitor,
        )
        return True

    def write_history(self, path: Path) -> None:
        """history.csv: one row per epoch, earlier processes of the run included (the chief only)."""
        if not self.is_chief:
            return
        header = history_header(self.metric)
        write_csv_atomic(path, header, ([_csv_value(row[h]) for h in header] for row in self.history))

    def _sync(self) -> Counters:
        """Wait for the queued steps, account for them and check that they stayed finite."""
        counters = self.runner.read()
        now = time.perf_counter()
        seconds = now - self._segment_started if self._segment_started is not None else 0.0
        self._segment_started = None
        before = self.step
        self.step += counters.steps
        self.batch_in_epoch += counters.steps
        self.sums = counters.epoch_sums
        self._timing.add(
            seconds,
            counters.steps,
            counters.window["examples"] - self._window_examples_seen,
            counters.input_wait_s,
        )
        self._window_examples_seen = counters.window["examples"]
        self._window_s += seconds
        self._window_wait_s += counters.input_wait_s
        if counters.nonfinite_loss or (
            counters.nonfinite_grads and (counters.loss_scale is None or counters.loss_scale < 1.0)
        ):
            bad_step = before + max(1, counters.first_nonfinite)
            what = (
                "the loss was NaN or infinite"
                if counters.nonfinite_loss
                else "the all-replica gradient was NaN or infinite"
                + (
                    f" even with the loss scale down to {counters.loss_scale:g}"
                    if counters.loss_scale
                    else ""
                )
            )
            raise TrainingDiverged(
                f"training diverged at step {bad_step} (epoch {self.epoch + 1}): {what} "
                f"({counters.nonfinite_loss} step(s) with a non-finite loss, {counters.nonfinite_grads} with a "
                f"non-finite gradient since step {before}); those updates were skipped and no checkpoint was "
                f"written after them. {self._last_finite_checkpoint()} Lower {self._learning_rate_flag()}, clip "
                f"the gradients or check the data; {self._rerun_outcome()}"
            )
        if counters.nonfinite_grads:
            log.info(
                "mixed precision: %d step(s) with overflowing gradients skipped; loss scale now %g",
                counters.nonfinite_grads,
                counters.loss_scale,
            )
        if self.step >= self._next_log or self._first_log:
            self._log_step(counters)
        return counters

    def _log_step(self, counters: Counters) -> None:
        w = counters.window
        total_epochs = self.config.epochs
        rate = w["examples"] / self._window_s if self._window_s > 0 else 0.0
        wait = (
            self._window_wait_s / self._window_s
            if self._window_s > 0 and self.runner.time_input
            else math.nan
        )
        lr = self._learning_rate()
        log.info(
            "step %d epoch %d/%d batch %d/%d loss %.4f %s %.4f (epoch mean loss %.4f) lr %.3g examples/s %.1f "
            "input wait %s eta %s",
            self.step,
            self.epoch + 1,
            total_epochs,
            self.batch_in_epoch,
            self.steps_per_epoch,
            _ratio(w["loss_sum"], w["examples"]),
            self.metric,
            _ratio(w["correct"], w["count"]),
            _ratio(self.sums["loss_sum"], self.sums["examples"]),
            lr,
            rate,
            f"{wait:.0%}" if math.isfinite(wait) else "not measured",
            self._eta(),
        )
        self.summaries.scalars(
            "train",
            self.step,
            {
                "loss": _ratio(w["loss_sum"], w["examples"]),
                self.metric: _ratio(w["correct"], w["count"]),
                "learning_rate": lr,
                "gradient_global_norm": _ratio(w["grad_norm_sum"], w["applied_steps"]),
                "examples_per_s": rate,
                "input_wait_fraction": wait,
                **({"loss_scale": counters.loss_scale} if counters.loss_scale is not None else {}),
            },
        )
        self.runner.reset_window()
        self._window_examples_seen = 0.0
        self._window_s = self._window_wait_s = 0.0
        self._first_log = False
        self._next_log = _next_multiple(self.step, self.config.log_every_steps)

    def _all_sum(self, value: float | list[float]) -> Any:
        """The sum of ``value`` over every worker (a collective: all workers call it); a float or a list."""
        strategy = self.runtime.strategy
        local = tf.constant(value, tf.float64)
        per_replica = strategy.run(lambda: tf.identity(local))
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()
        # Each worker contributes once per local replica.
        total = total / (strategy.num_replicas_in_sync / max(1, self.runtime.workers))
        return float(total) if total.ndim == 0 else [float(v) for v in total]

    def _worker_id(self) -> int:
        cluster = self.runtime.cluster
        chief = "chief" in cluster.cluster
        return 0 if cluster.task_type == "chief" else cluster.task_index + (1 if chief else 0)

    def _stop_agreed(self) -> bool:
        """Whether to stop now: SIGTERM here, or, with several workers, on any of them."""
        if not self.runtime.multi_worker:
            return self.stop.requested
        stop = self._all_sum(1.0 if self.stop.requested else 0.0) > 0
        if stop and not self.stop.requested:
            log.warning(
                "another worker received SIGTERM: checkpointing at step %d with it, then exiting", self.step
            )
        return stop

    def _check_same_step(self) -> None:
        """Every worker must resume from the chief's checkpoint: the same step, hence the same data position.

        A worker whose stage-in ran before the chief's last checkpoint reached S3 restored an
        older one. Every worker then takes the oldest step restored anywhere, when each holds that
        checkpoint (the chief keeps its last few); otherwise all stop (exit 75) so that the engine
        starts them again and their stage-ins find the chief's newest checkpoint.
        """
        vector = [0.0] * self.runtime.workers
        vector[self._worker_id()] = float(self.step)
        steps = [int(round(v)) for v in self._all_sum(vector)]
        if len(set(steps)) > 1:
            common = min(steps)
            held = (
                f"{CHECKPOINT_NAME}-{common}" in {Path(p).name for p in self.restore_manager.checkpoints}
                or self.step == common
            )
            missing = self._all_sum(0.0 if held else 1.0)
            if common == 0 or missing:
                raise ReplicasDisagree(
                    f"the workers restored different checkpoints (steps {steps}, this worker {self.step}): a replica's "
                    "stage-in ran before the chief's newest checkpoint reached S3. Every worker stops before training "
                    "so that they start again and all restore the chief's newest checkpoint"
                )
            log.warning(
                "the workers restored steps %s (a stage-in ran before the chief's newest checkpoint reached "
                "S3): every worker resumes from step %d, the newest that all of them hold",
                steps,
                common,
            )
            if self.step != common:
                self.restore(at_step=common)
        if self.step:
            log.info(
                "all %d worker(s) resume from the chief's checkpoint at step %d",
                self.runtime.workers,
                self.step,
            )

    def _train_epoch(self) -> bool:
        """Train until the epoch ends, ``--max-steps``, or SIGTERM; True when the epoch was completed."""
        strategy = self.runtime.strategy
        config = self.config
        dataset = shard_by_data(self.train_dataset_fn(self.epoch, self.batch_in_epoch))
        if self.runtime.coordinator is not None:
            # The chief reads the input and hands each step its batch (trainer.common.steps).
            iterator = iter(dataset)
        else:
            iterator = iter(strategy.experimental_distribute_dataset(dataset))
        self.runner.set_epoch_sums(self.sums)
        planned = self.step
        epoch_end = self.step + (self.steps_per_epoch - self.batch_in_epoch)
        while True:
            target = min(
                epoch_end,
                config.max_steps or math.inf,
                _next_multiple(planned, config.checkpoint_every_steps),
                _next_multiple(planned, self.on_step_every),
            )
            steps = int(min(config.steps_per_execution, target - planned))
            if self._segment_started is None:
                self._segment_started = time.perf_counter()
            self.runner.run(iterator, steps)
            planned += steps
            # Several workers see SIGTERM only at the points they all reach (the agreement below).
            local_stop = self.stop.requested and not self.runtime.multi_worker
            if planned < target and planned < self._next_log and not local_stop:
                continue
            self._sync()
            ended = self.step < planned or self.batch_in_epoch >= self.steps_per_epoch
            closing = ended or self._max_reached()
            if self._stop_agreed():
                self.save("SIGTERM" + (", epoch not yet closed" if closing else ""))
                raise Preempted()
            if not ended and self._stop_file_seen():
                return False  # closed as a partial epoch, then the run ends
            if closing:
                if ended and self.batch_in_epoch == 0:
                    raise UsageError(
                        f"epoch {self.epoch + 1} produced no training batch: fewer training examples than "
                        f"--batch-size {config.batch_size}"
                    )
                if self.step < planned:
                    log.warning(
                        "epoch %d ended after %d of %d batches: the input pipeline dropped examples",
                        self.epoch + 1,
                        self.batch_in_epoch,
                        self.steps_per_epoch,
                    )
                return ended
            every = config.checkpoint_every_steps
            if every and self.step % every == 0:
                self.save(f"every {every} steps")
            if self.on_step is not None and self.step % self.on_step_every == 0:
                self.on_step(self.step)
            planned = self.step

    def run(self, history_path: Path | None = None) -> LoopResult:
        """Train until ``--epochs``, ``--max-steps`` or early stopping; raise ``Preempted`` after SIGTERM.

        On return the model holds the weights to export: the best epoch's with
        ``--restore-best`` (the default), else the last ones.
        """
        self.restore()
        if self.runtime.multi_worker:
            self._check_same_step()
        self._first_log = True
        self._window_examples_seen = 0.0
        pending = self._close_pending()
        if pending is not None:
            log.info("the checkpoint was taken before epoch %d was closed: closing it now", self.epoch + 1)
            self._close_epoch(partial=pending)
            if history_path is not None:
                self.write_history(history_path)
        if self._finished():
            log.info("training already finished at step %d: writing the outputs again", self.step)
        else:
            # A partial row was written when --max-steps stopped mid-epoch; the epoch goes on now.
            self.history = [row for row in self.history if not row.get("partial")]
        while not self._finished():
            if self._stop_agreed():
                self.save("SIGTERM")
                raise Preempted()
            finished_epoch = self._train_epoch()
            self._close_epoch(partial=not finished_epoch)
            if history_path is not None:
                self.write_history(history_path)
            reason = (
                "early stopping"
                if self.stopped_early
                else "end of epoch"
                if finished_epoch
                else "--max-steps reached"
            )
            self.save(reason)
            if self.on_step is not None and self.step % self.on_step_every == 0:
                self.on_step(self.step)  # a hook step that ends an epoch runs after the close
        if history_path is not None:
            self.write_history(history_path)
        self.summaries.close()
        restored = self.restore_best_weights()
        exported = (
            self.best["row"] if restored and self.best else (self.history[-1] if self.history else None)
        )
        throughput = self._timing.report()
        return LoopResult(
            history=self.history,
            steps=self.step,
            resumed_from_step=self.resumed_from_step,
            wall_time_s=round(self.wall_time(), 3),
            examples_per_s=throughput["examples_per_s"],
            extra_state=self.extra_state,
            monitor=self.monitor,
            monitor_mode=self.monitor_mode,
            best=self.best,
            exported=exported,
            restored_best=restored,
            stopped_early=self.stopped_early,
            throughput=throughput,
        )


class ReplicasDisagree(Preempted):
    """The workers restored different checkpoints; every worker exits 75 to be started again."""


def shard_by_data(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Shard by element, so that each worker reads its part of every global batch.

    Keras' inputs are tensors and files read by ``map``, which TensorFlow's file-based
    auto-sharding cannot split; sharding the batches keeps each step's examples those of a
    single pod. Without several workers the option changes nothing.
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def metrics_document(
    *,
    trainer: str,
    task: str,
    metric: str,
    result: LoopResult,
    runtime: Runtime,
    skipped_files: int = 0,
    config: TrainerConfig | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """metrics.json: the exported model's metrics (``final``), the best and last epochs, steps,
    time, throughput split into input wait and compute, and devices."""
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
    doc.update(extra)
    return doc


def _constant_learning_rate(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The optimizer's learning rate when it is a number (a variable), None for a schedule."""
    value = optimizer.get_config().get("learning_rate")
    return float(value) if isinstance(value, int | float) else None


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else math.nan


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value
