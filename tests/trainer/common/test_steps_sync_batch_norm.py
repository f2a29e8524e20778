"""Over several replicas the classifier's batch norm uses the global batch's statistics."""

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
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.model import build_model

config = ClassifierConfig(data_dir="d", checkpoint_dir="c", output_dir="o", image_size=16)
out = {}
for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = build_model(config, 3, steps_per_epoch=10)
    x = tf.constant(np.random.default_rng(0).random((8, 16, 16, config.channels), dtype=np.float32) * 255)
    strategy.run(tf.function(lambda images: model(images, training=True)), args=(x,))
    layers = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    out[len(devices)] = [layer.synchronized for layer in layers]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_batch_norm_is_synchronized_only_with_several_replicas():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    synchronized = json.loads(proc.stdout.strip().splitlines()[-1])
    assert synchronized["1"] and not any(synchronized["1"]), synchronized
    assert synchronized["2"] and all(synchronized["2"]), synchronized
