"""Device set-up: the distribution strategy, mixed precision and the start-up device line.

Strategies (``--strategy``, trainer/README.md "Several workers"): MirroredStrategy over the
pod's GPUs (or ``--virtual-cpus``); MultiWorkerMirroredStrategy over the pods that TF_CONFIG
names (``trainer.common.cluster``), its collectives checked by one all-reduce at start-up;
ParameterServerStrategy with a ClusterCoordinator on the chief, while worker and ps replicas
only serve (:func:`serve`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from trainer.common.cluster import ClusterInfo, placement
from trainer.common.config import TrainerConfig
from trainer.common.contract import UsageError
from trainer.common.signals import StopRequest

log = logging.getLogger("kubetrain.trainer")
# TensorFlow's class names differ from the public ones (MultiWorkerMirroredStrategy is a CollectiveAllReduceStrategy).
CHIEF_IO_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"
STRATEGY_NAMES = {
    "multi_worker": "MultiWorkerMirroredStrategy",
    "parameter_server": "ParameterServerStrategy",
}


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
        cluster: this process's place in a multi-worker job (a single process by default).
        mode: ``mirrored``, ``multi_worker`` or ``parameter_server``.
        coordinator: the ClusterCoordinator in parameter-server mode.
    """

    strategy: tf.distribute.Strategy
    devices: list[str]
    replicas: int
    mixed_precision: bool
    deterministic: bool = False
    cluster: ClusterInfo = field(default_factory=lambda: ClusterInfo(None))
    mode: str = "mirrored"
    coordinator: Any = None

    @property
    def is_chief(self) -> bool:
        """Whether this process writes CHECKPOINT_DIR and OUTPUT_DIR."""
        return self.cluster.is_chief

    @property
    def io_device(self) -> str | None:
        """Where checkpoint and SavedModel files are read and written, when not where the variables live.

        In parameter-server mode the variables live on the ps replicas, which TensorFlow would
        have write (and merge) their shards on their own disks; every replica has a disk of
        its own, so all the I/O goes through the chief, which alone owns CHECKPOINT_DIR and
        OUTPUT_DIR. None: each variable's own device (one process, or mirrored replicas).
        """
        return CHIEF_IO_DEVICE if self.coordinator is not None else None

    @property
    def multi_worker(self) -> bool:
        """Several processes train in lock step: decisions must be taken together."""
        return self.mode == "multi_worker" and self.cluster.distributed

    @property
    def workers(self) -> int:
        return self.cluster.workers


def serve(cluster: ClusterInfo, stop: StopRequest) -> None:
    """A worker or ps replica in parameter-server mode: serve the coordinator until SIGTERM.

    The coordinator (the chief) sends the steps; the job's engine stops these replicas once
    the chief has finished (TFJob's success policy, the Indexed Job's successPolicy).
    """
    os.environ["TF_CONFIG"] = json.dumps(cluster.config)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=cluster.task_type,
        task_index=cluster.task_index,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    keep_sigterm_handler()
    log.info(
        "parameter-server mode: %s serves at %s until the chief has finished",
        cluster.describe(),
        server.target,
    )
    while not stop.requested:
        time.sleep(0.5)
    log.info("stopping: the job is over")


def configure(config: TrainerConfig) -> Runtime:
    """Pick devices and strategy, seed every generator and set the precision policy.

    Must run before any other TensorFlow work: logical devices cannot change afterwards.
    """
    cluster, mode = placement(config.strategy)
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
    coordinator = None
    if mode in ("multi_worker", "parameter_server") and cluster.config is not None:
        # TensorFlow's resolver reads TF_CONFIG; the strategy must exist before other TensorFlow work.
        os.environ["TF_CONFIG"] = json.dumps(cluster.config)
    if mode == "multi_worker":
        strategy: tf.distribute.Strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver()
        )
    elif mode == "parameter_server":
        strategy = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver()
        )
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        # Ops without a deterministic kernel then raise instead of running; tf.data keeps its
        # (already deterministic) element order.
        tf.config.experimental.enable_op_determinism()

    if mode != "mirrored":
        devices = [d.name for d in (gpus or cpus)]
    elif len(gpus) > 1:
        strategy = tf.distribute.MirroredStrategy()
        devices = [d.name for d in gpus]
    elif config.virtual_cpus > 1:
        logical = [d.name for d in tf.config.list_logical_devices("CPU")]
        strategy = tf.distribute.MirroredStrategy(devices=logical)
        devices = [d.name for d in cpus]
    else:
        strategy = tf.distribute.get_strategy()
        devices = [d.name for d in (gpus or cpus)]
    replicas = strategy.num_replicas_in_sync
    if mode == "parameter_server":
        # Each step is one worker's batch, applied asynchronously: the batch is not split.
        replicas = 1

    if config.batch_size % replicas:
        raise UsageError(
            f"--batch-size must be a multiple of the {replicas} replicas in sync, got {config.batch_size}"
        )
    if config.mixed_precision:
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        if not gpus:
            log.warning("mixed precision on CPU is supported but slow: float16 pays off on GPUs")
    where = (
        f" on {', '.join(strategy.extended.worker_devices)}" if replicas > 1 and mode == "mirrored" else ""
    )
    if mode != "mirrored":
        where = f" across {cluster.workers} worker(s); this process is {cluster.describe()}"
    log.info(
        "devices: %s; strategy %s with %d replica(s)%s; precision %s%s",
        ", ".join(devices),
        STRATEGY_NAMES.get(mode, type(strategy).__name__) if mode != "mirrored" else type(strategy).__name__,
        replicas,
        where,
        keras.mixed_precision.dtype_policy().name,
        "; deterministic ops" if config.deterministic else "",
    )
    runtime = Runtime(
        strategy=strategy,
        devices=devices,
        replicas=replicas,
        mixed_precision=config.mixed_precision,
        deterministic=config.deterministic,
        cluster=cluster,
        mode=mode,
        coordinator=coordinator,
    )
    if runtime.multi_worker:
        check_collectives(runtime)
    if mode != "mirrored":
        keep_sigterm_handler()
    return runtime


def keep_sigterm_handler() -> None:
    """Put the trainer's SIGTERM handler back in place.

    TensorFlow's coordination service installs a SIGTERM handler of its own in C++ when a
    multi-worker cluster starts (its preemption notifier), which replaces Python's: the trainer
    would no longer see SIGTERM, checkpoint and exit 75. Registering the Python handler again
    restores it (the training loop's agreement between workers replaces the notifier).
    """
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)


def check_collectives(runtime: Runtime) -> None:
    """One all-reduce over every replica of every worker: the ring is up, or start-up fails here."""
    strategy = runtime.strategy
    started = time.monotonic()
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)
    answered = int(round(float(total)))
    if answered != runtime.replicas:
        raise RuntimeError(
            f"collective check: {answered} of {runtime.replicas} replicas answered the all-reduce"
        )
    log.info(
        "collective ring of %d worker(s) is up: an all-reduce over %d replica(s) answered in %.1f s (cluster %s)",
        runtime.workers,
        answered,
        time.monotonic() - started,
        json.dumps(runtime.cluster.cluster),
    )


def to_float(value: Any) -> float:
    """A Python float from a tensor, variable or number."""
    return float(keras.ops.convert_to_numpy(value))
