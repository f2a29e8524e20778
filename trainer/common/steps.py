"""The distributed training step, run K steps per call, with every quantity kept on the device.

One training step, on every replica at once:

1. forward and backward pass on the replica's share of the global batch (the only part
   that ``--jit-compile`` hands to XLA); the loss is divided by the *global* batch size,
   so the sum of the replicas' gradients is the gradient of the mean loss;
2. one all-reduce (sum) of the gradients: from here on every replica holds the same
   global gradient;
3. the finite check on that global gradient and on the step's loss. A non-finite value
   on any replica reaches every replica through the sum, so all replicas take the same
   decision; the optimizer update is skipped for the whole step when it fails;
4. loss-scale unscaling (``--precision mixed_float16``), the global norm of the unscaled global
   gradient, and clipping (the optimizer's ``global_clipnorm``, ``clipnorm`` or
   ``clipvalue``, taken over from it: Keras would apply them to each replica's share);
5. the optimizer update.

In parameter-server mode (a ClusterCoordinator) the chief reads the input and schedules each
step, with its batch, on whichever worker is free; the step's variables live on the parameter
servers and the workers update them asynchronously; the bookkeeping variables live there too,
so the chief reads them after ``coordinator.join()``. Evaluation runs on the chief itself.

Keras' ``LossScaleOptimizer`` checks the gradients of replica 0 only, before the
all-reduce, and its optimizers clip before the all-reduce; both are replaced here.

Per-step sums (loss, examples, metric numerator and denominator), the count of steps run,
the non-finite counters and the time spent waiting for input accumulate in variables on
the device; the host reads them only when it logs, checkpoints, samples or closes an
epoch, so the training loop needs no device-to-host copy per step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

log = logging.getLogger("kubetrain.trainer")

SUM_KEYS = ("loss_sum", "examples", "correct", "count")
# The window accumulators add the global gradient norm of the applied steps and their count.
WINDOW_KEYS = (*SUM_KEYS, "grad_norm_sum", "applied_steps")

# compute_fn(model, batch, training) -> per-replica sums: loss_sum (sum of per-example
# losses), examples, correct and count (the metric's numerator and denominator).
ComputeFn = Callable[[keras.Model, Any, bool], dict[str, tf.Tensor]]


class DynamicLossScale:
    """Loss scaling for float16 training, decided on the all-reduced gradient.

    The loss is multiplied by ``scale`` before the backward pass so that small float16
    gradients do not flush to zero. A step whose global gradient is not finite is
    skipped and halves the scale; ``growth_steps`` finite steps in a row double it (the
    rule and defaults of Keras' ``LossScaleOptimizer``).
    """

    def __init__(self, initial: float = 2.0**15, growth_steps: int = 2000) -> None:
        self.growth_steps = growth_steps
        # Every replica computes the same value from the same global gradient.
        self.scale = tf.Variable(
            initial,
            dtype=tf.float32,
            trainable=False,
            name="loss_scale",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.good_steps = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="good_steps",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def checkpoint(self) -> tf.train.Checkpoint:
        """The loss scale's state, for the training checkpoint."""
        return tf.train.Checkpoint(scale=self.scale, good_steps=self.good_steps)

    def update(self, finite: tf.Tensor) -> None:
        """Halve on a non-finite step, double after ``growth_steps`` finite ones (cross-replica context)."""
        grow = tf.logical_and(finite, self.good_steps + 1 >= self.growth_steps)
        self.scale.assign(tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale), self.scale * 0.5))
        self.good_steps.assign(
            tf.where(
                tf.logical_and(finite, tf.logical_not(grow)),
                self.good_steps + 1,
                tf.zeros_like(self.good_steps),
            )
        )


@dataclass(frozen=True)
class Clipping:
    """Gradient clipping applied to the global (all-replica) gradient."""

    global_norm: float | None = None
    norm: float | None = None
    value: float | None = None

    @classmethod
    def take_from(cls, optimizer: keras.optimizers.Optimizer) -> Clipping:
        """Move the optimizer's clipping settings here, so that Keras no longer clips each replica's share."""
        clip = cls(
            global_norm=optimizer.global_clipnorm or None,
            norm=optimizer.clipnorm or None,
            value=optimizer.clipvalue or None,
        )
        optimizer.global_clipnorm = optimizer.clipnorm = optimizer.clipvalue = None
        return clip

    def __call__(self, grads: list[tf.Tensor], global_norm: tf.Tensor) -> list[tf.Tensor]:
        if self.global_norm:
            grads, _ = tf.clip_by_global_norm(grads, self.global_norm, use_norm=global_norm)
        elif self.norm:
            grads = [tf.clip_by_norm(g, self.norm) for g in grads]
        elif self.value:
            grads = [tf.clip_by_value(g, -self.value, self.value) for g in grads]
        return grads

    def describe(self) -> str:
        if self.global_norm:
            return f"global norm {self.global_norm:g}"
        if self.norm:
            return f"per-variable norm {self.norm:g}"
        if self.value:
            return f"value {self.value:g}"
        return "none"


