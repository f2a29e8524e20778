"""Device set-up: the distribution strategy, the precision policy, the GPU settings and the start-up device line.

GPU settings (``--precision``, ``--steps-per-execution``, ``--jit-compile``; their defaults are in
:mod:`kubetrain_contract.flags`) are resolved here for the devices the pod got
(:func:`resolve_gpu_settings`): ``auto`` precision is mixed_bfloat16 where every GPU has compute
capability 8.0 or more (Ampere and later: bfloat16 needs no loss scaling), mixed_float16 with dynamic
loss scaling on older GPUs, float32 on CPUs; an unset ``--jit-compile`` compiles with XLA on GPUs
only. :meth:`Runtime.facts` says what was resolved, for metrics.json.

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
# GPUs from this compute capability on (Ampere) compute in bfloat16 at full speed.
BFLOAT16_CAPABILITY = (8, 0)
# Steps per call into the compiled step function on a GPU when --steps-per-execution is unset:
# the host's per-call overhead is then small next to the step (bench/notes/gpu_step.md).
GPU_STEPS_PER_EXECUTION = 16
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
            scales the loss dynamically (float16 gradients underflow; bfloat16 ones do not).
        deterministic: whether TensorFlow's ops run deterministically.
        cluster: this process's place in a multi-worker job (a single process by default).
        mode: ``mirrored``, ``multi_worker`` or ``parameter_server``.
        coordinator: the ClusterCoordinator in parameter-server mode.
        precision: the dtype policy in use (``--precision`` resolved); default: from
            ``mixed_precision``.
        steps_per_execution: training steps per call into the compiled step function.
        jit_compile: whether the forward and backward pass are compiled with XLA
            (``--jit-compile`` resolved).
    """

    strategy: tf.distribute.Strategy
    devices: list[str]
    replicas: int
    mixed_precision: bool
    deterministic: bool = False
    cluster: ClusterInfo = field(default_factory=lambda: ClusterInfo(None))
    mode: str = "mirrored"
    coordinator: Any = None
    precision: str | None = None
    steps_per_execution: int = 1
    jit_compile: bool = False

    def __post_init__(self) -> None:
        if self.precision is None:
            self.precision = "mixed_float16" if self.mixed_precision else "float32"

    def facts(self) -> dict[str, Any]:
        """The GPU settings as resolved for this pod's devices (metrics.json's ``runtime_facts``)."""
        return {
            "precision": self.precision,
            "steps_per_execution": self.steps_per_execution,
            "jit_compile": self.jit_compile,
        }

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


def gpu_capabilities(gpus: list[Any]) -> list[tuple[int, int] | None]:
    """Each GPU's compute capability, ``(8, 0)`` for an A100; None where TensorFlow does not say."""
    found: list[tuple[int, int] | None] = []
    for gpu in gpus:
        try:
            capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        except (ValueError, RuntimeError):
            capability = None
        found.append(tuple(capability) if capability else None)
    return found


def resolve_gpu_settings(config: TrainerConfig, capabilities: list[tuple[int, int] | None]) -> dict[str, Any]:
    """``--precision``, ``--steps-per-execution`` and ``--jit-compile`` for devices with these GPUs.

    Args:
        config: the trainer's flags.
        capabilities: each GPU's compute capability (None: unknown); empty on a CPU-only pod.

    Returns:
        ``precision`` (a Keras dtype policy name), ``steps_per_execution`` and ``jit_compile``.
    """
    precision = config.precision
    if precision == "auto":
        if not capabilities:
            precision = "float32"
        elif all(c is not None and c >= BFLOAT16_CAPABILITY for c in capabilities):
            precision = "mixed_bfloat16"
        else:
            precision = "mixed_float16"
    steps = config.steps_per_execution
    if steps is None:
        steps = GPU_STEPS_PER_EXECUTION if capabilities else 1
    jit = bool(capabilities) if config.jit_compile is None else config.jit_compile
    return {"precision": precision, "steps_per_execution": steps, "jit_compile": jit}


def configure(config: TrainerConfig) -> Runtime:
    """Pick devices and strategy, seed every generator, set the precision policy and resolve the GPU settings.

    ``config``'s ``precision``, ``steps_per_execution`` and ``jit_compile`` are set to what they
    resolve to on this pod's devices (:func:`resolve_gpu_settings`), so that everything after
    start-up reads what runs; params.json, written before, keeps what was asked.

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
    settings = resolve_gpu_settings(config, gpu_capabilities(gpus))
    # From here on the config says what runs: the loop, the checkpoint state and metrics.json read it.
    for name, value in settings.items():
        setattr(config, name, value)
    keras.mixed_precision.set_dtype_policy(settings["precision"])
    if settings["precision"] != "float32" and not gpus:
        log.warning("%s on CPU is supported but slow: it pays off on GPUs", settings["precision"])
    where = (
        f" on {', '.join(strategy.extended.worker_devices)}" if replicas > 1 and mode == "mirrored" else ""
    )
    if mode != "mirrored":
        where = f" across {cluster.workers} worker(s); this process is {cluster.describe()}"
    log.info(
        "devices: %s; strategy %s with %d replica(s)%s; precision %s; %d step(s) per execution; XLA %s%s",
        ", ".join(devices),
        STRATEGY_NAMES.get(mode, type(strategy).__name__) if mode != "mirrored" else type(strategy).__name__,
        replicas,
        where,
        keras.mixed_precision.dtype_policy().name,
        settings["steps_per_execution"],
        "on" if settings["jit_compile"] else "off",
        "; deterministic ops" if config.deterministic else "",
    )
    runtime = Runtime(
        strategy=strategy,
        devices=devices,
        replicas=replicas,
        mixed_precision=settings["precision"] == "mixed_float16",
        deterministic=config.deterministic,
        cluster=cluster,
        mode=mode,
        coordinator=coordinator,
        **settings,
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
