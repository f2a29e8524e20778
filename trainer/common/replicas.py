"""Agreement between the workers of a multi-worker run (``--strategy multi_worker``).

Several workers train in lock step. They agree at every point where the host waits for the
device: SIGTERM on any worker stops all of them at the same step, each with its checkpoint,
and a resume that finds the workers at different steps either falls back to a step all of
them hold or stops before the first step. Each worker reads its share of every global batch
(:func:`shard_by_data`), so a step sees the same examples as on one pod.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from trainer.common.contract import Preempted
from trainer.common.runtime import Runtime
from trainer.common.signals import StopRequest

log = logging.getLogger("kubetrain.trainer")

__all__ = ["Replicas", "ReplicasDisagree", "shard_by_data"]


class ReplicasDisagree(Preempted):
    """The workers restored different checkpoints; every worker exits 75 to be started again."""


def shard_by_data(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Shard by element, so that each worker reads its part of every global batch.

    Keras' inputs are tensors and files read by ``map``, which TensorFlow's file-based
    auto-sharding cannot split; sharding the batches keeps each step's examples those of a
    single pod. Without several workers the option changes nothing.
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


class Replicas:
    """The decisions every worker takes together: stop on SIGTERM, and the step to resume from.

    Args:
        runtime: the strategy and this process's place in the job.
        stop: this process's SIGTERM flag.
    """

    def __init__(self, runtime: Runtime, stop: StopRequest) -> None:
        self.runtime = runtime
        self.stop = stop

    def all_sum(self, value: float | list[float]) -> Any:
        """The sum of ``value`` over every worker (a collective: all workers call it); a float or a list."""
        strategy = self.runtime.strategy
        local = tf.constant(value, tf.float64)
        per_replica = strategy.run(lambda: tf.identity(local))
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()
        # Each worker contributes once per local replica.
        total = total / (strategy.num_replicas_in_sync / max(1, self.runtime.workers))
        return float(total) if total.ndim == 0 else [float(v) for v in total]

    def worker_id(self) -> int:
        """This worker's place among the workers: the chief first, then the workers by index."""
        cluster = self.runtime.cluster
        chief = "chief" in cluster.cluster
        return 0 if cluster.task_type == "chief" else cluster.task_index + (1 if chief else 0)

    def stop_agreed(self, step: int) -> bool:
        """Whether to stop now: SIGTERM here, or, with several workers, on any of them."""
        if not self.runtime.multi_worker:
            return self.stop.requested
        stop = self.all_sum(1.0 if self.stop.requested else 0.0) > 0
        if stop and not self.stop.requested:
            log.warning(
                "another worker received SIGTERM: checkpointing at step %d with it, then exiting", step
            )
        return stop

    def agree_on_resume(self, step: int, holds: Callable[[int], bool], restore: Callable[[int], Any]) -> int:
        """Make every worker resume from the same step, hence the same data position; returns that step.

        A worker whose stage-in ran before the chief's last checkpoint reached S3 restored an
        older one. Every worker then takes the oldest step restored anywhere, when each holds
        that checkpoint (the chief keeps its last few).

        Args:
            step: the step this worker restored (0: none).
            holds: whether this worker can restore the checkpoint of a step.
            restore: restores the checkpoint of a step, when this worker must go back to it.

        Raises:
            ReplicasDisagree: no common checkpoint: all stop (exit 75) so that the engine starts
                them again and their stage-ins find the chief's newest checkpoint.
        """
        vector = [0.0] * self.runtime.workers
        vector[self.worker_id()] = float(step)
        steps = [int(round(v)) for v in self.all_sum(vector)]
        common = min(steps)
        if common != max(steps):
            self._fall_back(steps, step, holds)
            if step != common:
                restore(common)
        if common:
            log.info(
                "all %d worker(s) resume from the chief's checkpoint at step %d", self.runtime.workers, common
            )
        return common

    def _fall_back(self, steps: list[int], step: int, holds: Callable[[int], bool]) -> None:
        """The workers restored different steps: go back to the oldest if every worker holds it."""
        common = min(steps)
        held = step == common or holds(common)
        missing = self.all_sum(0.0 if held else 1.0)
        if common == 0 or missing:
            raise ReplicasDisagree(
                f"the workers restored different checkpoints (steps {steps}, this worker {step}): a replica's "
                "stage-in ran before the chief's newest checkpoint reached S3. Every worker stops before training "
                "so that they start again and all restore the chief's newest checkpoint"
            )
        log.warning(
            "the workers restored steps %s (a stage-in ran before the chief's newest checkpoint reached "
            "S3): every worker resumes from step %d, the newest that all of them hold",
            steps,
            common,
        )
