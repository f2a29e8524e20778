"""A Keras callback that gives ``model.fit`` the pod contract: reports, preemption, resume mid-epoch, early stop.

::

    from kubetrain_contract.keras_callback import KubetrainCallback

    kt = KubetrainCallback(monitor="val_accuracy")
    model.fit(kt.resumable(train, val), validation_data=val, epochs=10, callbacks=[kt])
    raise SystemExit(kt.exit_code)

What it does, by the contract of :mod:`kubetrain_contract.kit`:

* every epoch (and every ``report_every_steps`` steps) a line in OUTPUT_DIR/metrics.jsonl, which a
  sweep's median, ASHA and Hyperband rules read while the trial runs;
* a checkpoint in CHECKPOINT_DIR every ``save_every_steps`` steps and at each epoch's end: the weights
  with the optimizer's state (``model.save_weights``), the epoch, the step within it and the history,
  written to a temporary folder and renamed, so that a checkpoint is whole or absent;
* on SIGTERM (preemption, eviction), a checkpoint at the next batch's end, then exit
  :data:`~kubetrain_contract.kit.EXIT_PREEMPTED` (75), which the operator resumes from;
* on start, the newest whole checkpoint restored, and training continued at its step, not at the
  epoch's start: the callback trains the rest of the interrupted epoch on the batches the checkpoint
  had not seen (``train_on_batch`` over the dataset given to :meth:`KubetrainCallback.resumable`,
  then ``evaluate`` on its validation data for the epoch's report), and ``fit`` goes on from the next
  epoch, so a preempted run takes as many optimizer steps as an uninterrupted one. (Skipping inside
  the dataset instead would leave it of unknown length, and Keras then counts one more optimizer
  step at the end of every epoch.) Keras' progress bar and other callbacks do not see those batches;
* the stop file honoured: training stops at the next batch's end, the outputs are written and
  :attr:`KubetrainCallback.exit_code` is :data:`~kubetrain_contract.kit.EXIT_STOPPED` (79);
* at the end, OUTPUT_DIR/history.csv (every epoch, those before a resume too) and metrics.json with
  the monitored metric, its best epoch and the last.

Keras' own ``BackupAndRestore`` resumes at the last epoch's start at best and reports nothing; this
callback keeps its idea (weights with optimizer state and a small metadata file, restored in
``on_train_begin`` by setting the model's initial epoch) and adds the step, the reports and the signals.
Keras is imported by this module only: :mod:`kubetrain_contract.kit` stays standard library.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import keras

from kubetrain_contract import kit

log = logging.getLogger("kubetrain.keras")
WEIGHTS = "model.weights.h5"
STATE = "state.json"
FOLDER = "keras"


class KubetrainCallback(keras.callbacks.Callback):
    """The pod contract for ``model.fit`` (module docstring).

    :param monitor: the validation metric that picks the best epoch (``val_loss``, ``val_accuracy``, ...).
    :param mode: ``min`` or ``max``; by default ``max`` for accuracy-like names, ``min`` otherwise.
    :param save_every_steps: a checkpoint every so many optimizer steps (0: at epoch ends and on SIGTERM).
    :param report_every_steps: a metrics.jsonl line of the training metrics every so many steps (0: none).
    :param keep: how many checkpoints to keep.
    :param trainer: the name metrics.json gives the trainer.
    :param details: more keys for metrics.json (``task``, ``classes``: the report's Task row, a classifier's
        class names).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str | None = None,
        *,
        save_every_steps: int = 100,
        report_every_steps: int = 0,
        keep: int = 2,
        trainer: str = "keras",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        mode = mode or ("max" if any(w in monitor for w in ("acc", "auc", "precision", "recall")) else "min")
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode!r} is not valid: expected 'min' or 'max'")
        for name, value in (
            ("save_every_steps", save_every_steps),
            ("report_every_steps", report_every_steps),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} is not valid: expected an integer >= 0")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} is not valid: expected an integer >= 1")
        self.monitor, self.mode, self.trainer = monitor, mode, trainer
        self.save_every_steps, self.report_every_steps, self.keep = save_every_steps, report_every_steps, keep
        self.details = dict(details or {})
        self.exit_code = kit.EXIT_OK
        self.history: list[dict[str, Any]] = []
        self.resumed_at: tuple[int, int] | None = None  # (epoch, step within it) of the restored checkpoint
        self.resumed_from_step = 0  # the optimizer step of the restored checkpoint; 0: it started fresh
        self._epoch = 0
        self._in_epoch = 0  # batches of the current epoch done, those before a resume too
        self._train: Any = None
        self._validation: Any = None
        self._guard: kit.PreemptionGuard | None = None

    # -- the dataset ------------------------------------------------------------------------

    def resumable(self, dataset: Any, validation_data: Any = None) -> Any:
        """Remember the training data (a ``tf.data.Dataset`` of batches, the one given to ``fit``) and the
        validation data, to finish an epoch that a checkpoint interrupted; returns ``dataset`` unchanged."""
        import tensorflow as tf

        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"resumable() takes a tf.data.Dataset of batches, got {type(dataset).__name__}: "
                "wrap arrays with tf.data.Dataset.from_tensor_slices(...).batch(n)"
            )
        self._train, self._validation = dataset, validation_data
        return dataset

    # -- checkpoints ------------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        return kit.checkpoint_dir() / FOLDER

    def _checkpoints(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = [p for p in self.folder.iterdir() if p.name.startswith("step-") and (p / STATE).is_file()]
        return sorted(found, key=lambda p: p.name)

    def save(self) -> Path:
        """Write a checkpoint of the weights, the optimizer and where training is; returns its folder."""
        step = int(self.model.optimizer.iterations)
        target = self.folder / f"step-{step:010d}"
        tmp = self.folder / f".tmp-step-{step:010d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_weights(str(tmp / WEIGHTS))
        state = {"epoch": self._epoch, "in_epoch": self._in_epoch, "step": step, "history": self.history}
        (tmp / STATE).write_text(json.dumps(state))
        for path in (tmp / WEIGHTS, tmp / STATE):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        for old in self._checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info(
            "checkpoint at step %d (epoch %d, batch %d): %s", step, self._epoch + 1, self._in_epoch, target
        )
        return target

    def _restore(self) -> bool:
        """Load the newest checkpoint that loads whole; a damaged one is set aside, never trusted."""
        for path in reversed(self._checkpoints()):
            try:
                state = json.loads((path / STATE).read_text())
                if self.model.optimizer is not None and not self.model.optimizer.built:
                    self.model.optimizer.build(self.model.trainable_variables)
                self.model.load_weights(str(path / WEIGHTS))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("checkpoint %s cannot be loaded (%s): trying an older one", path, exc)
                os.replace(path, path.with_name(f".damaged-{path.name}"))
                continue
            self._epoch, self._in_epoch = int(state["epoch"]), int(state["in_epoch"])
            self.history = list(state.get("history") or [])
            self.resumed_at = (self._epoch, self._in_epoch)
            self.resumed_from_step = int(state["step"])
            log.info(
                "resumed from %s: epoch %d, batch %d, step %d",
                path,
                self._epoch + 1,
                self._in_epoch,
                state["step"],
            )
            return True
        return False

    # -- Keras' hooks -----------------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._guard = kit.PreemptionGuard()
        if not self._restore():
            return
        self._rewrite_reports()
        if self._in_epoch:
            if self._train is None:
                raise ValueError(
                    "the checkpoint was taken mid-epoch, but the training data was not passed through "
                    "resumable(): fit would train that epoch's first batches twice"
                )
            self._finish_epoch()
        # as BackupAndRestore does: fit starts at this epoch (the next one, when the interrupted one was finished)
        self.model._initial_epoch = self._epoch

    def _finish_epoch(self) -> None:
        """Train the interrupted epoch's remaining batches, validate, and close the epoch as fit would."""
        epoch, done = self._epoch, self._in_epoch
        self.model.reset_metrics()
        logs: dict[str, Any] = {}
        for x, y in self._train.skip(done):
            logs = self.model.train_on_batch(x, y, return_dict=True)
            self._in_epoch += 1
            self._after_batch(logs)
            if self.model.stop_training:
                break
        if self._validation is not None:
            scores = self.model.evaluate(self._validation, return_dict=True, verbose=0)
            logs.update({f"val_{k}": v for k, v in scores.items()})
        self.on_epoch_end(epoch, logs)

    def _rewrite_reports(self) -> None:
        """A retried pod starts with an empty OUTPUT_DIR: its metrics.jsonl gets the earlier epochs' reports
        back, so a stopping rule counts every report of the run."""
        path = kit.output_dir() / kit.METRICS_JSONL
        lines = "".join(json.dumps(row) + "\n" for row in self.history)
        kit._write_atomic(path, lines.encode())

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch, self._in_epoch = epoch, 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._in_epoch = (
            batch + 1
        )  # Keras' index of the epoch's last batch run (steps_per_execution may skip)
        self._after_batch(logs)

    def _after_batch(self, logs: dict | None) -> None:
        step = int(self.model.optimizer.iterations)
        if self._guard is not None and self._guard.requested:
            self.save()
            log.warning("SIGTERM: checkpoint written at step %d, exiting %d", step, kit.EXIT_PREEMPTED)
            raise SystemExit(kit.EXIT_PREEMPTED)
        if self.report_every_steps and step % self.report_every_steps == 0:
            kit.report(step=step, **{k: float(v) for k, v in (logs or {}).items()})
        if self.save_every_steps and step % self.save_every_steps == 0:
            self.save()
        if kit.should_stop():
            self.model.stop_training = True
            self.exit_code = kit.EXIT_STOPPED

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.monitor not in (logs or {}):
            raise ValueError(
                f"monitor {self.monitor!r} is not among the epoch's metrics {sorted(logs or {})}: "
                "pass validation_data to fit, or monitor one of those"
            )
        row = {"epoch": epoch + 1, "step": int(self.model.optimizer.iterations)}
        row.update({k: float(v) for k, v in (logs or {}).items()})
        self.history.append(kit.report(**row))
        self._epoch, self._in_epoch = epoch + 1, 0
        self.save()
        if kit.should_stop():
            self.model.stop_training = True
            self.exit_code = kit.EXIT_STOPPED

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._guard is not None:
            self._guard.restore()
        epochs = [r for r in self.history if self.monitor in r]
        if not self.history:
            return
        pick = max if self.mode == "max" else min
        best = pick(epochs, key=lambda r: r[self.monitor]) if epochs else None
        columns = [{k: v for k, v in r.items() if k != "time"} for r in self.history]
        kit.write_history(columns)
        kit.write_metrics(
            monitor=self.monitor,
            mode=self.mode,
            final=columns[-1],
            best={k: v for k, v in best.items() if k != "time"} if best else None,
            trainer=self.trainer,
            epochs=len(self.history),
            stopped_early=self.exit_code == kit.EXIT_STOPPED,
            # the run record's "resumed from step", said outright (the sync passes read it from the folder names)
            resumed_from_step=self.resumed_from_step,
            **self.details,
        )
