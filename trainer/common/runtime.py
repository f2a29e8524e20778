"""Device set-up: the distribution strategy, mixed precision and the start-up device line."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from trainer.common.config import TrainerConfig
from trainer.common.contract import UsageError

log = logging.getLogger("kubetrain.trainer")


@dataclass
class Runtime:
    """What the trainer runs on.

    Attributes:
        strategy: MirroredStrategy over several devices, else the default strategy.
        devices: the physical devices doing the work, e.g. ``/physical_device:GPU:0``.
        replicas: how many model replicas train in lock step.
        mixed_precision: whether the mixed_float16 policy is active; the training loop then
            scales the loss dynamically (float16 gradients underflow).
        deterministic: whether TensorFlow's ops run deterministically.
    """

    strategy: tf.distribute.Strategy
    devices: list[str]
    replicas: int
    mixed_precision: bool
    deterministic: bool = False


def configure(config: TrainerConfig) -> Runtime:
    """Pick devices and strategy, seed every generator and set the precision policy.

    Must run before any other TensorFlow work: logical devices cannot change afterwards.
    """
    cpus = tf.config.list_physical_devices("CPU")
    if config.virtual_cpus:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(config.virtual_cpus)]
        )
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        # Without memory growth TensorFlow takes all GPU memory up front, which hides the
        # real footprint from whoever sizes the pod's requests.
        tf.config.experimental.set_memory_growth(gpu, True)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        # Ops without a deterministic kernel then raise instead of running; tf.data keeps its
        # (already deterministic) element order.
        tf.config.experimental.enable_op_determinism()

    if len(gpus) > 1:
        strategy: tf.distribute.Strategy = tf.distribute.MirroredStrategy()
        devices = [d.name for d in gpus]
    elif config.virtual_cpus > 1:
        logical = [d.name for d in tf.config.list_logical_devices("CPU")]
        strategy = tf.distribute.MirroredStrategy(devices=logical)
        devices = [d.name for d in cpus]
    else:
        strategy = tf.distribute.get_strategy()
        devices = [d.name for d in (gpus or cpus)]
    replicas = strategy.num_replicas_in_sync

    if config.batch_size % replicas:
        raise UsageError(
            f"--batch-size must be a multiple of the {replicas} replicas in sync, got {config.batch_size}"
        )
    if config.mixed_precision:
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        if not gpus:
            log.warning("mixed precision on CPU is supported but slow: float16 pays off on GPUs")
    log.info(
        "devices: %s; strategy %s with %d replica(s)%s; precision %s%s",
        ", ".join(devices),
        type(strategy).__name__,
        replicas,
        f" on {', '.join(strategy.extended.worker_devices)}" if replicas > 1 else "",
        keras.mixed_precision.dtype_policy().name,
        "; deterministic ops" if config.deterministic else "",
    )
    return Runtime(strategy=strategy, devices=devices, replicas=replicas, mixed_precision=config.mixed_precision,
                   deterministic=config.deterministic)


def to_float(value: Any) -> float:
    """A Python float from a tensor, variable or number."""
    return float(keras.ops.convert_to_numpy(value))
