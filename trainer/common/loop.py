"""The custom training loop shared by the trainers, with checkpoints and resume.

What a checkpoint holds (``tf.train.Checkpoint`` under ``tf.train.CheckpointManager``):
the model, the optimizer (slots, iteration count, loss scale), the global step, the
epoch, the number of batches already consumed in that epoch, and the trainer state as a
JSON string (history so far, the current epoch's running sums, task data such as class
names). The same state is mirrored to ``CHECKPOINT_DIR/trainer_state.json`` after each
checkpoint for readers that do not load TensorFlow.

Resume restores the newest checkpoint listed in the ``checkpoint`` index file, which
TensorFlow rewrites atomically only after the checkpoint's data and index files are
complete, so a half-written checkpoint is never chosen. A checkpoint whose files are
damaged or missing is skipped in favour of the one before it.

The input pipeline skips the batches already consumed in the current epoch: each epoch's
order depends only on (seed, epoch), so the resumed epoch sees exactly the remaining
batches, and augmentation draws from stateless generators keyed by position.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer.common.config import TrainerConfig
from trainer.common.contract import (
    Preempted,
    UsageError,
    json_safe,
    write_csv_atomic,
    write_json_atomic,
)
from trainer.common.runtime import Runtime, to_float
from trainer.common.signals import StopRequest

log = logging.getLogger("kubetrain.trainer")

STATE_FILE = "trainer_state.json"
STATE_KIND = "kubetrain/trainer-state"
STATE_FORMAT_VERSION = 1
CHECKPOINT_NAME = "ckpt"
SUM_KEYS = ("loss_sum", "examples", "correct", "count")

# compute_fn(model, batch, training) -> per-replica sums: loss_sum (sum of per-example
# losses), examples, correct and count (the metric's numerator and denominator).
ComputeFn = Callable[[keras.Model, Any, bool], dict[str, tf.Tensor]]
# train_dataset_fn(epoch, skip_batches) -> batched dataset for that epoch, minus the
# first skip_batches batches.
DatasetFn = Callable[[int, int], tf.data.Dataset]


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


class TrainingLoop:
    """Runs epochs of distributed training steps with checkpoints, resume and SIGTERM handling.

    Args:
        trainer: trainer name, recorded in the state file.
        config: the trainer's configuration.
        runtime: devices and strategy from ``runtime.configure``.
        model: the Keras model, built under ``runtime.strategy.scope()``.
        optimizer: its optimizer, built under the same scope (wrapped for loss scaling).
        compute_fn: per-replica loss and metric sums for one batch.
        train_dataset_fn: the training batches of an epoch, minus a number already consumed.
        val_dataset: the validation batches.
        steps_per_epoch: batches per epoch (training drops the last partial batch).
        global_batch_size: examples per step, all replicas together.
        stop: the SIGTERM flag.
        metric: name of the metric (``accuracy``).
        extra_state: task data stored with each checkpoint (e.g. class names).
        check_resume: called with the restored task data; raises if it does not fit.
        on_step: called after every step with the global step number.
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
        self.extra_state = dict(extra_state or {})
        self.check_resume = check_resume
        self.on_step = on_step
        self.checkpoint_dir = Path(config.checkpoint_dir)

        self.step = 0
        self.epoch = 0  # epochs completed; the one in progress has this 0-based index
        self.batch_in_epoch = 0
        self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        self.history: list[dict[str, Any]] = []
        self.wall_before = 0.0  # training wall time spent by earlier processes of this run
        self.resumed_from_step = 0
        self.last_saved_step: int | None = None
        self._started = time.monotonic()

        # Counters live outside the strategy scope: they are bookkeeping, not replicated state.
        self._step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self._batch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch_in_epoch")
        self._state_var = tf.Variable("", dtype=tf.string, trainable=False, name="trainer_state")
        with runtime.strategy.scope():
            # Slot variables must exist before restoring, or their saved values are dropped.
            optimizer.build(model.trainable_variables)
        # Keras keeps the state of its dropout and augmentation generators in variables
        # that TensorFlow's object graph does not reach; naming them here checkpoints the
        # random streams too, so a resumed run draws the masks it would have drawn.
        rng = {f"generator_{i}": v for i, v in enumerate(
            v for v in model.variables if v.path.endswith("seed_generator_state"))}
        self.checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=optimizer,
            rng=tf.train.Checkpoint(**rng),
            step=self._step_var,
            epoch=self._epoch_var,
            batch_in_epoch=self._batch_var,
            trainer_state=self._state_var,
        )
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(self.checkpoint_dir), max_to_keep=config.keep_checkpoints,
            checkpoint_name=CHECKPOINT_NAME,
        )
        self._train_step = self._make_train_step()
        self._eval_step = self._make_eval_step()

    # -- steps -------------------------------------------------------------------------

    def _make_train_step(self) -> Callable[[Any], dict[str, tf.Tensor]]:
        strategy = self.runtime.strategy
        model, optimizer, compute_fn = self.model, self.optimizer, self.compute_fn
        scale = 1.0 / self.global_batch_size

        def replica_step(batch: Any) -> dict[str, tf.Tensor]:
            with tf.GradientTape() as tape:
                sums = compute_fn(model, batch, True)
                # Dividing by the global batch makes the all-reduced gradient the mean over
                # every replica's examples.
                loss = tf.cast(sums["loss_sum"], tf.float32) * scale
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return sums

        @tf.function(reduce_retracing=True)
        def train_step(batch: Any) -> dict[str, tf.Tensor]:
            per_replica = strategy.run(replica_step, args=(batch,))
            return {k: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None) for k, v in per_replica.items()}

        return train_step

    def _make_eval_step(self) -> Callable[[Any], dict[str, tf.Tensor]]:
        strategy = self.runtime.strategy
        model, compute_fn = self.model, self.compute_fn

        @tf.function(reduce_retracing=True)
        def eval_step(batch: Any) -> dict[str, tf.Tensor]:
            per_replica = strategy.run(lambda b: compute_fn(model, b, False), args=(batch,))
            return {k: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None) for k, v in per_replica.items()}

        return eval_step

    def evaluate(self) -> tuple[float, float]:
        """Loss and metric over the validation split."""
        totals = dict.fromkeys(SUM_KEYS, 0.0)
        for batch in self.runtime.strategy.experimental_distribute_dataset(self.val_dataset):
            for key, value in self._eval_step(batch).items():
                totals[key] += float(value)
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
            "epoch_sums": self.sums,
            "history": self.history,
            "wall_time_s": round(self.wall_time(), 3),
            "hyperparameters": self.config.hyperparameters(),
            "extra": self.extra_state,
            "saved_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }

    def save(self, reason: str) -> str | None:
        """Write a checkpoint for the current step (once per step), then the state file."""
        if self.last_saved_step == self.step:
            return None
        state = self.state()
        self._step_var.assign(self.step)
        self._epoch_var.assign(self.epoch)
        self._batch_var.assign(self.batch_in_epoch)
        self._state_var.assign(json.dumps(json_safe(state)))
        path = self.manager.save(checkpoint_number=self.step)
        self.last_saved_step = self.step
        # The JSON mirror is written strictly after the checkpoint it describes.
        write_json_atomic(self.checkpoint_dir / STATE_FILE, state)
        log.info("checkpoint %s written (%s; epoch %d, batch %d)", Path(path).name, reason, self.epoch + 1,
                 self.batch_in_epoch)
        return path

    def restore(self) -> bool:
        """Restore the newest usable checkpoint from CHECKPOINT_DIR; False when there is none."""
        candidates = list(reversed(self.manager.checkpoints))
        if not candidates:
            log.info("no checkpoint in %s: starting at step 0", self.checkpoint_dir)
            return False
        for path in candidates:
            try:
                status = self.checkpoint.restore(path)
                status.assert_existing_objects_matched()
            except (tf.errors.NotFoundError, tf.errors.DataLossError, tf.errors.OutOfRangeError) as exc:
                log.warning("checkpoint %s is unusable (%s): trying the one before it", Path(path).name,
                            exc.message.splitlines()[0] if exc.message else type(exc).__name__)
                continue
            except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as exc:
                raise UsageError(
                    f"checkpoint {path} does not fit this model ({str(exc).splitlines()[0][:300]}); it was "
                    f"written with different hyperparameters{self._describe_changes()}; use an empty "
                    "--checkpoint-dir to start a new run"
                ) from exc
            self._load_state(json.loads(self._state_var.numpy().decode("utf-8")))
            self.last_saved_step = self.step
            log.info("resumed from %s: step %d, epoch %d, batch %d of %d in that epoch", Path(path).name,
                     self.step, self.epoch + 1, self.batch_in_epoch, self.steps_per_epoch)
            return True
        raise UsageError(f"no usable checkpoint in {self.checkpoint_dir}: every listed one is damaged")

    def _describe_changes(self) -> str:
        try:
            saved = json.loads((self.checkpoint_dir / STATE_FILE).read_text())["hyperparameters"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        now = self.config.hyperparameters()
        changed = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(now) if saved.get(k) != now.get(k)]
        return f" ({'; '.join(changed)})" if changed else ""

    def _load_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != STATE_KIND or state.get("format_version") != STATE_FORMAT_VERSION:
            raise UsageError(
                f"checkpoint state of kind {state.get('kind')!r} format {state.get('format_version')!r} is not "
                f"understood; expected {STATE_KIND!r} format {STATE_FORMAT_VERSION}"
            )
        if self.check_resume is not None:
            self.check_resume(state.get("extra", {}))
        self.step = int(self._step_var.numpy())
        self.epoch = int(self._epoch_var.numpy())
        self.batch_in_epoch = int(self._batch_var.numpy())
        self.sums = {k: float(state["epoch_sums"].get(k, 0.0)) for k in SUM_KEYS}
        self.history = list(state.get("history", []))
        self.wall_before = float(state.get("wall_time_s", 0.0))
        self._started = time.monotonic()
        self.resumed_from_step = self.step
        if self.batch_in_epoch >= self.steps_per_epoch > 0:
            raise UsageError(
                f"the checkpoint is at batch {self.batch_in_epoch} of an epoch but this configuration has only "
                f"{self.steps_per_epoch} batches per epoch: the data or --batch-size changed since it was written"
            )

    # -- the loop ----------------------------------------------------------------------

    def _eta(self, seconds_per_step: float) -> str:
        """Training time left at the current step time (evaluation and checkpoints not counted)."""
        total = self.config.epochs * self.steps_per_epoch
        if self.config.max_steps is not None:
            total = min(total, self.config.max_steps)
        left = max(0, total - self.step) * seconds_per_step
        if left >= 3600:
            return f"{int(left // 3600)}h{int(left % 3600 // 60):02d}m"
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def _max_reached(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def _learning_rate(self) -> float:
        return to_float(self.optimizer.learning_rate)

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
        else:
            self.epoch += 1
            self.batch_in_epoch = 0
            self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        self.history.append(row)
        log.info(
            "epoch %d%s: loss %.4f %s %.4f val_loss %.4f val_%s %.4f",
            row["epoch"], " (partial, --max-steps reached)" if partial else "", row["loss"], self.metric,
            row[self.metric], val_loss, self.metric, val_metric,
        )

    def write_history(self, path: Path) -> None:
        """history.csv: one row per epoch, earlier processes of the run included."""
        header = history_header(self.metric)
        write_csv_atomic(path, header, ([_csv_value(row[h]) for h in header] for row in self.history))

    def run(self, history_path: Path | None = None) -> LoopResult:
        """Train until ``--epochs`` or ``--max-steps``; raise ``Preempted`` after SIGTERM."""
        self.restore()
        strategy = self.runtime.strategy
        train_seconds = 0.0
        examples = 0.0
        steps_run = 0
        first_logged = False
        total_epochs = self.config.epochs
        if self.epoch >= total_epochs or self._max_reached():
            log.info("training already finished at step %d: writing the outputs again", self.step)
        else:
            # A partial row was written when --max-steps stopped mid-epoch; the epoch goes on now.
            self.history = [row for row in self.history if not row.get("partial")]
        while self.epoch < total_epochs and not self._max_reached():
            if self.stop.requested:
                self.save("SIGTERM")
                raise Preempted()
            dataset = self.train_dataset_fn(self.epoch, self.batch_in_epoch)
            finished_epoch = True
            for batch in strategy.experimental_distribute_dataset(dataset):
                started = time.perf_counter()
                sums = {k: float(v) for k, v in self._train_step(batch).items()}
                train_seconds += time.perf_counter() - started
                steps_run += 1
                self.step += 1
                self.batch_in_epoch += 1
                examples += sums["examples"]
                for key in SUM_KEYS:
                    self.sums[key] += sums[key]
                if not first_logged or self.step % self.config.log_every_steps == 0:
                    first_logged = True
                    log.info(
                        "step %d epoch %d/%d batch %d/%d loss %.4f %s %.4f (epoch mean loss %.4f) lr %.3g "
                        "examples/s %.1f eta %s",
                        self.step, self.epoch + 1, total_epochs, self.batch_in_epoch, self.steps_per_epoch,
                        _ratio(sums["loss_sum"], sums["examples"]), self.metric,
                        _ratio(sums["correct"], sums["count"]),
                        _ratio(self.sums["loss_sum"], self.sums["examples"]), self._learning_rate(),
                        examples / train_seconds if train_seconds else 0.0,
                        self._eta(train_seconds / steps_run),
                    )
                if self.on_step is not None:
                    self.on_step(self.step)
                every = self.config.checkpoint_every_steps
                if every and self.step % every == 0:
                    self.save(f"every {every} steps")
                if self.stop.requested:
                    self.save("SIGTERM")
                    raise Preempted()
                if self._max_reached():
                    finished_epoch = self.batch_in_epoch >= self.steps_per_epoch
                    break
            if self.batch_in_epoch == 0 and finished_epoch:
                raise UsageError(
                    f"epoch {self.epoch + 1} produced no training batch: fewer training examples than "
                    f"--batch-size {self.config.batch_size}"
                )
            self._close_epoch(partial=not finished_epoch)
            if history_path is not None:
                self.write_history(history_path)
            self.save("end of epoch" if finished_epoch else "--max-steps reached")
        if history_path is not None:
            self.write_history(history_path)
        return LoopResult(
            history=self.history,
            steps=self.step,
            resumed_from_step=self.resumed_from_step,
            wall_time_s=round(self.wall_time(), 3),
            examples_per_s=round(examples / train_seconds, 2) if train_seconds else 0.0,
            extra_state=self.extra_state,
        )


def metrics_document(*, trainer: str, task: str, metric: str, result: LoopResult, runtime: Runtime,
                     skipped_files: int = 0, **extra: Any) -> dict[str, Any]:
    """metrics.json: final and best metrics, epochs, steps, time, throughput and devices."""
    monitor = f"val_{metric}"
    last = result.history[-1] if result.history else {}
    best_row = max(result.history, key=lambda r: r[monitor], default=None)
    doc = {
        "trainer": trainer,
        "task": task,
        "monitor": monitor,
        "monitor_mode": "max",
        "final": {k: last.get(k) for k in ("loss", metric, "val_loss", monitor)},
        "best": {monitor: best_row[monitor] if best_row else None, "epoch": best_row["epoch"] if best_row else None},
        "epochs": len(result.history),
        "steps": result.steps,
        "resumed_from_step": result.resumed_from_step,
        "wall_time_s": result.wall_time_s,
        "examples_per_s": result.examples_per_s,
        "devices": runtime.devices,
        "replicas": runtime.replicas,
        "mixed_precision": runtime.mixed_precision,
        "skipped_files": skipped_files,
    }
    doc.update(extra)
    return doc


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else math.nan


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value
