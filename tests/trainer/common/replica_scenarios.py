"""Training-loop scenarios on two logical CPU devices (MirroredStrategy), one per process.

Logical devices must be set before TensorFlow initialises, so the scenarios run in a
fresh interpreter: ``python tests/trainer/common/replica_scenarios.py DIR SCENARIO...``
prints one JSON object with each scenario's result (or its error) under its name. Each global batch of 8 is split in order: examples 0-3 go to
replica 0, examples 4-7 to replica 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE)]

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import trainer_loop_support as tiny  # noqa: E402

from trainer.common.contract import TrainingDiverged  # noqa: E402
from trainer.common.runtime import Runtime  # noqa: E402

# One strategy for every scenario: a second MirroredStrategy in the same process reuses the
# first one's collective instance keys and its all-reduces then meet the wrong partners.
STRATEGY = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])


def mirrored(mixed_precision: bool) -> Runtime:
    keras.mixed_precision.set_dtype_policy("mixed_float16" if mixed_precision else "float32")
    return Runtime(strategy=STRATEGY, devices=[cpu.name], replicas=2, mixed_precision=mixed_precision)


def replica_1(batch_index: int, scale: float):
    """Multiply the features of replica 1's half of global batch ``batch_index`` of epoch 0."""

    def poison(epoch: int, batch: int, x: np.ndarray) -> np.ndarray:
        if (epoch, batch) == (0, batch_index):
            x[4:] *= scale
        return x

    return poison


def overflow(root: Path) -> dict:
    """Step 1: replica 1's float16 gradients overflow (its inputs are 300x larger); replica 0's do not."""
    loop = tiny.make_loop(root, runtime=mirrored(True), poison=replica_1(0, 300.0), max_steps=1, epochs=1)
    before = tiny.weights(loop)
    loop.run()
    after = tiny.weights(loop)
    scale = loop.runner.loss_scale.scale.numpy()
    return {
        "weights_finite": all(bool(np.isfinite(w).all()) for w in after),
        "update_skipped": all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)),
        "loss_scale": float(scale),
        "optimizer_iterations": int(loop.optimizer.iterations.numpy()),
    }


def nan_loss(root: Path) -> dict:
    """Step 3: replica 1's inputs are infinite, its float16 forward pass gives NaN logits and a NaN loss."""
    loop = tiny.make_loop(
        root,
        runtime=mirrored(True),
        poison=replica_1(2, np.inf),
        epochs=1,
        checkpoint_every_steps=2,
        model=lambda: tiny.build_model(activation=None),
    )
    try:
        loop.run()
    except TrainingDiverged as exc:
        error = str(exc)
    else:
        error = None
    latest = tf.train.latest_checkpoint(str(root / "ckpt"))
    reader = tf.train.load_checkpoint(latest)
    finite = all(
        bool(np.isfinite(reader.get_tensor(n)).all())
        for n in reader.get_variable_to_shape_map()
        if np.asarray(reader.get_tensor(n)).dtype.kind == "f"
    )
    return {"error": error, "latest": Path(latest).name, "latest_finite": finite}


def one_sgd_step(root: Path, clip: float | None) -> dict:
    """One SGD step (learning rate 1) of a linear softmax model from zero weights; both halves of the
    batch are the same examples, so each replica's gradient is half the global one."""
    x = np.array(
        [[1.0, 2.0, 0.0, -1.0], [0.5, -1.0, 1.0, 2.0], [-2.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]] * 2,
        np.float32,
    )
    y = np.array([0, 1, 1, 0] * 2, np.int32)
    data = (np.tile(x, (8, 1)), np.tile(y, 8), x, y)

    def model() -> keras.Model:
        inputs = keras.Input((tiny.FEATURES,))
        outputs = keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros", activation="softmax")(
            inputs
        )
        return keras.Model(inputs, outputs)

    loop = tiny.make_loop(
        root,
        runtime=mirrored(False),
        data=data,
        model=model,
        max_steps=1,
        epochs=1,
        shuffle=False,
        optimizer=lambda: keras.optimizers.SGD(1.0, global_clipnorm=clip),
    )
    loop.run()
    delta = loop.model.get_weights()[0]
    # The gradient of the mean cross-entropy at zero weights: X^T (p - onehot(y)) / n with p = 1/2.
    expected = x.T @ (0.5 - np.eye(2, dtype=np.float32)[y]) / len(y)
    return {"delta": delta.tolist(), "gradient": expected.tolist()}


SCENARIOS = {
    "overflow": overflow,
    "nan_loss": nan_loss,
    "sgd": lambda root: one_sgd_step(root, None),
    "clip": lambda root: one_sgd_step(root, 0.05),
}

if __name__ == "__main__":
    results = {}
    for name in sys.argv[2:]:
        try:
            results[name] = SCENARIOS[name](Path(sys.argv[1]) / name)
        except Exception as exc:  # reported per scenario, so one failure does not hide the others
            results[name] = {"failed": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
