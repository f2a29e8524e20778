"""The custom training loop shared by the trainers: epochs of steps, checkpoints, resume and SIGTERM.

The loop composes the units that hold each concern:

* ``trainer.common.steps``: the compiled steps, run ``--steps-per-execution`` at a time on
  the device; the host waits for them only at a log line, a checkpoint, a step hook,
  SIGTERM and the end of an epoch;
* ``trainer.common.checkpoints``: what a checkpoint holds, writing it once per step, and
  which checkpoint a resume may use (and this run's learning rate on resume);
* ``trainer.common.best_epoch``: the best epoch by ``--monitor`` and its weights;
* ``trainer.common.stopping``: ``--epochs``, ``--max-steps``, ``--patience``, the stop file;
* ``trainer.common.replicas``: the decisions the workers of a multi-worker run take together;
* ``trainer.common.nan_guard``: the sync points also look for a non-finite loss, gradient or
  weights, and stop the run with ``TrainingDiverged`` before anything after it is saved;
* ``trainer.common.progress``: wall time, step timing, the log lines with the ETA, throughput;
* ``trainer.common.metrics_doc``: the result, history.csv and metrics.json.

A step gets at most one checkpoint, taken after everything that happens at that step: when
a periodic save falls on the last step of an epoch (or on ``--max-steps``), the save waits
for the epoch to be closed (validation, history row) and is the end-of-epoch checkpoint.
Only SIGTERM on such a step saves before the close, because the grace period may not cover
a validation pass; resuming from that checkpoint closes the epoch first.

The input pipeline skips the batches already consumed in the current epoch: each epoch's
order depends only on (seed, epoch), so the resumed epoch sees exactly the remaining
batches, and augmentation draws from stateless generators keyed by position.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer.common.best_epoch import BestEpoch
from trainer.common.checkpoints import (
    CheckpointStore,
    FlagLearningRate,
    TrainerState,
    epoch_close_pending,
    training_parts,
)
from trainer.common.config import MONITORS, TrainerConfig
from trainer.common.contract import Preempted, UsageError
from trainer.common.metrics_doc import LoopResult, write_history
from trainer.common.nan_guard import check_steps, check_weights, learning_rate_flag
from trainer.common.progress import Progress, next_multiple, ratio
from trainer.common.replicas import Replicas, shard_by_data
from trainer.common.runtime import Runtime
from trainer.common.signals import StopRequest
from trainer.common.steps import SUM_KEYS, ComputeFn, Counters, StepRunner
from trainer.common.stopping import Stopping
from trainer.common.summaries import Summaries

log = logging.getLogger("kubetrain.trainer")

# train_dataset_fn(epoch, skip_batches) -> batched dataset for that epoch, minus the
# first skip_batches batches.
DatasetFn = Callable[[int, int], tf.data.Dataset]

__all__ = ["DatasetFn", "TrainingLoop"]


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
        self.train_dataset_fn = train_dataset_fn
        self.val_dataset = val_dataset
        self.steps_per_epoch = steps_per_epoch
        self.global_batch_size = global_batch_size
        self.stop = stop
        self.metric = metric
        self.monitor = config.monitor
        self.monitor_mode = MONITORS[config.monitor]
        self.extra_state = dict(extra_state or {})
        self.on_step = on_step
        self.on_step_every = (on_step_every or 1) if on_step is not None else None
        self.dataset_version = dataset_version
        assert config.checkpoint_dir and config.output_dir  # the trainers' prepare_dir checked both
        self.checkpoint_dir = Path(config.checkpoint_dir)
        self.is_chief = runtime.is_chief
        self.summaries = Summaries(config.output_dir, enabled=config.tensorboard and self.is_chief)

        self.step = 0
        self.epoch = 0  # epochs completed; the one in progress has this 0-based index
        self.batch_in_epoch = 0
        self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        self.history: list[dict[str, Any]] = []
        self.resumed_from_step = 0

        with runtime.strategy.scope():
            # Slot variables must exist before restoring, or their saved values are dropped.
            optimizer.build(model.trainable_variables)
        self.learning_rate = FlagLearningRate(optimizer)
        self.runner = StepRunner(
            strategy=runtime.strategy,
            model=model,
            optimizer=optimizer,
            compute_fn=compute_fn,
            global_batch_size=global_batch_size,
            mixed_precision=runtime.mixed_precision,
            jit_compile=bool(config.jit_compile),  # resolved by the runtime (auto: the device decides)
            time_input=not runtime.deterministic,
            coordinator=runtime.coordinator,
        )
        loss_scale = self.runner.loss_scale
        self.checkpoints = CheckpointStore(
            checkpoint_dir=self.checkpoint_dir,
            runtime=runtime,
            parts=training_parts(
                model, optimizer, loss_scale.checkpoint() if loss_scale is not None else None
            ),
            keep=config.keep_checkpoints,
            trainer_state=TrainerState(
                trainer=trainer,
                checkpoint_dir=self.checkpoint_dir,
                global_batch_size=global_batch_size,
                steps_per_epoch=steps_per_epoch,
                dataset_version=dataset_version,
                hyperparameters=config.hyperparameters(),
                extra=self.extra_state,
                check_extra=check_resume,
            ),
        )
        self.best_epoch = BestEpoch(
            model=model,
            monitor=self.monitor,
            mode=self.monitor_mode,
            restore_best=config.restore_best,
            write_dir=self.checkpoints.write_dir,
            checkpoint_dir=self.checkpoint_dir,
            io=self.checkpoints.io,
        )
        self.replicas = Replicas(runtime, stop)
        self.stopping = Stopping(config, stop)
        self.progress = Progress(
            config,
            steps_per_epoch,
            metric=metric,
            summaries=self.summaries,
            input_timed=self.runner.time_input,
        )

    @property
    def best(self) -> dict[str, Any] | None:
        """The best epoch so far: epoch, step, value of the monitor, and its history row."""
        return self.best_epoch.best

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint this process wrote or resumed from."""
        return self.checkpoints.last_saved_step

    # -- evaluation and state ------------------------------------------------------------

    def evaluate(self) -> tuple[float, float]:
        """Loss and metric over the validation split."""
        totals = self.runner.evaluate(self.val_dataset)
        return ratio(totals["loss_sum"], totals["examples"]), ratio(totals["correct"], totals["count"])

    def state(self) -> dict[str, Any]:
        """The trainer state stored with each checkpoint."""
        return self.checkpoints.trainer_state.document(
            step=self.step,
            epoch=self.epoch,
            batch_in_epoch=self.batch_in_epoch,
            epoch_sums=self.sums,
            history=self.history,
            best=self.best,
            stopped_early=self.stopping.stopped_early,
            wall_time_s=self.progress.wall_time(),
        )

    def save(self, reason: str) -> str | None:
        """Write the checkpoint of the current step, then the state file; once per step.

        Raises:
            TrainingDiverged: a weight is no longer finite; nothing is written.
        """
        if self.checkpoints.already_saved(self.step, reason):
            return None
        check_weights(
            self.runner.variables_finite(), step=self.step, last_checkpoint=self.checkpoints.last_finite()
        )
        return self.checkpoints.save(
            step=self.step,
            epoch=self.epoch,
            batch_in_epoch=self.batch_in_epoch,
            state=self.state(),
            reason=reason,
        )

    def restore(self, at_step: int | None = None) -> bool:
        """Restore the newest usable checkpoint from CHECKPOINT_DIR (that of ``at_step`` when given); False when
        there is none."""
        restored = self.checkpoints.restore(at_step)
        if restored is None:
            return False
        state = restored.state
        self.step, self.epoch, self.batch_in_epoch = restored.step, restored.epoch, restored.batch_in_epoch
        self.sums = {k: float(state["epoch_sums"].get(k, 0.0)) for k in SUM_KEYS}
        self.history = list(state.get("history", []))
        self.best_epoch.best = state.get("best")
        self.stopping.stopped_early = state.get("stopped_early")
        self.progress.resumed(float(state.get("wall_time_s", 0.0)))
        self.resumed_from_step = self.step
        self.learning_rate.reapply()
        log.info(
            "resumed from %s: step %d, epoch %d, batch %d of %d in that epoch; learning rate %.6g",
            Path(restored.path).name,
            self.step,
            self.epoch + 1,
            self.batch_in_epoch,
            self.steps_per_epoch,
            self.learning_rate.current(),
        )
        return True

    def write_history(self, path: Path) -> None:
        """history.csv: one row per epoch, earlier processes of the run included (the chief only)."""
        if self.is_chief:
            write_history(path, self.metric, self.history)

    # -- the loop ----------------------------------------------------------------------

    def _finished(self) -> bool:
        return self.stopping.finished(step=self.step, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch)

    def _close_epoch(self, partial: bool) -> None:
        val_loss, val_metric = self.evaluate()
        row = {
            "epoch": self.epoch + 1,
            "step": self.step,
            "loss": ratio(self.sums["loss_sum"], self.sums["examples"]),
            self.metric: ratio(self.sums["correct"], self.sums["count"]),
            "val_loss": val_loss,
            f"val_{self.metric}": val_metric,
            "learning_rate": self.learning_rate.current(),
            "wall_time_s": round(self.progress.wall_time(), 3),
        }
        if partial:
            row["partial"] = True
        self.history.append(row)
        self.best_epoch.offer(row)
        if not partial:
            self.epoch += 1
            self.batch_in_epoch = 0
            self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        self.progress.log_epoch(row, best=self.monitor if self.best_epoch.is_best(self.step) else None)
        if not partial:
            self.stopping.after_epoch(row, self.best)

    def _sync(self) -> Counters:
        """Wait for the queued steps, account for them and check that they stayed finite."""
        counters = self.runner.read()
        self.progress.account(counters)
        before = self.step
        self.step += counters.steps
        self.batch_in_epoch += counters.steps
        self.sums = counters.epoch_sums
        check_steps(
            counters,
            before=before,
            epoch=self.epoch,
            last_checkpoint=self.checkpoints.last_finite(),
            rerun=self.checkpoints.rerun_outcome(),
            learning_rate_flag=learning_rate_flag(self.config),
        )
        if self.progress.due(self.step):
            self.progress.log_step(
                step=self.step,
                epoch=self.epoch,
                batch_in_epoch=self.batch_in_epoch,
                counters=counters,
                epoch_sums=self.sums,
                learning_rate=self.learning_rate.current(),
            )
            self.runner.reset_window()
        return counters

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
                next_multiple(planned, config.checkpoint_every_steps),
                next_multiple(planned, self.on_step_every),
            )
            # unset before configure() resolved it (a config built by hand): one step per call, as on a CPU
            steps = int(min(config.steps_per_execution or 1, target - planned))
            self.progress.start_segment()
            self.runner.run(iterator, steps)
            planned += steps
            # Several workers see SIGTERM only at the points they all reach (the agreement below).
            local_stop = self.stop.requested and not self.runtime.multi_worker
            if planned < target and planned < self.progress.next_log and not local_stop:
                continue
            self._sync()
            ended = self.step < planned or self.batch_in_epoch >= self.steps_per_epoch
            closing = ended or self.stopping.max_reached(self.step)
            if self.replicas.stop_agreed(self.step):
                self.save("SIGTERM" + (", epoch not yet closed" if closing else ""))
                raise Preempted()
            if not ended and self.stopping.stop_file_seen(
                step=self.step, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch
            ):
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
            if self.on_step is not None and self.on_step_every and self.step % self.on_step_every == 0:
                self.on_step(self.step)
            planned = self.step

    def run(self, history_path: Path | None = None) -> LoopResult:
        """Train until ``--epochs``, ``--max-steps`` or early stopping; raise ``Preempted`` after SIGTERM.

        On return the model holds the weights to export: the best epoch's with
        ``--restore-best`` (the default), else the last ones; ``LoopResult.exported`` is that
        epoch's history row.
        """
        self.restore()
        if self.runtime.multi_worker:
            self.replicas.agree_on_resume(self.step, self.checkpoints.holds, self.restore)
        pending = epoch_close_pending(
            step=self.step,
            batch_in_epoch=self.batch_in_epoch,
            steps_per_epoch=self.steps_per_epoch,
            history=self.history,
            max_steps=self.config.max_steps,
        )
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
            if self.replicas.stop_agreed(self.step):
                self.save("SIGTERM")
                raise Preempted()
            finished_epoch = self._train_epoch()
            self._close_epoch(partial=not finished_epoch)
            if history_path is not None:
                self.write_history(history_path)
            reason = (
                "early stopping"
                if self.stopping.stopped_early
                else "end of epoch"
                if finished_epoch
                else "--max-steps reached"
            )
            self.save(reason)
            if self.on_step is not None and self.on_step_every and self.step % self.on_step_every == 0:
                self.on_step(self.step)  # a hook step that ends an epoch runs after the close
        if history_path is not None:
            self.write_history(history_path)
        self.summaries.close()
        restored = self.best_epoch.restore_weights(self.history)
        throughput = self.progress.throughput.report()
        return LoopResult(
            history=self.history,
            steps=self.step,
            resumed_from_step=self.resumed_from_step,
            wall_time_s=round(self.progress.wall_time(), 3),
            examples_per_s=throughput["examples_per_s"],
            extra_state=self.extra_state,
            monitor=self.monitor,
            monitor_mode=self.monitor_mode,
            best=self.best,
            exported=self.best_epoch.exported_row(restored, self.history),
            restored_best=restored,
            stopped_early=self.stopping.stopped_early,
            throughput=throughput,
        )
