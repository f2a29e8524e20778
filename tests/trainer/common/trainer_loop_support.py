"""A tiny real training problem for the training loop's tests: 4 features, 2 classes.

64 training examples in batches of 8 (8 steps per epoch), 32 validation examples. The
training batches come from a Python generator, so a test can act when the loop asks for
a given batch (``on_batch``) and can poison one (``poison``) without touching the loop.
``flip_validation`` gives the validation examples the opposite labels of the rule the
training examples follow: the better the model learns, the lower its validation
accuracy, so the best epoch is an early one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer.common.config import TrainerConfig
from trainer.common.loop import TrainingLoop
from trainer.common.runtime import Runtime
from trainer.common.signals import StopRequest

FEATURES = 4
BATCH = 8
TRAIN = 64
VAL = 32
STEPS_PER_EPOCH = TRAIN // BATCH


def examples(
    seed: int = 0, flip_validation: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(TRAIN + VAL, FEATURES)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
    x_val, y_val = x[TRAIN:], y[TRAIN:]
    if flip_validation:
        y_val = 1 - y_val
    return x[:TRAIN], y[:TRAIN], x_val, y_val


def compute_fn(model: keras.Model, batch: Any, training: bool) -> dict[str, tf.Tensor]:
    x, y = batch
    probs = model(x, training=training)
    losses = keras.losses.sparse_categorical_crossentropy(y, probs)
    predicted = tf.argmax(probs, axis=-1, output_type=y.dtype)
    n = tf.cast(tf.shape(y)[0], tf.float32)
    return {
        "loss_sum": tf.reduce_sum(tf.cast(losses, tf.float32)),
        "examples": n,
        "correct": tf.reduce_sum(tf.cast(tf.equal(predicted, y), tf.float32)),
        "count": n,
    }


def build_model(hidden: int = 8, activation: str | None = "relu") -> keras.Model:
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(hidden, activation=activation)(inputs)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs)


def default_runtime() -> Runtime:
    return Runtime(
        strategy=tf.distribute.get_strategy(),
        devices=["/physical_device:CPU:0"],
        replicas=1,
        mixed_precision=False,
    )


class StopAtStep(StopRequest):
    """SIGTERM as if it arrived while the loop ran global step ``step`` (checked as the loop checks SIGTERM)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.at = step
        self.loop: TrainingLoop | None = None

    @property
    def requested(self) -> bool:
        if self.received_at is None and self.loop is not None and self.loop.step >= self.at:
            self.trigger()
        return self.received_at is not None


def make_loop(
    root: Path,
    *,
    stop: StopRequest | None = None,
    runtime: Runtime | None = None,
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    poison: Callable[[int, int, np.ndarray], np.ndarray] | None = None,
    optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
    model: Callable[[], keras.Model] | None = None,
    batch: int = BATCH,
    shuffle: bool = True,
    loop_args: dict[str, Any] | None = None,
    **config: Any,
) -> TrainingLoop:
    """A TrainingLoop on the tiny problem, checkpointing to root/ckpt and writing to root/out."""
    runtime = runtime or default_runtime()
    x, y, x_val, y_val = data if data is not None else examples()
    settings = {
        "epochs": 2,
        "steps_per_execution": 1,
        "batch_size": batch,
        "checkpoint_every_steps": 0,
        "log_every_steps": 1,
        **config,
    }
    cfg = TrainerConfig(
        data_dir=str(root), checkpoint_dir=str(root / "ckpt"), output_dir=str(root / "out"), **settings
    )
    keras.utils.set_random_seed(7)
    with runtime.strategy.scope():
        net = (model or build_model)()
        opt = (optimizer or (lambda: keras.optimizers.Adam(0.01)))()

    def train_dataset(epoch: int, skip: int) -> tf.data.Dataset:
        order = np.random.default_rng([11, epoch]).permutation(len(x)) if shuffle else np.arange(len(x))
        steps = len(x) // batch

        def batches():
            for b in range(skip, steps):
                index = order[b * batch : (b + 1) * batch]
                if on_batch is not None:
                    on_batch(epoch, b)
                xb = x[index]
                if poison is not None:
                    xb = poison(epoch, b, xb.copy())
                yield xb, y[index]

        return tf.data.Dataset.from_generator(
            batches,
            output_signature=(
                tf.TensorSpec((batch, FEATURES), tf.float32),
                tf.TensorSpec((batch,), tf.int32),
            ),
        )

    val = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch)
    loop = TrainingLoop(
        trainer="tiny",
        config=cfg,
        runtime=runtime,
        model=net,
        optimizer=opt,
        compute_fn=compute_fn,
        train_dataset_fn=train_dataset,
        val_dataset=val,
        steps_per_epoch=len(x) // batch,
        global_batch_size=batch,
        stop=stop or StopRequest(),
        **(loop_args or {}),
    )
    if isinstance(stop, StopAtStep):
        stop.loop = loop
    return loop


def checkpoint_state(path: str | Path) -> dict[str, Any]:
    """The trainer state stored inside one checkpoint (not the JSON mirror of the newest)."""
    import json

    reader = tf.train.load_checkpoint(str(path))
    return json.loads(reader.get_tensor("trainer_state/.ATTRIBUTES/VARIABLE_VALUE").decode("utf-8"))


def weights(loop: TrainingLoop) -> list[np.ndarray]:
    return [np.array(v) for v in loop.model.get_weights()]