def _keep_optimizer_from_aggregating(optimizer: keras.optimizers.Optimizer) -> None:
    """The step all-reduces the gradients itself; the optimizer must not sum them again.

    Keras' TensorFlow optimizers sum the gradients over the replicas inside ``apply``
    (``_all_reduce_sum_gradients``), before nothing else can look at the sum. The step
    does that sum first, so the optimizer's own becomes the identity. A Keras release
    without this method would double the update on several replicas: the check here
    refuses to start instead, and tests/trainer/common pins the update's size.
    """
    if not callable(getattr(optimizer, "_all_reduce_sum_gradients", None)):
        raise RuntimeError(
            f"keras {keras.__version__}: {type(optimizer).__name__} has no _all_reduce_sum_gradients; the "
            "training step cannot keep it from summing the already all-reduced gradients again"
        )
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


class StepRunner:
    """Builds and runs the training and evaluation functions of one model.

    Args:
        strategy: the distribution strategy the model was built under.
        model: the Keras model.
        optimizer: its optimizer (built); its clipping settings move to the step.
        compute_fn: per-replica loss and metric sums of one batch.
        global_batch_size: examples per step over all replicas.
        mixed_precision: scale the loss dynamically (float16 compute).
        jit_compile: compile the forward and backward pass with XLA.
        time_input: measure the time spent waiting for input (``tf.timestamp``, which
            TensorFlow refuses to run when op determinism is on).
        coordinator: the ClusterCoordinator in parameter-server mode.
    """

    def __init__(
        self,
        *,
        strategy: tf.distribute.Strategy,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        compute_fn: ComputeFn,
        global_batch_size: int,
        mixed_precision: bool,
        jit_compile: bool = False,
        time_input: bool = True,
        coordinator: Any = None,
    ) -> None:
        self.strategy = strategy
        self.coordinator = coordinator
        # With a coordinator the chief hands each step its batch: there is no input wait to time on the worker.
        time_input = time_input and coordinator is None
        self.time_input = time_input
        self.model = model
        self.optimizer = optimizer
        self.compute_fn = compute_fn
        self.global_batch_size = global_batch_size
        self.jit_compile = jit_compile
        self.clipping = Clipping.take_from(optimizer)
        _keep_optimizer_from_aggregating(optimizer)
        with strategy.scope():
            self.loss_scale = DynamicLossScale() if mixed_precision else None
        # Bookkeeping lives outside the strategy scope: one copy, written in cross-replica context.
        # With parameter servers it lives on them, where the workers' steps can reach it.
        with strategy.scope() if coordinator is not None else contextlib.nullcontext():
            self.epoch_sums = tf.Variable(
                tf.zeros([len(SUM_KEYS)], tf.float64), trainable=False, name="epoch_sums"
            )
            self.window = tf.Variable(
                tf.zeros([len(WINDOW_KEYS)], tf.float64), trainable=False, name="window"
            )
            self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps_run")
            self.nonfinite_loss = tf.Variable(0, dtype=tf.int64, trainable=False, name="nonfinite_loss_steps")
            self.nonfinite_grads = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="nonfinite_gradient_steps"
            )
            self.first_nonfinite = tf.Variable(
                -1, dtype=tf.int64, trainable=False, name="first_nonfinite_step"
            )
            self.input_wait = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="input_wait_s")
        self.eval_sums = tf.Variable(tf.zeros([len(SUM_KEYS)], tf.float64), trainable=False, name="eval_sums")
        self._train_chunk = self._make_train_chunk()
        self._eval_all = self._make_eval()

    # -- building blocks ---------------------------------------------------------------------

    def _gradients(self, batch: Any) -> tuple[dict[str, tf.Tensor], list[tf.Tensor | None]]:
        """Per replica: sums and the (loss-scaled) gradients of the replica's share of the batch."""
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            sums = self.compute_fn(self.model, batch, True)
            loss = tf.cast(sums["loss_sum"], tf.float32) / float(self.global_batch_size)
            if self.loss_scale is not None:
                loss = loss * self.loss_scale.scale
        grads = tape.gradient(loss, variables)
        return {k: tf.cast(sums[k], tf.float32) for k in SUM_KEYS}, grads

    def _make_train_chunk(self) -> Callable[[Any, tf.Tensor], tf.Tensor]:
        strategy, model, optimizer = self.strategy, self.model, self.optimizer
        variables = model.trainable_variables
        loss_scale, clipping = self.loss_scale, self.clipping
        gradients = tf.function(self._gradients, jit_compile=True) if self.jit_compile else self._gradients
        time_input = self.time_input

        def replica_step(batch: Any) -> tuple[dict[str, tf.Tensor], list[tf.Tensor]]:
            sums, grads = gradients(batch)
            present = [i for i, g in enumerate(grads) if g is not None]
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [grads[i] for i in present]
            )
            full: list[tf.Tensor] = [tf.zeros_like(v) for v in variables]
            for i, g in zip(present, reduced, strict=True):
                full[i] = g
            return sums, full

        def replica_apply(grads: Sequence[tf.Tensor]) -> tf.Tensor:
            grads = list(grads)
            if loss_scale is not None:
                grads = [g / loss_scale.scale for g in grads]
            norm = tf.linalg.global_norm(grads)
            optimizer.apply(clipping(grads, norm), variables)
            return norm

        def one_step(batch: Any) -> tf.Tensor:
            per_replica_sums, per_replica_grads = strategy.run(replica_step, args=(batch,))
            sums = [
                strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_sums[k], axis=None) for k in SUM_KEYS
            ]
            # After the all-reduce every replica holds the same gradient: replica 0's copy decides.
            grads = strategy.experimental_local_results(per_replica_grads)[0]
            grads_finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            loss_finite = tf.math.is_finite(sums[0])
            apply = tf.logical_and(grads_finite, loss_finite)

            def update() -> tf.Tensor:
                norm = strategy.run(replica_apply, args=(per_replica_grads,))
                return tf.cast(strategy.experimental_local_results(norm)[0], tf.float64)

            norm = tf.cond(apply, update, lambda: tf.constant(0.0, tf.float64))
            if loss_scale is not None:
                loss_scale.update(grads_finite)
            self.steps.assign_add(1)
            bad = tf.logical_not(apply)
            self.nonfinite_loss.assign_add(tf.cast(tf.logical_not(loss_finite), tf.int64))
            self.nonfinite_grads.assign_add(tf.cast(tf.logical_not(grads_finite), tf.int64))
            self.first_nonfinite.assign(
                tf.where(tf.logical_and(bad, self.first_nonfinite < 0), self.steps, self.first_nonfinite)
            )
            step_sums = tf.cast(tf.stack(sums), tf.float64)
            self.epoch_sums.assign_add(step_sums)
            # A value that exists only once the step (update included) has run on every replica.
            return self.window.assign_add(
                tf.concat([step_sums, tf.stack([norm, tf.cast(apply, tf.float64)])], 0)
            )[0]

        # Parameter-server mode: one step per scheduled call, its batch sent by the chief.
        self._scheduled_step = tf.function(one_step, reduce_retracing=True)

        @tf.function(reduce_retracing=True)
        def train_chunk(iterator: Any, k: tf.Tensor) -> tf.Tensor:
            done = tf.constant(0, tf.int32)
            more = tf.constant(True)
            previous = tf.constant(0.0, tf.float64)
            while done < k and more:
                if time_input:
                    # The wait starts when the previous step has finished on every replica: nothing
                    # orders a replica's compute before the next request for input otherwise, and with
                    # several replicas the clock would run while they still compute.
                    with tf.control_dependencies([previous]):
                        started = tf.timestamp()
                    with tf.control_dependencies([started]):
                        optional = iterator.get_next_as_optional()
                        more = optional.has_value()
                    with tf.control_dependencies([more]):
                        self.input_wait.assign_add(tf.timestamp() - started)
                else:
                    optional = iterator.get_next_as_optional()
                    more = optional.has_value()
                if more:
                    previous = one_step(optional.get_value())
                    done += 1
            return done

        return train_chunk

    def _make_eval(self) -> Callable[[Any], tf.Tensor]:
        strategy, model, compute_fn = self.strategy, self.model, self.compute_fn
        if self.coordinator is not None:

            @tf.function(reduce_retracing=True)
            def eval_on_chief(dataset: Any) -> tf.Tensor:
                # The chief evaluates by itself, reading the variables from the parameter servers.
                self.eval_sums.assign(tf.zeros_like(self.eval_sums))
                for batch in dataset:
                    sums = compute_fn(model, batch, False)
                    self.eval_sums.assign_add(tf.cast(tf.stack([sums[k] for k in SUM_KEYS]), tf.float64))
                return self.eval_sums.read_value()

            return eval_on_chief

        def replica_eval(batch: Any) -> dict[str, tf.Tensor]:
            sums = compute_fn(model, batch, False)
            return {k: tf.cast(sums[k], tf.float32) for k in SUM_KEYS}

        @tf.function(reduce_retracing=True)
        def eval_all(iterator: Any) -> tf.Tensor:
            self.eval_sums.assign(tf.zeros_like(self.eval_sums))
            for batch in iterator:
                per_replica = strategy.run(replica_eval, args=(batch,))
                sums = [
                    strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica[k], axis=None) for k in SUM_KEYS
                ]
                self.eval_sums.assign_add(tf.cast(tf.stack(sums), tf.float64))
            return self.eval_sums.read_value()

        return eval_all

    # -- what the loop calls -----------------------------------------------------------------

    def run(self, iterator: Any, steps: int) -> None:
        """Queue up to ``steps`` training steps (fewer when the iterator ends); does not wait for them."""
        if self.coordinator is not None:
            for _ in range(steps):
                batch = next(iterator, None)
                if batch is None:
                    return
                self.coordinator.schedule(self._scheduled_step, args=(batch,))
            return
        self._train_chunk(iterator, tf.constant(steps, tf.int32))

    def evaluate(self, dataset: tf.data.Dataset) -> dict[str, float]:
        """Sums over the whole (validation) dataset; one device-to-host copy."""
        if self.coordinator is not None:
            values = self._eval_all(dataset).numpy()
            return dict(zip(SUM_KEYS, map(float, values), strict=True))
        options = tf.data.Options()
        # Each worker evaluates its share of every batch (see trainer.common.replicas.shard_by_data).
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        iterator = iter(self.strategy.experimental_distribute_dataset(dataset.with_options(options)))
        values = self._eval_all(iterator).numpy()
        return dict(zip(SUM_KEYS, map(float, values), strict=True))

    def set_epoch_sums(self, sums: dict[str, float]) -> None:
        self.epoch_sums.assign([float(sums.get(k, 0.0)) for k in SUM_KEYS])

    def read(self) -> Counters:
        """Wait for the queued steps and read what they left, resetting the per-read counters."""
        if self.coordinator is not None:
            self.coordinator.join()
        counters = Counters(
            steps=int(self.steps.numpy()),
            nonfinite_loss=int(self.nonfinite_loss.numpy()),
            nonfinite_grads=int(self.nonfinite_grads.numpy()),
            first_nonfinite=int(self.first_nonfinite.numpy()),
            input_wait_s=float(self.input_wait.numpy()),
            epoch_sums=dict(zip(SUM_KEYS, map(float, self.epoch_sums.numpy()), strict=True)),
            window=dict(zip(WINDOW_KEYS, map(float, self.window.numpy()), strict=True)),
            loss_scale=float(self.loss_scale.scale.numpy()) if self.loss_scale is not None else None,
        )
        self.steps.assign(0)
        self.nonfinite_loss.assign(0)
        self.nonfinite_grads.assign(0)
        self.first_nonfinite.assign(-1)
        self.input_wait.assign(0.0)
        return counters

    def reset_window(self) -> None:
        self.window.assign(tf.zeros_like(self.window))

    def variables_finite(self) -> list[str]:
        """Paths of the model's variables that hold a NaN or an infinity (empty when all are finite)."""
        return [
            v.path
            for v in self.model.variables
            if tf.as_dtype(v.dtype).is_floating and not bool(tf.reduce_all(tf.math.is_finite(v.value)))
        ]


@dataclass
class Counters:
    """What the device accumulated since the previous read."""

    steps: int
    nonfinite_loss: int
    nonfinite_grads: int
    first_nonfinite: int  # 1-based index among ``steps`` of the first skipped step, -1 for none
    input_wait_s: float
    epoch_sums: dict[str, float]
    window: dict[str, float]
    loss_scale: float | None
