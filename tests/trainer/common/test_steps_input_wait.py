"""input_wait_fraction over 2 replicas: a slow input reads high, an input that keeps up reads low."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# In a child process: the two virtual CPUs must be set before TensorFlow starts.
PROBE = r"""
import json, sys, time
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from trainer.common.steps import StepRunner

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert strategy.num_replicas_in_sync == 2

def sums(model, batch, training):
    x, y = batch
    losses = keras.losses.sparse_categorical_crossentropy(y, model(x, training=training), from_logits=True)
    n = tf.cast(tf.shape(y)[0], tf.float32)
    return {"loss_sum": tf.reduce_sum(losses), "examples": n, "correct": n, "count": n}

with strategy.scope():
    model = keras.Sequential(
        [keras.Input((512,)), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1024, activation="relu"),
         keras.layers.Dense(10)]
    )
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
runner = StepRunner(strategy=strategy, model=model, optimizer=optimizer, compute_fn=sums, global_batch_size=256,
                    mixed_precision=False)
x = np.random.default_rng(0).random((256 * 8, 512), dtype=np.float32)
y = np.arange(256 * 8) % 10

def slow_batch(x, y):
    # The input pipeline of a slow disk: every batch takes 1 s to arrive, several times a step's compute even
    # on a loaded machine, so that the two readings stay apart however busy the CPUs are.
    return tf.py_function(lambda a: (time.sleep(1.0), a)[1], [x], tf.float32), y

def dataset(slow):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(256, drop_remainder=True).cache().repeat()
    if slow:
        ds = ds.map(slow_batch).map(lambda a, b: (tf.ensure_shape(a, [256, 512]), b))
    return ds.prefetch(8)

out = {}
for name in sys.argv[1].split(","):
    iterator = iter(strategy.experimental_distribute_dataset(dataset(name == "slow")))
    for _ in range(10):  # tracing, the iterators' first fill
        runner.run(iterator, 1)
    runner.read()
    started = time.perf_counter()
    for _ in range(30):
        runner.run(iterator, 1)  # one step per call, as --steps-per-execution 1
    counters = runner.read()
    out[name] = counters.input_wait_s / (time.perf_counter() - started)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_input_wait_fraction_tells_a_slow_input_from_a_fast_one_on_two_replicas():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "fast,slow,fast"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fractions = json.loads(proc.stdout.strip().splitlines()[-1])
    # The slow input makes each step wait about 1 s for its batch; the fast one is always ready. On a loaded
    # machine the fast input's reading rises, as it should: its producer thread waits for a core too, and the
    # steps truly wait for it (0.41 beside two CPU hogs, 0.62 beside two hogs, the Airflow side's suite and a
    # training run). The slow one's stays far above it: that difference is what the figure is for.
    assert fractions["slow"] > 0.7, fractions
    assert fractions["slow"] > fractions["fast"] + 0.3, fractions
